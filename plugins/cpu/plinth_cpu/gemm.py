"""GEMM for the CPU backend: dense fp32/bf16/fp16 weights and ggml q4_1/q8_0 blocks.

With the native kernels, fp32 weights are laid out once at load in 8-row panels
(``[ceil(N/8), K, 8]``, format ``"f32_panels"``, replacing the ``[N, K]`` tensor): one k of a
panel is one vector of 8 outputs' weights, so the register tiles need no horizontal sums and keep
a tile's weights in L1 across a decode batch (see ``csrc/kernels.c``). At batch 1 the kernel
streams the weights at close to read bandwidth (torch's M=1 GEMM reaches about a third of it
here), and batched it runs on the backend's own thread pool, which keeps going when a thread is
descheduled. Other dtypes, and fp32 without native kernels, stay ``[N, K]`` and use
``F.linear``. A row-major ``[K, N]`` right operand in bf16 is ~100x slower on AVX2 hosts, so the
weight is never pre-transposed.

Quantized weights keep their GGUF blocks (never dequantized at load). Few rows (decode): the
native kernel unpacks each block in registers and multiplies it with the activations rounded to
int16 per 32-block (``PLINTH_CPU_ACTIVATIONS``, default "int16"): exact integer products, and a
rounding at most 2^-16 of the block's largest activation, which kept SmolLM2-135M's log-probs
within 1.5e-3 nats of the dequantized fp32 model. Multiplying fp32 activations as given ("fp32")
is exact up to fp32 rounding but slower: AVX2 has to convert every weight to float, and that, not
memory, bounds the kernel. Many rows: each group of 3 weight rows is dequantized into a
cache-resident buffer and multiplied with the fp32 register tiles (fp32 activations); the
dequantization is then a small share of the work. Prefill-sized products dequantize the whole
weight into panels in a reused scratch buffer (at most a few MB per layer) and go through the
panel kernel. "int8" rounds activations to int8 per 32-block first on every path, as llama.cpp
does: logits off by the rounding (measured up to 0.3 nats on SmolLM2-135M, enough to flip
near-tied greedy choices).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from plinth.platform.backend import GemmKernels, LinearWeight
from plinth.platform.quant import QuantizedWeight
from plinth_cpu.native import QUANT_FORMATS, NativeKernels

#: ``LinearWeight.format`` of an fp32 weight laid out in 8-row panels for the native kernels.
PANELS = "f32_panels"
#: Activation handling for quantized weights at few rows: "int16" (default), "fp32" or "int8".
ACTIVATIONS_ENV = "PLINTH_CPU_ACTIVATIONS"
ACTIVATION_MODES = ("int16", "fp32", "int8")

#: Quantized products up to this many rows dequantize 3 weight rows at a time (per 32-row block of
#: activations); above, the whole weight is dequantized once into scratch.
DEQUANT_ROWS_MAX_ROWS = 64

#: Quantized products with at most this many rows use the per-block kernel.
NATIVE_QUANT_MAX_ROWS = 16


class CpuGemm(GemmKernels):
    """``x @ w.T + b`` in one compute dtype; ``native`` kernels where available (else torch only)."""

    def __init__(self, dtype: torch.dtype, native: NativeKernels | None = None, activations: str | None = None) -> None:
        self.dtype = dtype
        self.native = native
        if activations is None:
            activations = os.environ.get(ACTIVATIONS_ENV, "int16")
            where = f"{ACTIVATIONS_ENV}={activations!r}"
        else:
            where = f"activations={activations!r}"
        if activations not in ACTIVATION_MODES:
            raise ValueError(f"{where}: expected one of {', '.join(ACTIVATION_MODES)}")
        self.activations = activations
        self._scratch: torch.Tensor | None = None  # dequantized weight of a prefill-sized product

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearWeight:
        """Cast ``weight`` [N, K] (and ``bias`` [N]) to the compute dtype on the CPU; fp32 weights
        the native kernels take are laid out in panels (format ``"f32_panels"``)."""
        w = weight.to(device="cpu", dtype=self.dtype).contiguous()  # [N, K]
        b = None if bias is None else bias.to(device="cpu", dtype=self.dtype).contiguous()  # [N]
        n, k = w.shape
        if self.native is not None and self.dtype == torch.float32 and k % 8 == 0:
            panels = self.native.pack_f32(w)  # [ceil(N/8), K, 8]
            return LinearWeight(n, k, weight=None, bias=b, format=PANELS, data={"panels": panels})
        return LinearWeight(out_features=n, in_features=k, weight=w, bias=b)

    def prepare_quantized(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> LinearWeight:
        """Keep q4_1/q8_0 blocks as they are (the bias in fp32); other formats are dequantized."""
        if self.native is None or weight.format not in QUANT_FORMATS:
            return super().prepare_quantized(weight, bias)
        b = None if bias is None else bias.to(device="cpu", dtype=torch.float32).contiguous()
        return LinearWeight(
            out_features=weight.out_features,
            in_features=weight.in_features,
            weight=None,
            bias=b,
            format=weight.format,
            data={"blocks": weight.blocks.contiguous()},
        )

    def linear(self, x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
        """``x`` [M, K] -> [M, N]."""
        if weight.format == PANELS:
            return self._panels(x, weight.data["panels"], weight.bias, weight.out_features)
        if weight.format != "dense":
            return self._linear_quantized(x, weight)
        if weight.weight is None:
            raise ValueError(f"CpuGemm got a {weight.format!r} weight without a dense tensor")
        return F.linear(x, weight.weight, weight.bias)

    def _panels(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
        native = self.native
        if native is None:
            raise ValueError(f"CpuGemm got a {PANELS!r} weight but has no native kernels")
        xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
        y = native.gemm_f32_panels(xf, panels, bias, n)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def _linear_quantized(self, x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
        native = self.native
        if native is None:
            raise ValueError(f"CpuGemm got a {weight.format!r} weight but has no native kernels")
        xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
        blocks = weight.data["blocks"]
        n = weight.out_features
        m = x.shape[0]
        if m <= NATIVE_QUANT_MAX_ROWS:
            y = native.gemm_quant(weight.format, xf, blocks, weight.bias, n, activations=self.activations)
        else:  # fp32 activations, or int8 as in the few-row path
            if self.activations == "int8":
                xf = native.round_trip_q8(xf)
            if m <= DEQUANT_ROWS_MAX_ROWS:  # fp32 tiles on 3 rows dequantized at a time
                y = native.gemm_dequant(weight.format, xf, blocks, weight.bias, n)
            else:  # prefill-sized: the whole weight dequantized once into panels in scratch
                k = weight.in_features
                size = (n + 7) // 8 * 8 * k
                if self._scratch is None or self._scratch.numel() < size:
                    self._scratch = torch.empty(size, dtype=torch.float32)
                panels = native.dequant_panels(weight.format, blocks, n, k, self._scratch)
                y = native.gemm_f32_panels(xf, panels, weight.bias, n)
        return y if x.dtype == torch.float32 else y.to(x.dtype)
