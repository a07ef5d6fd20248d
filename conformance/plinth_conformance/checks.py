"""Helpers the suite's test modules share: asking for declared kernels, calling them, reporting.

Every failure message starts with ``[case-id]`` and says what went wrong in words (the reason a
CI log reader needs), whatever the kernel raised.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from plinth.platform.backend import AttentionKernels, AttentionSpec, Backend, GemmKernels, NotSupported
from plinth_conformance.tolerance import bits


@contextmanager
def kernel_call(case_id: str, what: str) -> Iterator[None]:
    """Run a kernel call of a declared case: ``NotSupported`` or any other exception fails the case
    with its id, the call and the error (the traceback is kept as the cause)."""
    try:
        yield
    except NotSupported as exc:
        raise AssertionError(f"[{case_id}] declared, but {what} raised NotSupported: {exc}") from exc
    except AssertionError:
        raise
    except Exception as exc:
        raise AssertionError(f"[{case_id}] {what} raised {type(exc).__name__}: {exc}") from exc


def declared_attention(backend: Backend, spec: AttentionSpec, case_id: str) -> AttentionKernels:
    """The backend's attention kernels for a case it declares or the core profile mandates."""
    missing = backend.capabilities().unsupported(spec)
    if missing:  # only mandatory cases get here undeclared: generation follows the declaration
        pytest.fail(
            f"[{case_id}] the mandatory core profile needs this case, but the backend does not declare: "
            + "; ".join(missing),
            pytrace=False,
        )
    with kernel_call(case_id, "attention_kernels()"):
        return backend.attention_kernels(spec)
    raise AssertionError("unreachable")  # pragma: no cover - kernel_call re-raises


def declared_gemm(backend: Backend, dtype: str, case_id: str) -> GemmKernels:
    """The backend's GEMM for a declared (or mandatory) dtype."""
    if dtype not in backend.capabilities().dtypes:
        pytest.fail(
            f"[{case_id}] the mandatory core profile needs GEMM in {dtype}, which is not declared", pytrace=False
        )
    with kernel_call(case_id, f"gemm_kernels({dtype!r})"):
        return backend.gemm_kernels(dtype)
    raise AssertionError("unreachable")  # pragma: no cover


#: A feature a backend declares when two calls with the same inputs may differ (atomics, a
#: thread-count-dependent split): the repeat check is then not gated, and the certificate shows it.
NONDETERMINISTIC = "nondeterministic"


def check_repeat(backend: Backend, case_id: str, first: torch.Tensor, second: torch.Tensor) -> None:
    """A second call with the same inputs must give the same bits (unless the backend declares
    :data:`NONDETERMINISTIC`): differences far below any tolerance still make runs irreproducible."""
    if NONDETERMINISTIC in backend.capabilities().features:
        return
    a, b = first.detach().cpu(), second.detach().cpu()
    if a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b)):
        return
    if a.shape != b.shape or a.dtype != b.dtype:
        raise AssertionError(f"[{case_id}] not deterministic: a second call gave {tuple(b.shape)} {b.dtype}")
    n = int((bits(a) != bits(b)).sum())
    diff = float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))
    raise AssertionError(
        f"[{case_id}] not deterministic: a second call with the same inputs differs in {n} of {a.numel()} "
        f"elements (relative difference {diff:.2e}); declare the feature {NONDETERMINISTIC!r} if by design"
    )
