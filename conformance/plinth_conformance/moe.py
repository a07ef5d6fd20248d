"""The fused-MoE cases' inputs and oracles (plugin API 1.8, suite 1.5).

Router logits are constructed, not drawn: each token's chosen experts (per the case's routing,
:data:`plinth_conformance.moe_cases.ROUTINGS`) get logits at least ``GAP`` above every other
expert's, so the top-k set is the same in fp32, fp64 and after rounding to bf16 (a backend may
softmax in its own order: a near tie would make "which expert" a coin toss, not a bug). The
golden result is the op computed in fp64 from the rounded inputs: fp64 softmax, top-k,
renormalised in fp64, each chosen expert's MLP in fp64. The reference op
(:class:`plinth.platform.reference.ReferenceMoE`) in the case's dtype calibrates the thresholds.

Quantized experts: a backend may round the activations entering each of the expert's two GEMMs
the way its quantized GEMM does (none, int16 or int8 per 32-block: the schemes of
:mod:`.quantized`), and it may choose per expert group (a group of 5 rows and one of 40 take
different kernel paths). The golden result is the expert chain without rounding; each slot's
allowance is the largest difference any known scheme makes to that expert's output
(:func:`quantized_gold`), plus one quantum on the activations that lie near a rounding
half-way point (the second GEMM's input carries the first GEMM's rounding, so "near" is as wide
as that error). A dropped expert or a wrong weight costs far more than any scheme.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from plinth.platform.backend import torch_dtype
from plinth.platform.quant import QuantizedWeight, dequantize
from plinth_conformance.moe_cases import MoECase
from plinth_conformance.quantized import (
    ACTIVATION_SCHEMES,
    minimums,
    random_weight,
    rounded_weight,
    scheme_operands,
    tie_allowance,
)

#: Logit margin between a token's weakest chosen expert and its strongest other one.
GAP = 0.3
#: A bound on |act'(g)| for both activations (silu: 1.0998, gelu_tanh: 1.1289).
ACT_SLOPE = 1.13


def chosen_experts(case: MoECase, gen: torch.Generator) -> torch.Tensor:
    """``[T, k]`` int64: the experts each token must be routed to (distinct per token)."""
    e, k, t = case.experts, case.top_k, case.tokens
    rows = []
    fixed = torch.randperm(e, generator=gen)[:k]
    half = max(e // 2, k)
    for i in range(t):
        if case.routing == "one-expert":
            rows.append(fixed)
            continue
        if case.routing == "idle-experts":
            rows.append(torch.randperm(half, generator=gen)[:k])
            continue
        perm = torch.randperm(e, generator=gen)
        if case.routing == "all-experts":
            first = i % e
        elif case.routing == "uneven":  # ~60% to expert 0, then a geometric tail
            u = float(torch.rand(1, generator=gen))
            first = 0 if u < 0.6 else min(int(math.log(1.0 - u) / math.log(0.5)), e - 1)
        else:
            rows.append(perm[:k])
            continue
        rest = perm[perm != first][: k - 1]
        rows.append(torch.cat((torch.tensor([first]), rest)))
    return torch.stack(rows) if rows else torch.zeros(0, k, dtype=torch.int64)


def router_logits(case: MoECase, gen: torch.Generator) -> torch.Tensor:
    """``[T, E]`` fp32 logits whose top-k set is :func:`chosen_experts`, with margin :data:`GAP`."""
    e, k, t = case.experts, case.top_k, case.tokens
    chosen = chosen_experts(case, gen)
    top = 3.0 - 0.5 * torch.arange(k, dtype=torch.float32)  # rank r's logit, before jitter
    logits = -4.0 + torch.rand(t, e, generator=gen) * (float(top[-1]) - GAP + 4.0)  # below every chosen
    picked = top[None, :] + 0.2 * torch.rand(t, k, generator=gen)
    logits.scatter_(1, chosen, picked)
    return logits


def guarded(x: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(view, buffer)``: ``x`` [R, C] as a view into a NaN-filled ``[R + 2, C + 8]`` buffer."""
    r, c = x.shape
    buf = torch.full((r + 2, c + 8), float("nan"), dtype=x.dtype, device=device)
    buf[1 : r + 1, 3 : c + 3] = x.to(device)
    return buf[1 : r + 1, 3 : c + 3], buf


def dense_experts(case: MoECase, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate_up`` [E, 2I, H] and ``down`` [E, H, I] in the case's dtype, values ~ 1 / sqrt(fan-in)."""
    dtype = torch_dtype(case.dtype)
    gate_up = torch.randn(case.experts, 2 * case.inter, case.hidden, generator=gen) / math.sqrt(case.hidden)
    down = torch.randn(case.experts, case.hidden, case.inter, generator=gen) / math.sqrt(case.inter)
    return gate_up.to(dtype), down.to(dtype)


def quantized_experts(case: MoECase, gen: torch.Generator) -> tuple[list[QuantizedWeight], list[QuantizedWeight]]:
    """Per expert one ``[2I, H]`` and one ``[H, I]`` random weight in the case's block format."""
    assert case.quant is not None
    gate_up = [random_weight(case.quant, 2 * case.inter, case.hidden, gen) for _ in range(case.experts)]
    down = [random_weight(case.quant, case.hidden, case.inter, gen) for _ in range(case.experts)]
    return gate_up, down


def gold_routing(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 softmax of ``logits`` [T, E], top-k (weights [T, k] fp64, ids [T, k]), renormalised in fp64."""
    probs = torch.softmax(logits.double(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def act_fp64(h: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(act(gate) * up, gate, up)`` of ``h`` [n, 2I] in fp64."""
    gate, up = h.chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return act * up, gate, up


def dense_gold(
    x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, case: MoECase
) -> torch.Tensor:
    """The op in fp64 from the rounded inputs: ``[T, H]``."""
    weights, ids = gold_routing(logits, case.top_k, case.renormalize)
    out = torch.zeros(x.shape[0], case.hidden, dtype=torch.float64)
    for e in torch.unique(ids).tolist():
        tokens, slot = torch.nonzero(ids == e, as_tuple=True)
        a, _, _ = act_fp64(x[tokens].double() @ gate_up[e].double().t(), case.activation)
        y = a @ down[e].double().t()
        out.index_add_(0, tokens, y * weights[tokens, slot][:, None])
    return out


def _chain(x: torch.Tensor, wgu: torch.Tensor, mgu: torch.Tensor, wd: torch.Tensor, md: torch.Tensor,
           activation: str, scheme: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """One expert under ``scheme``: (y [n, H], a [n, I], gate, up), fp64."""
    h = torch.zeros(x.shape[0], wgu.shape[0], dtype=torch.float64)
    for xs, ws in scheme_operands(x, wgu, mgu, scheme):
        h = h + xs.double() @ ws.double().t()
    a, gate, up = act_fp64(h, activation)
    y = torch.zeros(x.shape[0], wd.shape[0], dtype=torch.float64)
    for xs, ws in scheme_operands(a.float(), wd, md, scheme):
        y = y + xs.double() @ ws.double().t()
    return y, a, gate, up


def _near_half(a: torch.Tensor, w: torch.Tensor, scheme: str, window: torch.Tensor) -> torch.Tensor:
    """``[n, N]``: one quantum ``d * |w|`` for each activation ``a`` whose ``a / d`` lies within
    ``window / d`` (``window`` [n, K]: an absolute error bound of ``a``) of a half-way point."""
    levels = ACTIVATION_SCHEMES[scheme][0]
    n, k = a.shape
    blocks = a.reshape(n, k // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / levels  # [n, K/32, 1]
    safe = torch.where(d > 0, d, 1.0)
    t = blocks / safe
    frac = (t.abs() - t.abs().floor() - 0.5).abs()
    near = (frac <= window.reshape(n, k // 32, 32) / safe) & (d > 0)
    if ACTIVATION_SCHEMES[scheme][1]:
        d = d.to(torch.float16).double()
    return (near.double() * d).reshape(n, k) @ w.double().abs().t()


def quantized_gold(
    x: torch.Tensor,
    logits: torch.Tensor,
    gate_up: list[QuantizedWeight],
    down: list[QuantizedWeight],
    case: MoECase,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gold, allowance)`` [T, H] fp64: the chain without rounding, and per element the weighted
    sum over the token's experts of the largest difference a known rounding scheme makes."""
    weights, ids = gold_routing(logits, case.top_k, case.renormalize)
    gold = torch.zeros(x.shape[0], case.hidden, dtype=torch.float64)
    allowance = torch.zeros_like(gold)
    eps = float(torch.finfo(torch_dtype(case.dtype)).eps)
    # how far the backend's second-GEMM input may be from the fp64 one (the first GEMM's rounding)
    rel = 4.0 * eps + 8.0 * math.sqrt(case.hidden) * float(torch.finfo(torch.float32).eps)
    for e in torch.unique(ids).tolist():
        tokens, slot = torch.nonzero(ids == e, as_tuple=True)
        xs = x[tokens].float()
        wgu, wd = dequantize(gate_up[e]), dequantize(down[e])
        mgu, md = minimums(gate_up[e]), minimums(down[e])
        y_none, _, _, _ = _chain(xs, wgu, mgu, wd, md, case.activation, "none")
        worst = torch.zeros_like(y_none)
        for scheme in ACTIVATION_SCHEMES:
            if scheme == "none":
                continue
            y, a, gate, up = _chain(xs, wgu, mgu, wd, md, case.activation, scheme)
            tie_h = tie_allowance(xs, rounded_weight(wgu, mgu, scheme), scheme)  # [n, 2I]: first rounding's ties
            tie_g, tie_u = tie_h.chunk(2, dim=-1)
            act_g = (F.silu(gate) if case.activation == "silu" else F.gelu(gate, approximate="tanh")).abs()
            tie_a = ACT_SLOPE * up.abs() * tie_g + act_g * tie_u  # [n, I], first order
            window = rel * (a.abs() + a.pow(2).mean(-1, keepdim=True).sqrt()) + tie_a
            near = _near_half(a, rounded_weight(wd, md, scheme), scheme, window)  # the second rounding's ties
            w_round = rounded_weight(wd, md, scheme)  # what the rounded a multiplies; the rest takes a's sum
            spread = tie_a @ (w_round.double().abs() + (wd - w_round).double().abs()).t()  # tie_a through down
            worst = torch.maximum(worst, (y - y_none).abs() + spread + near)
        w = weights[tokens, slot][:, None]
        gold.index_add_(0, tokens, y_none * w)
        allowance.index_add_(0, tokens, worst * w)
    return gold, allowance
