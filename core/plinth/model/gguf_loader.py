"""GGUF checkpoints: config from metadata, tensors under Hugging Face names (fp32 or raw q4_1/q8_0 blocks).

Mixture-of-experts files hold each layer's experts as one 3-D tensor (``ffn_gate_exps`` [E, I, H]);
they are split into one weight per expert under the Qwen-MoE names (``mlp.experts.{e}.gate_proj``),
the names the model reads for every MoE architecture.

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
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    # Gemma 3's norms after attention and after the MLP (its ffn_norm is the pre-MLP norm)
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    # mixture of experts: the router, the shared expert and its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# per-architecture exceptions to _BLOCK_NAMES
_ARCH_BLOCK_NAMES = {"gemma3": {"ffn_norm": "pre_feedforward_layernorm"}}
# the 3-D expert tensors [E, N, K] -> the per-expert weight name (after mlp.experts.{e}.)
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
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


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """Map a llama.cpp tensor name of a file of GGUF architecture ``arch`` to its Hugging Face
    parameter name (for a 3-D expert tensor: the name with ``{e}`` where the expert index goes)."""
    if m := _BLOCK.match(gguf_name):
        layer, part, kind = m.groups()
        names = {**_BLOCK_NAMES, **_ARCH_BLOCK_NAMES.get(arch, {})}
        if part in names:
            return f"model.layers.{layer}.{names[part]}.{kind}"
        if part in _EXPERT_NAMES:
            return f"model.layers.{layer}.mlp.experts.{{e}}.{_EXPERT_NAMES[part]}.{kind}"
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
    :class:`QuantizedWeight` blocks; F16 and BF16 tensors in their own dtype (the model casts what
    its GEMM does not take as stored); everything else is dequantized to fp32.
    """
    arch = str(gguf.metadata.get("general.architecture"))
    permuted = arch in _PERMUTED_ARCHS
    for name in gguf.tensors:
        if name in _CONFIG_TENSORS:
            continue
        target = hf_name(name, arch)
        info = gguf.tensors[name]
        keep = info.type_name.lower() in keep_quantized
        if "{e}" in target:  # [E, N, K]: one weight per expert
            experts = gguf.quantized_experts(name) if keep else None
            if experts is None:
                dense = gguf.tensor(name)
                yield from ((target.format(e=e), dense[e].clone()) for e in range(dense.shape[0]))
            else:
                yield from ((target.format(e=e), w) for e, w in enumerate(experts))
            continue
        quantized = gguf.quantized(name) if keep else None
        tensor: torch.Tensor | QuantizedWeight = gguf.tensor(name, as_stored=True) if quantized is None else quantized
        if isinstance(tensor, torch.Tensor) and target.endswith(".mlp.shared_expert_gate.weight") and tensor.ndim == 1:
            tensor = tensor[None, :]  # llama.cpp stores the [1, H] shared-expert gate as [H]
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
