"""Decode step graphs in the engine: the same tokens as eager steps, and --enforce-eager turns them off."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from engine_helpers import save_tiny_folder

from plinth import LLM, SamplingParams
from plinth.config import EngineConfig
from plinth.engine_args import add_engine_arguments, engine_options
from plinth_cpu.native import native, native_status

PROMPTS = [
    "The quick brown fox",
    "A",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "1, 1, 2, 3, 5, 8, 13,",
    "Once upon a time, in a land far away, there lived a dragon who",
    "SELECT name, age FROM users WHERE",
]
# different lengths: the decode batch shrinks from 6 through buckets 8, 4, 2 and 1 as requests finish
MAX_TOKENS = [40, 7, 23, 12, 31, 3]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_folder("llama", path)
    return path


@pytest.mark.skipif(native() is None, reason=native_status())
@pytest.mark.parametrize("quantization", ["none", "int8"])  # int8: q8_0 weights, quantized GEMMs in the graphs
def test_graphs_generate_the_eager_tokens(folder: Path, quantization: str) -> None:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outputs = {}
    for eager in (False, True):
        llm = LLM(
            model=str(folder),
            backend="cpu",
            num_kv_blocks=128,
            block_size=16,
            quantization=quantization,
            enforce_eager=eager,
        )
        outputs[eager] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        fmt = llm.engine.model.layers[0].mlp.gate_up_proj.weight.format
        kept = ("q8_0", "q8_0p16") if quantization == "int8" else ("dense", "f32_panels")  # p16: int16 activations
        assert fmt in kept
        graphs = llm.engine.runner.graphs
        if eager:
            assert graphs is None
        else:
            assert graphs is not None
            assert graphs.stats.captures >= 4 and graphs.stats.replays > 0  # buckets 8, 4, 2, 1 at least
            assert graphs.stats.replays + graphs.stats.captures >= max(MAX_TOKENS) - 1
            assert graphs.stats.eager == 0
    assert [len(t) for t in outputs[False]] == MAX_TOKENS
    assert outputs[False] == outputs[True]


@pytest.mark.skipif(native() is None, reason=native_status())
def test_a_bf16_checkpoint_keeps_its_16_bits_and_the_fp32_results(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint stored in bf16, run as an fp32 model on the cpu backend, keeps its linear weights in
    bf16 panels (half the bytes a decode step reads) and generates the same tokens and logprobs, bit for
    bit, as with the weights cast to fp32 panels (PLINTH_CPU_KEEP_16BIT=0), in graphs and eagerly."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    bf16 = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).save_pretrained(bf16, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, bf16 / name)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in MAX_TOKENS]
    runs = {}
    for keep in ("1", "0"):
        monkeypatch.setenv("PLINTH_CPU_KEEP_16BIT", keep)
        for eager in (False, True):
            llm = LLM(model=str(bf16), backend="cpu", num_kv_blocks=128, block_size=16, enforce_eager=eager)
            proj = llm.engine.model.layers[0].mlp.gate_up_proj.weight
            panels = proj.data["panels"]
            kept = ("w16_panels", torch.bfloat16) if keep == "1" else ("f32_panels", torch.float32)
            assert (proj.format, panels.dtype) == kept
            outs = llm.generate(PROMPTS, params)
            runs[keep, eager] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
            if not eager:
                assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.stats.replays > 0
    for key, run in runs.items():
        assert run == runs["0", True], f"keep={key[0]} eager={key[1]} differs from fp32 panels, eager"
    assert [len(t) for t, _ in runs["1", False]] == MAX_TOKENS


@pytest.mark.slow
@pytest.mark.skipif(native() is None, reason=native_status())
def test_graphs_generate_the_eager_tokens_on_the_default_model() -> None:
    """SmolLM2's q4_1 weights (quantized GEMMs in the graphs), 30 layers: about 5 s."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 5, 16, 9)]
    outputs = []
    for eager in (False, True):
        llm = LLM(backend="cpu", max_model_len=512, enforce_eager=eager)
        outputs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], params)])
    assert llm.engine.model.layers[0].mlp.gate_up_proj.weight.format in ("q4_1", "q4_1p16")  # p16: the native builds
    assert outputs[0] == outputs[1]


def test_enforce_eager_option() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert EngineConfig(**engine_options(parser.parse_args(["--enforce-eager"]))).enforce_eager is True
    assert EngineConfig(**engine_options(parser.parse_args([]))).enforce_eager is False
