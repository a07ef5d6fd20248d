"""Cases beyond single kernels: undeclared values (must raise ``NotSupported``), the whole engine on
tiny models, and the timed perf kernels."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from plinth.platform.backend import AttentionSpec, Capabilities
from plinth_conformance.case_base import (
    _SHORT,
    KNOWN_DTYPES,
    MANDATORY_BLOCK_SIZE,
    MANDATORY_DTYPE,
    MANDATORY_HEAD_SIZES,
    _home_block,
    case_seed,
)


@dataclass(frozen=True, slots=True)
class UndeclaredCase:
    """A case the backend does not declare: it must raise ``NotSupported``, not return numbers."""

    what: str  # the dimension that is out of the declared set
    spec: AttentionSpec | None  # an attention spec to ask for, or None for a GEMM dtype
    gemm_dtype: str | None = None
    tier: str = "core"

    @property
    def id(self) -> str:
        """The pytest id, e.g. ``undeclared-head-size-80``."""
        return f"undeclared-{self.what}"

    @property
    def seed(self) -> int:
        """See :func:`case_seed`."""
        return case_seed(self.id)


def _first_missing(candidates: tuple[Any, ...], declared: Any) -> Any:
    return next((c for c in candidates if c not in declared), None)


def undeclared_cases(caps: Capabilities, default_dtype: str) -> list[UndeclaredCase]:
    """One case per dimension that has an undeclared value: head size, block size, dtypes, GQA
    ratio, sliding window, soft-cap, GEMM dtype."""
    dtype = MANDATORY_DTYPE if MANDATORY_DTYPE in caps.dtypes else next(iter(sorted(caps.dtypes)), MANDATORY_DTYPE)
    kv = dtype if dtype in caps.kv_cache_dtypes else next(iter(sorted(caps.kv_cache_dtypes)), dtype)
    head = next((h for h in (*MANDATORY_HEAD_SIZES, *sorted(caps.head_sizes)) if h in caps.head_sizes), 64)
    block = _home_block(caps) if caps.block_sizes else MANDATORY_BLOCK_SIZE
    base = AttentionSpec(4, 2, head, block, dtype, kv)
    cases: list[UndeclaredCase] = []
    if (h := _first_missing((80, 96, 72, 100, 36, 513, 1024, 4096), caps.head_sizes)) is not None:
        cases.append(UndeclaredCase(f"head-size-{h}", replace(base, head_size=h)))
    if (b := _first_missing((3, 5, 24, 48, 512, 1024), caps.block_sizes)) is not None:
        cases.append(UndeclaredCase(f"block-size-{b}", replace(base, block_size=b)))
    if (d := _first_missing(KNOWN_DTYPES, caps.dtypes)) is not None:
        cases.append(UndeclaredCase(f"dtype-{_SHORT[d]}", replace(base, dtype=d, kv_cache_dtype=d)))
        cases.append(UndeclaredCase(f"gemm-dtype-{_SHORT[d]}", None, gemm_dtype=d))
    if (d := _first_missing(KNOWN_DTYPES, caps.kv_cache_dtypes)) is not None:
        cases.append(UndeclaredCase(f"kv-cache-dtype-{_SHORT[d]}", replace(base, kv_cache_dtype=d)))
    if caps.max_gqa_ratio is not None:
        ratio = caps.max_gqa_ratio + 1
        cases.append(UndeclaredCase(f"gqa-ratio-{ratio}", replace(base, num_heads=ratio, num_kv_heads=1)))
    if "sliding_window" not in caps.features:
        cases.append(UndeclaredCase("sliding-window", replace(base, sliding_window=8)))
    if "logits_soft_cap" not in caps.features:
        cases.append(UndeclaredCase("logits-soft-cap", replace(base, logits_soft_cap=30.0)))
    return cases


#: Engine models: the random tiny ones (:mod:`.tiny_models`: architecture coverage) and the
#: constructed induction ones (:mod:`.induction`: output that only attention to the context gets right).
ENGINE_MODELS: tuple[str, ...] = ("llama", "qwen2", "mistral-sw", "induction", "induction-sw")


@dataclass(frozen=True, slots=True)
class EngineCase:
    """Whole-engine greedy decoding on a tiny model (see :mod:`.tiny_models`, :mod:`.induction`).

    Checks: ``greedy-vs-reference`` and ``batch-invariance`` (random models); ``copy-vs-reference``
    (the induction model's tokens are the context's continuation, its logprobs the reference's) and
    ``forks-and-prefix-hits`` (``n = 2`` forks sharing a partial block, and a request whose long
    prefix is a cache hit: the same tokens and logprobs).
    """

    model: str  # see ENGINE_MODELS
    check: str
    block_size: int
    tier: str = "extended"

    @property
    def id(self) -> str:
        """The pytest id, e.g. ``engine-llama-greedy-vs-reference``."""
        return f"engine-{self.model}-{self.check}"

    @property
    def seed(self) -> int:
        """See :func:`case_seed`."""
        return case_seed(self.id)


def engine_cases(caps: Capabilities, default_dtype: str) -> list[EngineCase]:
    """Per tiny model the backend can run: greedy equality with the reference and batch invariance
    (random models), the induction model's copy (core) and its forks and prefix-cache hits."""
    block = _home_block(caps)
    sw = "sliding_window" in caps.features
    models = ["llama", "qwen2"] + (["mistral-sw"] if sw else [])
    cases = [EngineCase(m, c, block) for m in models for c in ("greedy-vs-reference", "batch-invariance")]
    cases.append(EngineCase("induction", "copy-vs-reference", MANDATORY_BLOCK_SIZE, "core"))
    cases.append(EngineCase("induction", "forks-and-prefix-hits", block))
    if sw:
        cases += [EngineCase("induction-sw", c, block) for c in ("copy-vs-reference", "forks-and-prefix-hits")]
    return cases


@dataclass(frozen=True, slots=True)
class PerfCase:
    """One timed kernel, normalised to the machine's roofline (see :mod:`.perf`)."""

    name: str
    tier: str = "perf"

    @property
    def id(self) -> str:
        """The pytest id, e.g. ``perf-decode-attention``."""
        return f"perf-{self.name}"

    @property
    def seed(self) -> int:
        """See :func:`case_seed`."""
        return case_seed(self.id)


def perf_cases(caps: Capabilities, default_dtype: str) -> list[PerfCase]:
    """Decode attention (bandwidth-bound), prefill attention and GEMMs at batch 1 and 512."""
    return [PerfCase(n) for n in ("decode-attention", "prefill-attention", "gemm-m1", "gemm-m512", "kv-write")]
