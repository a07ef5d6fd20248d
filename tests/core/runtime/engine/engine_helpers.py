"""Tiny random Hugging Face models saved as folders the engine loads (with the SmolLM2 tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

VOCAB = 49152  # the SmolLM2 tokenizer's


def save_tiny_folder(kind: str, folder: Path) -> Any:
    """Save a tiny random ``kind`` ("llama": GQA + tied embeddings, "qwen2": qkv bias) with a tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

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
    else:
        raise ValueError(kind)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # HF initialises biases to 0 and norms to 1: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif "embed" in name:
                p.mul_(20.0)  # wider logit gaps: greedy ties between near-equal tokens are noise
    model.save_pretrained(folder, safe_serialization=True)
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
