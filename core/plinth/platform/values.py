"""The contract's value objects: what a backend answers and declares, importable without torch.

Discovery, selection and ``plinth backends`` need only these (plus :mod:`plinth.hookspecs` and the
plugin host), so none of them imports torch: a process that only asks "which backend?" never pays
torch's import. The tensor-facing ABCs (:class:`~plinth.platform.backend.Backend`, the kernels, the
device services) live in :mod:`plinth.platform.backend`, which re-exports everything here, so
``from plinth.platform.backend import Capabilities`` keeps working.

Each object carries ``versionadded`` for itself and for every member added after it (see
:data:`plinth.hookspecs.API_HISTORY`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


class NotSupported(Exception):
    """A backend cannot run the requested case. The message names the backend and the reason.

    Raised by a backend's kernel factories for an undeclared case, and by the core (in strict mode,
    or where no fallback exists) when it refuses to build one.

    :param backend: the backend's name.
    :param what: the op or case refused ("attention", "GEMM in bfloat16").
    :param reasons: one reason or several, each in words an operator can act on.

    .. versionadded:: 1.0
    """

    def __init__(self, backend: str, what: str, reasons: list[str] | str) -> None:
        self.backend = backend
        self.what = what
        self.reasons = [reasons] if isinstance(reasons, str) else list(reasons)
        super().__init__(f"backend {backend!r} does not support {what}: " + "; ".join(self.reasons))


@dataclass(frozen=True, slots=True)
class Probe:
    """A backend's answer to "can you run here, and how well?" (``Backend.probe()``).

    .. versionadded:: 1.0
    """

    #: 0 means unusable; otherwise the highest score wins selection.
    score: int
    #: Why, in words an operator can act on (shown by ``plinth backends``).
    reasons: tuple[str, ...] = ()
    #: The device the backend would run on, as an operator would name it.
    device_name: str = ""
    #: True when the backend runs its code on a device it was not written for (Gaudi ops on the
    #: CPU): usable for tests, never a hardware certification.
    emulation: bool = False


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """The layout of one layer's KV cache tensor, described by named dimensions.

    .. versionadded:: 1.0
    """

    #: The names ``kv`` (2: key, value), ``num_blocks``, ``block_size``, ``num_kv_heads`` and
    #: ``head_size`` in the order the tensor stores them.
    dims: tuple[str, ...] = ("kv", "num_blocks", "block_size", "num_kv_heads", "head_size")

    def shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """The tensor shape for the given sizes."""
        sizes = {
            "kv": 2,
            "num_blocks": num_blocks,
            "block_size": block_size,
            "num_kv_heads": num_kv_heads,
            "head_size": head_size,
        }
        return tuple(sizes[d] for d in self.dims)


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """Everything about one attention layer that decides whether a backend can run it.

    .. versionadded:: 1.0
    """

    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    #: Compute dtype name ("float32", "bfloat16", ...).
    dtype: str = "float32"
    kv_cache_dtype: str = "float32"
    #: Keys further back than this many positions are masked (feature ``sliding_window``).
    sliding_window: int | None = None
    #: ``cap * tanh(scores / cap)`` before the softmax (feature ``logits_soft_cap``).
    logits_soft_cap: float | None = None


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend declares it supports (``Backend.capabilities()``).

    The core asks before it builds; the conformance suite checks every declared case runs and
    every undeclared one raises :class:`NotSupported`.

    .. versionadded:: 1.0
    """

    dtypes: frozenset[str]
    kv_cache_dtypes: frozenset[str]
    head_sizes: frozenset[int]
    block_sizes: tuple[int, ...]
    #: None: any ratio ``num_heads / num_kv_heads``.
    max_gqa_ratio: int | None = None
    #: Optional attention features: "sliding_window", "logits_soft_cap".
    features: frozenset[str] = frozenset()
    #: ggml block formats ("q4_1", "q8_0") the GEMM takes through ``prepare_quantized``; the core
    #: dequantizes weights in any other format at load time.
    #:
    #: .. versionadded:: 1.1
    quant_formats: frozenset[str] = frozenset()
    #: The KV cache layout the attention kernels read and ``allocate_kv_cache`` makes.
    kv_cache_layout: KVCacheLayout = field(default_factory=KVCacheLayout)

    def unsupported(self, spec: AttentionSpec) -> list[str]:
        """Reasons ``spec`` cannot run on this backend; empty when it can."""
        reasons = []
        if spec.dtype not in self.dtypes:
            reasons.append(f"dtype {spec.dtype} (supported: {sorted(self.dtypes)})")
        if spec.kv_cache_dtype not in self.kv_cache_dtypes:
            reasons.append(f"kv cache dtype {spec.kv_cache_dtype} (supported: {sorted(self.kv_cache_dtypes)})")
        if spec.head_size not in self.head_sizes:
            reasons.append(f"head size {spec.head_size} (supported: {sorted(self.head_sizes)})")
        if spec.block_size not in self.block_sizes:
            reasons.append(f"block size {spec.block_size} (supported: {list(self.block_sizes)})")
        if spec.num_heads % spec.num_kv_heads:
            reasons.append(f"{spec.num_heads} query heads not a multiple of {spec.num_kv_heads} kv heads")
        elif self.max_gqa_ratio is not None and spec.num_heads // spec.num_kv_heads > self.max_gqa_ratio:
            reasons.append(f"GQA ratio {spec.num_heads // spec.num_kv_heads} > {self.max_gqa_ratio}")
        if spec.sliding_window is not None and "sliding_window" not in self.features:
            reasons.append("sliding window attention")
        if spec.logits_soft_cap is not None and "logits_soft_cap" not in self.features:
            reasons.append("logits soft-cap")
        return reasons

    def require_attention(self, backend: str, spec: AttentionSpec) -> None:
        """Raise :class:`NotSupported` (naming ``backend`` and every reason) unless ``spec`` is declared."""
        reasons = self.unsupported(spec)
        if reasons:
            raise NotSupported(backend, "attention", reasons)

    def require_gemm(self, backend: str, dtype: str) -> None:
        """Raise :class:`NotSupported` unless GEMM in ``dtype`` is declared."""
        if dtype not in self.dtypes:
            raise NotSupported(backend, f"GEMM in {dtype}", f"supported: {sorted(self.dtypes)}")
