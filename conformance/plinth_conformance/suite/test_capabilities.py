"""Capabilities are checked, not trusted.

* The mandatory core profile must be declared (declaring nothing cannot pass).
* The declared KV layout is a permutation of the named dims, and ``allocate_kv_cache`` follows it.
* Every undeclared case must raise :class:`plinth.platform.NotSupported` (when the kernels are
  asked for, or at the latest when they are called), never return numbers.
"""

from __future__ import annotations

import pytest
import torch

from plinth.hookspecs import PLUGIN_API_VERSION
from plinth.platform.backend import Backend, NotSupported, torch_dtype
from plinth_conformance.cases import (
    MANDATORY_BLOCK_SIZE,
    MANDATORY_DTYPE,
    MANDATORY_GQA_RATIO,
    MANDATORY_HEAD_SIZES,
    MAX_TESTED_BLOCK_SIZE,
    UndeclaredCase,
)
from plinth_conformance.paged import CANONICAL_DIMS, build_batch

pytestmark = pytest.mark.plinth_tier("core")


def test_probe_and_api_version(plinth_backend: Backend) -> None:
    """The backend probes usable here and was written against this plugin API major."""
    probe = plinth_backend.probe()
    assert probe.score > 0, f"probe score {probe.score}: {'; '.join(probe.reasons)}"
    assert plinth_backend.api_version[0] == PLUGIN_API_VERSION[0]


def test_mandatory_profile_is_declared(plinth_backend: Backend) -> None:
    """float32 (compute and KV cache), head sizes 64 and 128, block size 16, GQA ratios up to 8."""
    caps = plinth_backend.capabilities()
    missing = []
    if MANDATORY_DTYPE not in caps.dtypes:
        missing.append(f"dtype {MANDATORY_DTYPE}")
    if MANDATORY_DTYPE not in caps.kv_cache_dtypes:
        missing.append(f"KV cache dtype {MANDATORY_DTYPE}")
    missing += [f"head size {h}" for h in MANDATORY_HEAD_SIZES if h not in caps.head_sizes]
    if MANDATORY_BLOCK_SIZE not in caps.block_sizes:
        missing.append(f"block size {MANDATORY_BLOCK_SIZE}")
    if caps.max_gqa_ratio is not None and caps.max_gqa_ratio < MANDATORY_GQA_RATIO:
        missing.append(f"GQA ratio {MANDATORY_GQA_RATIO} (declares at most {caps.max_gqa_ratio})")
    assert not missing, "[mandatory-profile] not declared: " + ", ".join(missing)


def test_scale_out_declarations_hold(plinth_backend: Backend) -> None:
    """What the core relies on when it splits a model (plugin API 1.12-1.13): local rank 0 binds the
    device the services then drive (the core's start-up check, made here on every backend); a backend
    declaring ``spmd`` has static-shape steps and a ``compile_step`` that takes the plan; one declaring
    a ``device_resource`` (a device per rank) maps ranks 0 and 1 to different devices."""
    import inspect

    caps = plinth_backend.capabilities()
    plinth_backend.bind_local_rank(0)
    services = plinth_backend.device_services()
    bound = services.device_for_rank(0)
    assert bound == services.device, f"[bind-local-rank] local rank 0 maps to {bound}; services drive {services.device}"
    if caps.spmd:
        assert plinth_backend.step_buckets(64, 8, 8) is not None, "[spmd] declared without step buckets"
        params = inspect.signature(services.compile_step).parameters
        assert "spmd" in params, "[spmd] declared, but DeviceServices.compile_step takes no spmd="
    if caps.device_resource is not None:
        assert services.device_for_rank(1) != services.device_for_rank(0), (
            f"[device-resource] {caps.device_resource!r} declared (a device per rank), but ranks 0 and 1 "
            f"both map to {services.device_for_rank(0)}"
        )


def test_kv_cache_layout(plinth_backend: Backend) -> None:
    """The layout is a permutation of the canonical dims or an interleaved one (API 1.5: checked when
    the layout is built); allocate_kv_cache returns its physical shape in the KV dtype, zero-filled
    (padding features included), and the canonical view of it writes through to distinct elements."""
    caps = plinth_backend.capabilities()
    layout = caps.kv_cache_layout
    if not layout.interleaved:
        dims = layout.dims
        assert sorted(dims) == sorted(CANONICAL_DIMS), f"[kv-layout] dims {dims}: not a permutation of {CANONICAL_DIMS}"
    from plinth.platform.backend import AttentionSpec, canonical_kv_view

    for block in [b for b in caps.block_sizes if b <= MAX_TESTED_BLOCK_SIZE]:
        for kv_dtype in sorted(caps.kv_cache_dtypes):
            head = min(caps.head_sizes, key=lambda h: abs(h - 64))
            spec = AttentionSpec(4, 2, head, block, MANDATORY_DTYPE, kv_dtype)
            dtype = torch_dtype(kv_dtype)
            cache = plinth_backend.allocate_kv_cache(spec, 3)
            want = layout.shape(3, block, 2, head, itemsize=dtype.itemsize)
            assert tuple(cache.shape) == want, f"[kv-layout] block {block}: shape {tuple(cache.shape)}, want {want}"
            assert cache.dtype == dtype, f"[kv-layout] dtype {cache.dtype}, want {kv_dtype}"
            host = cache.cpu()
            assert not host.any(), f"[kv-layout] allocate_kv_cache({kv_dtype}) is not zero-filled"
            view = canonical_kv_view(host, layout, 2, head)  # [2, NB, B, Hkv, D]
            view.copy_(torch.arange(view.numel(), dtype=torch.float64).reshape(view.shape).to(dtype))
            assert int(host.ne(0).sum()) == view.numel() - 1, "[kv-layout] the canonical view aliases elements"


def _refuses(case_id: str, run: object) -> None:
    """``run()`` must raise NotSupported; anything else (numbers or another error) fails the case."""
    try:
        run()  # type: ignore[operator]
    except NotSupported:
        return
    except Exception as exc:
        pytest.fail(
            f"[{case_id}] undeclared, and raised {type(exc).__name__} instead of NotSupported: {exc}", pytrace=False
        )
    pytest.fail(
        f"[{case_id}] undeclared, but the backend returned numbers instead of raising NotSupported", pytrace=False
    )


def test_undeclared_case_raises_not_supported(plinth_backend: Backend, undeclared_case: UndeclaredCase) -> None:
    """Asking for (or running) an undeclared case raises NotSupported."""
    case = undeclared_case
    device = plinth_backend.device_services().device
    if case.spec is None:
        assert case.gemm_dtype is not None

        def run_gemm() -> None:
            dtype = torch_dtype(case.gemm_dtype or MANDATORY_DTYPE)
            gemm = plinth_backend.gemm_kernels(case.gemm_dtype or MANDATORY_DTYPE)
            weight = gemm.prepare(torch.ones(8, 8, dtype=dtype), None)
            gemm.linear(torch.ones(2, 8, dtype=dtype, device=device), weight)

        _refuses(case.id, run_gemm)
        return
    spec = case.spec

    def run_attention() -> None:
        kernels = plinth_backend.attention_kernels(spec)
        batch = build_batch(spec, "decode", torch.Generator().manual_seed(case.seed))
        cache = plinth_backend.allocate_kv_cache(spec, batch.num_blocks)
        kernels.forward(batch.query.to(device), cache, batch.meta, batch.scale)

    _refuses(case.id, run_attention)
