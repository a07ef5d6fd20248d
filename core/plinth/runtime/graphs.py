"""Decode steps as step graphs: record a batch size's kernel calls once, then replay them.

At batch 1 on a CPU, the Python that issues a decode step's few hundred kernel calls costs about as
much as their arithmetic. Where the backend can record its calls (:meth:`DeviceServices.
begin_graph_capture`), the runner captures each decode batch-size bucket once, the first time it
sees it, and from then on only refills fixed input buffers and replays the recording: the vLLM
CUDA-graph scheme, with the same rules.

* Only pure decode steps (one new token per sequence) of at most ``max(batch_sizes)`` sequences
  use graphs; a batch is padded up to its bucket with rows that write no KV (slot -1) and attend
  to one cached position of block 0, and whose outputs are dropped. A backend whose graphs can run
  fewer rows than they were recorded with (``StepGraph.replay_rows``, API 1.3: the CPU's) skips
  the padding rows altogether.
* The graph starts after the embedding lookup (done here into the fixed input buffer) and ends
  with the final norm; logits and sampling run as usual.
* A kernels-only recorder (the CPU's) cannot record torch ops, so a capture during which a torch
  op computed anything (views and allocations are fine) is discarded and that bucket runs eagerly
  from then on. Every tensor made during a kept capture stays alive: replays write into them.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from plinth.model.context import ForwardContext
from plinth.platform.backend import AttentionMetadata, DeviceServices, StepGraph
from plinth.platform.devices import HOST

logger = logging.getLogger(__name__)

#: Decode batch sizes captured (a batch runs in the smallest bucket that holds it).
GRAPH_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)

#: Ops that compute nothing: a kernels-only capture may run them.
_ALLOCATIONS = frozenset({"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::detach", "aten::alias"})


class GraphModel(Protocol):
    """What graphs need of a model: the embedding, and the forward from embedded inputs."""

    def embed(self, input_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def forward_embedded(self, hidden: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor: ...


class _ComputeGuard(TorchDispatchMode):
    """Runs every torch op as usual, keeps its outputs alive, and notes the ops that computed."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # True (torch's default) wraps __torch_dispatch__ in torch._disable_dynamo, whose first
        # call imports torch._dynamo: 2.3 s here. Nothing in a capture is compiled.
        return False

    def __init__(self) -> None:
        super().__init__()
        self.computed: list[str] = []
        self.keep: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            # reshape (and its kin) are "views" that copy when the strides do not allow one: a copy
            # is a computation the replay would skip, so an output in new storage counts
            if not _shares_storage(out, args):
                self.computed.append(func.name())
        elif func.name().partition(".")[0] not in _ALLOCATIONS:
            self.computed.append(func.name())
        self.keep.append(out)
        return out


def _shares_storage(out: Any, args: Any) -> bool:
    """True when ``out`` (a tensor, or the first of several) lives in the storage of a tensor in ``args``."""
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    if not isinstance(first, torch.Tensor):
        return True
    ptr = first.untyped_storage().data_ptr()
    return any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == ptr for a in args)


@dataclass
class _Captured:
    graph: StepGraph
    output: torch.Tensor  # [bucket, hidden], rewritten by every replay
    keep: list[Any]  # tensors the recorded calls read and write


@dataclass
class GraphStats:
    """How decode steps ran: counts since the engine started."""

    replays: int = 0
    captures: int = 0
    eager: int = 0  # decode steps too large for a bucket, or in a bucket that could not be captured


def _flat_views(tensors: Sequence[torch.Tensor]) -> tuple[ctypes.Array[Any], ctypes.Array[Any], ctypes.Array[Any]]:
    """Flat ctypes arrays over the memory of host tensors (int64 ids/positions/slots, int32 lengths,
    int32 block tables), which the caller keeps alive."""
    longs, lens, tables = tensors
    return (
        (ctypes.c_int64 * longs.numel()).from_address(longs.data_ptr()),
        (ctypes.c_int32 * lens.numel()).from_address(lens.data_ptr()),
        (ctypes.c_int32 * tables.numel()).from_address(tables.data_ptr()),
    )


class DecodeGraphs:
    """Captures and replays pure decode steps, one graph per batch-size bucket.

    :param model: the model (embedding + forward from embedded inputs).
    :param services: the backend's device services (``begin_graph_capture``).
    :param kv_caches: the per-layer KV caches every graph reads and writes.
    :param block_size: KV block size.
    :param max_blocks_per_seq: block-table width (context length / block size, rounded up).
    :param hidden_size: the model's hidden size.
    :param dtype: the model's activation dtype.
    :param max_seq_len: the context length (the metadata's ``max_seq_len`` at capture).
    :param batch_sizes: the buckets.
    """

    def __init__(
        self,
        model: GraphModel,
        services: DeviceServices,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_blocks_per_seq: int,
        hidden_size: int,
        dtype: torch.dtype,
        max_seq_len: int,
        batch_sizes: Sequence[int] = GRAPH_BATCH_SIZES,
    ) -> None:
        self.model = model
        self.services = services
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.stats = GraphStats()
        self._graphs: dict[int, _Captured] = {}
        self._eager: set[int] = set()  # buckets whose capture was discarded
        dev = services.device
        n = self.batch_sizes[-1]
        # Fixed inputs, shared by every bucket's graph (a bucket of size b uses the first b rows).
        # the token ids, positions and slots are rows of one buffer: a step fills them in one copy
        self._longs = torch.zeros(3, n, dtype=torch.long, device=dev)
        self._ids, self._positions, self._slots = self._longs[0], self._longs[1], self._longs[2]
        self._slots.fill_(-1)
        self._seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self._block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self._query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self._hidden = torch.zeros(n, hidden_size, dtype=dtype, device=dev)
        # A step writes its inputs through flat views of host tensors, with no torch call: after a
        # replay has streamed the weights through the caches, each torch call (its dispatch code and
        # data cold) cost 15-45 us at batch 1, the six of a fill ~130 us a token. In host memory the
        # tensors are the buffers themselves; a device's buffers get host copies, copied over.
        self._staging = (self._longs, self._seq_lens, self._block_tables)
        self._views = _flat_views(self._staging)
        if torch.device(dev).type != HOST.type:
            self._stage_on_host()

    def _stage_on_host(self) -> None:
        """Fill host copies of the input buffers and copy a step's rows over (three copies a step):
        the path of buffers in device memory."""
        self._staging = (
            self._longs.to(HOST, copy=True),
            self._seq_lens.to(HOST, copy=True),
            self._block_tables.to(HOST, copy=True),
        )
        self._views = _flat_views(self._staging)

    def bucket(self, num_seqs: int) -> int | None:
        """The bucket a decode batch of ``num_seqs`` sequences runs in; None: too large, or the
        bucket could not be captured (the step runs eagerly)."""
        for b in self.batch_sizes:
            if b >= num_seqs:
                return None if b in self._eager else b
        return None

    def run(self, input_ids: list[int], positions: list[int], block_ids: Sequence[list[int]]) -> torch.Tensor:
        """One decode step: token ``input_ids[i]`` of sequence i at ``positions[i]``, whose KV blocks
        are ``block_ids[i]``. Returns the final hidden states [B, hidden] (valid until the next run).

        The caller checks :meth:`bucket` first; a bucket whose capture is discarded still returns
        this step's (eagerly computed) result.
        """
        b = len(input_ids)
        bucket = self.bucket(b)
        if bucket is None:
            raise ValueError(f"no step graph bucket for a decode batch of {b}")
        self._fill(input_ids, positions, block_ids, bucket)
        captured = self._graphs.get(bucket)
        if captured is None:
            return self._capture(bucket)[:b]
        captured.graph.replay_rows(b, bucket)
        self.stats.replays += 1
        return captured.output[:b]

    def _fill(self, input_ids: list[int], positions: list[int], block_ids: Sequence[list[int]], bucket: int) -> None:
        b = len(input_ids)
        pad = bucket - b
        bs = self.block_size
        slots = [ids[p // bs] * bs + p % bs for ids, p in zip(block_ids, positions, strict=True)]
        lens = [p + 1 for p in positions] + [1] * pad
        # rows only need the blocks up to their length; the rest of a row is never read
        used = [p // bs + 1 for p in positions]
        longs, seq_lens, tables = self._views
        n = len(seq_lens)
        longs[:bucket] = input_ids + [0] * pad
        longs[n : n + bucket] = positions + [0] * pad
        longs[2 * n : 2 * n + bucket] = slots + [-1] * pad
        seq_lens[:bucket] = lens
        width = len(tables) // n
        for i, (ids, u) in enumerate(zip(block_ids, used, strict=True)):
            tables[i * width : i * width + u] = ids[:u]
        for i in range(b, bucket):  # a padding row reads its first block only (length 1)
            tables[i * width] = 0
        if self._staging[0] is not self._longs:  # on a device: the rows this step reads, copied over
            widest = max(used, default=1)
            self._longs[:, :bucket].copy_(self._staging[0][:, :bucket])
            self._seq_lens[:bucket].copy_(self._staging[1][:bucket])
            self._block_tables[:bucket, :widest].copy_(self._staging[2][:bucket, :widest])
        self.model.embed(self._ids[:bucket], out=self._hidden[:bucket])

    def _context(self, bucket: int) -> ForwardContext:
        # the fixed buffers themselves: every replay reads what _fill wrote into them
        meta = AttentionMetadata.from_lengths(
            [1] * bucket,
            self._seq_lens[:bucket],
            self._block_tables[:bucket],
            slot_mapping=self._slots[:bucket],
            query_start_loc=self._query_start_loc[: bucket + 1],
            max_seq_len=self.max_seq_len,
        )
        return ForwardContext(meta, self.kv_caches)

    def _capture(self, bucket: int) -> torch.Tensor:
        ctx = self._context(bucket)
        capture = self.services.begin_graph_capture()
        if capture is None:  # the backend cannot record: every decode step runs eagerly
            self._eager.update(self.batch_sizes)
            logger.info("the backend offers no step graphs: decode steps run eagerly")
            return self.model.forward_embedded(self._hidden[:bucket], self._positions[:bucket], ctx)
        guard = _ComputeGuard() if capture.kernels_only else None
        try:
            if guard is not None:
                with guard:
                    output = self.model.forward_embedded(self._hidden[:bucket], self._positions[:bucket], ctx)
            else:
                output = self.model.forward_embedded(self._hidden[:bucket], self._positions[:bucket], ctx)
        except BaseException:
            capture.cancel()
            raise
        if guard is not None and guard.computed:
            capture.cancel()
            self._eager.add(bucket)
            ops = ", ".join(sorted(set(guard.computed)))
            logger.warning("decode batch %d runs without a step graph: the forward ran torch ops (%s)", bucket, ops)
            return output
        self._graphs[bucket] = _Captured(capture.finish(), output, guard.keep if guard is not None else [])
        self.stats.captures += 1
        return output
