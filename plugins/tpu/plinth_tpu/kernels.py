"""The TPU backend's kernel objects: plinth's contract on top of the jax functions.

Each method takes torch tensors: :class:`~plinth_tpu.bridge.JaxTensor` inside a compiled step (the
jax function joins the trace), plain host tensors when called eagerly (the conformance suite; the
arrays cross by DLPack). Attention is the Pallas ragged kernel with the KV write fused
(:meth:`TpuAttention.write_and_attend`, API 1.5); GEMMs, norms, rotary and the activation are ``jax.numpy``
for XLA to fuse.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import jax.numpy as jnp
import torch
from jax import lax

from plinth.platform.backend import (
    AttentionKernels,
    AttentionMetadata,
    AttentionSpec,
    GemmKernels,
    KVCacheLayout,
    LinearWeight,
    SmallOps,
)
from plinth.platform.quant import QUANT_BLOCKS, QuantizedWeight
from plinth_tpu.bridge import is_traced, run_jax
from plinth_tpu.ragged_attention import ragged_paged_attention
from plinth_tpu.ragged_attention import write_kv as _write_kv
from plinth_tpu.spmd import active_mesh, per_device_attention

# -- attention -------------------------------------------------------------------------------------


def _attend(
    q: Any,
    k: Any,
    v: Any,
    cache: Any,
    slots: Any,
    tables: Any,
    seq_lens: Any,
    starts: Any,
    distribution: Any,
    **static: Any,
) -> tuple[Any, Any]:
    return ragged_paged_attention(
        q,
        k,
        v,
        cache,
        slots.astype(jnp.int32),
        tables.astype(jnp.int32),
        seq_lens.astype(jnp.int32),
        starts.astype(jnp.int32),
        distribution.astype(jnp.int32),
        **static,
    )


def _store(cache: Any, k: Any, v: Any, slots: Any) -> Any:
    return _write_kv(cache, k, v, slots.astype(jnp.int32))


class TpuAttention(AttentionKernels):
    """Ragged paged attention over the TPU layout (K/V interleaved, heads packed, lanes padded).

    :param interpret: run the Pallas kernel in Pallas' interpreter (any jax platform: the CPU here).
    """

    #: The jax function the kernels call, ``(q, k, v, cache, slots, tables, seq_lens, starts,
    #: distribution, **static) -> (out, cache)``: the Pallas kernel (a subclass may put another
    #: function of the same semantics here, as the benchmarks' plain-jnp variant does).
    attention_fn: ClassVar[Callable[..., tuple[Any, Any]]] = staticmethod(_attend)

    def __init__(self, spec: AttentionSpec, layout: KVCacheLayout, *, interpret: bool) -> None:
        super().__init__(spec, layout)
        self.interpret = interpret

    def _static(self, scale: float) -> dict[str, Any]:
        return {
            "scale": float(scale),
            "block_size": self.spec.block_size,
            "sliding_window": self.spec.sliding_window,
            "soft_cap": self.spec.logits_soft_cap,
            "interpret": self.interpret,
        }

    @staticmethod
    def _distribution(meta: AttentionMetadata) -> torch.Tensor:
        if meta.distribution is not None:
            return meta.distribution
        n = meta.num_seqs
        return torch.tensor([0, 0, n], dtype=torch.int32)  # every sequence general: always correct

    def write_and_attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One Pallas call writes the K/V and attends; returns the new cache (traced) or, eagerly,
        the same cache tensor with the new cache's contents copied in. Traced for a mesh (SPMD),
        every device runs the call on its own heads and cache slice."""
        mesh = active_mesh() if is_traced(kv_cache) else None
        out, cache = run_jax(
            self.attention_fn if mesh is None else per_device_attention(self.attention_fn, mesh),
            query,
            key,
            value,
            kv_cache,
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self._distribution(meta),
            **self._static(scale),
        )
        if is_traced(kv_cache):
            return out, cache
        kv_cache.copy_(cache)
        return out, kv_cache

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """The KV write alone, in place (eager callers: the cache tensor is a host tensor)."""
        if is_traced(kv_cache):
            raise TypeError("tpu: write_kv cannot update a traced cache in place; the model calls write_and_attend")
        kv_cache.copy_(run_jax(_store, kv_cache, key, value, slot_mapping))

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Attention over the cache as it is (the fused kernel with nothing to write)."""
        t, _h, d = query.shape
        empty = torch.zeros(t, self.spec.num_kv_heads, d, dtype=query.dtype)
        nowhere = torch.full((t,), -1, dtype=torch.int32)
        out, _ = run_jax(
            self.attention_fn,
            query,
            empty,
            empty,
            kv_cache,
            nowhere,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self._distribution(meta),
            **self._static(scale),
        )
        return out


# -- GEMM ------------------------------------------------------------------------------------------


def _dense(x: Any, w: Any, b: Any) -> Any:
    out = lax.dot_general(x.astype(w.dtype), w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if b is not None:
        out = out + b.astype(jnp.float32)
    return out.astype(x.dtype)


def _q8_0(x: Any, codes: Any, scales: Any, b: Any) -> Any:
    n, k = codes.shape
    w = (codes.reshape(n, k // 32, 32).astype(jnp.float32) * scales[:, :, None]).reshape(n, k)
    return _dense(x, w.astype(x.dtype), b)


class TpuGemm(GemmKernels):
    """Dense GEMMs accumulated in float32, and q8_0 weight-only int8 (codes and per-32 scales kept;
    dequantized inside the step, where XLA fuses it into the dot)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearWeight:
        return LinearWeight(
            out_features=weight.shape[0],
            in_features=weight.shape[1],
            weight=weight.to(self.dtype).contiguous(),
            bias=None if bias is None else bias.to(self.dtype).contiguous(),
        )

    def prepare_quantized(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> LinearWeight:
        if weight.format != "q8_0":
            return super().prepare_quantized(weight, bias)
        _, nbytes = QUANT_BLOCKS["q8_0"]
        blocks = weight.blocks.reshape(-1, nbytes)
        scales = blocks[:, :2].contiguous().view(torch.float16).float().reshape(weight.out_features, -1)
        codes = blocks[:, 2:].contiguous().view(torch.int8).reshape(weight.out_features, weight.in_features)
        return LinearWeight(
            out_features=weight.out_features,
            in_features=weight.in_features,
            weight=None,
            bias=None if bias is None else bias.to(self.dtype).contiguous(),
            format="q8_0",
            data={"codes": codes.contiguous(), "scales": scales.contiguous()},
        )

    def linear(self, x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
        if weight.format == "q8_0":
            return run_jax(_q8_0, x, weight.data["codes"], weight.data["scales"], weight.bias)
        return run_jax(_dense, x, weight.weight, weight.bias)


# -- small ops -------------------------------------------------------------------------------------


def _rms_norm(x: Any, w: Any, *, eps: float) -> Any:
    xf = x.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16) else x
    out = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (out * w.astype(out.dtype)).astype(x.dtype)


def _add_rms_norm(x: Any, r: Any, w: Any, *, eps: float) -> tuple[Any, Any]:
    s = x + r
    return _rms_norm(s, w, eps=eps), s


def _silu_and_mul(x: Any) -> Any:
    gate, up = jnp.split(x, 2, axis=-1)
    return (gate * jax_sigmoid(gate)) * up


def jax_sigmoid(x: Any) -> Any:
    """The logistic function in the input's dtype (as torch's silu computes it)."""
    return 1 / (1 + jnp.exp(-x))


def _rotary(x: Any, positions: Any, cos_sin: Any, *, rotary_dim: int) -> Any:
    cs = jnp.take(cos_sin, positions, axis=0)
    cos, sin = jnp.split(cs, 2, axis=-1)
    cos = cos[:, None, :].astype(x.dtype)
    sin = sin[:, None, :].astype(x.dtype)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = jnp.split(rot, 2, axis=-1)
    out = jnp.concatenate((x1 * cos - x2 * sin, x2 * cos + x1 * sin), axis=-1)
    return jnp.concatenate((out, rest), axis=-1) if rest.shape[-1] else out


class TpuSmallOps(SmallOps):
    """RMSNorm, the residual add, SwiGLU and rotary in ``jax.numpy``, computed as the defaults do."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return run_jax(_rms_norm, x, weight, eps=float(eps))

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, s = run_jax(_add_rms_norm, x, residual, weight, eps=float(eps))
        return normed, s

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return run_jax(_silu_and_mul, x)

    def rotary(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
        return run_jax(_rotary, x, positions, cos_sin, rotary_dim=int(rotary_dim))
