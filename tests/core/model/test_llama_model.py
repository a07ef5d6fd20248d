"""plinth's Llama-family graph against Hugging Face transformers on tiny random models (fp32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from model_helpers import allocate_caches, hf_logits, reference_kernels, run_step, save_tiny
from transformers import (
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from plinth.model.loader import load_model, resolve_model

TOL = 1e-4
PROMPT = [5, 17, 200, 3, 99, 42, 7, 7, 128, 250, 1, 64, 33, 12, 180, 9, 77, 2, 31]

_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)

CONFIGS = {
    "llama_tied_gqa": lambda: LlamaConfig(**_COMMON, tie_word_embeddings=True),
    "llama3_rope": lambda: LlamaConfig(
        **_COMMON,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,  # small, so the scaling bites at these positions
        },
        rope_theta=500000.0,
    ),
    "llama_linear_rope_bias": lambda: LlamaConfig(
        **_COMMON, rope_scaling={"rope_type": "linear", "factor": 2.0}, attention_bias=True, mlp_bias=True
    ),
    "qwen2_qkv_bias": lambda: Qwen2Config(**_COMMON, tie_word_embeddings=False),
    "mistral_sliding_window": lambda: MistralConfig(**_COMMON, sliding_window=5, head_dim=16),
    "qwen3_qk_norm": lambda: Qwen3Config(**_COMMON, head_dim=16, tie_word_embeddings=False),
    # a window smaller than the prompt, so both kinds of layer matter; a local rotary base of its own
    # and a query scalar that is not head_dim, so a model that ignored either would fail
    "gemma3_sliding_and_global": lambda: Gemma3TextConfig(
        **{**_COMMON, "num_hidden_layers": 3},
        head_dim=16,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=24,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        final_logit_softcapping=3.0,
    ),
    "mixtral_top2_of_4": lambda: MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe_shared_expert": lambda: Qwen2MoeConfig(
        **_COMMON,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        decoder_sparse_step=1,
        mlp_only_layers=[1],  # one dense layer among the sparse ones
    ),
    "qwen3_moe_norm_topk": lambda: Qwen3MoeConfig(
        **_COMMON, head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, norm_topk_prob=True
    ),
}


def _hf_eager(model: Any) -> Any:
    # eager attention honours the sliding window mask the same way on every transformers version
    model.config._attn_implementation = "eager"
    return model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Any]:
    """(plinth model, plinth config, HF model) for one tiny architecture."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(CONFIGS[request.param](), folder)
    model, config = load_model(resolve_model(str(folder)), reference_kernels(), torch.float32, 4, "float32")
    return model, config, _hf_eager(hf)


def test_full_prompt_logits_match_hf(tiny: tuple[Any, Any, Any]) -> None:
    model, _, hf = tiny
    logits = run_step(model, allocate_caches(model, 1), [PROMPT], [0])
    expected = hf_logits(hf, PROMPT)
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max().item() < TOL


def test_chunked_prefill_matches_full(tiny: tuple[Any, Any, Any]) -> None:
    model, _, hf = tiny
    expected = hf_logits(hf, PROMPT)
    caches = allocate_caches(model, 1)
    first = run_step(model, caches, [PROMPT[:7]], [0])
    second = run_step(model, caches, [PROMPT[7:]], [7])
    assert (first - expected[:7]).abs().max().item() < TOL
    assert (second - expected[7:]).abs().max().item() < TOL
    assert (second[-1] - expected[-1]).abs().max().item() < TOL


def test_mixed_batch_prefill_and_decode(tiny: tuple[Any, Any, Any]) -> None:
    """One step serving a decode of sequence 0 and a prefill chunk of sequence 1."""
    model, _, hf = tiny
    other = PROMPT[::-1][:11]
    caches = allocate_caches(model, 2)
    run_step(model, caches, [PROMPT[:-1], other[:4]], [0, 0])
    logits = run_step(model, caches, [PROMPT[-1:], other[4:]], [len(PROMPT) - 1, 4])
    assert (logits[0] - hf_logits(hf, PROMPT)[-1]).abs().max().item() < TOL
    assert (logits[1:] - hf_logits(hf, other)[4:]).abs().max().item() < TOL


def test_decode_one_token_at_a_time(tiny: tuple[Any, Any, Any]) -> None:
    model, _, hf = tiny
    expected = hf_logits(hf, PROMPT)
    caches = allocate_caches(model, 1)
    run_step(model, caches, [PROMPT[:10]], [0])
    for pos in range(10, len(PROMPT)):
        logits = run_step(model, caches, [PROMPT[pos : pos + 1]], [pos])
        assert (logits[0] - expected[pos]).abs().max().item() < TOL


def test_config_and_specs(tiny: tuple[Any, Any, Any]) -> None:
    model, config, hf = tiny
    specs = model.attention_specs()
    assert len(specs) == config.num_layers == hf.config.num_hidden_layers
    assert {s.num_heads for s in specs} == {4} and {s.num_kv_heads for s in specs} == {2}
    assert {s.head_size for s in specs} == {16} and {s.block_size for s in specs} == {4}
    window = getattr(hf.config, "sliding_window", None)
    types = getattr(hf.config, "layer_types", None) or []
    if config.architecture == "MistralForCausalLM":
        assert [s.sliding_window for s in specs] == [window] * len(specs)
    elif "sliding_attention" in types:
        assert [s.sliding_window for s in specs] == [window if t == "sliding_attention" else None for t in types]
    else:
        assert {s.sliding_window for s in specs} == {None}
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    hf_bias = getattr(hf.config, "attention_bias", False)
    qkv_bias = config.architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
    assert config.attention_bias == (qkv_bias or hf_bias)


def test_qwen2_sliding_window_off_unless_enabled() -> None:
    from plinth.model.config import ModelConfig

    off = Qwen2Config(**_COMMON, sliding_window=8, use_sliding_window=False).to_dict()
    off["architectures"] = ["Qwen2ForCausalLM"]
    assert ModelConfig.from_hf_config(off).layer_sliding_window(1) is None
    # a 4.x-style hub config: the window value is set but disabled
    legacy = dict(off, sliding_window=32768, use_sliding_window=False, max_window_layers=1)
    legacy.pop("layer_types")
    assert ModelConfig.from_hf_config(legacy).layer_sliding_window(1) is None
    legacy["use_sliding_window"] = True
    cfg = ModelConfig.from_hf_config(legacy)
    assert [cfg.layer_sliding_window(i) for i in range(2)] == [None, 32768]


def test_llama3_inv_freq_matches_transformers() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from plinth.model.config import ModelConfig
    from plinth.model.layers import rope_inv_freq

    hf_cfg = CONFIGS["llama3_rope"]()
    hf_cfg.rope_parameters["original_max_position_embeddings"] = 8192
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    cfg = ModelConfig.from_hf_config(hf_cfg.to_dict())
    assert torch.equal(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), expected)
