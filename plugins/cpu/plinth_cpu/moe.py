"""The CPU backend's fused mixture-of-experts op: the step's tokens grouped by expert.

One ``forward`` routes (:func:`route_experts`), sorts the flattened ``[T * k]`` expert ids once
(a stable argsort: each expert's rows stay in token order) and walks the experts that got any
rows: one gate/up GEMM over the expert's whole group, the gated activation, one down GEMM, the
routing weight. Each expert's weights are therefore read once per step (a decode step with
T = 1 touches only its k experts), through the backend's own GEMM (:mod:`plinth_cpu.gemm`):
fp32 weights in the native 8-row panels, q4_1/q8_0 blocks kept as they are, other dtypes
``F.linear``. The groups' outputs, weighted, are copied to their slots of a token-major
``[T * k, H]`` buffer (every slot written exactly once) and summed over each token's k slots in slot order: no
scatter-add, so the result is the same bits on every call and at any thread count. A step of one
token (decode of a single sequence) skips the sort and runs its k experts in turn.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from plinth.platform.backend import (
    ExpertWeights,
    GemmKernels,
    LinearWeight,
    MoEKernels,
    MoESpec,
    SmallOps,
    route_experts,
)
from plinth.platform.quant import QuantizedWeight


def _check_quantized(spec: MoESpec, gate_up: Sequence[QuantizedWeight], down: Sequence[QuantizedWeight]) -> None:
    e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
    if len(gate_up) != e or len(down) != e:
        raise ValueError(f"{len(gate_up)} gate_up and {len(down)} down weights for {e} experts ({spec})")
    for n, (gu, d) in enumerate(zip(gate_up, down, strict=True)):
        got = [(w.format, w.out_features, w.in_features) for w in (gu, d)]
        want = [(spec.quant_format, 2 * i, h), (spec.quant_format, h, i)]
        if got != want:
            raise ValueError(f"expert {n}: (format, N, K) of gate_up / down {got}; expected {want} ({spec})")


class MoEScratch:
    """Work buffers kept between fused-MoE calls, grown as needed. One per backend, shared by every
    layer's op: layers run one after another, and each call's result is a fresh tensor."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """A ``[rows, cols]`` buffer (its contents are overwritten by the caller)."""
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < rows * cols:
            self._buffers.pop(name, None)  # freed before the larger one is allocated
            buf = self._buffers[name] = torch.empty(rows * cols, dtype=dtype)
        return buf[: rows * cols].view(rows, cols)


class CpuMoE(MoEKernels):
    """Grouped fused MoE over the backend's GEMM ``gemm`` (in ``spec.dtype``) and its ``ops``;
    ``scratch`` holds the work buffers (the backend passes one shared by all its MoE layers)."""

    def __init__(self, spec: MoESpec, gemm: GemmKernels, ops: SmallOps, scratch: MoEScratch | None = None) -> None:
        super().__init__(spec)
        self.gemm = gemm
        self.ops = ops
        self.scratch = scratch or MoEScratch()

    def prepare(self, gate_up: torch.Tensor, down: torch.Tensor) -> ExpertWeights:
        """Each expert's ``[2I, H]`` and ``[H, I]`` prepared by the GEMM (fp32: panels, and the dense
        stacks are dropped; other dtypes keep the stacks, the per-expert weights are views of them)."""
        self.check_experts(gate_up, down)
        first = self.gemm.prepare(gate_up[0], None)
        if first.format == "dense" and first.weight is not None:  # kept [N, K]: one stack, views per expert
            dtype = first.weight.dtype
            stack_gu = gate_up.to(device="cpu", dtype=dtype).contiguous()  # [E, 2I, H]
            stack_dn = down.to(device="cpu", dtype=dtype).contiguous()  # [E, H, I]
            gu = [LinearWeight(w.shape[0], w.shape[1], w) for w in stack_gu]
            dn = [LinearWeight(w.shape[0], w.shape[1], w) for w in stack_dn]
            return ExpertWeights(self.spec, stack_gu, stack_dn, "dense", {"gate_up": gu, "down": dn})
        gu = [first] + [self.gemm.prepare(gate_up[e], None) for e in range(1, self.spec.num_experts)]
        dn = [self.gemm.prepare(down[e], None) for e in range(self.spec.num_experts)]
        fmt = first.format
        return ExpertWeights(self.spec, None, None, fmt, {"gate_up": gu, "down": dn})

    def prepare_quantized(self, gate_up: Sequence[QuantizedWeight], down: Sequence[QuantizedWeight]) -> ExpertWeights:
        """Each expert's blocks as the GEMM keeps them (q4_1/q8_0: never dequantized; the AVX-512 build lays
        them out in its 16-row panels at load)."""
        _check_quantized(self.spec, gate_up, down)
        gu = [self.gemm.prepare_quantized(w, None) for w in gate_up]
        dn = [self.gemm.prepare_quantized(w, None) for w in down]
        return ExpertWeights(self.spec, None, None, gu[0].format, {"gate_up": gu, "down": dn})

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` of ``h`` [n, 2I] -> [n, I], in ``h``'s dtype."""
        if self.spec.activation == "silu":
            return self.ops.silu_and_mul(h)
        gate, up = h.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, weights: ExpertWeights) -> torch.Tensor:
        """``x`` [T, H], ``router_logits`` [T, E] -> [T, H] in ``x``'s dtype."""
        s = self.spec
        self.check_call(x, router_logits, weights)
        t, k = x.shape[0], s.top_k
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        route_w, route_ids = route_experts(router_logits, k, s.renormalize)  # [T, k] fp32, [T, k] int64
        gate_up: list[LinearWeight] = weights.data["gate_up"]
        down: list[LinearWeight] = weights.data["down"]
        if t == 1:  # one decode token: its k experts in turn; sorting and gathering cost ~15% here
            out = torch.zeros(1, s.hidden_size, dtype=acc)
            for w, e in zip(route_w[0].tolist(), route_ids[0].tolist(), strict=True):
                y = self.gemm.linear(self._activation(self.gemm.linear(x, gate_up[e])), down[e])  # [1, H]
                out.add_(y.to(acc), alpha=w)
            return out.to(x.dtype)
        flat_ids = route_ids.flatten()  # [T * k]
        order = torch.argsort(flat_ids, stable=True)  # slots grouped by expert, tokens in order
        counts = torch.bincount(flat_ids, minlength=s.num_experts).tolist()  # one sync for all groups
        # Two costs of this host shape the code. A torch op big enough to use torch's thread pool
        # costs a few ms whenever a pool thread is descheduled (a [256, 512] mul: 0.03 ms on one
        # thread, 4-8 ms on two at load ~3 on 2 cores), so the per-expert loop runs only the native
        # GEMMs and activation, and the gather, weighting and un-sorting are one op each around it
        # (64 groups of such ops: 1.9 s for E=64/k=8/T=2048). And a fresh buffer of 32 MB or more
        # is mmapped and faulted in page by page on every call (a [16384, 512] fp32 cat: 0.5 s),
        # so the [T * k, H] buffers are kept between calls.
        rows = t * k
        xs_all = self.scratch.get("rows", rows, s.hidden_size, x.dtype)  # [T * k, H], sorted by expert
        torch.index_select(x, 0, order // k, out=xs_all)  # each slot's token row
        ys: list[torch.Tensor] = []
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            h = self.gemm.linear(xs_all[start : start + n], gate_up[e])  # [n, 2I]: the whole group at once
            ys.append(self.gemm.linear(self._activation(h), down[e]))  # [n, H]
            start += n
        weighted = self.scratch.get("weighted", rows, s.hidden_size, acc)  # [T * k, H], sorted by expert
        torch.cat(ys, out=weighted)  # (cast to acc: bf16/fp16 GEMM outputs are summed in fp32)
        weighted.mul_(route_w.flatten()[order].to(acc)[:, None])  # each row's routing weight
        per_slot = self.scratch.get("slots", rows, s.hidden_size, acc)  # [T * k, H], token-major slots
        per_slot.index_copy_(0, order, weighted)  # each slot written once
        return per_slot.view(t, k, s.hidden_size).sum(dim=1).to(x.dtype)  # [T, H]
