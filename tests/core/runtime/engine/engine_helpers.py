"""Tiny random Hugging Face models saved as folders the engine loads (with the SmolLM2 tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

VOCAB = 49152  # the SmolLM2 tokenizer's


#: The tiny architectures :func:`save_tiny_folder` makes.
KINDS = ("llama", "qwen2", "qwen3", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe")


def save_tiny_folder(kind: str, folder: Path) -> Any:
    """Save a tiny random ``kind`` (one of :data:`KINDS`) with the SmolLM2 tokenizer.

    "llama": GQA + tied embeddings; "qwen2": qkv bias; "qwen3": q/k norm; "gemma3": a sliding
    window (8) shorter than most prompts between global layers; "mixtral": top-2 of 4 experts;
    "qwen2_moe": a shared expert and one dense layer; "qwen3_moe": top-3 of 8, renormalised.
    """
    from transformers import (
        AutoModelForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    from plinth.model.loader import load_tokenizer, resolve_model

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "llama":
        config = LlamaConfig(**common, tie_word_embeddings=True, rope_theta=10000.0)
    elif kind == "qwen2":
        config = Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1000000.0)
    elif kind == "qwen3":
        config = Qwen3Config(**common, head_dim=16, tie_word_embeddings=False)
    elif kind == "gemma3":
        config = Gemma3TextConfig(
            **{**common, "num_hidden_layers": 3},
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )
    elif kind == "mixtral":
        config = MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    elif kind == "qwen2_moe":
        config = Qwen2MoeConfig(
            **{**common, "num_hidden_layers": 3},
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        )
    elif kind == "qwen3_moe":
        config = Qwen3MoeConfig(
            **common, head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, norm_topk_prob=True
        )
    else:
        raise ValueError(kind)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # HF initialises biases to 0 and norms to 1: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif "embed" in name:
                # wider logit gaps: greedy ties between near-equal tokens are noise (Gemma scales its
                # embeddings by sqrt(hidden) itself: 20x more and a tied model only repeats its input)
                p.mul_(2.0 if kind == "gemma3" else 20.0)
    model.save_pretrained(folder, safe_serialization=True)
    model.config._attn_implementation = "eager"  # the sliding-window mask, the same on every transformers version
    smol = load_tokenizer(resolve_model(None))
    smol.backend.save(str(folder / "tokenizer.json"))
    tok_config = {"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "chat_template": smol.chat_template}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return model


def host_with(name: str, backend: object) -> Any:
    """A plugin host whose only plugin (named ``name``) registers ``backend``: an engine test's own backend."""
    from plinth.hookspecs import hookimpl
    from plinth.platform.host import PluginHost

    class _Plugin:
        @hookimpl
        def plinth_register_backends(self) -> list[object]:
            return [backend]

    return PluginHost(plugins=((name, _Plugin()),))
