"""The tensor-facing half of the contract: the backend, its device services and its kernels.

A plugin's ``plinth_register_backends`` hook returns :class:`Backend` objects. After selection the
engine holds plain kernel objects (:class:`AttentionKernels`, :class:`GemmKernels`,
:class:`SmallOps`) and calls their methods in the step loop; no hook is called per token.

The list of contract objects and the version history are in :mod:`plinth.hookspecs`; each object
here carries ``versionadded`` for itself and for each member added after it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from plinth.platform.devices import HOST, HOST_COLLECTIVES
from plinth.platform.lora import LoRABatch, LoRAKernels
from plinth.platform.quant import QuantizedWeight, dequantize

# The torch-free value objects live in plinth.platform.values (discovery imports them without
# torch); re-exported here because plugins have always imported them from this module.
from plinth.platform.values import (
    AttentionSpec,
    Capabilities,
    KVCacheLayout,
    LoRASpec,
    MoECapabilities,
    MoESpec,
    NotSupported,
    Probe,
    SpmdPlan,
    StepBuckets,
    StepShape,
)

__all__ = [
    "AttentionKernels",
    "AttentionMetadata",
    "AttentionSpec",
    "Backend",
    "CANONICAL_KV_DIMS",
    "Capabilities",
    "CompiledStep",
    "Communicator",
    "DeviceServices",
    "ExpertWeights",
    "MoECapabilities",
    "MoEKernels",
    "MoESpec",
    "PendingSend",
    "FlatBlocks",
    "GemmKernels",
    "GraphCapture",
    "KVCacheLayout",
    "KernelProvider",
    "LinearWeight",
    "LoRABatch",
    "LoRAKernels",
    "LoRASpec",
    "NotSupported",
    "Probe",
    "SmallOps",
    "SpmdPlan",
    "StepBuckets",
    "StepGraph",
    "StepInputs",
    "StepProgram",
    "StepShape",
    "canonical_kv_view",
    "dtype_name",
    "route_experts",
    "torch_dtype",
]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    # a KV-cache dtype only: 1 byte a value, torch's rounding (to nearest even, saturating at +-448)
    "float8_e4m3fn": torch.float8_e4m3fn,
}


def torch_dtype(name: str) -> torch.dtype:
    """Map a dtype name used in capabilities and configs ("float32", ...) to a torch dtype.

    .. versionadded:: 1.0
    .. versionchanged:: 1.16
       ``float8_e4m3fn`` (a KV-cache dtype only).
    """
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The inverse of :func:`torch_dtype`.

    .. versionadded:: 1.0
    """
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported torch dtype {dtype}")


#: The canonical order of a KV cache's dims: what :func:`canonical_kv_view` returns.
CANONICAL_KV_DIMS: tuple[str, ...] = ("kv", "num_blocks", "block_size", "num_kv_heads", "head_size")


def canonical_kv_view(
    cache: torch.Tensor, layout: KVCacheLayout, num_kv_heads: int, head_size: int, *, physical: bool = False
) -> torch.Tensor:
    """A ``[2, num_blocks, block_size, num_kv_heads, head_size]`` view of ``cache`` stored in ``layout``.

    Writing the view writes the cache (it is never a copy: a layout whose dims cannot be viewed so
    raises). For interleaved layouts the combined heads are split back into K and V, a packed
    ``packing`` dim merged back, and the head size cut to the model's (``physical=True``: the
    physical size, padding features included, which must hold zeros).

    .. versionadded:: 1.5
    """
    if not layout.interleaved:
        view = cache.permute([layout.dims.index(d) for d in CANONICAL_KV_DIMS])
    else:
        order = [d for d in ("num_blocks", "block_size", "kv_heads", "packing", "head_size") if d in layout.dims]
        v = cache.permute([layout.dims.index(d) for d in order])
        nb, bs, dp = v.shape[0], v.shape[1], v.shape[-1]
        try:
            view = v.view(nb, bs, num_kv_heads, 2, dp).permute(3, 0, 1, 2, 4)
        except RuntimeError as e:  # the dims to merge are not adjacent in memory: no view exists
            raise ValueError(
                f"KV cache layout {layout.dims}: the cache {tuple(cache.shape)} has no canonical view ({e})"
            ) from None
    return view if physical else view[..., :head_size]


@dataclass(slots=True)
class FlatBlocks:
    """Every sequence's KV blocks of one step in one list, padded: the layout a flat paged-attention
    kernel reads (one batched pass over all blocks instead of a loop over sequences).

    Entry ``j`` is block ``block_list[j]``, the ``block_index[j]``-th block of sequence
    ``block_groups[j]``; its slot ``s`` holds the key at position ``block_index[j] * block_size + s``,
    valid while that is below the sequence's length. Padding entries name block 0 (the null block)
    and group ``B`` (one past the last sequence): a kernel gives group ``B`` length 0, so they mask out.
    Sequences appear in step order, each one's blocks in table order.

    .. versionadded:: 1.6
    """

    block_list: torch.Tensor  # [NB] int32
    block_groups: torch.Tensor  # [NB] int32: the sequence of each entry; B for padding
    block_index: torch.Tensor  # [NB] int32: the entry's index in its sequence's table
    #: The real (unpadded) entries.
    num_blocks: int = 0

    @staticmethod
    def count(seq_lens: Sequence[int], block_size: int) -> int:
        """Entries the flat list of sequences of ``seq_lens`` needs: their blocks, summed."""
        return sum(-(-n // block_size) for n in seq_lens)

    @classmethod
    def build(
        cls,
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]] | torch.Tensor,
        block_size: int,
        pad_to: int | None = None,
        *,
        num_seqs: int | None = None,
    ) -> FlatBlocks:
        """The flat list of sequences of ``seq_lens`` (host ints) over ``block_tables`` (one row per
        sequence), padded to ``pad_to`` entries (default: none); ``num_seqs`` is B, the padding group
        (default ``len(seq_lens)``).

        :raises ValueError: the list does not fit in ``pad_to``.
        """
        tables = block_tables.tolist() if isinstance(block_tables, torch.Tensor) else block_tables
        blocks: list[int] = []
        groups: list[int] = []
        index: list[int] = []
        for i, n in enumerate(seq_lens):
            used = -(-n // block_size)
            blocks.extend(tables[i][:used])
            groups.extend([i] * used)
            index.extend(range(used))
        real = len(blocks)
        size = real if pad_to is None else pad_to
        if real > size:
            raise ValueError(f"a flat block list of {real} blocks does not fit in {size} entries")
        pad_group = len(seq_lens) if num_seqs is None else num_seqs
        pad = size - real
        return cls(
            block_list=torch.tensor(blocks + [0] * pad, dtype=torch.int32),
            block_groups=torch.tensor(groups + [pad_group] * pad, dtype=torch.int32),
            block_index=torch.tensor(index + [0] * pad, dtype=torch.int32),
            num_blocks=real,
        )

    @classmethod
    def from_metadata(cls, meta: AttentionMetadata, block_size: int) -> FlatBlocks:
        """The flat list of ``meta``'s batch, unpadded (``meta.flat_blocks`` where the step has one)."""
        if meta.flat_blocks is not None:
            return meta.flat_blocks
        if meta.traced:
            raise ValueError("a traced step without a flat block list: declare StepBuckets.flat_blocks")
        flat = cls.build(meta.seq_lens_host, meta.block_tables.to(HOST), block_size, num_seqs=meta.num_seqs)
        device = meta.block_tables.device
        return cls(
            flat.block_list.to(device), flat.block_groups.to(device), flat.block_index.to(device), flat.num_blocks
        )


@dataclass(slots=True)
class AttentionMetadata:
    """The varlen batch one attention call serves: any mix of prefill chunks and decodes.

    T is the number of tokens in the step, B the number of sequences. Sequence ``i`` owns query
    tokens ``query_start_loc[i]:query_start_loc[i+1]``; they are the *last* tokens of its
    ``seq_lens[i]`` kv tokens (whose K/V are already written to the cache when ``forward`` runs),
    so query token ``j`` of sequence ``i`` sits at position ``seq_lens[i] - query_len + j`` and
    attends causally to kv positions ``<=`` its own.

    .. versionadded:: 1.0
    """

    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32; entries past a sequence's blocks are padding
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset; -1 marks a padding token
    max_query_len: int
    max_seq_len: int
    query_lens_host: list[int]  # host copies, so a kernel never syncs to read them
    seq_lens_host: list[int]
    #: ``[3]`` int32, cumulative ends ``(d, d + p, n)``: sequences ``[0, d)`` are decodes (one query
    #: token), ``[d, d + p)`` prefills from position 0, ``[d + p, n)`` any other chunk (after cached
    #: context), and ``[n, B)`` padding (length 0). The runner orders every step decode-first, so a
    #: kernel may run one pass per kind; a batch in another order is described as all general
    #: (``d = p = 0``), which is always correct. None only where built without :meth:`from_lengths`.
    #:
    #: .. versionadded:: 1.5
    distribution: torch.Tensor | None = None
    #: The host copy of :attr:`distribution` (empty when ``traced``).
    #:
    #: .. versionadded:: 1.5
    distribution_host: tuple[int, ...] = ()
    #: True inside a compiled static-shape step (:meth:`DeviceServices.compile_step`): the tensors
    #: are traced values, the host lists are empty, and ``max_query_len``/``max_seq_len`` are the
    #: bucket's bounds (T and W * block_size), not the step's.
    #:
    #: .. versionadded:: 1.5
    traced: bool = False
    #: The step's flat block list (every sequence's blocks in one padded list), where the step's
    #: buckets declare one (:attr:`StepBuckets.flat_blocks`); None otherwise: a kernel that wants
    #: one builds it with :meth:`FlatBlocks.from_metadata`.
    #:
    #: .. versionadded:: 1.6
    flat_blocks: FlatBlocks | None = None
    #: True when every sequence has exactly one query token and token ``i`` is sequence ``i``'s (a
    #: step of the decode set, or a batch of only decodes): a kernel may take its decode path
    #: without reading a length. Decided by the step's shape, never by values, so a graph captured
    #: for one shape takes one path.
    #:
    #: .. versionadded:: 1.6
    decode_only: bool = False

    @property
    def num_seqs(self) -> int:
        """B, the number of sequences (padding sequences included in a padded step).

        .. versionchanged:: 1.5
           read from ``seq_lens`` (a traced step has no host lists).
        """
        return int(self.seq_lens.shape[0])

    @staticmethod
    def describe(query_lens: list[int], seq_lens: list[int]) -> tuple[int, int, int]:
        """The :attr:`distribution` of a batch: ``(d, d + p, n)`` (see there).

        .. versionadded:: 1.5
        """
        n = len(seq_lens)
        while n and seq_lens[n - 1] == 0:
            n -= 1
        d = 0
        while d < n and query_lens[d] == 1:
            d += 1
        p = d
        while p < n and query_lens[p] == seq_lens[p]:
            p += 1
        return d, p, n

    @classmethod
    def from_lengths(
        cls,
        query_lens: list[int],
        seq_lens: list[int] | torch.Tensor,
        block_tables: torch.Tensor | list[list[int]],
        *,
        block_size: int | None = None,
        slot_mapping: torch.Tensor | None = None,
        query_start_loc: torch.Tensor | None = None,
        max_seq_len: int | None = None,
        device: torch.device | str | None = None,
    ) -> AttentionMetadata:
        """The metadata of a batch whose sequence ``i`` computes its last ``query_lens[i]`` of
        ``seq_lens[i]`` tokens: the one way to build one (API 1.4).

        .. versionadded:: 1.4
        .. versionchanged:: 1.5
           sets :attr:`distribution`.
        .. versionchanged:: 1.6
           sets :attr:`decode_only`.

        :param query_lens: new tokens per sequence (host ints).
        :param seq_lens: kv tokens per sequence: host ints, or an int32 tensor used as it is (a
            step graph's fixed buffer; its host copy is read once, here).
        :param block_tables: ``[B, max_blocks]`` int32 tensor used as it is, or one block-id list per
            sequence (padded with block 0).
        :param block_size: derive ``slot_mapping`` from the block tables (each token's slot in its
            block); give this or ``slot_mapping``.
        :param slot_mapping: ``[T]`` int64 slots used as they are (-1: a padding token that writes no
            K/V); a caller that already holds the tokens' positions computes them once itself.
        :param query_start_loc: ``[B+1]`` offsets the caller already holds (default: the cumulative
            sum of ``query_lens``).
        :param max_seq_len: default ``max(seq_lens)``; a step graph passes the context length.
        :param device: where the tensors go (default: where they are; new ones on the host).
        """
        if (block_size is None) == (slot_mapping is None):
            raise ValueError("AttentionMetadata.from_lengths needs exactly one of block_size and slot_mapping")
        if isinstance(seq_lens, torch.Tensor):
            seq_lens_host: list[int] = seq_lens.tolist()
            seq_lens_t = seq_lens.to(device=device, dtype=torch.int32)
        else:
            seq_lens_host = seq_lens
            seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        if not isinstance(block_tables, torch.Tensor):
            width = max(len(t) for t in block_tables)
            block_tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
        if query_start_loc is None:
            query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
            torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0, out=query_start_loc[1:])
        if slot_mapping is None:
            assert block_size is not None
            # token j of sequence i sits at position seq_lens[i] - query_lens[i] + j
            positions = torch.tensor(
                [p for q, s in zip(query_lens, seq_lens_host, strict=True) for p in range(s - q, s)], dtype=torch.long
            )
            seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))  # [T]
            blocks = block_tables.to(HOST)[seq_of_token, positions // block_size].long()
            slot_mapping = blocks * block_size + positions % block_size
        distribution = cls.describe(query_lens, seq_lens_host)
        return cls(
            query_start_loc=query_start_loc.to(device=device, dtype=torch.int32),
            seq_lens=seq_lens_t,
            block_tables=block_tables.to(device=device),
            slot_mapping=slot_mapping.to(device=device, dtype=torch.int64),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens_host) if max_seq_len is None else max_seq_len,
            query_lens_host=query_lens,
            seq_lens_host=seq_lens_host,
            distribution=torch.tensor(distribution, dtype=torch.int32, device=device),
            distribution_host=distribution,
            decode_only=bool(query_lens) and all(q == 1 for q in query_lens),
        )


class AttentionKernels(ABC):
    """KV-cache write and paged attention for one :class:`AttentionSpec`.

    .. versionadded:: 1.0
    """

    def __init__(self, spec: AttentionSpec, layout: KVCacheLayout) -> None:
        self.spec = spec
        self.layout = layout

    @abstractmethod
    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store ``key``/``value`` ([T, Hkv, D], any strides: ``value`` is usually a view into the
        fused QKV projection) at ``slot_mapping`` ([T]); slots < 0 are skipped."""

    @abstractmethod
    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Paged attention: ``query`` [T, H, D] -> output [T, H, D] over the cached K/V."""

    def write_and_attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused, functional entry: store ``key``/``value`` ([T, Hkv, D], any strides) at
        ``meta.slot_mapping`` and attend ``query`` ([T, H, D]) over the cache; returns
        ``(output [T, H, D], kv_cache)``.

        The model's attention layers call this, and keep the cache it returns as the layer's cache:
        a device whose arrays are immutable returns a new cache (and may fuse the write into the
        attention kernel); the default writes in place with :meth:`write_kv`, then runs
        :meth:`forward`, and returns ``kv_cache`` itself.

        .. versionadded:: 1.5
        """
        self.write_kv(key.contiguous(), value, kv_cache, meta.slot_mapping)
        return self.forward(query.contiguous(), kv_cache, meta, scale), kv_cache

    def copy_blocks(self, kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer's cache (copy-on-write of shared blocks).

        A backend with immutable caches replaces the list's entries with the copied caches."""
        if not pairs:
            return
        axis = self.layout.dims.index("num_blocks")
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=kv_caches[0].device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=kv_caches[0].device)
        for cache in kv_caches:
            if cache.dtype.itemsize == 1 and cache.dtype.is_floating_point:
                cache = cache.view(torch.uint8)  # fp8: copied as bytes (torch has no fp8 index_copy_)
            cache.index_copy_(axis, dst, cache.index_select(axis, src))


@dataclass(slots=True)
class LinearWeight:
    """A weight prepared by a backend's GEMM: dense ``[N, K]`` or a backend-specific format.

    .. versionadded:: 1.0
    """

    out_features: int
    in_features: int
    weight: torch.Tensor | None
    bias: torch.Tensor | None = None
    format: str = "dense"
    data: dict[str, Any] = field(default_factory=dict)


class GemmKernels(ABC):
    """Matrix multiplication of activations with prepared weights.

    .. versionadded:: 1.0
    """

    #: Dtypes in which a dense linear weight reaches :meth:`prepare` as the checkpoint stored it
    #: (moved to the device, not cast); :meth:`prepare` then casts it as it sees fit (the cpu
    #: backend keeps a bf16/fp16 checkpoint's weights in 16 bits in an fp32 model). Weights in any
    #: other dtype, and every weight where this is empty (the default), arrive cast to the model's
    #: dtype.
    #:
    #: .. versionadded:: 1.14
    stored_dtypes: frozenset[torch.dtype] = frozenset()

    @abstractmethod
    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearWeight:
        """Turn a dense ``weight`` [N, K] (and ``bias`` [N]) into the layout ``linear`` wants.

        Called once per weight at load time; may re-lay out, cast or move to the device. The weight
        is in the model's dtype, or in its stored dtype where that is one of :attr:`stored_dtypes`.
        """

    @abstractmethod
    def linear(self, x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
        """``x`` [M, K] @ weight.T (+ bias) -> [M, N]."""

    def prepare_quantized(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> LinearWeight:
        """Prepare a weight kept in a ggml block format (see :mod:`plinth.platform.quant`).

        The core calls this only for formats the backend lists in ``Capabilities.quant_formats``;
        for any other it dequantizes first and calls :meth:`prepare`. The default dequantizes, so
        declaring a format without overriding this is correct, merely not compact.

        .. versionadded:: 1.1
        """
        return self.prepare(dequantize(weight), bias)


def route_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused-MoE op's routing rule: ``router_logits`` [T, E] -> (weights [T, k] fp32, ids [T, k] int64).

    Softmax over the experts in fp32, the ``top_k`` largest probabilities (largest first; among
    equal ones torch's ``topk`` picks), divided by their sum when ``renormalize``. A backend may
    route its own way as long as it picks the same experts with the same weights.

    .. versionadded:: 1.8
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@dataclass(slots=True)
class ExpertWeights:
    """A layer's experts as a backend's fused-MoE op prepared them: dense stacks or its own format.

    ``gate_up`` is ``[E, 2 * I, H]`` (each expert's gate rows, then its up rows) and ``down``
    ``[E, H, I]`` where the op keeps them dense; ``data`` holds anything else it made.

    .. versionadded:: 1.8
    """

    spec: MoESpec
    gate_up: torch.Tensor | None
    down: torch.Tensor | None
    format: str = "dense"
    data: dict[str, Any] = field(default_factory=dict)


class MoEKernels(ABC):
    """A fused mixture-of-experts op for one :class:`MoESpec`.

    ``forward(x, router_logits, weights)`` is, for every token, the sum over its ``top_k`` experts
    (chosen and weighted by :func:`route_experts`) of ``w * down_e(act(gate_e(x)) * up_e(x))``,
    where ``act`` is ``spec.activation``. A fast implementation groups the step's tokens by expert
    so that each expert's weights are read once per step, not once per token. The reference
    (:class:`plinth.platform.reference.ReferenceMoE`) is the oracle and the per-op fallback.

    .. versionadded:: 1.8
    """

    def __init__(self, spec: MoESpec) -> None:
        self.spec = spec

    @abstractmethod
    def prepare(self, gate_up: torch.Tensor, down: torch.Tensor) -> ExpertWeights:
        """Lay out dense experts once, at load time: ``gate_up`` [E, 2I, H], ``down`` [E, H, I]."""

    def check_experts(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Raise ``ValueError`` naming both shapes unless ``gate_up`` is [E, 2I, H] and ``down``
        [E, H, I] for :attr:`spec` (what :meth:`prepare` receives)."""
        s = self.spec
        want_gate_up = (s.num_experts, 2 * s.intermediate_size, s.hidden_size)
        want_down = (s.num_experts, s.hidden_size, s.intermediate_size)
        if tuple(gate_up.shape) != want_gate_up or tuple(down.shape) != want_down:
            raise ValueError(
                f"expert weights gate_up {tuple(gate_up.shape)} / down {tuple(down.shape)}; "
                f"expected {want_gate_up} / {want_down} for {s}"
            )

    def check_call(self, x: torch.Tensor, router_logits: torch.Tensor, weights: ExpertWeights) -> None:
        """Raise ``ValueError`` naming what is wrong unless ``x`` is [T, H], ``router_logits``
        [T, E] and ``weights`` were prepared for :attr:`spec` (what :meth:`forward` receives)."""
        s = self.spec
        if x.dim() != 2 or x.shape[1] != s.hidden_size:
            raise ValueError(f"x {tuple(x.shape)}: expected [T, {s.hidden_size}] for {s}")
        if tuple(router_logits.shape) != (x.shape[0], s.num_experts):
            raise ValueError(f"router_logits {tuple(router_logits.shape)}: expected [{x.shape[0]}, {s.num_experts}]")
        if weights.spec != s:
            raise ValueError(f"expert weights prepared for {weights.spec} ({weights.format}), not for {s}")

    def prepare_quantized(self, gate_up: Sequence[QuantizedWeight], down: Sequence[QuantizedWeight]) -> ExpertWeights:
        """Prepare experts kept in ``spec.quant_format``: one ``[2I, H]`` and one ``[H, I]`` weight per expert.

        The core calls this only when the backend declares the format in
        ``MoECapabilities.quant_formats``. The default dequantizes and calls :meth:`prepare`, so
        declaring a format without overriding this is correct, merely not compact.
        """
        dtype = torch_dtype(self.spec.dtype)
        stack_gate_up = torch.stack([dequantize(w) for w in gate_up]).to(dtype)
        stack_down = torch.stack([dequantize(w) for w in down]).to(dtype)
        return self.prepare(stack_gate_up, stack_down)

    @abstractmethod
    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, weights: ExpertWeights) -> torch.Tensor:
        """``x`` [T, H] in ``spec.dtype``, ``router_logits`` [T, E] -> [T, H] in ``spec.dtype``."""


class SmallOps:
    """Elementwise and normalisation ops a backend may override. The defaults are plain torch.

    .. versionadded:: 1.0
    """

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """``x.argmax(dim=-1)`` of a 2-D tensor ``[S, V]`` -> ``[S]`` int64: the first index of each
        row's maximum, a NaN counting as the maximum (torch's rule). The sampler picks greedy tokens
        and its exponential-race draws with it, once per step; a backend whose torch argmax is slow
        on its device overrides it with a faster equivalent that returns the same indices.

        .. versionadded:: 1.4
        """
        return x.argmax(dim=-1)

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Set to ``-inf``, in place, the logits of the tokens a bitmask forbids: structured output.

        ``logits`` [S, V] float32 (rows may be a view with a row stride); ``bitmask`` [S, ceil(V/32)]
        int32 on the same device, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed
        (the layout of llguidance and xgrammar). Bits past ``V`` are ignored. The sampler calls it
        once per step for the rows of constrained requests; a backend overrides it with one kernel.

        .. versionadded:: 1.9
        """
        vocab = logits.shape[-1]
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab]  # [S, V]
        logits.masked_fill_(allowed == 0, float("-inf"))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim, computed in fp32 at least: ``x / rms(x) * weight``."""
        dtype = x.dtype
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (out * weight.to(out.dtype)).to(dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``s = x + residual``; returns ``(rms_norm(s), s)``.

        The pre-norm residual step of every decoder layer in one call. ``residual`` belongs to
        the caller's forward pass and may be overwritten with ``s`` (and returned as it).

        .. versionadded:: 1.1
        """
        s = x + residual
        return self.rms_norm(s, weight, eps), s

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [M, 2I] -> silu(x[:, :I]) * x[:, I:]  ([M, I])."""
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def rms_norm_heads(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of every head of ``x`` [T, H, D] over its ``D`` values (``weight`` [D]) -> a new
        contiguous [T, H, D]: the q/k norm of Qwen3 and Gemma 3. ``x`` is a view of the fused QKV
        projection (heads dense, any token stride). The default copies the heads dense and calls
        :meth:`rms_norm`; a backend whose step graphs record only its own kernels overrides it with
        one kernel that reads the strided view (a copy by torch would keep the step out of a graph).

        .. versionadded:: 1.8
        """
        num_tokens, num_heads, head_dim = x.shape
        return self.rms_norm(x.reshape(num_tokens * num_heads, head_dim), weight, eps).view(x.shape)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [M, 2I] -> gelu_tanh(x[:, :I]) * x[:, I:]  ([M, I]): GELU's tanh approximation, the
        gated MLP of Gemma 3.

        .. versionadded:: 1.8
        """
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.gelu(gate, approximate="tanh") * up

    def rotary(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
        """NeoX-style rotary embedding of ``x`` [T, H, D] at ``positions`` [T].

        ``cos_sin`` is [max_pos, rotary_dim] (cos in the first half, sin in the second); the first
        ``rotary_dim`` features of each head are rotated, the rest pass through.
        """
        cs = cos_sin.index_select(0, positions)  # [T, rotary_dim]
        cos, sin = cs.chunk(2, dim=-1)
        cos = cos.unsqueeze(1).to(x.dtype)  # [T, 1, rotary_dim/2]
        sin = sin.unsqueeze(1).to(x.dtype)
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return torch.cat((out, rest), dim=-1) if rest.numel() else out


class StepGraph(ABC):
    """Kernel calls recorded once over fixed buffers, replayed without the code that issued them.

    The analogue of a CUDA graph: every buffer a recorded call read or wrote is the one it uses on
    replay, so the caller refills the inputs in place and reads the outputs where they were.

    .. versionadded:: 1.2
    """

    @abstractmethod
    def replay(self) -> None:
        """Run the recorded calls again, in order."""

    def replay_rows(self, rows: int, captured: int) -> None:
        """Replay for the first ``rows`` of the ``captured`` rows (tokens) the graph was recorded
        with: the rest are a bucket's padding, whose outputs are dropped. The default replays every
        row; a backend whose recorded calls work row by row may run only ``rows``.

        .. versionadded:: 1.3
        """
        self.replay()


class GraphCapture(ABC):
    """A recording in progress, from :meth:`DeviceServices.begin_graph_capture`.

    Between ``begin_graph_capture`` and :meth:`finish` the caller runs a model forward once, for
    real (its results are valid); the backend records its kernel calls as they run.

    .. versionadded:: 1.2
    """

    #: True when only the backend's own kernel calls are recorded, not torch ops. The core then
    #: watches the capture and discards it if any torch op computed something (views and
    #: allocations are fine), and keeps every tensor made during it alive for the replays.
    kernels_only: ClassVar[bool] = True

    @abstractmethod
    def finish(self) -> StepGraph:
        """Stop recording; the graph of what ran since the capture began."""

    @abstractmethod
    def cancel(self) -> None:
        """Stop recording and discard it."""


@dataclass(slots=True)
class StepInputs:
    """The padded inputs of one static-shape step (shape ``(T, B, W)``, a :class:`StepShape`).

    The runner fills them from the scheduled batch, decode-first (see
    :attr:`AttentionMetadata.distribution`), and pads them with these semantics:

    * tokens past the real ones have id 0, position 0 and slot -1: they write no K/V, belong to no
      sequence, and their outputs are dropped (an attention kernel leaves any finite value there);
    * sequences past the real ones have length 0 and no query tokens (their ``query_start_loc``
      entries repeat the real token count), a block-table row of block 0 (the null block), and a
      logits index of 0 whose logits are dropped;
    * every block-table row is ``W`` wide; entries past a sequence's blocks are 0.

    All tensors are on the host; a compiled step moves them to its device.

    .. versionadded:: 1.5
    """

    input_ids: torch.Tensor  # [T] int32
    positions: torch.Tensor  # [T] int32
    slot_mapping: torch.Tensor  # [T] int32; -1: padding
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32; 0: padding
    block_tables: torch.Tensor  # [B, W] int32
    distribution: torch.Tensor  # [3] int32, as AttentionMetadata.distribution
    logits_indices: torch.Tensor  # [B] int32: the index into T of each sequence's last token
    #: The shape these tensors are padded to.
    shape: StepShape
    #: The real (unpadded) counts: tokens and sequences.
    num_tokens: int = 0
    num_seqs: int = 0
    #: The step's flat block list, padded to ``shape.flat_blocks`` (padding: block 0, group B);
    #: None when the shape has none.
    #:
    #: .. versionadded:: 1.6
    flat_blocks: FlatBlocks | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors by name (what a compiled step takes as its input arrays).

        .. versionchanged:: 1.6
           ``flat_block_list``, ``flat_block_groups`` and ``flat_block_index`` where the shape has a
           flat block list.
        """
        out = {
            "input_ids": self.input_ids,
            "positions": self.positions,
            "slot_mapping": self.slot_mapping,
            "query_start_loc": self.query_start_loc,
            "seq_lens": self.seq_lens,
            "block_tables": self.block_tables,
            "distribution": self.distribution,
            "logits_indices": self.logits_indices,
        }
        if self.flat_blocks is not None:
            out["flat_block_list"] = self.flat_blocks.block_list
            out["flat_block_groups"] = self.flat_blocks.block_groups
            out["flat_block_index"] = self.flat_blocks.block_index
        return out

    @classmethod
    def dummy(cls, shape: StepShape) -> StepInputs:
        """Inputs of ``shape`` that are all padding but one decode token of sequence 0 (a warm-up
        step: compiles the shape, writes nothing)."""
        t, b, w = shape.tokens, shape.seqs, shape.blocks_per_seq
        flat = FlatBlocks.build([1], [[0]], 1, shape.flat_blocks, num_seqs=b) if shape.flat_blocks else None
        return cls(
            input_ids=torch.zeros(t, dtype=torch.int32),
            positions=torch.zeros(t, dtype=torch.int32),
            slot_mapping=torch.full((t,), -1, dtype=torch.int32),
            query_start_loc=torch.tensor([0] + [1] * b, dtype=torch.int32),
            seq_lens=torch.tensor([1] + [0] * (b - 1), dtype=torch.int32),
            block_tables=torch.zeros(b, w, dtype=torch.int32),
            distribution=torch.tensor([1, 1, 1], dtype=torch.int32),
            logits_indices=torch.zeros(b, dtype=torch.int32),
            shape=shape,
            num_tokens=1,
            num_seqs=1,
            flat_blocks=flat,
        )


class StepProgram(ABC):
    """A model's whole step as a pure function of its weights, KV caches and padded inputs.

    The core builds it from the loaded model; a compiled backend traces :meth:`__call__` (with its
    own array types standing in for the tensors) and compiles it once per :class:`StepShape`. No
    state outside the arguments is read or written: the step's K/V writes come back in the
    returned caches.

    .. versionadded:: 1.5
    """

    #: Every tensor the forward reads, by a stable name (the arguments the compiled function takes).
    weights: dict[str, torch.Tensor]
    #: The vocabulary size (the logits' last dim) and the hidden size.
    vocab_size: int
    hidden_size: int

    @abstractmethod
    def __call__(
        self,
        weights: dict[str, torch.Tensor],
        kv_caches: list[torch.Tensor],
        inputs: dict[str, torch.Tensor],
        shape: StepShape,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``(logits [B, vocab] float32, kv_caches)`` of the step whose padded ``inputs`` (by the
        names of :meth:`StepInputs.tensors`) have ``shape``; row ``i`` of the logits is sequence
        ``i``'s last token (padding sequences' rows are dropped)."""


class CompiledStep(ABC):
    """A :class:`StepProgram` compiled for a set of shapes, holding the KV caches as explicit state.

    From :meth:`DeviceServices.compile_step`. It owns the caches from then on (as device arrays):
    the runner calls :meth:`run` for every step, and :meth:`copy_blocks` for copy-on-write.

    .. versionadded:: 1.5
    """

    #: Compilations so far (one per shape, warm-up included; a cache hit from disk counts too: it
    #: is a trace). The engine records the count after warm-up and logs loudly when it moves.
    compilations: int = 0

    def warmup(
        self, shapes: Sequence[StepShape], progress: Callable[[int, int, StepShape], None] | None = None
    ) -> None:
        """Compile every shape (ahead of the first request), calling ``progress(done, total, shape)``
        after each; must leave the KV caches as they were.

        The default runs one all-padding step per shape (:meth:`StepInputs.dummy`: it writes nothing).

        .. versionchanged:: 1.7
           a default (it was abstract).
        """
        for i, shape in enumerate(shapes):
            self.run(StepInputs.dummy(shape))
            if progress is not None:
                progress(i + 1, len(shapes), shape)

    @abstractmethod
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Run one step; the logits ``[B, vocab]`` float32 on the host (B: the padded count)."""

    @abstractmethod
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer's cache."""

    @abstractmethod
    def kv_caches(self) -> list[torch.Tensor]:
        """The caches as host tensors in the declared layout (a copy where the device needs one):
        for tests and debugging, never called in the step loop."""


class PendingSend(Protocol):
    """A send under way (:meth:`Communicator.send`).

    .. versionadded:: 1.7
    """

    def wait(self) -> None:
        """Return once the tensor was sent (the caller may then change it)."""


class Communicator(ABC):
    """Collectives over one group of ranks, each driving one device (tensor and pipeline parallelism).

    A backend supplies one for its device group through :meth:`DeviceServices.communicator`; the
    default is ``torch.distributed`` over a process group of the backend's declared
    ``Capabilities.communicator`` (gloo when none is declared). Every method is collective: each rank
    of the group calls it, in the same order, with tensors of the same shape and dtype.

    .. versionadded:: 1.7
    """

    #: This process's rank in the group, and the group's size.
    rank: int
    world_size: int

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place (any strides); returns it."""

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along ``dim``, rank order (a new tensor)."""

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``src``'s ``tensor`` on every rank, in place; returns it."""

    @abstractmethod
    def barrier(self) -> None:
        """Return once every rank has called it."""

    @abstractmethod
    def send(self, tensor: torch.Tensor, dst: int) -> PendingSend:
        """Start sending ``tensor`` to rank ``dst`` (which calls :meth:`recv`); may return before
        ``dst`` has it (a pipeline stage goes on to its next micro-batch meanwhile). Call ``wait()``
        on the result before changing ``tensor``."""

    @abstractmethod
    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into ``tensor`` (its shape and dtype: the sender's) from rank ``src``; returns it."""


def host_memory_info() -> tuple[int, int]:
    """``(available_bytes, total_bytes)`` of host memory: /proc/meminfo's MemAvailable where the host
    has one (free memory plus what the kernel can reclaim, such as the page cache a checkpoint was
    just read through, which MemFree leaves out), else the free pages."""
    import os
    from pathlib import Path

    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, total
    return os.sysconf("SC_AVPHYS_PAGES") * page, total


class DeviceServices:
    """Device-level services: where tensors live, how much memory is free, step graphs.

    The default describes the host CPU; accelerator backends override it.

    .. versionadded:: 1.0
    .. versionchanged:: 1.4
        ``compile`` removed: the core never called it (an override is now simply unused); the
        engine's compiled path is the step graph (:meth:`begin_graph_capture`).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def memory_info(self) -> tuple[int, int]:
        """``(free_bytes, total_bytes)`` of the memory the KV cache is allocated in (the default:
        the host's, :func:`host_memory_info`)."""
        return host_memory_info()

    def synchronize(self) -> None:
        """Wait until every kernel queued on the device has finished (no-op on synchronous devices).

        Called before a clock is read around device work (the conformance suite's kernel timings
        and roofline, ``plinth bench``'s timings) and before results of checked kernel calls are
        compared on the host. Never called in the step loop: reading sampled tokens back already
        orders the work there.
        """

    def default_dtype(self) -> str:
        """The compute dtype to use when the user does not choose one."""
        return "float32"

    def set_num_threads(self, n: int) -> None:
        """Run this backend's host-side work on ``n`` threads (``--threads``, ``EngineConfig.num_threads``).

        The engine calls it once, before it asks for any kernels, and only when the user chose a
        count; otherwise the backend keeps its own default. The default sets torch's intra-op thread
        count (the host threads torch's CPU ops use); a backend with a thread pool of its own sets that
        too.

        .. versionadded:: 1.4
        """
        torch.set_num_threads(n)

    def read_probes(self) -> dict[str, Callable[[torch.Tensor], object]]:
        """Ways to stream-read device memory, by name, for ``plinth bench latency``'s bandwidth limits.

        Each callable reads every element of one fp32 tensor on :attr:`device` (contiguous, ``numel`` a
        multiple of 4096) once, and writes nothing to it; the bench times each (calling
        :meth:`synchronize` after it) and holds batch-1 decode to the fastest, the read bandwidth a
        bandwidth-bound GEMV could reach. The tensor is a 256 MB buffer, or an fp32 view of a prepared
        weight's bytes in place (any 4-byte-aligned address; whatever its dtype, the values may be
        any bits), one after another over the whole model. The default is torch's ``sum``; a backend
        adds the loads its own GEMV kernel makes.

        .. versionadded:: 1.4
        """
        return {"torch_sum": torch.Tensor.sum}

    def compile_step(
        self,
        program: StepProgram,
        kv_caches: list[torch.Tensor],
        *,
        cache_dir: str | None = None,
        spmd: SpmdPlan | None = None,
    ) -> CompiledStep | None:
        """Compile ``program`` into a :class:`CompiledStep` that takes over ``kv_caches`` (the
        engine's, from :meth:`Backend.allocate_kv_cache`); None (the default) where the backend does
        not compile whole steps (the runner then runs the program eagerly on the padded inputs).

        Asked only of a backend whose :meth:`Backend.step_buckets` returns buckets; the engine then
        calls :meth:`CompiledStep.warmup` with every shape before serving. ``cache_dir`` is where
        compiled executables may be kept across processes (``EngineConfig.compile_cache_dir``);
        None: no disk cache.

        ``spmd`` (only to a backend declaring ``Capabilities.spmd``, and only when the engine runs
        ``tensor_parallel_size > 1``): place the weights and caches over a mesh of ``spmd.size``
        devices as the plan says; the caches handed in are whole (every KV head). A backend that
        cannot (too few devices) raises ``ValueError`` naming what it has.

        .. versionadded:: 1.5
        .. versionchanged:: 1.12
            ``spmd``
        """
        return None

    def device_for_rank(self, local_rank: int) -> torch.device:
        """The device the ``local_rank``-th rank on this host drives (the default: :attr:`device`
        for every rank, as on the CPU; a GPU backend returns ``cuda:<local_rank>``).

        .. versionadded:: 1.7
        """
        return self.device

    def communicator(
        self, world_size: int, rank: int, backend: str | None, *, groups: list[list[int]] | None = None
    ) -> Communicator:
        """The collectives of this rank's device group, once ``torch.distributed`` is initialised
        (the core does that, with a CPU group it keeps for its own control messages).

        ``backend`` is the backend's ``Capabilities.communicator`` (a ``torch.distributed`` backend
        name; None: the host collectives, :data:`plinth.platform.devices.HOST_COLLECTIVES`). The
        default makes a new ``torch.distributed`` group of that backend over every rank.

        ``groups`` (tensor and pipeline parallelism together) splits the world of ``world_size``
        ranks into groups, each a list of world ranks; every rank passes the same list, in the same
        order (collective: a ``torch.distributed`` group is made by every rank of the world, member or
        not). The result is the communicator of the group holding world rank ``rank``, numbered by
        place in that list (its ``rank``/``world_size`` are the group's; ``send``/``recv``/``broadcast``
        take group ranks). The core calls it twice, tensor-parallel groups first, then pipeline
        groups. None: one group of every rank. The core passes ``groups`` only to an implementation
        that takes it; one that does not (written for 1.7-1.9) is refused TP x PP with its name.

        .. versionadded:: 1.7
        .. versionchanged:: 1.10
            ``groups``
        """
        from plinth.parallel.comm import TorchDistributedCommunicator

        if groups is None:
            return TorchDistributedCommunicator.new_group(world_size, rank, backend or HOST_COLLECTIVES)
        return TorchDistributedCommunicator.split(groups, rank, backend or HOST_COLLECTIVES)

    def begin_graph_capture(self) -> GraphCapture | None:
        """Start recording kernel calls into a :class:`StepGraph`; None (the default) where the
        backend cannot. The runner captures decode steps once per batch-size bucket and replays
        them; a backend's kernels must then make the same calls for the same batch size (the
        choices they make on the host may depend on shapes, not on the values in the metadata).

        .. versionadded:: 1.2
        """
        return None


class Backend(ABC):
    """A hardware backend as a plugin registers it. Subclasses set the class attributes.

    .. versionadded:: 1.0
    """

    #: Unique across installed plugins; what users type in ``--backend``.
    name: ClassVar[str]
    #: The backend's own version (shown by ``plinth backends`` and in certificates).
    version: ClassVar[str] = "0"
    #: The ``PLUGIN_API_VERSION`` this backend was written against (see :mod:`plinth.hookspecs`).
    api_version: ClassVar[tuple[int, int]] = (1, 0)
    description: ClassVar[str] = ""

    @abstractmethod
    def probe(self) -> Probe:
        """Check the hardware and software this backend needs. Must not raise for missing hardware:
        return score 0 with the reason instead."""

    @abstractmethod
    def capabilities(self) -> Capabilities:
        """What this backend supports."""

    @abstractmethod
    def device_services(self) -> DeviceServices:
        """Device services for this backend's device."""

    @abstractmethod
    def attention_kernels(self, spec: AttentionSpec) -> AttentionKernels:
        """Kernels for ``spec``; raise :class:`NotSupported` if the capabilities exclude it."""

    @abstractmethod
    def gemm_kernels(self, dtype: str) -> GemmKernels:
        """GEMM for activations of ``dtype``; raise :class:`NotSupported` if unsupported."""

    def small_ops(self) -> SmallOps:
        """Norm, activation and rotary ops; the default is plain torch."""
        return SmallOps()

    def moe_kernels(self, spec: MoESpec) -> MoEKernels:
        """The fused-MoE op for ``spec``; raise :class:`NotSupported` for a case not declared in
        ``Capabilities.fused_moe``. The default supplies none (MoE layers then run the reference op).

        .. versionadded:: 1.8
        """
        raise NotSupported(self.name, "fused MoE", "the backend supplies no fused-MoE op")

    def lora_kernels(self, spec: LoRASpec) -> LoRAKernels:
        """The batched LoRA op for ``spec`` (multi-LoRA serving); raise :class:`NotSupported` for a
        case it does not cover. The default supplies none: a LoRA-enabled engine then runs the
        reference op (:class:`plinth.platform.reference.ReferenceLoRA`) with a fallback warning.

        .. versionadded:: 1.11
        """
        raise NotSupported(self.name, "LoRA", "the backend supplies no batched LoRA op")

    def bind_local_rank(self, local_rank: int) -> None:
        """Make this process drive the device of ``local_rank`` (its index among the ranks on this
        host) before :meth:`device_services` is asked for anything: a rank of a tensor- or
        pipeline-parallel world calls it first, once. Afterwards ``device_services().device`` must
        be ``device_services().device_for_rank(local_rank)``; the core refuses the rank, naming both,
        when it is not. The default does nothing (every rank drives the one device: the CPU); a GPU
        backend selects GPU ``local_rank`` (``torch.cuda.set_device``) and makes its services for it.

        :raises ValueError: there is no such device on this host (name how many there are).

        .. versionadded:: 1.13
        """
        return None  # every rank drives the one device

    def step_buckets(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int) -> StepBuckets | None:
        """The shapes to pad every step to, for an engine whose steps have at most ``max_tokens``
        query tokens, ``max_seqs`` sequences and ``max_blocks_per_seq`` blocks per sequence; None
        (the default): steps keep their own shapes.

        A static-shape backend (a compiler: XLA, HPU graphs) returns buckets whose largest of each
        kind holds the maximum (:meth:`StepBuckets.powers_of_two` is one way); the engine refuses
        buckets that do not. Every step is then padded (:class:`StepInputs`) and run through
        :meth:`DeviceServices.compile_step`.

        .. versionadded:: 1.5
        """
        return None

    def allocate_kv_cache(self, spec: AttentionSpec, num_blocks: int, *, prefault: bool = False) -> torch.Tensor:
        """One layer's KV cache, shaped by the declared :class:`KVCacheLayout`, zero-filled.

        :param prefault: back every page with memory before returning (``EngineConfig.kv_cache_prefault``,
            what a long-running server wants: no step then pays for a first touch). False lets a backend
            fill pages lazily, as blocks are first written (what a one-shot command wants: a short
            start-up). The default writes the whole cache either way. An implementation written before
            1.4 does not take it and is called without it.

        .. versionchanged:: 1.4
           ``prefault``.
        """
        layout = self.capabilities().kv_cache_layout
        dtype = torch_dtype(spec.kv_cache_dtype)
        shape = layout.shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size, itemsize=dtype.itemsize)
        device = self.device_services().device
        return torch.zeros(shape, dtype=dtype, device=device)


class KernelProvider(ABC):
    """Kernels a plugin contributes to another plugin's backend (``plinth_register_kernels``).

    Resolution per op (:func:`plinth.platform.kernels.resolve_kernels`): providers with
    ``priority`` above 0, highest first, are asked before the backend; the backend's own kernels
    have priority 0; providers at 0 or below are asked only where the backend raises
    ``NotSupported``. A factory returns None for a case it does not cover, never raises for it.

    .. versionadded:: 1.0
    """

    #: The backend these kernels are for; a provider for another backend is ignored.
    backend_name: ClassVar[str]
    #: Named in the engine's log when its kernels are chosen, and in errors.
    name: ClassVar[str]
    #: The backend's own kernels have priority 0.
    priority: ClassVar[int] = 0
    #: The ``PLUGIN_API_VERSION`` this provider was written against; checked like
    #: ``Backend.api_version`` (a kernel-only plugin registers no backend to check).
    #:
    #: .. versionadded:: 1.4
    api_version: ClassVar[tuple[int, int]] = (1, 0)

    def attention_kernels(self, spec: AttentionSpec, layout: KVCacheLayout) -> AttentionKernels | None:
        """Kernels for ``spec``, or None when this provider does not cover it."""
        return None

    def gemm_kernels(self, dtype: str) -> GemmKernels | None:
        """GEMM for ``dtype``, or None when this provider does not cover it."""
        return None

    def moe_kernels(self, spec: MoESpec) -> MoEKernels | None:
        """A fused-MoE op for ``spec``, or None when this provider does not cover it.

        .. versionadded:: 1.8
        """
        return None

    def lora_kernels(self, spec: LoRASpec) -> LoRAKernels | None:
        """A batched LoRA op for ``spec``, or None when this provider does not cover it.

        .. versionadded:: 1.11
        """
        return None
