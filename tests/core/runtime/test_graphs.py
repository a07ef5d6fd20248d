"""Decode step graphs (plinth.runtime.graphs.DecodeGraphs) against eager forwards of a tiny random Llama."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from plinth.model.context import ForwardContext, ModelKernels
from plinth.model.loader import load_model, resolve_model
from plinth.platform.backend import AttentionMetadata, Backend, SmallOps
from plinth.platform.reference import ReferenceBackend
from plinth.runtime.graphs import DecodeGraphs
from plinth.runtime.runner import ModelRunner
from plinth.sched.output import ScheduledChunk, SchedulerOutput
from plinth.sched.request import SequenceId
from plinth_cpu.backend import CpuBackend, CpuStepGraph
from plinth_cpu.native import native, native_status

BLOCK = 8
NUM_BLOCKS = 48
MAX_BLOCKS = 6  # per sequence: a 48-token context
HIDDEN = 64
VOCAB = 256
PROMPT_LENS = [6, 7, 15, 3, 8]  # the first decodes cross a block boundary after 0-2 steps
TOL = dict(rtol=1e-5, atol=1e-5)

needs_native = pytest.mark.skipif(native() is None, reason=native_status())


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (GQA, tied embeddings) saved as an HF folder."""
    path = tmp_path_factory.mktemp("tiny_llama")
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # HF initialises norms to 1: make them count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _load(folder: Path, backend: Backend) -> Any:
    kernels = ModelKernels(
        gemm=backend.gemm_kernels("float32"), ops=backend.small_ops(), attention=backend.attention_kernels
    )
    model, _ = load_model(resolve_model(str(folder)), kernels, torch.float32, BLOCK, "float32")
    return model


@pytest.fixture(scope="module")
def cpu_model(folder: Path) -> tuple[Any, CpuBackend]:
    backend = CpuBackend()
    return _load(folder, backend), backend


def _meta(chunks: Sequence[Sequence[int]], computed: Sequence[int], tables: Sequence[list[int]]) -> AttentionMetadata:
    """The eager varlen batch: sequence i computes ``chunks[i]`` after ``computed[i]`` cached tokens."""
    q_lens = [len(c) for c in chunks]
    seq_lens = [c + n for c, n in zip(computed, q_lens, strict=True)]
    block_tables = torch.tensor([t + [0] * (MAX_BLOCKS - len(t)) for t in tables], dtype=torch.int32)
    return AttentionMetadata.from_lengths(q_lens, seq_lens, block_tables, block_size=BLOCK)


def _eager(
    model: Any,
    caches: list[torch.Tensor],
    chunks: Sequence[Sequence[int]],
    computed: Sequence[int],
    tables: Sequence[list[int]],
) -> torch.Tensor:
    """Final hidden states [T, hidden] of one eager forward."""
    ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long)
    positions = torch.tensor([p for c, n in zip(computed, chunks, strict=True) for p in range(c, c + len(n))])
    return model(ids, positions, ForwardContext(_meta(chunks, computed, tables), caches))


class _Batch:
    """Five prefilled sequences with shuffled block tables, and two copies of the KV caches: one the
    graphs run on, one the eager forwards run on."""

    def __init__(self, model: Any, backend: Backend, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        specs = model.attention_specs()
        self.graph_caches = [backend.allocate_kv_cache(spec, NUM_BLOCKS) for spec in specs]
        for cache in self.graph_caches:
            cache.fill_(0.5)  # never-written slots hold a value a stray write would change
        free = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()  # block 0: the null block
        self.tables = [free[i * MAX_BLOCKS : (i + 1) * MAX_BLOCKS] for i in range(len(PROMPT_LENS))]
        self.lens = list(PROMPT_LENS)
        prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
        _eager(model, self.graph_caches, prompts, [0] * len(prompts), self.tables)
        self.eager_caches = [c.clone() for c in self.graph_caches]
        self.gen = gen

    def tokens(self, n: int) -> list[int]:
        return torch.randint(0, VOCAB, (n,), generator=self.gen).tolist()

    def runner(self, model: Any, backend: Backend, graphs: DecodeGraphs) -> ModelRunner:
        """A runner over the graph caches that uses ``graphs``."""
        attn = model.layers[0].self_attn.attn_kernels
        return ModelRunner(model, self.graph_caches, attn, backend.device_services(), BLOCK, graphs=graphs)

    def scheduled(self, rows: list[int], ids: list[list[int]]) -> SchedulerOutput:
        """A step computing tokens ``ids[j]`` of sequence ``rows[j]`` after its cached ones."""
        reqs = [
            ScheduledChunk(SequenceId(f"r{i}", 0), t, self.lens[i], self.tables[i], ())
            for i, t in zip(rows, ids, strict=True)
        ]
        return SchedulerOutput(reqs, num_batched_tokens=sum(len(t) for t in ids))

    def step(self, model: Any, graphs: DecodeGraphs, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode of sequences ``rows`` by the graphs and eagerly: (graph, eager) hidden states."""
        ids = self.tokens(len(rows))
        positions = [self.lens[i] for i in rows]
        tables = [self.tables[i] for i in rows]
        got = graphs.run(ids, positions, tables).clone()
        expected = _eager(model, self.eager_caches, [[t] for t in ids], positions, tables)
        for i in rows:
            self.lens[i] += 1
        return got, expected

    def slots(self, rows: list[int]) -> set[int]:
        """The cache slots of the next token of sequences ``rows``."""
        return {self.tables[i][self.lens[i] // BLOCK] * BLOCK + self.lens[i] % BLOCK for i in rows}


def _graphs(model: Any, backend: Backend, caches: list[torch.Tensor]) -> DecodeGraphs:
    return DecodeGraphs(
        model,
        backend.device_services(),
        caches,
        block_size=BLOCK,
        max_blocks_per_seq=MAX_BLOCKS,
        hidden_size=HIDDEN,
        dtype=torch.float32,
        max_seq_len=MAX_BLOCKS * BLOCK,
    )


def _written_slots(before: list[torch.Tensor], after: list[torch.Tensor], backend: Backend) -> set[int]:
    """Slots (block * BLOCK + offset) whose K or V changed in any layer's cache."""
    dims = backend.capabilities().kv_cache_layout.dims
    order = [dims.index(d) for d in ("num_blocks", "block_size", "kv", "num_kv_heads", "head_size")]
    changed = set()
    for b, a in zip(before, after, strict=True):
        diff = (b != a).permute(order).flatten(2).any(dim=2)  # [NB, BLOCK]
        changed |= {int(i) for i in diff.flatten().nonzero()}
    return changed


@needs_native
@pytest.mark.parametrize("batch,bucket", [(1, 1), (3, 4), (5, 8)])
def test_replays_match_eager_forwards(
    cpu_model: tuple[Any, CpuBackend], batch: int, bucket: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Captured once, replayed on every later step over the batch's rows only (``replay_rows``):
    hidden states and logits equal an eager forward while positions advance across block
    boundaries, and padding rows write no KV."""
    model, backend = cpu_model
    replayed: list[tuple[int, int]] = []
    replay_rows = CpuStepGraph.replay_rows

    def recorded(self: CpuStepGraph, rows: int, captured: int) -> None:
        replayed.append((rows, captured))
        replay_rows(self, rows, captured)

    monkeypatch.setattr(CpuStepGraph, "replay_rows", recorded)
    data = _Batch(model, backend, seed=batch)
    graphs = _graphs(model, backend, data.graph_caches)
    rows = list(range(batch))
    assert graphs.bucket(batch) == bucket
    for step in range(6):
        before = [c.clone() for c in data.graph_caches]
        expected_slots = data.slots(rows)
        got, expected = data.step(model, graphs, rows)
        assert got.shape == (batch, HIDDEN)
        torch.testing.assert_close(got, expected, **TOL, msg=f"step {step}")
        torch.testing.assert_close(model.compute_logits(got), model.compute_logits(expected), **TOL)
        assert _written_slots(before, data.graph_caches, backend) == expected_slots  # none for the padding rows
        for g, e in zip(data.graph_caches, data.eager_caches, strict=True):
            torch.testing.assert_close(g, e, **TOL)
    assert (graphs.stats.captures, graphs.stats.replays, graphs.stats.eager) == (1, 5, 0)
    assert replayed == [(batch, bucket)] * 5
    assert graphs.bucket(batch) == bucket


@needs_native
def test_buckets_share_the_input_buffers(cpu_model: tuple[Any, CpuBackend]) -> None:
    """Steps of changing batch sizes and sequence orders, each bucket captured once: the rows a
    larger bucket left in the shared buffers never leak into a smaller one."""
    model, backend = cpu_model
    data = _Batch(model, backend, seed=7)
    graphs = _graphs(model, backend, data.graph_caches)
    schedule = [[4, 0, 2], [1], [0, 1, 2, 3, 4], [3], [2, 4, 1], [4, 3, 2, 1, 0], [0, 2], [1, 3, 4]]
    for rows in schedule:
        got, expected = data.step(model, graphs, rows)
        torch.testing.assert_close(got, expected, **TOL, msg=str(rows))
    assert graphs.stats.captures == 4  # buckets 1, 2, 4, 8
    assert graphs.stats.replays == len(schedule) - 4


@needs_native
def test_a_capture_that_ran_torch_compute_is_discarded(
    cpu_model: tuple[Any, CpuBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward that computes with torch ops in bucket 4 (a kernels-only recorder misses them) keeps
    that step's result, and bucket 4 runs eagerly from then on; other buckets are still captured."""
    model, backend = cpu_model
    ops = model.layers[0].mlp.ops
    native_silu = ops.silu_and_mul

    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        return SmallOps.silu_and_mul(ops, x) if x.shape[0] == 4 else native_silu(x)

    monkeypatch.setattr(ops, "silu_and_mul", silu_and_mul)
    data = _Batch(model, backend, seed=11)
    graphs = _graphs(model, backend, data.graph_caches)
    got, expected = data.step(model, graphs, [0, 1, 2])
    torch.testing.assert_close(got, expected, **TOL)
    assert graphs.bucket(3) is None and graphs.bucket(4) is None
    assert (graphs.stats.captures, graphs.stats.replays) == (0, 0)
    for rows in ([1], [3]):  # bucket 1 is captured, then replayed
        got, expected = data.step(model, graphs, rows)
        torch.testing.assert_close(got, expected, **TOL)
    assert (graphs.stats.captures, graphs.stats.replays) == (1, 1)
    assert graphs.bucket(1) == 1 and graphs.bucket(8) == 8
    with pytest.raises(ValueError, match="no step graph bucket for a decode batch of 3"):
        graphs.run([1, 2, 3], [9, 9, 9], data.tables[:3])

    # the runner runs bucket 4's decodes eagerly and counts them; prefills are not decode steps
    runner = data.runner(model, backend, graphs)

    def scheduled(rows: list[int], n_tokens: int = 1) -> SchedulerOutput:
        return data.scheduled(rows, [data.tokens(n_tokens) for _ in rows])

    assert runner.execute(scheduled([0, 1, 2])) == {}
    assert graphs.stats.eager == 1
    runner.execute(scheduled([4]))
    assert (graphs.stats.eager, graphs.stats.replays) == (1, 2)
    runner.execute(scheduled([0, 1], n_tokens=2))
    assert (graphs.stats.eager, graphs.stats.replays, graphs.stats.captures) == (1, 2, 1)


def test_a_backend_without_step_graphs_runs_every_step_eagerly(folder: Path) -> None:
    """The reference backend's DeviceServices offers no capture: the first step finds that out for
    every bucket (and still returns its eager result); the runner then runs every decode eagerly."""
    backend = ReferenceBackend()
    assert backend.device_services().begin_graph_capture() is None
    model = _load(folder, backend)
    data = _Batch(model, backend, seed=3)
    graphs = _graphs(model, backend, data.graph_caches)
    assert graphs.bucket(3) == 4
    before = [c.clone() for c in data.graph_caches]
    expected_slots = data.slots([0, 1, 2])
    got, expected = data.step(model, graphs, [0, 1, 2])
    torch.testing.assert_close(got, expected, **TOL)
    assert _written_slots(before, data.graph_caches, backend) == expected_slots
    assert all(graphs.bucket(n) is None for n in (1, 2, 3, 32))

    runner = data.runner(model, backend, graphs)
    for rows in ([0], [0, 1, 2, 3]):
        ids = data.tokens(len(rows))
        step = data.scheduled(rows, [[t] for t in ids])
        before = [c.clone() for c in data.graph_caches]
        expected_slots = data.slots(rows)
        runner.execute(step)
        positions, tables = [data.lens[i] for i in rows], [data.tables[i] for i in rows]
        _eager(model, data.eager_caches, [[t] for t in ids], positions, tables)
        for i in rows:
            data.lens[i] += 1
        assert _written_slots(before, data.graph_caches, backend) == expected_slots
        for g, e in zip(data.graph_caches, data.eager_caches, strict=True):
            torch.testing.assert_close(g, e, **TOL)
    assert (graphs.stats.captures, graphs.stats.replays, graphs.stats.eager) == (0, 0, 2)


@needs_native
def test_device_buffers_are_filled_as_host_buffers_are(cpu_model: tuple[Any, CpuBackend]) -> None:
    """A step writes its inputs into host tensors through flat views (no torch call); in host memory
    they are the buffers, on a device host copies whose rows are copied over. Both paths (the
    device's run here on host buffers) hold every value a replay reads equal (ids, positions,
    slots and lengths of the bucket's rows, each row's blocks up to its length, a padding row's
    first block), over steps of changing sizes whose earlier, longer rows leave stale values behind."""
    model, backend = cpu_model
    caches = _Batch(model, backend, seed=3).graph_caches
    host, staged = _graphs(model, backend, caches), _graphs(model, backend, caches)
    assert host._staging[0] is host._longs
    staged._stage_on_host()  # the path of a device whose buffers are not in host memory
    assert staged._staging[0] is not staged._longs
    gen = torch.Generator().manual_seed(5)
    for b in (5, 2, 8, 1, 3):
        bucket = host.bucket(b)
        assert bucket is not None
        positions = [int(p) for p in torch.randint(0, MAX_BLOCKS * BLOCK, (b,), generator=gen)]
        tables = [[int(x) for x in torch.randperm(40, generator=gen)[:MAX_BLOCKS]] for _ in range(b)]
        ids = [int(t) for t in torch.randint(0, 100, (b,), generator=gen)]
        for graphs in (host, staged):
            graphs._fill(ids, positions, tables, bucket)
        assert torch.equal(host._longs[:, :bucket], staged._longs[:, :bucket])
        slots = [t[p // BLOCK] * BLOCK + p % BLOCK for t, p in zip(tables, positions, strict=True)]
        assert host._longs[2, :b].tolist() == slots
        assert host._longs[2, b:bucket].tolist() == [-1] * (bucket - b)  # padding rows write no KV
        assert torch.equal(host._seq_lens[:bucket], staged._seq_lens[:bucket])
        for i in range(bucket):
            used = positions[i] // BLOCK + 1 if i < b else 1
            want = tables[i][:used] if i < b else [0]
            assert host._block_tables[i, :used].tolist() == want, (b, i)
            assert torch.equal(host._block_tables[i, :used], staged._block_tables[i, :used]), (b, i)
        assert torch.equal(host._hidden[:bucket], staged._hidden[:bucket])
