"""The reference backend: plain torch, one sequence at a time, obviously correct.

It is the oracle of the tests and the conformance suite, and the per-op fallback of every other
backend. It is registered through the ``plinth.backends`` entry-point group like any third-party
plugin. Its score is low on purpose: it wins selection only when nothing else can run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from plinth.hookspecs import hookimpl
from plinth.platform.backend import (
    AttentionKernels,
    AttentionMetadata,
    AttentionSpec,
    Backend,
    Capabilities,
    DeviceServices,
    ExpertWeights,
    GemmKernels,
    KVCacheLayout,
    LinearWeight,
    LoRABatch,
    LoRAKernels,
    LoRASpec,
    MoECapabilities,
    MoEKernels,
    MoESpec,
    Probe,
    route_experts,
    torch_dtype,
)
from plinth.platform.devices import HOST

REFERENCE_SCORE = 1


def reference_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention over a paged cache, sequence by sequence and block by block.

    ``key_cache``/``value_cache`` are [num_blocks, block_size, Hkv, D]. Computed in fp64 when the
    query is fp64, fp32 otherwise; the output has the query's dtype.
    """
    num_tokens, num_heads, head_size = query.shape
    block_size = key_cache.shape[1]
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    out = torch.zeros(num_tokens, num_heads, head_size, dtype=query.dtype, device=query.device)
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens_host):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        n_blocks = math.ceil(seq_len / block_size)
        blocks = meta.block_tables[i, :n_blocks].tolist()
        # each block widened before the cat: torch.cat has no fp8 kernel where IPEX replaces it (torch 2.8)
        k = torch.cat([key_cache[b].to(acc) for b in blocks])[:seq_len]  # [S, Hkv, D]
        v = torch.cat([value_cache[b].to(acc) for b in blocks])[:seq_len]
        k = k.repeat_interleave(group, dim=1)  # [S, H, D]
        v = v.repeat_interleave(group, dim=1)
        q = query[q_start:q_end].to(acc)  # [Q, H, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [H, Q, S]
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= q_pos - k_pos < sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


class ReferenceAttention(AttentionKernels):
    """KV write by indexing one token at a time; attention by :func:`reference_paged_attention`.

    The template's starter attention subclasses it.

    .. versionadded:: 1.0
    """

    @staticmethod
    def default_layout() -> KVCacheLayout:
        """The only KV layout the reference kernels read and write."""
        return KVCacheLayout()

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        block_size = kv_cache.shape[2]
        for t, slot in enumerate(slot_mapping.tolist()):
            if slot < 0:  # padding token
                continue
            kv_cache[0, slot // block_size, slot % block_size] = key[t]
            kv_cache[1, slot // block_size, slot % block_size] = value[t]

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        return reference_paged_attention(
            query,
            kv_cache[0],
            kv_cache[1],
            meta,
            scale,
            sliding_window=self.spec.sliding_window,
            logits_soft_cap=self.spec.logits_soft_cap,
        )


class ReferenceGemm(GemmKernels):
    """``x @ w.T + b`` with torch.matmul, no re-layout. The template's starter GEMM subclasses it.

    .. versionadded:: 1.0
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearWeight:
        return LinearWeight(
            out_features=weight.shape[0],
            in_features=weight.shape[1],
            weight=weight.to(self.dtype).contiguous(),
            bias=None if bias is None else bias.to(self.dtype),
        )

    def linear(self, x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
        assert weight.weight is not None
        out = torch.matmul(x, weight.weight.t())
        return out if weight.bias is None else out + weight.bias


def gated_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` of ``gate_up`` [..., 2I] (gate first) -> [..., I], for ``MoESpec.activation``."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(gate, approximate="tanh") * up
    raise ValueError(f"unknown MoE activation {activation!r}")


class ReferenceMoE(MoEKernels):
    """The fused-MoE oracle: route with :func:`route_experts`, then, expert by expert, the MLP of the
    tokens that chose it, weighted and summed into their rows (accumulated in fp32, fp64 for fp64).

    Every declared dtype, activation and format (quantized experts are dequantized at load).

    .. versionadded:: 1.8
    """

    def prepare(self, gate_up: torch.Tensor, down: torch.Tensor) -> ExpertWeights:
        self.check_experts(gate_up, down)
        dtype = torch_dtype(self.spec.dtype)
        return ExpertWeights(self.spec, gate_up.to(dtype).contiguous(), down.to(dtype).contiguous())

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, weights: ExpertWeights) -> torch.Tensor:
        self.check_call(x, router_logits, weights)
        assert weights.gate_up is not None and weights.down is not None
        s = self.spec
        route_w, route_ids = route_experts(router_logits, s.top_k, s.renormalize)
        acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        out = torch.zeros(x.shape[0], s.hidden_size, dtype=acc_dtype, device=x.device)
        for e in torch.unique(route_ids).tolist():
            tokens, slot = torch.nonzero(route_ids == e, as_tuple=True)
            h = gated_activation(x[tokens] @ weights.gate_up[e].t(), s.activation)
            y = (h @ weights.down[e].t()).to(acc_dtype)
            out.index_add_(0, tokens, y * route_w[tokens, slot].to(acc_dtype)[:, None])
        return out.to(x.dtype)


class ReferenceLoRA(LoRAKernels):
    """The batched-LoRA oracle: token by token, the token's own adapter's matrices, accumulated in
    fp32 (fp64 for fp64). Slow (a Python loop over the step's tokens), obviously correct.

    .. versionadded:: 1.11
    """

    def shrink(self, x: torch.Tensor, a: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        out = torch.zeros(x.shape[0], a.shape[1], dtype=acc, device=x.device)  # [T, rank]
        for t, slot in enumerate(batch.slots):
            if slot >= 0:
                out[t] = a[slot].to(acc) @ x[t].to(acc)
        return out.to(x.dtype)

    def expand(self, y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, batch: LoRABatch) -> None:
        acc = torch.float64 if y.dtype == torch.float64 else torch.float32
        for t, slot in enumerate(batch.slots):
            if slot >= 0:
                y[t] = (y[t].to(acc) + b[slot].to(acc) @ s[t].to(acc)).to(y.dtype)


class ReferenceBackend(Backend):
    """Plain torch on the host CPU in fp32 or fp64; every head size, block size and feature."""

    name = "reference"
    version = "0.1.0"
    api_version = (1, 11)
    description = "plain-torch oracle: slow, obviously correct"

    def __init__(self) -> None:
        self._services = DeviceServices(HOST)
        self._caps = Capabilities(
            dtypes=frozenset({"float32", "float64"}),
            kv_cache_dtypes=frozenset({"float32", "float64"}),
            head_sizes=frozenset(range(1, 513)),
            block_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            max_gqa_ratio=None,
            features=frozenset({"sliding_window", "logits_soft_cap"}),
            kv_cache_layout=KVCacheLayout(),
            fused_moe=MoECapabilities(
                dtypes=frozenset({"float32", "float64"}), activations=frozenset({"silu", "gelu_tanh"})
            ),
        )

    def probe(self) -> Probe:
        return Probe(
            score=REFERENCE_SCORE,
            reasons=("always available; a correctness oracle, not meant for speed",),
            device_name="host CPU",
        )

    def capabilities(self) -> Capabilities:
        return self._caps

    def device_services(self) -> DeviceServices:
        return self._services

    def attention_kernels(self, spec: AttentionSpec) -> AttentionKernels:
        self._caps.require_attention(self.name, spec)
        return ReferenceAttention(spec, self._caps.kv_cache_layout)

    def gemm_kernels(self, dtype: str) -> GemmKernels:
        self._caps.require_gemm(self.name, dtype)
        return ReferenceGemm(torch_dtype(dtype))

    def moe_kernels(self, spec: MoESpec) -> MoEKernels:
        self._caps.require_moe(self.name, spec)
        return ReferenceMoE(spec)

    def lora_kernels(self, spec: LoRASpec) -> LoRAKernels:
        return ReferenceLoRA(spec)


@hookimpl
def plinth_register_backends() -> Sequence[Backend]:
    """The reference backend registers itself like any plugin."""
    return [ReferenceBackend()]
