"""An optional MLX kernel provider for the metal backend: attention and GEMM computed by MLX.

MLX is what vllm-metal and mlx-lm compute with; on a Mac its kernels run on the GPU, under
``mlx[cpu]`` on Linux they run on the CPU, which is how their numerics are checked here. The
provider is never required: :mod:`plinth_metal.plugin` offers it only when MLX is importable and
``PLINTH_METAL_MLX=1``; nothing in the backend imports this module otherwise.

What crosses between torch and MLX, and what it costs:

* GEMM: the weight crosses once, in ``prepare`` (held as an MLX array); each call copies the
  activations in and the output back.
* attention: the pages are gathered in torch by :class:`plinth_metal.attention.MetalAttention`
  (the engine's KV cache is a torch tensor, written in place by ``write_kv``); only the gathered
  run of each call crosses, and ``mx.fast.scaled_dot_product_attention`` (GQA without repeated K/V)
  or MLX's matmul/softmax (soft-cap) computes it. The crossing is a copy (through NumPy's buffer;
  16-bit floats as their bits, NumPy has no bfloat16): MLX cannot alias a torch buffer.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import numpy as np
import torch

from plinth.platform.backend import (
    AttentionKernels,
    AttentionSpec,
    GemmKernels,
    KernelProvider,
    KVCacheLayout,
    LinearWeight,
)
from plinth_metal.attention import AttendFn, MetalAttention

#: Set to 1 to have the metal backend's attention and GEMM computed by MLX (when it is installed).
MLX_ENV = "PLINTH_METAL_MLX"
MLX_PRIORITY = 10  # above the backend's own kernels (0): asked first when offered

_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


def mlx_available() -> bool:
    """True when ``mlx`` can be imported (``pip install 'plinth-metal[mlx]'``, or ``mlx[cpu]`` on Linux)."""
    return importlib.util.find_spec("mlx") is not None


def mlx_requested() -> bool:
    """True when ``PLINTH_METAL_MLX=1``: the one place the switch is read."""
    return os.environ.get(MLX_ENV, "") == "1"


def _mx() -> Any:
    import mlx.core as mx

    return mx


def mlx_dtype(dtype: torch.dtype) -> Any:
    """MLX's dtype of the same name as torch's ``dtype``."""
    return getattr(_mx(), str(dtype).removeprefix("torch."))


def to_mlx(t: torch.Tensor) -> Any:
    """A copy of ``t`` as an MLX array of the same dtype (16-bit floats crossing as their bits)."""
    mx = _mx()
    t = t.detach().contiguous().cpu()
    if t.dtype in _BITS:
        target = mx.bfloat16 if t.dtype == torch.bfloat16 else mx.float16
        return mx.array(t.view(_BITS[t.dtype]).numpy()).view(target)
    return mx.array(t.numpy())


def to_torch(a: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An MLX array back as a torch tensor of ``dtype`` on ``device``."""
    mx = _mx()
    if dtype in _BITS:
        return torch.from_numpy(np.array(a.view(mx.int16))).view(dtype).to(device)
    return torch.from_numpy(np.array(a)).to(device)


def mlx_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """``mx.fast.scaled_dot_product_attention`` on the gathered run (shapes as ``AttendFn``)."""
    mx = _mx()
    # 16-bit inputs computed in float32: MLX's CPU SDPA keeps the scores in the input dtype, which
    # failed 8 of the extended tier's large-value fp16/bf16 cases (scaled error up to 0.106 vs 0.020)
    qm, km, vm = (to_mlx(t).astype(mx.float32) for t in (q, k, v))
    out = mx.fast.scaled_dot_product_attention(qm, km, vm, scale=scale, mask=to_mlx(allowed))
    return to_torch(out.astype(mlx_dtype(q.dtype)), q.dtype, q.device)


def mlx_matmul_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float, soft_cap: float
) -> torch.Tensor:
    """Scores, soft-cap, mask, softmax (fp32) and values in MLX; GQA by grouping query heads."""
    mx = _mx()
    n, h, ql, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    qg = to_mlx(q).astype(mx.float32).reshape(n, hkv, g * ql, d)  # float32 throughout, as mlx_sdpa
    km, vm = to_mlx(k).astype(mx.float32), to_mlx(v).astype(mx.float32)
    scores = (qg @ km.transpose(0, 1, 3, 2)) * scale  # [N, Hkv, G*Q, S]
    scores = soft_cap * mx.tanh(scores / soft_cap)
    scores = mx.where(to_mlx(allowed)[:, :, None], scores.reshape(n, hkv, g, ql, -1), -mx.inf)
    probs = mx.softmax(scores, axis=-1).reshape(n, hkv, g * ql, -1)
    out = (probs @ vm).reshape(n, h, ql, d).astype(mlx_dtype(q.dtype))
    return to_torch(out, q.dtype, q.device)


class MlxAttention(MetalAttention):
    """The metal backend's gather and KV write (and its MPS workarounds), attention computed by MLX."""

    def _attend_fn(self) -> AttendFn:
        cap = self.spec.logits_soft_cap
        if cap is None:
            return mlx_sdpa
        return lambda q, k, v, allowed, scale: mlx_matmul_attend(q, k, v, allowed, scale, cap)


class MlxGemm(GemmKernels):
    """``x @ w.T + b`` by ``mx.matmul``; the weight crosses to MLX once, in ``prepare``."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearWeight:
        w = weight.to(self.dtype)
        data: dict[str, Any] = {"wt": to_mlx(w.t())}  # [in, out]: x @ wt
        if bias is not None:
            data["b"] = to_mlx(bias.to(self.dtype))
        return LinearWeight(out_features=w.shape[0], in_features=w.shape[1], weight=None, format="mlx", data=data)

    def linear(self, x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
        out = to_mlx(x.to(self.dtype)) @ weight.data["wt"]
        if "b" in weight.data:
            out = out + weight.data["b"]
        return to_torch(out, self.dtype, x.device)


class MlxProvider(KernelProvider):
    """MLX attention and GEMM for the ``metal`` backend, in the dtypes MLX and the backend share."""

    backend_name = "metal"
    name = "mlx"
    priority = MLX_PRIORITY
    api_version = (1, 5)

    DTYPES = frozenset({"float32", "float16", "bfloat16"})

    def attention_kernels(self, spec: AttentionSpec, layout: KVCacheLayout) -> AttentionKernels | None:
        if spec.dtype not in self.DTYPES or spec.kv_cache_dtype not in self.DTYPES or layout != KVCacheLayout():
            return None
        return MlxAttention(spec, layout)

    def gemm_kernels(self, dtype: str) -> GemmKernels | None:
        if dtype not in self.DTYPES:
            return None
        return MlxGemm(getattr(torch, dtype))
