"""LoRA in the model: PEFT folders read and checked (every refusal names its field), the reference
op against the formula, and the adapter slots of the fused projections."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_helpers import save_peft_adapter

from plinth.model.loader import load_config, resolve_model
from plinth.model.lora import LoRAAdapterError, LoRALayer, read_peft_adapter
from plinth.platform.reference import ReferenceLoRA
from plinth.platform.values import LoRASpec


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny Llama (vocab 128) folder, its config, and an r=4 adapter of every module."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = tmp_path_factory.mktemp("lora-model")
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(root / "base")
    save_peft_adapter(hf, root / "adapter", r=4, alpha=12)
    return {"hf": hf, "root": root, "config": load_config(resolve_model(str(root / "base")))}


def _variant(tiny: dict[str, Any], tmp_path: Path, **changes: Any) -> Path:
    """A copy of the adapter folder with ``changes`` made to its adapter_config.json."""
    src = tiny["root"] / "adapter"
    dst = tmp_path / "variant"
    dst.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    config.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    (dst / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    return dst


def test_reads_rank_scale_and_every_module(tiny: dict[str, Any]) -> None:
    adapter = read_peft_adapter(tiny["root"] / "adapter", tiny["config"], max_rank=16)
    assert adapter.rank == 4 and adapter.scale == 12 / 4
    assert len(adapter.weights) == 2 * 7  # two layers, seven modules
    a, b = adapter.weights[(1, "k_proj")]
    assert a.shape == (4, 32) and b.shape == (2 * 8, 4)  # k_proj: 2 kv heads of 8


def test_rslora_scale_is_alpha_over_sqrt_r(tiny: dict[str, Any], tmp_path: Path) -> None:
    adapter = read_peft_adapter(_variant(tiny, tmp_path, use_rslora=True), tiny["config"], max_rank=16)
    assert adapter.scale == pytest.approx(12 / math.sqrt(4))


@pytest.mark.parametrize(
    ("changes", "field", "message"),
    [
        ({"fan_in_fan_out": True}, "fan_in_fan_out", "transposed"),
        ({"use_dora": True}, "use_dora", "DoRA"),
        ({"bias": "all"}, "bias", "only 'none'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save", "not supported"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern", "per-module ranks"),
        ({"target_modules": ["q_proj", "lm_head"]}, "target_modules", r"\['lm_head'\] are not adapted"),
        ({"peft_type": "IA3"}, "peft_type", "only LORA"),
        ({"r": 32}, "r", "r=32 exceeds max_lora_rank=16"),
        ({"lora_alpha": "big"}, "lora_alpha", "must be a number"),
    ],
)
def test_refusals_name_the_field(
    tiny: dict[str, Any], tmp_path: Path, changes: dict[str, Any], field: str, message: str
) -> None:
    with pytest.raises(LoRAAdapterError, match=message) as err:
        read_peft_adapter(_variant(tiny, tmp_path, **changes), tiny["config"], max_rank=16)
    assert err.value.field == field
    assert "adapter_config.json" in str(err.value)


def test_tensors_that_do_not_match_the_model_are_refused(tiny: dict[str, Any], tmp_path: Path) -> None:
    from safetensors.torch import save_file

    folder = _variant(tiny, tmp_path)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    save_file(
        {key: torch.zeros(4, 33), key.replace("lora_A", "lora_B"): torch.zeros(32, 4)},
        folder / "adapter_model.safetensors",
    )
    with pytest.raises(LoRAAdapterError, match=r"has shape \(4, 33\), expected \(4, 32\)"):
        read_peft_adapter(folder, tiny["config"], max_rank=16)
    save_file({key: torch.zeros(4, 32)}, folder / "adapter_model.safetensors")
    with pytest.raises(LoRAAdapterError, match="has no lora_B weight"):
        read_peft_adapter(folder, tiny["config"], max_rank=16)
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 32)}, folder / "adapter_model.safetensors")
    with pytest.raises(LoRAAdapterError, match="is not a LoRA A/B weight of a decoder layer"):
        read_peft_adapter(folder, tiny["config"], max_rank=16)
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAAdapterError, match="has no adapter_model.safetensors") as err:
        read_peft_adapter(folder, tiny["config"], max_rank=16)
    assert err.value.field == "lora_path"


def _formula(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """``(x[t] @ a[s].T) @ b[s].T`` per token, 0 where the slot is -1 (in fp64)."""
    rows = [
        (b[s].double() @ (a[s].double() @ x[t].double())) if s >= 0 else torch.zeros(b.shape[1], dtype=torch.float64)
        for t, s in enumerate(slots)
    ]
    return torch.stack(rows)


def test_reference_op_is_the_formula_on_column_slices() -> None:
    torch.manual_seed(0)
    spec = LoRASpec(max_loras=3, max_rank=4)
    op = ReferenceLoRA(spec)
    slots = [2, 2, -1, 0, 1, -1, 0]
    x = torch.randn(len(slots), 10)
    a = torch.randn(3, 4, 10)
    b = torch.randn(3, 6, 4)
    wide = torch.randn(len(slots), 20)  # the module is columns 5:11 of a fused output
    base = wide.clone()
    batch = op.prepare_batch(slots, torch.device("cpu"))
    op.expand(wide[:, 5:11], op.shrink(x, a, batch), b, batch)
    want = base[:, 5:11].double() + _formula(x, a, b, slots)
    torch.testing.assert_close(wide[:, 5:11].double(), want, atol=1e-5, rtol=1e-5)  # fp32 sums vs fp64
    torch.testing.assert_close(wide[:, :5], base[:, :5])  # the other columns untouched
    torch.testing.assert_close(wide[:, 11:], base[:, 11:])


def test_fused_slots_adapt_only_their_slice_and_clear_to_zero() -> None:
    torch.manual_seed(0)
    op = ReferenceLoRA(LoRASpec(max_loras=2, max_rank=4))
    layer = LoRALayer(op, 8, [("q_proj", 6), ("k_proj", 3), ("v_proj", 3)], torch.float32, torch.device("cpu"))
    a, b = torch.randn(2, 8), torch.randn(3, 2)  # rank 2 < max rank 4: zero-padded
    layer.write(1, "k_proj", a, b)
    x = torch.randn(3, 8)
    y = torch.zeros(3, 12)
    batch = op.prepare_batch([1, -1, 1], torch.device("cpu"))
    layer.apply(y, x, batch)
    want = torch.zeros(3, 12)
    want[[0, 2], 6:9] = (x[[0, 2]] @ a.t()) @ b.t()
    torch.testing.assert_close(y, want)
    layer.clear(1, {"k_proj"})
    assert layer.users == [0, 0, 0] and not layer.a.any() and not any(t.any() for t in layer.b)
    y.zero_()
    layer.apply(y, x, batch)  # no adapter left: nothing added (and nothing computed)
    assert not y.any()


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_model_logits_with_an_adapter_equal_peft_merged(tmp_path: Path, kind: str) -> None:
    """A tiny Llama loaded from its HF folder or from a GGUF (q/k rows permuted as llama.cpp does,
    undone at load), one sequence through adapter slot 1, others through none: logits equal
    transformers with the adapter merged, and without it."""
    from model_helpers import allocate_caches, hf_logits, make_metadata, reference_kernels
    from test_gguf_loader import _COMMON, write_gguf
    from transformers import AutoModelForCausalLM, LlamaConfig

    from plinth.model.context import ForwardContext
    from plinth.model.loader import load_model
    from plinth.model.lora import attach_lora, write_adapter

    config = LlamaConfig(**_COMMON, tie_word_embeddings=True, rope_theta=100000.0)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path / "hf")
    merged = save_peft_adapter(hf, tmp_path / "adapter", r=4, alpha=8, magnitude=0.2)
    if kind == "gguf":
        write_gguf(tmp_path / "tiny.gguf", hf, "llama")
    source = resolve_model(str(tmp_path / ("tiny.gguf" if kind == "gguf" else "hf")))
    model, model_config = load_model(source, reference_kernels(), torch.float32, 4, "float32")
    spec = LoRASpec(max_loras=2, max_rank=8)
    op = ReferenceLoRA(spec)
    attach_lora(model, op, spec)
    write_adapter(model, 1, read_peft_adapter(tmp_path / "adapter", model_config, max_rank=8))
    prompts = [[5, 17, 200, 3, 99, 42, 7], [8, 9, 10, 11]]
    slots = [1] * len(prompts[0]) + [-1] * len(prompts[1])
    meta = make_metadata([0, 0], [len(p) for p in prompts])
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for p in prompts for i in range(len(p))])
    ctx = ForwardContext(meta, allocate_caches(model, 2), op.prepare_batch(slots, torch.device("cpu")))
    logits = model.compute_logits(model(ids, positions, ctx))
    n = len(prompts[0])
    torch.testing.assert_close(logits[:n], hf_logits(merged, prompts[0]), atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[n:], hf_logits(hf, prompts[1]), atol=1e-4, rtol=0)
    assert (hf_logits(merged, prompts[0]) - hf_logits(hf, prompts[0])).abs().max() > 0.1  # it does adapt
