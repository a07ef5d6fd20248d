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
from typing import NamedTuple


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


#: The dimension names a :class:`KVCacheLayout` may use (API 1.0 and 1.5).
KV_DIMS: frozenset[str] = frozenset(
    {"kv", "num_blocks", "block_size", "num_kv_heads", "head_size", "kv_heads", "packing"}
)


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """The layout of one layer's KV cache tensor, described by named dimensions.

    Two families of ``dims``:

    * separate K and V (1.0): ``kv`` (2: key, value), ``num_blocks``, ``block_size``,
      ``num_kv_heads`` and ``head_size``, in any order (the order the tensor stores them);
    * interleaved K and V (1.5): ``num_blocks``, ``block_size``, ``kv_heads`` and ``head_size``,
      optionally ``packing``. ``kv_heads`` holds ``2 * num_kv_heads`` combined heads, the key of kv
      head ``h`` at ``2h`` and its value at ``2h + 1``. With ``packing`` in ``dims`` the combined heads
      are split as ``[2 * num_kv_heads // p, p]``, ``p = 4 // itemsize`` values of the cache dtype per
      32-bit word (1 for float32, 2 for bfloat16): the sub-32-bit packing of a TPU's sublanes.

    ``head_size`` is the physical head size: the model's rounded up to a multiple of
    :attr:`head_size_align` (a device's lane width: 64 or 96 -> 128), the extra features zero.
    The KV cache is sized from the physical shape (:meth:`shape`, :meth:`block_bytes`).

    .. versionadded:: 1.0
    .. versionchanged:: 1.5
       interleaved ``kv_heads``, ``packing``, :attr:`head_size_align`, :meth:`block_bytes`.
    """

    #: The dimension names in the order the tensor stores them (see the class docstring).
    dims: tuple[str, ...] = ("kv", "num_blocks", "block_size", "num_kv_heads", "head_size")
    #: The physical head size is the model's rounded up to a multiple of this.
    #:
    #: .. versionadded:: 1.5
    head_size_align: int = 1

    def __post_init__(self) -> None:
        unknown = [d for d in self.dims if d not in KV_DIMS]
        if unknown:
            raise ValueError(f"KV cache layout: unknown dims {unknown}; known: {sorted(KV_DIMS)}")
        if len(set(self.dims)) != len(self.dims):
            raise ValueError(f"KV cache layout: a dim is repeated in {self.dims}")
        common = {"num_blocks", "block_size", "head_size"}
        separate, interleaved = common | {"kv", "num_kv_heads"}, common | {"kv_heads"}
        found = set(self.dims)
        if found not in (separate, interleaved, interleaved | {"packing"}):
            raise ValueError(
                f"KV cache layout dims {self.dims}: need {sorted(separate)} (separate K and V) or "
                f"{sorted(interleaved)} (+ optionally 'packing') (K and V interleaved per head)"
            )
        if self.head_size_align < 1:
            raise ValueError(f"KV cache layout: head_size_align must be >= 1, got {self.head_size_align}")

    @property
    def interleaved(self) -> bool:
        """True when K and V are interleaved per head (``kv_heads``), not separate (``kv``).

        .. versionadded:: 1.5
        """
        return "kv_heads" in self.dims

    def physical_head_size(self, head_size: int) -> int:
        """``head_size`` rounded up to :attr:`head_size_align`.

        .. versionadded:: 1.5
        """
        align = self.head_size_align
        return -(-head_size // align) * align

    def packing(self, itemsize: int) -> int:
        """Values per 32-bit word in the ``packing`` dim for a cache dtype of ``itemsize`` bytes (1
        when the layout does not pack).

        .. versionadded:: 1.5
        """
        if "packing" not in self.dims:
            return 1
        if itemsize not in (1, 2, 4):
            raise ValueError(f"KV cache layout: cannot pack {itemsize}-byte values into 32-bit words")
        return 4 // itemsize

    def shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, *, itemsize: int = 4
    ) -> tuple[int, ...]:
        """The tensor shape for the given sizes (``head_size``: the model's; the shape has the
        physical one). ``itemsize`` is the cache dtype's size in bytes (only a packed layout needs it).

        .. versionchanged:: 1.5
           ``itemsize``; the physical head size; interleaved and packed dims.
        """
        pack = self.packing(itemsize)
        if self.interleaved and (2 * num_kv_heads) % pack:
            raise ValueError(f"KV cache layout: {2 * num_kv_heads} combined K/V heads do not pack by {pack}")
        sizes = {
            "kv": 2,
            "num_blocks": num_blocks,
            "block_size": block_size,
            "num_kv_heads": num_kv_heads,
            "head_size": self.physical_head_size(head_size),
            "kv_heads": 2 * num_kv_heads // pack,
            "packing": pack,
        }
        return tuple(sizes[d] for d in self.dims)

    def block_bytes(self, block_size: int, num_kv_heads: int, head_size: int, itemsize: int) -> int:
        """Bytes one block of one layer takes in this layout (padding included).

        .. versionadded:: 1.5
        """
        n = itemsize
        for size in self.shape(1, block_size, num_kv_heads, head_size, itemsize=itemsize):
            n *= size
        return n


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


#: The gated activations a fused-MoE op may be asked for (:attr:`MoESpec.activation`, API 1.8):
#: ``act(gate) * up`` with SiLU or with GELU's tanh approximation.
MOE_ACTIVATIONS: frozenset[str] = frozenset({"silu", "gelu_tanh"})


#: The largest LoRA rank an engine accepts (``EngineConfig.max_lora_rank``, :class:`LoRASpec`).
MAX_LORA_RANK = 64


@dataclass(frozen=True, slots=True)
class MoESpec:
    """One mixture-of-experts layer: what decides whether a backend's fused-MoE op can run it.

    The op's semantics (:class:`plinth.platform.backend.MoEKernels`): each token's router logits
    ``[E]`` are soft-maxed in fp32, the ``top_k`` largest kept (``renormalize``: divided by their
    sum, Mixtral's "softmax over the chosen" and Qwen3-MoE's ``norm_topk_prob``), and the token's
    output is the weighted sum, over its chosen experts ``e``, of
    ``down_e(act(gate_e(x)) * up_e(x))``. Shared experts and their gates are the model's, not the op's.

    .. versionadded:: 1.8
    """

    num_experts: int
    top_k: int
    hidden_size: int
    #: Each expert's MLP width (``moe_intermediate_size``).
    intermediate_size: int
    #: Compute dtype name ("float32", "bfloat16", ...).
    dtype: str = "float32"
    renormalize: bool = True
    activation: str = "silu"
    #: The ggml block format the experts' weights are kept in (None: dense, in ``dtype``).
    quant_format: str | None = None

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"MoESpec.num_experts must be at least 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"MoESpec.top_k must be in 1..{self.num_experts} (num_experts), got {self.top_k}")
        if self.hidden_size < 1 or self.intermediate_size < 1:
            raise ValueError(
                f"MoESpec sizes must be positive, got hidden {self.hidden_size}, intermediate {self.intermediate_size}"
            )
        if self.activation not in MOE_ACTIVATIONS:
            raise ValueError(f"MoESpec.activation {self.activation!r}: choose one of {sorted(MOE_ACTIVATIONS)}")


@dataclass(frozen=True, slots=True)
class LoRASpec:
    """The adapter slots of a LoRA-enabled engine: what a backend's batched LoRA op is built for.

    The op's semantics (:class:`plinth.platform.lora.LoRAKernels`): for every token ``t`` of a step
    whose adapter slot ``s = slot[t]`` is not -1, ``y[t] += (x[t] @ A[s].T) @ B[s].T``, with ``A``
    stacked ``[max_loras, rank, in]`` and ``B`` ``[max_loras, out, rank]`` (the adapter's scale is
    folded into ``B`` at load time). Tokens with slot -1 are left as the base layer computed them.

    .. versionadded:: 1.11
    """

    #: Adapter slots (adapters resident at once).
    max_loras: int
    #: The largest adapter rank a slot holds (smaller ranks are zero-padded).
    max_rank: int
    #: Compute dtype name ("float32", "bfloat16", ...).
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"LoRASpec.max_loras must be at least 1, got {self.max_loras}")
        if not 1 <= self.max_rank <= MAX_LORA_RANK:
            raise ValueError(f"LoRASpec.max_rank must be in 1..{MAX_LORA_RANK}, got {self.max_rank}")


#: How :class:`SpmdPlan` splits a weight over the mesh: by its output features (rows of an
#: ``[out, in]`` weight, a bias's one dim, an embedding table's vocabulary rows) or its input features.
SPMD_SPLITS: frozenset[str] = frozenset({"out", "in"})


@dataclass(frozen=True, slots=True)
class SpmdPlan:
    """The core's tensor-parallel plan for a backend that declares ``Capabilities.spmd``.

    One process holds the whole model; the backend places each step-program weight over a mesh of
    :attr:`size` devices, split as :attr:`splits` says (Megatron's plan: the fused q/k/v and
    gate/up projections and the LM head by output, ``o_proj`` and ``down_proj`` by input, the
    embedding table by vocabulary row; every weight not named is replicated), and each layer's KV
    cache by KV head (``size`` divides :attr:`num_kv_heads`: heads are never replicated here).
    A split is a placement, never a change of meaning: the step's result is the same whatever the
    backend places where (a dimension that does not divide may stay whole).

    The fused q/k/v and gate/up weights come grouped by shard: their rows are ``size`` contiguous
    groups, group ``r`` holding shard ``r``'s query heads, then its KV heads (its gate rows, then its
    up rows), so an even split by output gives each device exactly its heads with no exchange.

    :param size: devices in the mesh (the engine's ``tensor_parallel_size``).
    :param splits: step-program weight name -> ``"out"`` or ``"in"`` (see :data:`SPMD_SPLITS`); a
        name ending ``.data.<key>`` is a backend-prepared tensor, split along the same logical
        dimension in the backend's own layout.
    :param num_kv_heads: the model's KV heads per layer (the caches' split).

    .. versionadded:: 1.12
    """

    size: int
    splits: dict[str, str]
    num_kv_heads: int

    def __post_init__(self) -> None:
        if self.size < 2:
            raise ValueError(f"SpmdPlan.size {self.size}: a mesh of at least 2 devices")
        bad = sorted(f"{name}: {how!r}" for name, how in self.splits.items() if how not in SPMD_SPLITS)
        if bad:
            raise ValueError(f"SpmdPlan.splits: {', '.join(bad[:3])}; choose one of {sorted(SPMD_SPLITS)}")
        if self.num_kv_heads % self.size:
            raise ValueError(f"SpmdPlan: {self.num_kv_heads} KV heads do not split over {self.size} devices")


@dataclass(frozen=True, slots=True)
class MoECapabilities:
    """What a backend's fused-MoE op covers (:attr:`Capabilities.fused_moe`).

    The conformance suite runs every declared case and checks that an undeclared one raises
    :class:`NotSupported`; the core falls back to the reference op for a case not covered.

    .. versionadded:: 1.8
    """

    dtypes: frozenset[str]
    #: ggml block formats the op takes its experts in without dequantizing them.
    quant_formats: frozenset[str] = frozenset()
    #: None: any number of experts / any top-k.
    max_experts: int | None = None
    max_top_k: int | None = None
    activations: frozenset[str] = frozenset({"silu"})

    def unsupported(self, spec: MoESpec) -> list[str]:
        """Reasons ``spec`` is outside what is declared; empty when it is covered."""
        reasons = []
        if spec.dtype not in self.dtypes:
            reasons.append(f"dtype {spec.dtype} (supported: {sorted(self.dtypes)})")
        if spec.quant_format is not None and spec.quant_format not in self.quant_formats:
            reasons.append(f"experts in {spec.quant_format} (supported: {sorted(self.quant_formats) or 'dense only'})")
        if self.max_experts is not None and spec.num_experts > self.max_experts:
            reasons.append(f"{spec.num_experts} experts (at most {self.max_experts})")
        if self.max_top_k is not None and spec.top_k > self.max_top_k:
            reasons.append(f"top-{spec.top_k} routing (at most top-{self.max_top_k})")
        if spec.activation not in self.activations:
            reasons.append(f"activation {spec.activation} (supported: {sorted(self.activations)})")
        return reasons


#: The block placements a backend may ask for (:attr:`Capabilities.block_placement`, API 1.6).
BLOCK_PLACEMENTS: frozenset[str] = frozenset({"any", "contiguous"})


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend declares it supports (``Backend.capabilities()``).

    The core asks before it builds; the conformance suite checks every declared case runs and
    every undeclared one raises :class:`NotSupported`.

    .. versionadded:: 1.0
    """

    dtypes: frozenset[str]
    #: The KV-cache dtypes: compute dtypes, and ``float8_e4m3fn`` (1 byte a value, stored as
    #: ``Tensor.to`` rounds: to nearest even, saturating at +-448, with no scale), which is never a
    #: compute dtype.
    #:
    #: .. versionchanged:: 1.16
    #:    ``float8_e4m3fn``.
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
    #: False: one forward must hold only decodes (one query token per sequence) or only prefill
    #: chunks, never both (a graph compiler's separate prefill and decode graphs). The scheduler then
    #: picks one phase per step (:class:`plinth.sched.scheduler.Scheduler`, ``mixed_batches``).
    #:
    #: .. versionadded:: 1.6
    mixed_batches: bool = True
    #: How the block pool hands out KV blocks: ``"any"`` (least recently freed first, what the
    #: prefix cache's eviction wants) or ``"contiguous"`` (lowest free ids first, so a step's blocks
    #: form a dense low id range a kernel can slice instead of gather; eviction then goes by id).
    #:
    #: .. versionadded:: 1.6
    block_placement: str = "any"
    #: The block size the engine takes when the user names none (None: 16 where declared, else the
    #: first of :attr:`block_sizes`).
    #:
    #: .. versionadded:: 1.6
    preferred_block_size: int | None = None
    #: The ``torch.distributed`` backend of this device's process group (the name the backend's
    #: vendor registers with torch), for tensor and pipeline parallelism; None: not declared (the
    #: host collectives are used).
    #:
    #: .. versionadded:: 1.6
    communicator: str | None = None
    #: The fused mixture-of-experts op the backend supplies (``Backend.moe_kernels``); None: it
    #: supplies none, and MoE layers run the reference op (with a fallback warning).
    #:
    #: .. versionadded:: 1.8
    fused_moe: MoECapabilities | None = None
    #: Tensor parallelism in one process: the backend's compiled steps run over a mesh of
    #: ``tensor_parallel_size`` devices, the weights and KV caches placed by the
    #: :class:`SpmdPlan` the core passes to ``DeviceServices.compile_step``, the collectives the
    #: compiler's (as XLA's SPMD partitioner inserts them). The core then starts no worker
    #: processes for tensor parallelism. Only a backend with static-shape steps may declare it.
    #:
    #: .. versionadded:: 1.12
    spmd: bool = False
    #: What a cluster scheduler counts one of this backend's devices as (Ray's resource name:
    #: ``"GPU"`` for CUDA and ROCm GPUs); None: the host's cores only (the CPU backends). The Ray
    #: executor reserves one per rank, rank 0's on its own node, and each rank binds the one Ray
    #: gives it.
    #:
    #: .. versionadded:: 1.13
    device_resource: str | None = None

    def __post_init__(self) -> None:
        if self.block_placement not in BLOCK_PLACEMENTS:
            raise ValueError(
                f"Capabilities.block_placement {self.block_placement!r}: choose one of {sorted(BLOCK_PLACEMENTS)}"
            )
        if self.preferred_block_size is not None and self.preferred_block_size not in self.block_sizes:
            raise ValueError(
                f"Capabilities.preferred_block_size {self.preferred_block_size} is not among the declared "
                f"block sizes {list(self.block_sizes)}"
            )

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

    def require_moe(self, backend: str, spec: MoESpec) -> None:
        """Raise :class:`NotSupported` (naming ``backend`` and every reason) unless ``spec`` is declared.

        .. versionadded:: 1.8
        """
        if self.fused_moe is None:
            raise NotSupported(backend, "fused MoE", "the backend declares no fused-MoE op")
        reasons = self.fused_moe.unsupported(spec)
        if reasons:
            raise NotSupported(backend, "fused MoE", reasons)

    def require_gemm(self, backend: str, dtype: str) -> None:
        """Raise :class:`NotSupported` unless GEMM in ``dtype`` is declared."""
        if dtype not in self.dtypes:
            raise NotSupported(backend, f"GEMM in {dtype}", f"supported: {sorted(self.dtypes)}")


class StepShape(NamedTuple):
    """One compiled shape of a static-shape step: the padded sizes of its flattened batch.

    .. versionadded:: 1.5
    .. versionchanged:: 1.6
       ``flat_blocks`` and ``decode``.
    """

    #: T: query tokens of the step (every sequence's chunk, concatenated), padded.
    tokens: int
    #: B: sequences of the step, padded (padding sequences have length 0).
    seqs: int
    #: W: the block table's width (blocks per sequence), padded.
    blocks_per_seq: int
    #: The length of the step's flat block list (every sequence's blocks in one list), padded; 0
    #: when the buckets declare no flat list.
    #:
    #: .. versionadded:: 1.6
    flat_blocks: int = 0
    #: True for a shape of the decode set (:attr:`StepBuckets.decode`): every sequence has one query
    #: token, token ``i`` belongs to sequence ``i`` (T == B).
    #:
    #: .. versionadded:: 1.6
    decode: bool = False


def _bucket_values(name: str, values: tuple[int, ...], *, allow_empty: bool = False) -> tuple[int, ...]:
    if (not values and not allow_empty) or any(not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"step buckets: {name} must be positive integers, got {values!r}")
    return tuple(sorted(set(values)))


def _powers_of_two(minimum: int, maximum: int) -> tuple[int, ...]:
    if minimum < 1 or maximum < 1:
        raise ValueError(f"step buckets: bounds must be >= 1, got {minimum}..{maximum}")
    out = [minimum]
    while out[-1] < maximum:
        out.append(out[-1] * 2)
    return tuple(out)


def _fit(values: tuple[int, ...], n: int) -> int | None:
    for v in values:
        if v >= n:
            return v
    return None


@dataclass(frozen=True, slots=True)
class StepBuckets:
    """The shapes a static-shape backend compiles its steps for (``Backend.step_buckets``).

    Every step, not only pure decodes, is padded up to the smallest bucket of each kind that holds
    it: the number of query tokens (T), of sequences (B) and the block table's width (W); with
    :attr:`flat_blocks`, also the length of the step's flat block list. A compiled backend then sees
    only the shapes in :meth:`shapes`, and compiles each once. The padding semantics (what the
    runner fills the padding with) are in :class:`plinth.platform.backend.StepInputs`.

    With :attr:`decode` set, steps of only decodes are padded to that set instead (shapes marked
    ``decode``), every other step to this one: separate prefill and decode graphs.

    .. versionadded:: 1.5
    .. versionchanged:: 1.6
       ``flat_blocks`` and ``decode``.
    """

    tokens: tuple[int, ...]
    seqs: tuple[int, ...]
    blocks_per_seq: tuple[int, ...]
    #: Buckets of the flat block list's length (the blocks of all the step's sequences, in one
    #: list: :class:`plinth.platform.backend.FlatBlocks`); empty: the step has no flat list.
    #:
    #: .. versionadded:: 1.6
    flat_blocks: tuple[int, ...] = ()
    #: The bucket set of decode-only steps (its ``tokens`` and ``seqs`` should be equal: T == B
    #: there); None: decodes are padded like every other step.
    #:
    #: .. versionadded:: 1.6
    decode: StepBuckets | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", _bucket_values("tokens", tuple(self.tokens)))
        object.__setattr__(self, "seqs", _bucket_values("seqs", tuple(self.seqs)))
        object.__setattr__(self, "blocks_per_seq", _bucket_values("blocks_per_seq", tuple(self.blocks_per_seq)))
        flat = _bucket_values("flat_blocks", tuple(self.flat_blocks), allow_empty=True)
        object.__setattr__(self, "flat_blocks", flat)
        if self.decode is not None:
            if self.decode.decode is not None:
                raise ValueError("step buckets: the decode set cannot have a decode set of its own")
            if not set(self.decode.seqs) & set(self.decode.tokens):
                raise ValueError(
                    f"step buckets: the decode set's tokens {self.decode.tokens} and sequences "
                    f"{self.decode.seqs} share no value (a decode step has T == B)"
                )

    @classmethod
    def powers_of_two(
        cls,
        *,
        max_tokens: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        min_tokens: int = 16,
        min_seqs: int = 1,
        min_blocks_per_seq: int = 1,
    ) -> StepBuckets:
        """Powers of two from each minimum up to the first that holds each maximum."""
        return cls(
            tokens=_powers_of_two(min_tokens, max_tokens),
            seqs=_powers_of_two(min_seqs, max_seqs),
            blocks_per_seq=_powers_of_two(min_blocks_per_seq, max_blocks_per_seq),
        )

    def fit(
        self, tokens: int, seqs: int, blocks_per_seq: int, flat_blocks: int = 0, decode: bool = False
    ) -> StepShape | None:
        """The shape a step of these sizes is padded to; None when one exceeds the largest bucket.

        ``flat_blocks`` is the step's total block count (read only with :attr:`flat_blocks`);
        ``decode`` says every sequence has one query token (the step then goes to :attr:`decode`
        when there is one).

        .. versionchanged:: 1.6
           ``flat_blocks`` and ``decode``.
        """
        if decode and self.decode is not None:
            shape = self.decode.fit(tokens, seqs, blocks_per_seq, flat_blocks)
            return None if shape is None else shape._replace(decode=True)
        t = _fit(self.tokens, tokens)
        b = _fit(self.seqs, seqs)
        w = _fit(self.blocks_per_seq, blocks_per_seq)
        nb = _fit(self.flat_blocks, flat_blocks) if self.flat_blocks else 0
        if t is None or b is None or w is None or nb is None:
            return None
        return StepShape(t, b, w, nb)

    def _flat_for(self, b_low: int, b: int, w: int) -> list[int]:
        """The flat-block buckets a step of ``b_low < seqs <= b`` sequences, ``w`` blocks wide, can
        reach: from the one holding ``b_low + 1`` blocks to the one holding ``b * w``."""
        if not self.flat_blocks:
            return [0]
        low = _fit(self.flat_blocks, b_low + 1) or self.flat_blocks[-1]
        high = _fit(self.flat_blocks, b * w) or self.flat_blocks[-1]
        return [nb for nb in self.flat_blocks if low <= nb <= high]

    def _own_shapes(self, decode: bool) -> list[StepShape]:
        out: list[StepShape] = []
        for t in self.tokens:
            if decode:
                seqs = [t] if t in self.seqs else []
            else:
                seqs = [b for b in self.seqs if b <= t] or [self.seqs[0]]
                bigger = [b for b in self.seqs if b > t]
                if seqs[-1] < t and bigger:  # B up to T must fit: keep the bucket that holds B = T
                    seqs.append(bigger[0])
            for b in seqs:
                i = self.seqs.index(b)
                b_low = self.seqs[i - 1] if i else 0
                for w in self.blocks_per_seq:
                    for nb in self._flat_for(b_low, b, w):
                        out.append(StepShape(t, b, w, nb, decode))
        return out

    def shapes(self) -> list[StepShape]:
        """Every shape a step can be padded to, smallest first: each (T, B, W) with B <= T, except
        that the smallest sequence bucket holding T is kept even above T; with :attr:`flat_blocks`,
        each flat-list length a step of B sequences W blocks wide can have; then the decode set's
        (T == B only).

        .. versionchanged:: 1.6
           flat-list lengths; the decode set.
        """
        out = self._own_shapes(decode=False)
        if self.decode is not None:
            out.extend(self.decode._own_shapes(decode=True))
        return out

    def largest(self) -> StepShape:
        """The largest bucket of each kind (of this set, not the decode set)."""
        nb = self.flat_blocks[-1] if self.flat_blocks else 0
        return StepShape(self.tokens[-1], self.seqs[-1], self.blocks_per_seq[-1], nb)
