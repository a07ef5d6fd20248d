"""ModelConfig for the Qwen3, Gemma 3 and MoE architectures, from config.json and GGUF metadata, and the
variants it refuses (an error naming the field, never a model that would compute something else)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from plinth.model.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig

BASE: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=12,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def hf(architecture: str, **fields: Any) -> dict[str, Any]:
    return {**BASE, "architectures": [architecture], **fields}


def test_gemma3_defaults_follow_transformers() -> None:
    cfg = ModelConfig.from_hf_config(hf("Gemma3ForCausalLM", sliding_window=512))
    # every sixth layer global (sliding_window_pattern 6), the others local
    assert [i for i, t in enumerate(cfg.layer_types) if t == FULL_ATTENTION] == [5, 11]
    assert cfg.layer_sliding_window(0) == 512 and cfg.layer_sliding_window(5) is None
    assert cfg.layer_rope_theta(0) == 10000.0 and cfg.layer_rope_theta(5) == 1000000.0
    assert cfg.hidden_act == "gelu_tanh" and cfg.qk_norm and cfg.sandwich_norms
    assert cfg.norm_weight_offset == 1.0 and cfg.tie_word_embeddings
    assert cfg.embed_scale == pytest.approx(8.0)  # sqrt(64)
    assert cfg.attention_scale == pytest.approx(256**-0.5)  # query_pre_attn_scalar's default


def test_gemma3_transformers4_rope_fields() -> None:
    cfg = ModelConfig.from_hf_config(
        hf(
            "Gemma3ForCausalLM",
            sliding_window=8,
            sliding_window_pattern=3,
            rope_theta=50000.0,
            rope_local_base_freq=77.0,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            query_pre_attn_scalar=32,
        )
    )
    assert cfg.layer_types[:3] == (SLIDING_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION)
    assert cfg.rope_theta == 50000.0 and cfg.rope_local_theta == 77.0
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0  # the global layers'
    assert cfg.attention_scale == pytest.approx(1 / math.sqrt(32))


def test_qwen3_has_qk_norm_and_no_bias() -> None:
    cfg = ModelConfig.from_hf_config(hf("Qwen3ForCausalLM"))
    assert cfg.qk_norm and not cfg.attention_bias and cfg.moe is None and not cfg.sandwich_norms


def test_moe_configs() -> None:
    mixtral = ModelConfig.from_hf_config(hf("MixtralForCausalLM", num_local_experts=8, num_experts_per_tok=2))
    assert mixtral.moe is not None and mixtral.moe.renormalize and all(mixtral.moe.sparse_layers)
    assert (mixtral.moe.num_experts, mixtral.moe.top_k, mixtral.moe.intermediate_size) == (8, 2, 128)

    qwen2 = ModelConfig.from_hf_config(
        hf(
            "Qwen2MoeForCausalLM",
            num_experts=60,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=96,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
        )
    )
    assert qwen2.moe is not None and not qwen2.moe.renormalize and qwen2.moe.shared_expert_size == 96
    assert [i for i in range(12) if qwen2.layer_is_sparse(i)] == [1, 5, 7, 9, 11]  # every 2nd, not layer 3
    assert qwen2.attention_bias  # Qwen2's q/k/v bias

    qwen3 = ModelConfig.from_hf_config(
        hf("Qwen3MoeForCausalLM", num_experts=128, num_experts_per_tok=8, moe_intermediate_size=48, norm_topk_prob=True)
    )
    assert qwen3.moe is not None and qwen3.moe.renormalize and qwen3.moe.shared_expert_size == 0
    assert qwen3.qk_norm and qwen3.moe.intermediate_size == 48


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
        (dict(hidden_act="relu2"), "hidden_act"),
    ],
)
def test_unimplemented_variants_are_refused_by_name(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_hf_config(hf("Qwen3ForCausalLM", **fields), source="config.json")


def test_unimplemented_moe_routing_is_refused_by_name() -> None:
    cfg = hf("Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    with pytest.raises(ValueError, match="scoring_func 'sigmoid'"):
        ModelConfig.from_hf_config({**cfg, "scoring_func": "sigmoid"})
    with pytest.raises(ValueError, match="n_group"):
        ModelConfig.from_hf_config({**cfg, "n_group": 8, "topk_group": 4})


def test_gemma3_local_rope_scaling_is_refused_by_name() -> None:
    cfg = hf(
        "Gemma3ForCausalLM",
        rope_parameters={
            "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    )
    with pytest.raises(ValueError, match="rope_parameters.sliding_attention.rope_type 'linear'"):
        ModelConfig.from_hf_config(cfg)


def test_a_vision_tower_is_refused_by_name() -> None:
    cfg = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": BASE,
        "vision_config": {"hidden_size": 1152},
    }
    with pytest.raises(ValueError, match="vision_config"):
        ModelConfig.from_hf_config(cfg, source="gemma-3-4b-it/config.json")


# -- GGUF metadata ---------------------------------------------------------------------------------


def gguf_meta(arch: str, **keys: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "general.architecture": arch,
        f"{arch}.embedding_length": 64,
        f"{arch}.block_count": 12,
        f"{arch}.feed_forward_length": 128,
        f"{arch}.attention.head_count": 4,
        f"{arch}.attention.head_count_kv": 2,
        f"{arch}.vocab_size": 256,
    }
    meta.update({f"{arch}.{k}": v for k, v in keys.items()})
    return meta


def test_gguf_gemma3_follows_llama_cpp() -> None:
    names = {"blk.0.attn_q_norm.weight", "blk.0.post_ffw_norm.weight", "token_embd.weight"}
    cfg = ModelConfig.from_gguf_metadata(
        gguf_meta("gemma3", **{"attention.sliding_window": 512, "attention.key_length": 32}), names
    )
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.head_dim == 32
    assert [i for i, t in enumerate(cfg.layer_types) if t == FULL_ATTENTION] == [5, 11]
    assert cfg.rope_local_theta == 10000.0 and cfg.attention_scale == pytest.approx(32**-0.5)
    assert cfg.norm_weight_offset == 0.0  # the converter stored 1 + w already
    assert cfg.tie_word_embeddings and cfg.qk_norm and cfg.sandwich_norms


def test_gguf_moe_architectures() -> None:
    names = {f"blk.{i}.ffn_gate_inp.weight" for i in range(12)} | {"output.weight"}
    mixtral = ModelConfig.from_gguf_metadata(gguf_meta("llama", expert_count=8, expert_used_count=2), names)
    assert mixtral.architecture == "MixtralForCausalLM"
    assert mixtral.moe is not None and mixtral.moe.renormalize and mixtral.moe.intermediate_size == 128

    qwen2 = ModelConfig.from_gguf_metadata(
        gguf_meta(
            "qwen2moe",
            expert_count=60,
            expert_used_count=4,
            expert_feed_forward_length=32,
            expert_shared_feed_forward_length=96,
        ),
        names - {"blk.3.ffn_gate_inp.weight"},
    )
    assert qwen2.moe is not None and not qwen2.moe.renormalize and qwen2.moe.shared_expert_size == 96
    assert not qwen2.layer_is_sparse(3) and qwen2.layer_is_sparse(4)

    qwen3 = ModelConfig.from_gguf_metadata(
        gguf_meta("qwen3moe", expert_count=128, expert_used_count=8, expert_feed_forward_length=48), names
    )
    assert qwen3.architecture == "Qwen3MoeForCausalLM" and qwen3.moe is not None and qwen3.moe.renormalize
