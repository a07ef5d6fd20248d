"""Static-shape steps (API 1.5): every step padded to a bucket and run as one compiled function.

A compiler backend (XLA on a TPU, HPU graphs on Gaudi) wants few shapes, all known ahead, and a step
that is a pure function. Where the backend declares :class:`StepBuckets`, the runner here:

* orders each step's chunks decode-first (decodes, then prefills from position 0, then chunks after
  cached context) and pads the flattened batch to the smallest bucket of tokens, sequences and
  block-table width that holds it (:func:`pad_inputs`, semantics in :class:`StepInputs`);
* hands the backend the model's step as a pure function of (weights, KV caches, padded inputs)
  (:class:`ModelStepProgram`), which the backend compiles once per shape at start-up
  (:meth:`DeviceServices.compile_step`), and from then on only runs;
* counts compilations after warm-up: steady state must not compile, and the runner logs loudly
  when it does.

A backend that declares buckets but compiles nothing gets the same padded steps, run eagerly.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from plinth.model.context import ForwardContext
from plinth.platform.backend import (
    AttentionMetadata,
    CompiledStep,
    DeviceServices,
    FlatBlocks,
    LinearWeight,
    SpmdPlan,
    StepBuckets,
    StepInputs,
    StepProgram,
    StepShape,
)
from plinth.platform.devices import HOST
from plinth.platform.quant import QuantizedWeight, dequantize
from plinth.sched.output import ScheduledChunk

logger = logging.getLogger(__name__)


def chunk_kind(chunk: ScheduledChunk[Any]) -> int:
    """0: a decode (one query token), 1: a prefill from position 0, 2: any other chunk."""
    if len(chunk.token_ids) == 1:
        return 0
    return 1 if chunk.start_position == 0 else 2


def decode_first(chunks: Sequence[ScheduledChunk[Any]]) -> list[ScheduledChunk[Any]]:
    """The step's chunks in the contract's order: decodes, prefills, other chunks (stable)."""
    return sorted(chunks, key=chunk_kind)


def pad_inputs(chunks: Sequence[ScheduledChunk[Any]], shape: StepShape, block_size: int) -> StepInputs:
    """The padded inputs of a step whose ``chunks`` are already in decode-first order."""
    t_pad, b_pad, w_pad = shape.tokens, shape.seqs, shape.blocks_per_seq
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    seq_lens: list[int] = []
    tables = torch.zeros(b_pad, w_pad, dtype=torch.int32)
    for i, c in enumerate(chunks):
        n = len(c.token_ids)
        ids.extend(c.token_ids)
        for p in range(c.start_position, c.start_position + n):
            positions.append(p)
            slots.append(c.block_ids[p // block_size] * block_size + p % block_size)
        starts.append(starts[-1] + n)
        seq_lens.append(c.start_position + n)
        used = -(-seq_lens[-1] // block_size)
        if used > w_pad:
            raise ValueError(f"a sequence of {seq_lens[-1]} tokens needs {used} blocks; the bucket has {w_pad}")
        tables[i, :used] = torch.tensor(c.block_ids[:used], dtype=torch.int32)
    t, b = len(ids), len(chunks)
    if t > t_pad or b > b_pad:
        raise ValueError(f"a step of {t} tokens and {b} sequences does not fit the bucket {tuple(shape)}")
    query_lens = [starts[i + 1] - starts[i] for i in range(b)]
    distribution = AttentionMetadata.describe(query_lens, seq_lens)
    last = [s - 1 for s in starts[1:]]
    flat = None
    if shape.flat_blocks:  # API 1.6: the step's blocks in one list, padded to the shape's length
        flat = FlatBlocks.build(seq_lens, tables, block_size, shape.flat_blocks, num_seqs=b_pad)
    return StepInputs(
        input_ids=torch.tensor(ids + [0] * (t_pad - t), dtype=torch.int32),
        positions=torch.tensor(positions + [0] * (t_pad - t), dtype=torch.int32),
        slot_mapping=torch.tensor(slots + [-1] * (t_pad - t), dtype=torch.int32),
        query_start_loc=torch.tensor(starts + [t] * (b_pad - b), dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens + [0] * (b_pad - b), dtype=torch.int32),
        block_tables=tables,
        distribution=torch.tensor(distribution, dtype=torch.int32),
        logits_indices=torch.tensor(last + [0] * (b_pad - b), dtype=torch.int32),
        shape=shape,
        num_tokens=t,
        num_seqs=b,
        flat_blocks=flat,
    )


class StepModel(Protocol):
    """What a step program needs of a model: the forward and the logits head (an ``nn.Module``)."""

    embed_tokens: torch.Tensor | QuantizedWeight | None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def named_modules(self) -> Iterator[tuple[str, nn.Module]]: ...


def _slots(module: nn.Module) -> Iterator[tuple[str, Any, str, torch.Tensor]]:
    """``(name, owner, attribute, tensor)`` for every tensor a module keeps as a plain attribute or
    inside a :class:`LinearWeight`; ``owner`` is what holds it (the module, the weight, its ``data``)."""
    for attr, value in list(vars(module).items()):
        if attr.startswith("_"):
            continue
        if isinstance(value, torch.Tensor):
            yield attr, module, attr, value
        elif isinstance(value, LinearWeight):
            for field in ("weight", "bias"):
                t = getattr(value, field)
                if isinstance(t, torch.Tensor):
                    yield f"{attr}.{field}", value, field, t
            for key, t in value.data.items():
                if isinstance(t, torch.Tensor):
                    yield f"{attr}.data.{key}", value.data, key, t


class ModelStepProgram(StepProgram):
    """The loaded model's step, as :class:`StepProgram` specifies: weights in, logits and caches out.

    While a call runs, the model's tensors are swapped for the ``weights`` passed in (a tracer's
    arrays, or the model's own), so the one model graph serves eager, traced and compiled steps.
    A quantized embedding table is dequantized once here: a lookup in ggml blocks runs on the host.

    :param model: the loaded model.
    :param block_size: the KV block size (the metadata's bounds).
    :param vocab_size: the logits' width.
    :param hidden_size: the model's hidden size.
    """

    def __init__(self, model: StepModel, block_size: int, vocab_size: int, hidden_size: int) -> None:
        table = model.embed_tokens
        if isinstance(table, QuantizedWeight):
            model.embed_tokens = dequantize(table).to(getattr(model, "dtype", torch.float32))
        self.model = model
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self._owners: dict[str, tuple[Any, str]] = {}
        self._alias: dict[str, str] = {}  # every slot -> the weight bound there (a tied weight: one argument)
        weights: dict[str, torch.Tensor] = {}
        seen: dict[int, str] = {}
        for mod_name, module in model.named_modules():
            for name, owner, attr, tensor in _slots(module):
                full = f"{mod_name}.{name}" if mod_name else name
                first = seen.setdefault(id(tensor), full)
                if first == full:
                    weights[full] = tensor
                self._owners[full] = (owner, attr)
                self._alias[full] = first
        self.weights = weights

    def _tensors_by_owner(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, (owner, attr) in self._owners.items():
            out[name] = owner[attr] if isinstance(owner, dict) else getattr(owner, attr)
        return out

    @contextlib.contextmanager
    def bound(self, weights: dict[str, torch.Tensor]) -> Iterator[None]:
        """The model with ``weights`` in place of its own tensors, restored afterwards."""
        missing = sorted(set(self.weights) - set(weights))
        if missing:
            raise ValueError(f"step program: weights missing: {missing[:5]}")
        saved = self._tensors_by_owner()
        try:
            for name, (owner, attr) in self._owners.items():
                value = weights[self._alias[name]]
                if isinstance(owner, dict):
                    owner[attr] = value
                else:
                    setattr(owner, attr, value)
            yield
        finally:
            for name, (owner, attr) in self._owners.items():
                if isinstance(owner, dict):
                    owner[attr] = saved[name]
                else:
                    setattr(owner, attr, saved[name])

    def _metadata(
        self, inputs: dict[str, torch.Tensor], shape: StepShape, host: StepInputs | None
    ) -> AttentionMetadata:
        bounds = (shape.tokens, shape.blocks_per_seq * self.block_size)
        if host is None:  # traced: the lengths are device values
            q_host: list[int] = []
            s_host: list[int] = []
            dist: tuple[int, ...] = ()
            max_q, max_s = bounds
        else:
            starts = host.query_start_loc.tolist()
            q_host = [starts[i + 1] - starts[i] for i in range(len(starts) - 1)]
            s_host = host.seq_lens.tolist()
            dist = tuple(host.distribution.tolist())
            max_q, max_s = max(q_host), max(s_host)
        flat = None
        if shape.flat_blocks:
            flat = FlatBlocks(
                inputs["flat_block_list"],
                inputs["flat_block_groups"],
                inputs["flat_block_index"],
                host.flat_blocks.num_blocks if host is not None and host.flat_blocks is not None else 0,
            )
        return AttentionMetadata(
            query_start_loc=inputs["query_start_loc"],
            seq_lens=inputs["seq_lens"],
            block_tables=inputs["block_tables"],
            slot_mapping=inputs["slot_mapping"],
            max_query_len=max_q,
            max_seq_len=max_s,
            query_lens_host=q_host,
            seq_lens_host=s_host,
            distribution=inputs["distribution"],
            distribution_host=dist,
            traced=host is None,
            flat_blocks=flat,
            decode_only=shape.decode,
        )

    def _step(
        self,
        weights: dict[str, torch.Tensor],
        kv_caches: list[torch.Tensor],
        inputs: dict[str, torch.Tensor],
        shape: StepShape,
        host: StepInputs | None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        ctx = ForwardContext(self._metadata(inputs, shape, host), list(kv_caches))
        with self.bound(weights):
            hidden = self.model.forward(inputs["input_ids"], inputs["positions"], ctx)  # [T, hidden]
            last = hidden.index_select(0, inputs["logits_indices"])  # [B, hidden]
            logits = self.model.compute_logits(last).float()
        return logits, ctx.kv_caches

    def __call__(
        self,
        weights: dict[str, torch.Tensor],
        kv_caches: list[torch.Tensor],
        inputs: dict[str, torch.Tensor],
        shape: StepShape,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self._step(weights, kv_caches, inputs, shape, None)

    def eager(self, kv_caches: list[torch.Tensor], inputs: StepInputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The step run eagerly on the model's own weights (metadata with host lists)."""
        device = kv_caches[0].device if kv_caches else HOST
        tensors = {k: v.to(device) for k, v in inputs.tensors().items()}
        return self._step(self.weights, kv_caches, tensors, inputs.shape, inputs)


def default_progress(done: int, total: int, shape: StepShape) -> None:
    """A progress bar on a terminal's stderr, and a log line every tenth of the way (and at the end)."""
    if sys.stderr.isatty():
        bar = "#" * (24 * done // total)
        end = "\n" if done == total else ""
        print(f"\rcompiling step shapes [{bar:<24}] {done}/{total}", end=end, file=sys.stderr, flush=True)
    if done == total or done % max(1, total // 10) == 0:
        logger.info(
            "compiled %d/%d step shapes (last: %d tokens, %d seqs, %d blocks, %d flat blocks%s)",
            done,
            total,
            *shape[:4],
            ", decode" if shape.decode else "",
        )


class StaticSteps:
    """The runner's static-shape path: pads, runs (compiled or eager), and counts compilations.

    :param buckets: the backend's shape buckets.
    :param program: the model's step.
    :param kv_caches: the engine's caches (a compiled step takes them over).
    :param services: the backend's device services (``compile_step``).
    :param block_size: KV block size.
    :param cache_dir: where a compiled step may keep executables across processes.
    :param compile: False runs the padded steps eagerly (``--enforce-eager``), compiling nothing.
    :param spmd: the mesh placement for a backend that declares ``Capabilities.spmd`` (API 1.12).
    """

    def __init__(
        self,
        buckets: StepBuckets,
        program: ModelStepProgram,
        kv_caches: list[torch.Tensor],
        services: DeviceServices,
        block_size: int,
        cache_dir: str | None = None,
        compile: bool = True,
        spmd: SpmdPlan | None = None,
    ) -> None:
        self.buckets = buckets
        self.program = program
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.compiled: CompiledStep | None = None
        if compile and spmd is not None:
            self.compiled = services.compile_step(program, kv_caches, cache_dir=cache_dir, spmd=spmd)
        elif compile:
            self.compiled = services.compile_step(program, kv_caches, cache_dir=cache_dir)
        #: compilations the compiled step had made when warm-up ended (None before warm-up)
        self.compilations_at_warmup: int | None = None
        self.warmup_seconds = 0.0
        self.steps = 0
        self.shapes_seen: set[StepShape] = set()

    @property
    def compilations(self) -> int:
        """Compilations so far (0 when nothing compiles)."""
        return self.compiled.compilations if self.compiled is not None else 0

    @property
    def compilations_after_warmup(self) -> int:
        """Compilations since warm-up ended: 0 in a steady state."""
        if self.compilations_at_warmup is None:
            return self.compilations
        return self.compilations - self.compilations_at_warmup

    def warmup(self, progress: Callable[[int, int, StepShape], None] | None = default_progress) -> None:
        """Compile every shape the buckets allow (nothing to do when the steps run eagerly)."""
        t0 = time.monotonic()
        if self.compiled is not None:
            shapes = self.buckets.shapes()
            logger.info("compiling %d step shapes ahead of serving", len(shapes))
            self.compiled.warmup(shapes, progress)
        self.compilations_at_warmup = self.compilations
        self.warmup_seconds = time.monotonic() - t0

    def run(self, chunks: Sequence[ScheduledChunk[Any]]) -> torch.Tensor:
        """Logits ``[len(chunks), vocab]`` of the decode-first ordered ``chunks``."""
        blocks = [-(-(c.start_position + len(c.token_ids)) // self.block_size) for c in chunks]
        tokens = sum(len(c.token_ids) for c in chunks)
        decode = tokens == len(chunks)
        shape = self.buckets.fit(tokens, len(chunks), max(blocks), sum(blocks), decode)
        if shape is None:
            largest = (self.buckets.decode if decode and self.buckets.decode else self.buckets).largest()
            raise ValueError(
                f"a step of {tokens} tokens, {len(chunks)} sequences, {max(blocks)} blocks per sequence and "
                f"{sum(blocks)} blocks in all exceeds the backend's largest bucket {tuple(largest)}"
            )
        inputs = pad_inputs(chunks, shape, self.block_size)
        before = self.compilations
        if self.compiled is not None:
            logits = self.compiled.run(inputs)
        else:
            logits, caches = self.program.eager(self.kv_caches, inputs)
            self.kv_caches[:] = caches
        self.steps += 1
        self.shapes_seen.add(shape)
        if self.compilations_at_warmup is not None and self.compilations != before:
            logger.warning(
                "COMPILED DURING SERVING: step shape %s was not compiled at warm-up (%d compilations since); "
                "a steady state must not compile",
                tuple(shape),
                self.compilations_after_warmup,
            )
        return logits[: len(chunks)]

    def copy_blocks(
        self, pairs: list[tuple[int, int]], eager: Callable[[list[torch.Tensor], list[tuple[int, int]]], None]
    ) -> None:
        """Copy-on-write through the compiled step (which owns the caches), or ``eager``."""
        if self.compiled is not None:
            self.compiled.copy_blocks(pairs)
        else:
            eager(self.kv_caches, pairs)
