"""Model building blocks that call the backend's kernels: Linear, RMSNorm, rotary, attention, MLP.

Every layer works on flattened tokens ([T, ...]: all sequences of the step concatenated), so one
call serves any mix of prefill chunks and decodes. Weights are plain tensors and
:class:`LinearWeight` objects prepared by the backend's GEMM at load time, not ``nn.Parameter``:
nothing here is trained.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import nn

from plinth.model.config import MoEConfig, RopeScaling
from plinth.model.context import ForwardContext, ModelKernels
from plinth.model.lora import NO_LORA, LoRALayer
from plinth.platform.backend import (
    AttentionKernels,
    ExpertWeights,
    LinearWeight,
    LoRABatch,
    MoEKernels,
    MoESpec,
    dtype_name,
)
from plinth.platform.quant import QuantizedWeight, dequantize, quantize_q8_0
from plinth.platform.reference import ReferenceMoE


class Linear(nn.Module):
    """``y = x @ W.T (+ b)`` through the backend GEMM, on a weight prepared once at load time.

    ``row_parallel`` (under tensor parallelism): the weight is this rank's slice of the input dim,
    so the product is a partial sum: it is all-reduced over the ranks and the bias added once, after.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool, kernels: ModelKernels, *, row_parallel: bool = False
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.has_bias = bias
        self.gemm = kernels.gemm
        self.quant_formats = kernels.quant_formats
        self.quantize = kernels.quantize
        self.weight: LinearWeight | None = None
        self.reduce = kernels.tp.comm if row_parallel and kernels.tp is not None else None
        self.reduced_bias: torch.Tensor | None = None  # row-parallel: added after the all-reduce

    def load(self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        """Prepare ``weight`` [N, K] (and ``bias`` [N]) with the backend GEMM.

        A :class:`QuantizedWeight` stays quantized where the GEMM takes its format and is
        dequantized otherwise; a dense weight is quantized first when the model asks for it.
        """
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight shape {tuple(weight.shape)} != expected {(self.out_features, self.in_features)}")
        if (bias is not None) != self.has_bias:
            raise ValueError(f"bias {'missing' if bias is None else 'unexpected'} for this layer")
        if self.reduce is not None:  # the bias joins after the reduction, not in each rank's GEMM
            self.reduced_bias, bias = bias, None
        if isinstance(weight, torch.Tensor) and self.quantize == "q8_0" and self.in_features % 32 == 0:
            weight = quantize_q8_0(weight)
        if isinstance(weight, QuantizedWeight):
            if weight.format in self.quant_formats:
                self.weight = self.gemm.prepare_quantized(weight, bias)
                return
            weight = dequantize(weight)
        self.weight = self.gemm.prepare(weight, bias)

    def forward(self, x: torch.Tensor, before_reduce: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """``x`` [T, K] -> [T, N]. ``before_reduce`` adds to the product in place before a
        row-parallel layer's all-reduce (a LoRA delta of this rank's input slice is a partial sum too)."""
        if self.weight is None:
            raise RuntimeError("Linear used before its weight was loaded")
        y = self.gemm.linear(x, self.weight)
        if before_reduce is not None:
            before_reduce(y)
        if self.reduce is None:
            return y
        y = self.reduce.all_reduce(y)
        return y if self.reduced_bias is None else y + self.reduced_bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.has_bias}"


class RMSNorm(nn.Module):
    """RMSNorm over the hidden dimension through ``SmallOps.rms_norm``."""

    def __init__(self, hidden_size: int, eps: float, kernels: ModelKernels) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.ops = kernels.ops
        self.weight: torch.Tensor | None = None

    def load(self, weight: torch.Tensor) -> None:
        """Keep ``weight`` [hidden]."""
        if tuple(weight.shape) != (self.hidden_size,):
            raise ValueError(f"norm weight shape {tuple(weight.shape)} != expected ({self.hidden_size},)")
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, hidden] -> [T, hidden]."""
        assert self.weight is not None, "RMSNorm used before its weight was loaded"
        return self.ops.rms_norm(x, self.weight, self.eps)

    def forward_heads(self, x: torch.Tensor) -> torch.Tensor:
        """Each head of ``x`` [T, H, D] normalised over ``D`` (this norm's size) -> [T, H, D]."""
        assert self.weight is not None, "RMSNorm used before its weight was loaded"
        return self.ops.rms_norm_heads(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; ``residual`` may be overwritten with the sum."""
        assert self.weight is not None, "RMSNorm used before its weight was loaded"
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(rotary_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] in fp32, computed exactly as transformers does."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (theta**exponent)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "freq_factors":
        factors = torch.tensor(scaling.freq_factors, dtype=torch.float32)
        if factors.numel() != inv_freq.numel():
            raise ValueError(f"{factors.numel()} rope frequency factors for {inv_freq.numel()} frequencies")
        return inv_freq / factors
    if scaling.rope_type != "llama3":
        raise ValueError(f"unsupported rope scaling type {scaling.rope_type!r}")
    # Llama 3.1: long wavelengths are divided by factor, short ones kept, the band between blended
    factor = scaling.factor
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """NeoX / HF "rotate_half" rotary embedding from a precomputed cos/sin table.

    ``cos_sin`` is [max_positions, rotary_dim]: cos of every (position, frequency) in the first
    half, sin in the second, the layout ``SmallOps.rotary`` reads. It stays fp32 whatever the model
    dtype, so positions far into the context keep their precision.
    """

    def __init__(
        self,
        rotary_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling | None,
        kernels: ModelKernels,
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.ops = kernels.ops
        inv_freq = rope_inv_freq(rotary_dim, theta, scaling)  # [rotary_dim / 2]
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [P, rd/2]
        self.cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(kernels.device)  # [P, rotary_dim]

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` [T, H, D] at ``positions`` [T] -> rotated [T, H, D]."""
        return self.ops.rotary(x, positions, self.cos_sin, self.rotary_dim)


class Attention(nn.Module):
    """Self-attention over the paged KV cache: fused QKV projection, optional q/k norms, rotary, KV
    write, attention, o_proj.

    ``qk_norm`` (Qwen3, Gemma 3): each query and key head is RMS-normalised over its ``head_dim``
    (weights ``q_norm``/``k_norm``) before the rotary embedding. ``scale`` is the softmax scale
    (None: ``1/sqrt(head_dim)``).
    """

    def __init__(
        self,
        layer_idx: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool,
        out_bias: bool,
        rotary: RotaryEmbedding,
        attn_kernels: AttentionKernels,
        kernels: ModelKernels,
        *,
        qk_norm_eps: float | None = None,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        #: SPMD: the fused rows (and so the output columns) are ``groups`` groups, shard r's q, k, v
        self.groups = kernels.shard_groups
        self.qkv_proj = Linear(hidden_size, self.q_size + 2 * self.kv_size, qkv_bias, kernels)
        self.o_proj = Linear(self.q_size, hidden_size, out_bias, kernels, row_parallel=True)
        self.rotary = rotary
        self.attn_kernels = attn_kernels
        self.q_norm = RMSNorm(head_dim, qk_norm_eps, kernels) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps, kernels) if qk_norm_eps is not None else None
        # adapter slots (plinth.model.lora.attach_lora), used only in steps with adapter tokens
        self.qkv_lora: LoRALayer = NO_LORA
        self.o_lora: LoRALayer = NO_LORA

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``hidden`` [T, hidden] at ``positions`` [T] -> [T, hidden]."""
        # Submodules are called through .forward: nn.Module.__call__ costs microseconds per call
        # (hook bookkeeping), and a decode step makes hundreds of these calls.
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj.forward(hidden)  # [T, (H + 2 Hkv) D]
        lora = ctx.lora
        if lora is not None:  # each of q/k/v is a slice of the fused output
            self.qkv_lora.apply(qkv, hidden, lora)
        if self.groups == 1:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        else:  # each group's q, k, v, then the groups' heads side by side: the plain head order
            g = self.groups
            parts = qkv.view(num_tokens, g, -1).split([self.q_size // g, self.kv_size // g, self.kv_size // g], dim=-1)
            q, k, v = (p.reshape(num_tokens, -1) for p in parts)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # per head, over head_dim
            q = self.q_norm.forward_heads(q)
            k = self.k_norm.forward_heads(k)
        q = self.rotary.forward(q, positions)  # [T, H, D]
        k = self.rotary.forward(k, positions)  # [T, Hkv, D]
        # v stays a strided view of qkv (write_kv takes any strides): no copy
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        # the fused entry (API 1.5): writes K/V and attends; a functional backend returns a new cache
        out, ctx.kv_caches[self.layer_idx] = self.attn_kernels.write_and_attend(
            q, k, v, ctx.kv_caches[self.layer_idx], ctx.attn, self.scale
        )  # [T, H, D]
        out = out.reshape(num_tokens, self.q_size)
        if lora is None:
            return self.o_proj.forward(out)
        return self.o_proj.forward(out, lambda y: self.o_lora.apply(y, out, lora))  # [T, hidden]


class GatedMLP(nn.Module):
    """Gated MLP: fused gate/up projection, ``act(gate) * up``, down projection.

    ``activation`` is ``"silu"`` (SwiGLU: Llama, Qwen) or ``"gelu_tanh"`` (GeGLU: Gemma 3).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        kernels: ModelKernels,
        activation: str = "silu",
        *,
        row_parallel: bool = True,
    ) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias, kernels)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, kernels, row_parallel=row_parallel)
        if activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported MLP activation {activation!r}; supported: 'silu', 'gelu_tanh'")
        self.silu = activation == "silu"
        self.ops = kernels.ops
        #: SPMD: the fused rows are ``groups`` groups, shard r's gate rows then its up rows
        self.groups = kernels.shard_groups
        # adapter slots (plinth.model.lora.attach_lora), used only in steps with adapter tokens
        self.gate_up_lora: LoRALayer = NO_LORA
        self.down_lora: LoRALayer = NO_LORA

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        """``x`` [T, hidden] -> [T, hidden]; ``lora``: the step's adapter slots, if it has any."""
        gate_up = self.gate_up_proj.forward(x)  # [T, 2I]
        if lora is not None:  # gate and up are slices of the fused output
            self.gate_up_lora.apply(gate_up, x, lora)
        num_tokens = gate_up.shape[0]
        if self.groups > 1:  # one row per group: each its own gate and up halves
            gate_up = gate_up.reshape(num_tokens * self.groups, -1)
        act = self.ops.silu_and_mul(gate_up) if self.silu else self.ops.gelu_tanh_and_mul(gate_up)  # [T, I]
        if self.groups > 1:
            act = act.reshape(num_tokens, -1)
        if lora is None:
            return self.down_proj.forward(act)  # [T, hidden]
        return self.down_proj.forward(act, lambda y: self.down_lora.apply(y, act, lora))


class SparseMoE(nn.Module):
    """A mixture-of-experts block: router, the backend's fused-MoE op, and an optional shared expert.

    ``y = moe(x, router(x)) + sigmoid(shared_gate(x)) * shared_expert(x)`` (the shared terms only
    where ``config.shared_expert_size`` > 0: Qwen2-MoE). The router is a plain linear [E, hidden]
    through the GEMM; routing (softmax, top-k, renormalisation) is the op's.
    """

    def __init__(
        self, hidden_size: int, config: MoEConfig, kernels: ModelKernels, dtype: torch.dtype, activation: str = "silu"
    ) -> None:
        super().__init__()
        self.config = config
        self.kernels = kernels
        self.base_spec = MoESpec(
            num_experts=config.num_experts,
            top_k=config.top_k,
            hidden_size=hidden_size,
            intermediate_size=config.intermediate_size,
            dtype=dtype_name(dtype),
            renormalize=config.renormalize,
            activation=activation,
        )
        self.dtype = dtype
        self.gate = Linear(hidden_size, config.num_experts, False, kernels)
        self.op: MoEKernels | None = None
        self.experts: ExpertWeights | None = None
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if config.shared_expert_size:
            self.shared_expert = GatedMLP(hidden_size, config.shared_expert_size, False, kernels, activation)
            self.shared_expert_gate = Linear(hidden_size, 1, False, kernels)

    def load_experts(
        self,
        gate: list[torch.Tensor | QuantizedWeight],
        up: list[torch.Tensor | QuantizedWeight],
        down: list[torch.Tensor | QuantizedWeight],
    ) -> None:
        """Hand every expert's gate [I, H], up [I, H] and down [H, I] to the op, kept in their blocks
        where the op takes their (one) format, dense otherwise."""
        parts = [*gate, *up, *down]
        blocks = [p for p in parts if isinstance(p, QuantizedWeight)]
        formats = {p.format for p in blocks}
        factory = self.kernels.moe or ReferenceMoE
        if len(blocks) == len(parts) and len(formats) == 1 and formats <= self.kernels.moe_quant_formats:
            self.op = factory(dataclasses.replace(self.base_spec, quant_format=formats.pop()))
            n = len(gate)
            gate_up_q = [QuantizedWeight.cat([g, u]) for g, u in zip(blocks[:n], blocks[n : 2 * n], strict=True)]
            self.experts = self.op.prepare_quantized(gate_up_q, blocks[2 * n :])
            return

        def dense(t: torch.Tensor | QuantizedWeight) -> torch.Tensor:
            return (dequantize(t) if isinstance(t, QuantizedWeight) else t).to(
                device=self.kernels.device, dtype=self.dtype
            )

        gate_up = torch.stack([torch.cat([dense(g), dense(u)]) for g, u in zip(gate, up, strict=True)])
        down_stack = torch.stack([dense(d) for d in down])
        self.op = factory(self.base_spec)
        self.experts = self.op.prepare(gate_up, down_stack)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        """``x`` [T, hidden] -> [T, hidden]; ``lora`` is ignored (experts are not adapted)."""
        assert self.op is not None and self.experts is not None, "SparseMoE used before its experts were loaded"
        out = self.op.forward(x, self.gate.forward(x), self.experts)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate.forward(x)) * self.shared_expert.forward(x)
        return out
