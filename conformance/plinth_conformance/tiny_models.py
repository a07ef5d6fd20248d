"""Tiny random Hugging Face model folders for the engine tests, built without transformers.

A folder holds ``config.json``, ``model.safetensors`` (random weights under the Hugging Face
names plinth's loader expects) and a word-level ``tokenizer.json`` made with ``tokenizers``: the
suite needs nothing beyond plinth's own dependencies and downloads nothing.

Head size 64 and block-size-agnostic shapes keep every model inside the mandatory profile; the
embeddings are large so greedy logit gaps are wide (a near-tie would be noise, not a bug).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

VOCAB = 512
HIDDEN = 128
INTERMEDIATE = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_SIZE = 64
MAX_POSITIONS = 512
#: Sliding window of the ``mistral-sw`` model: shorter than the test prompts.
SLIDING_WINDOW = 24

#: Model name -> (architecture, extra config.json keys).
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {"model_type": "llama", "tie_word_embeddings": True, "rope_theta": 10000.0}),
    "qwen2": ("Qwen2ForCausalLM", {"model_type": "qwen2", "tie_word_embeddings": False, "rope_theta": 1e6}),
    "mistral-sw": (
        "MistralForCausalLM",
        {"model_type": "mistral", "tie_word_embeddings": False, "sliding_window": SLIDING_WINDOW},
    ),
}


def _config(name: str) -> dict[str, Any]:
    architecture, extra = MODELS[name]
    return {
        "architectures": [architecture],
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_SIZE,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
        **extra,
    }


def _weights(config: dict[str, Any], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random weights: projections ~ 1/sqrt(fan_in), norms near 1, biases small, big embeddings."""
    h, inter, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    qkv_bias = config["architectures"][0] == "Qwen2ForCausalLM"

    def mat(n_out: int, n_in: int) -> torch.Tensor:
        return torch.randn(n_out, n_in, generator=gen) / math.sqrt(n_in)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(config["vocab_size"], h, generator=gen),
        "model.norm.weight": norm(h),
    }
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = torch.randn(config["vocab_size"], h, generator=gen)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        for name, (n_out, n_in) in {
            "self_attn.q_proj": (q, h),
            "self_attn.k_proj": (kv, h),
            "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q),
            "mlp.gate_proj": (inter, h),
            "mlp.up_proj": (inter, h),
            "mlp.down_proj": (h, inter),
        }.items():
            w[f"{p}{name}.weight"] = mat(n_out, n_in)
            if qkv_bias and name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                w[f"{p}{name}.bias"] = 0.1 * torch.randn(n_out, generator=gen)
    return w


def _tokenizer_json(vocab_size: int) -> str:
    """A word-level tokenizer: ``<unk> <s> </s> w3 w4 ...`` split on whitespace."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok.to_str()


def save_tiny_model(name: str, folder: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write the tiny ``name`` model ("llama", "qwen2", "mistral-sw") into ``folder``; returns it.

    ``overrides`` replace ``config.json`` keys (``num_hidden_layers=30``, ``hidden_size=512``, ...):
    a random model of another shape, for benchmarks.
    """
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = {**_config(name), **overrides}
    gen = torch.Generator().manual_seed(seed)
    save_file(_weights(config, gen), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "tokenizer.json").write_text(_tokenizer_json(config["vocab_size"]))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    """Random token-id prompts of the given lengths (ids 3.. avoid the special tokens)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def assert_same_generations(got: list[Any], want: list[Any], tol: float) -> float:
    """Two engines' ``generate`` results agree: every sample's greedy (or seeded) token ids equal, and
    each step's top log-probabilities (the same tokens, in the same order) within ``tol`` nats.

    Returns the worst difference (for a note); raises AssertionError naming where they part.
    """
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        for j, (a, b) in enumerate(zip(g.outputs, w.outputs, strict=True)):
            assert a.token_ids == b.token_ids, f"prompt {i} sample {j}: {a.token_ids} vs {b.token_ids}"
            for step, (la, lb) in enumerate(zip(a.logprobs or [], b.logprobs or [], strict=True)):
                mine, theirs = dict(la.top), dict(lb.top)
                assert list(mine) == list(theirs), f"prompt {i} sample {j} step {step}: top tokens {mine} vs {theirs}"
                worst = max(worst, *(abs(mine[t] - theirs[t]) for t in mine))
    assert worst < tol, f"top log-probabilities differ by {worst:.3g} nats (tolerance {tol:g})"
    return worst
