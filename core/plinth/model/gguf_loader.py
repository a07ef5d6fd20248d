"""GGUF checkpoints: config from metadata, tensors under Hugging Face names (fp32 or raw q4_1/q8_0 blocks).

llama.cpp's converter permutes the rows of q_proj/k_proj of llama-architecture models (it turns
HF's "rotate_half" rotary layout into GPT-J's interleaved one); :func:`unpermute_qk` undoes it so
the graph can use the same NeoX-style rotary as for Hugging Face checkpoints.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

import torch

from plinth.model.config import ModelConfig, RopeScaling
from plinth.model.gguf_reader import GGUFFile
from plinth.platform.quant import QuantizedWeight

# llama.cpp tensor name (inside blk.N.) -> Hugging Face name (inside model.layers.N.)
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_TOP = re.compile(r"(\w+)\.(weight|bias)$")
# tensors that are not model weights: llama3 rope frequency factors go into the config instead
_CONFIG_TENSORS = {"rope_freqs.weight"}
# architectures whose q/k rows llama.cpp permutes at conversion
_PERMUTED_ARCHS = {"llama"}


class GGUFTensorNameError(ValueError):
    """A GGUF tensor name has no Hugging Face counterpart."""


def hf_name(gguf_name: str) -> str:
    """Map a llama.cpp tensor name to its Hugging Face parameter name."""
    if m := _BLOCK.match(gguf_name):
        layer, part, kind = m.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    elif (m := _TOP.match(gguf_name)) and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    raise GGUFTensorNameError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent in plinth's mapping")


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp writes ``w.reshape(n_head, 2, head_dim // 2, *rest).swapaxes(1, 2)``: within each
    head, the two rotary halves are interleaved row by row. This de-interleaves them back. Works
    for a weight [n_head * head_dim, K] and a bias [n_head * head_dim].
    """
    rows = w.shape[0]
    head_dim = rows // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def gguf_config(gguf: GGUFFile) -> ModelConfig:
    """The :class:`ModelConfig` a GGUF file describes."""
    config = ModelConfig.from_gguf_metadata(gguf.metadata, gguf.tensors.keys(), source=str(gguf.path))
    if "rope_freqs.weight" in gguf.tensors:
        # Llama 3.1 GGUFs store the llama3 rope rule already evaluated, as per-frequency divisors
        factors = tuple(float(f) for f in gguf.tensor("rope_freqs.weight").tolist())
        config = dataclasses.replace(config, rope_scaling=RopeScaling("freq_factors", freq_factors=factors))
    return config


def gguf_weights(
    gguf: GGUFFile, config: ModelConfig, keep_quantized: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """``(hf_name, weight)`` for every model weight in the file, q/k un-permuted.

    Matrices stored in a format named in ``keep_quantized`` ("q4_1", "q8_0") come as their raw
    :class:`QuantizedWeight` blocks; everything else is dequantized to fp32.
    """
    permuted = gguf.metadata.get("general.architecture") in _PERMUTED_ARCHS
    for name in gguf.tensors:
        if name in _CONFIG_TENSORS:
            continue
        target = hf_name(name)
        info = gguf.tensors[name]
        quantized = gguf.quantized(name) if info.type_name.lower() in keep_quantized else None
        tensor: torch.Tensor | QuantizedWeight = gguf.tensor(name) if quantized is None else quantized
        heads = None
        if permuted and ".self_attn.q_proj." in target:
            heads = config.num_heads
        elif permuted and ".self_attn.k_proj." in target:
            heads = config.num_kv_heads
        if heads is not None:
            if isinstance(tensor, QuantizedWeight):  # rows move whole: permute the row order
                tensor = tensor.rows(unpermute_qk(torch.arange(tensor.out_features), heads))
            else:
                tensor = unpermute_qk(tensor, heads)
        yield target, tensor
