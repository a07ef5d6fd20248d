"""Static-shape steps (API 1.5): buckets, padding, decode-first order, the step program, the engine path."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from engine_helpers import host_with, save_tiny_folder

from plinth.config import EngineConfig
from plinth.platform.backend import (
    AttentionMetadata,
    CompiledStep,
    DeviceServices,
    SpmdPlan,
    StepBuckets,
    StepInputs,
    StepProgram,
    StepShape,
)
from plinth.platform.devices import HOST
from plinth.platform.reference import ReferenceBackend
from plinth.platform.values import KVCacheLayout
from plinth.runtime.engine import InvalidRequest, LLMEngine
from plinth.runtime.outputs import RequestOutput
from plinth.runtime.static import ModelStepProgram, decode_first, pad_inputs
from plinth.sampling_params import SamplingParams
from plinth.sched.output import ScheduledChunk
from plinth.sched.request import SequenceId
from plinth_conformance.tiny_models import assert_same_generations, prompts, save_tiny_model

BLOCK = 4


def _chunk(name: str, start: int, n: int, blocks: list[int]) -> ScheduledChunk[SamplingParams]:
    return ScheduledChunk(SequenceId(name, 0), list(range(100, 100 + n)), start, blocks, ())


# -- value objects -------------------------------------------------------------------------------


def test_powers_of_two_hold_each_maximum_and_fit_picks_the_smallest() -> None:
    b = StepBuckets.powers_of_two(max_tokens=100, max_seqs=6, max_blocks_per_seq=9, min_tokens=16)
    assert b.tokens == (16, 32, 64, 128) and b.seqs == (1, 2, 4, 8) and b.blocks_per_seq == (1, 2, 4, 8, 16)
    assert b.fit(17, 3, 5) == StepShape(32, 4, 8)
    assert b.fit(16, 1, 1) == StepShape(16, 1, 1)
    assert b.fit(129, 1, 1) is None and b.fit(1, 9, 1) is None and b.fit(1, 1, 17) is None
    assert b.largest() == StepShape(128, 8, 16)


def test_shapes_cover_every_step_that_fits() -> None:
    b = StepBuckets(tokens=(2, 8), seqs=(1, 4, 16), blocks_per_seq=(1, 3))
    shapes = set(b.shapes())
    assert len(shapes) == len(b.shapes())
    for t in range(1, 9):
        for s in range(1, t + 1):  # a sequence has at least one token
            for w in (1, 2, 3):
                assert b.fit(t, s, w) in shapes, (t, s, w)
    assert StepShape(2, 16, 1) not in shapes  # 16 sequences never fit in 2 tokens


@pytest.mark.parametrize("bad", [(), (0, 4), (-1,), (2.5,)])
def test_buckets_refuse_non_positive_or_empty_lists(bad: tuple) -> None:
    with pytest.raises(ValueError, match="tokens must be positive integers"):
        StepBuckets(tokens=bad, seqs=(1,), blocks_per_seq=(1,))


def test_interleaved_padded_and_packed_layouts_size_the_physical_cache() -> None:
    tpu = KVCacheLayout(("num_blocks", "block_size", "kv_heads", "packing", "head_size"), head_size_align=128)
    assert tpu.interleaved
    assert tpu.shape(5, 16, 3, 64, itemsize=2) == (5, 16, 3, 2, 128)  # 6 combined heads packed by 2
    assert tpu.shape(5, 16, 3, 64, itemsize=4) == (5, 16, 6, 1, 128)
    assert tpu.block_bytes(16, 3, 64, 2) == 16 * 6 * 128 * 2  # the padding is paid for
    plain = KVCacheLayout()
    assert plain.shape(5, 16, 3, 64) == (2, 5, 16, 3, 64) and plain.block_bytes(16, 3, 64, 4) == 2 * 16 * 3 * 64 * 4
    with pytest.raises(ValueError, match="do not pack by 4"):
        tpu.shape(1, 16, 1, 64, itemsize=1)


@pytest.mark.parametrize(
    ("dims", "message"),
    [
        (("kv", "num_blocks", "block_size", "head_size"), "need"),
        (("num_blocks", "block_size", "kv_heads", "kv", "head_size"), "need"),
        (("num_blocks", "block_size", "heads", "head_size"), "unknown dims"),
        (("kv", "kv", "num_blocks", "block_size", "num_kv_heads", "head_size"), "repeated"),
    ],
)
def test_a_layout_with_wrong_dims_is_refused_naming_them(dims: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVCacheLayout(dims)


def test_distribution_counts_decodes_then_prefills_and_ignores_padding() -> None:
    assert AttentionMetadata.describe([1, 1, 5, 3, 4, 0, 0], [9, 4, 5, 3, 10, 0, 0]) == (2, 4, 5)
    # out of order: still a valid description, everything after the first non-decode is general
    assert AttentionMetadata.describe([5, 1, 1], [12, 3, 4]) == (0, 0, 3)
    meta = AttentionMetadata.from_lengths([1, 3], [7, 3], [[1, 2], [3]], block_size=BLOCK)
    assert meta.distribution is not None and meta.distribution.tolist() == [1, 2, 2]
    assert meta.distribution_host == (1, 2, 2) and not meta.traced and meta.num_seqs == 2


# -- padding ---------------------------------------------------------------------------------------


def test_decode_first_is_stable_and_by_kind() -> None:
    chunks = [_chunk("p", 0, 5, [1, 2]), _chunk("c", 4, 3, [3, 4]), _chunk("d1", 6, 1, [5, 6]), _chunk("d2", 2, 1, [7])]
    assert [c.seq_id.request_id for c in decode_first(chunks)] == ["d1", "d2", "p", "c"]


def test_padding_writes_nowhere_and_pads_sequences_with_length_zero() -> None:
    chunks = decode_first([_chunk("p", 0, 5, [1, 2]), _chunk("d", 6, 1, [3, 4])])
    x = pad_inputs(chunks, StepShape(8, 4, 3), BLOCK)
    assert x.input_ids.tolist() == [100, 100, 101, 102, 103, 104, 0, 0]
    assert x.positions.tolist() == [6, 0, 1, 2, 3, 4, 0, 0]
    # d's position 6 is offset 2 of its second block (4); p's tokens fill block 1, then block 2
    assert x.slot_mapping.tolist() == [4 * 4 + 2, 4, 5, 6, 7, 8, -1, -1]
    assert x.query_start_loc.tolist() == [0, 1, 6, 6, 6] and x.seq_lens.tolist() == [7, 5, 0, 0]
    assert x.block_tables.tolist() == [[3, 4, 0], [1, 2, 0], [0, 0, 0], [0, 0, 0]]
    assert x.distribution.tolist() == [1, 2, 2] and x.logits_indices.tolist() == [0, 5, 0, 0]
    assert (x.num_tokens, x.num_seqs) == (6, 2)
    with pytest.raises(ValueError, match="does not fit the bucket"):
        pad_inputs(chunks, StepShape(4, 4, 3), BLOCK)
    with pytest.raises(ValueError, match="needs 2 blocks; the bucket has 1"):
        pad_inputs(chunks, StepShape(8, 4, 1), BLOCK)


def test_a_dummy_step_writes_nothing() -> None:
    x = StepInputs.dummy(StepShape(16, 4, 2))
    assert (x.slot_mapping == -1).all() and x.seq_lens.tolist() == [1, 0, 0, 0]
    assert set(x.tensors()) == {
        "input_ids",
        "positions",
        "slot_mapping",
        "query_start_loc",
        "seq_lens",
        "block_tables",
        "distribution",
        "logits_indices",
    }


# -- the engine on a backend that declares buckets ------------------------------------------------


class StaticReference(ReferenceBackend):
    """The reference kernels behind the 1.5 bucket contract: every step padded, run eagerly."""

    name = "static-reference"
    api_version = (1, 5)

    def __init__(self, buckets: StepBuckets | None = None) -> None:
        super().__init__()
        self.buckets = buckets

    def step_buckets(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int) -> StepBuckets | None:
        if self.buckets is not None:
            return self.buckets
        return StepBuckets.powers_of_two(
            max_tokens=max_tokens, max_seqs=max_seqs, max_blocks_per_seq=max_blocks_per_seq, min_tokens=8
        )


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_folder("llama", path)
    return path


def _engine(folder: Path, backend: ReferenceBackend, **kw: object) -> LLMEngine:
    host = host_with("test", backend)
    config = EngineConfig(model=str(folder), backend=backend.name, num_kv_blocks=96, block_size=BLOCK, **kw)  # type: ignore[arg-type]
    return LLMEngine(config, host=host)


def _run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, list[list[int]]]:
    """Each request's completions; prompt i is added after request i - 1 has run a step (so the
    last prompt finds the first one's blocks in the prefix cache)."""
    done: dict[str, list[list[int]]] = {}
    cached = 0
    pending = list(enumerate(zip(prompts, params, strict=True)))
    while pending or engine.has_unfinished():
        if pending:
            i, (p, sp) = pending.pop(0)
            engine.add_request(f"r{i}", p, sp)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [o.token_ids for o in out.outputs]
                cached += out.metrics.num_cached_prompt_tokens
    assert cached > 0, "no prefix-cache hit"
    return done


PROMPTS = [[5, 9, 13, 2, 7, 7, 1, 30, 31, 4, 8, 11, 12], [3, 4], [6], [5, 9, 13, 2, 7, 7, 1, 30, 31, 4, 8, 40, 41, 42]]


def test_padded_steps_give_the_reference_tokens_with_forks_chunks_and_prefix_hits(folder: Path) -> None:
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=9, ignore_eos=True),  # forks: copy-on-write
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),  # shares r0's first blocks
    ]
    plain = _run(_engine(folder, ReferenceBackend(), max_num_batched_tokens=16), PROMPTS, params)
    static_engine = _engine(folder, StaticReference(), max_num_batched_tokens=16)
    assert static_engine.static is not None and static_engine.runner.graphs is None
    static = _run(static_engine, PROMPTS, params)
    assert static == plain
    steps = static_engine.static
    assert steps.steps > 10 and steps.shapes_seen <= set(steps.buckets.shapes())
    assert len(steps.shapes_seen) > 2  # decodes, chunks and mixed steps padded to different buckets
    assert steps.compiled is None and steps.compilations_after_warmup == 0


def test_buckets_too_small_for_the_engine_are_refused_naming_what(folder: Path) -> None:
    small = StaticReference(StepBuckets(tokens=(8,), seqs=(4,), blocks_per_seq=(2,)))
    with pytest.raises(InvalidRequest, match=r"tokens 8 < 16, sequences 4 < 16, blocks per sequence 2 < 32"):
        _engine(folder, small, max_num_batched_tokens=16, max_model_len=128)


def test_the_step_program_is_a_pure_function_of_its_arguments(folder: Path) -> None:
    engine = _engine(folder, StaticReference(), max_num_batched_tokens=16)
    assert engine.static is not None
    program = engine.static.program
    assert isinstance(program, ModelStepProgram)
    caches = engine.static.kv_caches
    zeros = [torch.zeros_like(c) for c in caches]
    chunks = decode_first([_chunk("a", 0, 6, [1, 2])])
    x = pad_inputs(chunks, StepShape(8, 1, 2), BLOCK)
    logits, new = program.eager(zeros, x)
    # other weights give other logits: the weights really are the argument
    doubled = {k: v * 2 if k.endswith("norm.weight") else v for k, v in program.weights.items()}
    tensors = x.tensors()
    twice, _ = program._step(doubled, [torch.zeros_like(c) for c in caches], tensors, x.shape, x)
    assert not torch.allclose(logits, twice)
    # the model's own tensors are back in place afterwards; tied weights are one argument
    assert engine.model.norm.weight is program.weights["norm.weight"]
    assert "embed_tokens" in program.weights and "lm_head.weight.weight" not in program.weights
    assert logits.shape == (1, engine.model_config.vocab_size)
    assert any(bool(c.any()) for c in new)  # the K/V of the 6 tokens came back in the caches
    again, _ = program.eager([torch.zeros_like(c) for c in caches], x)
    assert torch.equal(logits, again)
    with pytest.raises(ValueError, match="weights missing"):
        program(dict(list(program.weights.items())[1:]), zeros, tensors, x.shape)


def test_the_canonical_view_of_an_interleaved_packed_cache_writes_through() -> None:
    from plinth.platform.backend import canonical_kv_view

    layout = KVCacheLayout(("num_blocks", "block_size", "kv_heads", "packing", "head_size"), head_size_align=8)
    cache = torch.zeros(layout.shape(3, 4, 2, 6, itemsize=2), dtype=torch.bfloat16)  # [3, 4, 2, 2, 8]
    view = canonical_kv_view(cache, layout, 2, 6)
    assert tuple(view.shape) == (2, 3, 4, 2, 6)
    view[0, 1, 2, 1] = 1.0  # K of kv head 1 -> combined head 2 -> word column 1, packing slot 0
    view[1, 1, 2, 0] = 2.0  # V of kv head 0 -> combined head 1 -> word column 0, slot 1
    assert cache[1, 2, 1, 0, :6].tolist() == [1.0] * 6 and cache[1, 2, 0, 1, :6].tolist() == [2.0] * 6
    assert cache.sum().item() == 6 * 3  # nothing else written; the padding features stay 0
    assert tuple(canonical_kv_view(cache, layout, 2, 6, physical=True).shape) == (2, 3, 4, 2, 8)
    plain = KVCacheLayout(("num_blocks", "kv", "block_size", "num_kv_heads", "head_size"))
    c2 = torch.zeros(plain.shape(3, 4, 2, 6))
    canonical_kv_view(c2, plain, 2, 6)[1, 2, 3, 1, 5] = 7.0
    assert c2[2, 1, 3, 1, 5] == 7.0


# -- SPMD tensor parallelism (API 1.12): one process, the model's fused rows grouped by shard ------


class _RecordingServices(DeviceServices):
    """Host services that keep the SPMD plan ``compile_step`` is handed and compile nothing."""

    def __init__(self) -> None:
        super().__init__(HOST)
        self.plans: list[SpmdPlan | None] = []

    def compile_step(
        self,
        program: StepProgram,
        kv_caches: list[torch.Tensor],
        *,
        cache_dir: str | None = None,
        spmd: SpmdPlan | None = None,
    ) -> CompiledStep | None:
        self.plans.append(spmd)
        return None  # the runner runs the program eagerly: the grouped rows must still mean the same


class SpmdReference(StaticReference):
    """A static-shape reference that declares ``Capabilities.spmd``: no workers, the plan recorded."""

    name = "spmd-reference"
    api_version = (1, 12)

    def __init__(self) -> None:
        super().__init__()
        self._caps = dataclasses.replace(self._caps, spmd=True)
        self._services = _RecordingServices()


def _generate(engine: LLMEngine, batch: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
    for i, p in enumerate(batch):
        engine.add_request(f"g{i}", p, params)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        done.update((out.request_id, out) for out in engine.step() if out.finished)
    return [done[f"g{i}"] for i in range(len(batch))]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_spmd_grouped_rows_give_the_single_device_generations_and_the_plan_names_the_splits(
    kind: str, tmp_path: Path
) -> None:
    if kind == "qwen3":  # q/k norms per head: grouped heads must still meet their own norm
        save_tiny_folder(kind, tmp_path)
    else:  # logits with real gaps (the conformance suite's tiny models), so logprobs tell rows apart
        save_tiny_model(kind, tmp_path)
    batch = prompts(0, (1, 9, 17, 30))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    want = _generate(_engine(tmp_path, ReferenceBackend(), max_num_batched_tokens=16), batch, params)
    backend = SpmdReference()
    engine = _engine(tmp_path, backend, max_num_batched_tokens=16, tensor_parallel_size=2)
    assert engine.spmd and engine.executor is None  # one process: no workers for the mesh
    assert engine.model.layers[0].self_attn.groups == 2 and engine.model.layers[0].mlp.groups == 2
    assert_same_generations(_generate(engine, batch, params), want, 1e-4)  # float32 order of sums only
    (plan,) = backend._services.plans
    assert plan is not None and plan.size == 2 and plan.num_kv_heads == 2
    splits = plan.splits
    assert splits["layers.0.self_attn.qkv_proj.weight.weight"] == "out"
    assert splits["layers.1.mlp.gate_up_proj.weight.weight"] == "out"
    assert splits["layers.0.self_attn.o_proj.weight.weight"] == "in"
    assert splits["layers.1.mlp.down_proj.weight.weight"] == "in"
    assert splits["embed_tokens"] == "out"
    assert "norm.weight" not in splits and "layers.0.input_layernorm.weight" not in splits
    if kind == "qwen2":  # a column-parallel bias splits with its rows
        assert splits["layers.0.self_attn.qkv_proj.weight.bias"] == "out"
    if kind != "llama":  # untied: the LM head has its own weight
        assert splits["lm_head.weight.weight"] == "out"
    assert set(splits) <= set(engine.static.program.weights)  # type: ignore[union-attr]


def test_spmd_refuses_a_model_whose_kv_heads_do_not_split_over_the_mesh(folder: Path) -> None:
    with pytest.raises(InvalidRequest, match="num_key_value_heads 2 is not divisible by 4"):
        _engine(folder, SpmdReference(), max_num_batched_tokens=16, tensor_parallel_size=4)
