"""Deliberately broken backends: the conformance suite must fail each of them, for the right reason.

Each is the reference backend with one realistic bug. The tests copy this file next to a fake
``dist-info`` on ``sys.path`` so the plugin host discovers them by entry point, exactly like an
installed plugin (see ``fake_broken_dist`` in test_broken_backends.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from plinth.hookspecs import hookimpl
from plinth.platform.backend import (
    AttentionKernels,
    AttentionMetadata,
    AttentionSpec,
    Backend,
    Capabilities,
    ExpertWeights,
    GemmKernels,
    KVCacheLayout,
    LinearWeight,
    MoECapabilities,
    MoEKernels,
    MoESpec,
    NotSupported,
    SmallOps,
    route_experts,
)
from plinth.platform.quant import QUANT_BLOCKS, QuantizedWeight, dequantize, dequantize_blocks
from plinth.platform.reference import (
    ReferenceAttention,
    ReferenceBackend,
    ReferenceGemm,
    ReferenceMoE,
    gated_activation,
)


def _full_block_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, read_whole_pages: bool
) -> torch.Tensor:
    """Attention with a page-loop bug: either only whole pages are read (the last partial page is
    ignored) or whole pages are read without masking past the sequence's end."""
    out = torch.zeros_like(query)
    block = kv_cache.shape[2]
    group = query.shape[1] // kv_cache.shape[3]
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens_host):
        q_len = starts[i + 1] - starts[i]
        pages = math.ceil(seq_len / block) if read_whole_pages else seq_len // block  # the bug
        if pages == 0:
            continue
        table = meta.block_tables[i, :pages].long()
        k = kv_cache[0, table].flatten(0, 1).repeat_interleave(group, dim=1)  # [pages*B, H, D]
        v = kv_cache[1, table].flatten(0, 1).repeat_interleave(group, dim=1)
        q = query[starts[i] : starts[i + 1]]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(k.shape[0])[None, :]
        # causal masking is right; it cannot help: 0 * NaN is NaN when a read past the end is summed
        probs = torch.softmax(scores.masked_fill(k_pos > q_pos, float("-inf")), dim=-1)
        out[starts[i] : starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


class _IgnoresPartialBlock(ReferenceAttention):
    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float):  # noqa: ANN201
        return _full_block_attention(query, kv_cache, meta, scale, read_whole_pages=False)


class _ReadsPastEnd(ReferenceAttention):
    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float):  # noqa: ANN201
        return _full_block_attention(query, kv_cache, meta, scale, read_whole_pages=True)


class _IgnoresPaddingSlot(ReferenceAttention):
    def write_kv(self, key, value, kv_cache, slot_mapping) -> None:  # noqa: ANN001
        block = kv_cache.shape[2]
        slots = slot_mapping.long()  # the bug: -1 becomes page -1, offset block-1 (the last slot)
        kv_cache[0, slots // block, slots % block] = key
        kv_cache[1, slots // block, slots % block] = value


class _WrongScaleFor80(ReferenceAttention):
    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float):  # noqa: ANN201
        if self.spec.head_size == 80:
            scale = 1.0 / 8.0  # the bug: a kernel specialised for 64 reused for 80
        return super().forward(query, kv_cache, meta, scale)


class _DropsKTail(ReferenceGemm):
    def linear(self, x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
        assert weight.weight is not None
        k = x.shape[1] // 64 * 64  # the bug: a 64-wide K loop without the remainder
        out = torch.matmul(x[:, :k], weight.weight[:, :k].t())
        return out if weight.bias is None else out + weight.bias


class _StoredBf16ComputedInBf16(ReferenceGemm):
    """Takes bf16 weights as stored (plugin API 1.14) and then multiplies in bf16: the bug is the
    activations rounded to the weight's dtype, where the model's fp32 product was due."""

    stored_dtypes = frozenset({torch.bfloat16})

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearWeight:
        if weight.dtype != torch.bfloat16:
            return super().prepare(weight, bias)
        return LinearWeight(weight.shape[0], weight.shape[1], weight.contiguous(), bias)

    def linear(self, x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
        assert weight.weight is not None
        w = weight.weight
        bias = None if weight.bias is None else weight.bias.to(w.dtype)
        return F.linear(x.to(w.dtype), w, bias).to(x.dtype)


class _BlockGemm(ReferenceGemm):
    """Keeps q4_1/q8_0 blocks as they are; ``linear`` decodes them with ``values`` and multiplies
    ``activations(x)`` in fp32. As is, a correct (if slow) native-format GEMM."""

    def prepare_quantized(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> LinearWeight:
        b = None if bias is None else bias.to(self.dtype)
        return LinearWeight(weight.out_features, weight.in_features, None, b, weight.format, {"blocks": weight.blocks})

    def values(self, fmt: str, blocks: torch.Tensor) -> torch.Tensor:
        """Blocks [n_blocks, bytes] -> fp32 weights [n_blocks, 32]."""
        return dequantize_blocks(fmt, blocks)

    def activations(self, x: torch.Tensor) -> torch.Tensor:
        """What the kernel multiplies in place of ``x`` (fp32)."""
        return x.float()

    def linear(self, x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
        if weight.format == "dense":
            return super().linear(x, weight)
        _, nbytes = QUANT_BLOCKS[weight.format]
        w = self.values(weight.format, weight.data["blocks"].reshape(-1, nbytes))
        w = w.reshape(weight.out_features, weight.in_features)
        bias = None if weight.bias is None else weight.bias.float()
        return F.linear(self.activations(x), w, bias).to(x.dtype)


class _RoundsActivations(_BlockGemm):
    """Correct: activations rounded to int8 per 32-block with scale amax / 127, as llama.cpp does."""

    def activations(self, x: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        xb = x.float().reshape(m, k // 32, 32)
        d = xb.abs().amax(-1, keepdim=True) / 127.0
        q = torch.where(d > 0, xb / d, torch.zeros_like(xb)).round()
        return (q * d).reshape(m, k)


class _IgnoresQ41Min(_BlockGemm):
    def values(self, fmt: str, blocks: torch.Tensor) -> torch.Tensor:
        if fmt != "q4_1":
            return super().values(fmt, blocks)
        qs = blocks[:, 4:]
        d = blocks[:, :2].contiguous().view(torch.float16).float()
        return d * torch.cat((qs & 0x0F, qs >> 4), dim=1).float()  # the bug: "+ m" forgotten


class _SwapsNibbles(_BlockGemm):
    def values(self, fmt: str, blocks: torch.Tensor) -> torch.Tensor:
        if fmt != "q4_1":
            return super().values(fmt, blocks)
        swapped = blocks.clone()
        swapped[:, 4:] = (blocks[:, 4:] >> 4) | (blocks[:, 4:] << 4)  # the bug: high nibbles read as weights 0-15
        return super().values(fmt, swapped)


class _StaleResidualOps(SmallOps):
    def add_rms_norm(self, x, residual, weight, eps):  # noqa: ANN001, ANN201
        s = x + residual
        return self.rms_norm(s, weight, eps), residual  # the bug: the old residual returned as the sum


def _round_int8(x: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] rounded to int8 per 32-block with scale amax / 127 (llama.cpp's activations)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // 32, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127.0
    q = torch.where(d > 0, xb / d, torch.zeros_like(xb)).round()
    return (q * d).reshape(m, k)


class _GroupedMoE(ReferenceMoE):
    """The reference op written as a backend would: routed, then expert by expert over its tokens;
    quantized experts keep their blocks. The hooks are where the bugs go."""

    def prepare_quantized(self, gate_up: Sequence[QuantizedWeight], down: Sequence[QuantizedWeight]) -> ExpertWeights:
        return ExpertWeights(self.spec, None, None, self.spec.quant_format or "dense", {"q": (gate_up, down)})

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route_experts(logits, self.spec.top_k, self.spec.renormalize)

    def experts(self) -> range:
        return range(self.spec.num_experts)

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def activations(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()

    def _expert(self, weights: ExpertWeights, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        if "q" not in weights.data:
            assert weights.gate_up is not None and weights.down is not None
            return weights.gate_up[e].float(), weights.down[e].float()
        gate_up, down = weights.data["q"]
        return dequantize(gate_up[e]), dequantize(down[e])

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, weights: ExpertWeights) -> torch.Tensor:
        x = self.inputs(x)
        route_w, ids = self.route(router_logits)
        out = torch.zeros(x.shape[0], self.spec.hidden_size)
        for e in self.experts():
            tokens, slot = torch.nonzero(ids == e, as_tuple=True)
            if tokens.numel() == 0:
                continue
            w_gate_up, w_down = self._expert(weights, e)
            h = gated_activation(self.activations(x[tokens]) @ w_gate_up.t(), self.spec.activation)
            out.index_add_(0, tokens, (self.activations(h) @ w_down.t()) * route_w[tokens, slot][:, None])
        return out.to(x.dtype)


class _MoEAlwaysRenormalizes(_GroupedMoE):
    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route_experts(logits, self.spec.top_k, True)  # the bug: the spec's flag ignored


class _MoEDropsLastExpert(_GroupedMoE):
    def experts(self) -> range:
        return range(self.spec.num_experts - 1)  # the bug: an off-by-one in the group loop


class _MoEAssumesContiguous(_GroupedMoE):
    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        return x.as_strided(x.shape, (x.shape[1], 1))  # the bug: rows read as if densely packed


class _MoERoundsActivations(_GroupedMoE):
    """Correct: both GEMMs of a quantized expert take int8-rounded activations, as llama.cpp's do."""

    def activations(self, x: torch.Tensor) -> torch.Tensor:
        return _round_int8(x) if self.spec.quant_format is not None else x.float()


class _Broken(ReferenceBackend):
    """The reference backend with a bug; ``attention_cls`` / ``gemm_cls`` swap one kernel."""

    attention_cls: type[AttentionKernels] = ReferenceAttention
    gemm_cls: type[GemmKernels] = ReferenceGemm

    def __init__(self) -> None:
        super().__init__()
        self._caps = self.declare()

    def declare(self) -> Capabilities:
        """A realistic declaration: fp32, model head sizes, block 16 (so broken cases run fast)."""
        return Capabilities(
            dtypes=frozenset({"float32"}),
            kv_cache_dtypes=frozenset({"float32"}),
            head_sizes=frozenset({64, 128}),
            block_sizes=(16,),
            kv_cache_layout=KVCacheLayout(),
        )

    def attention_kernels(self, spec: AttentionSpec) -> AttentionKernels:
        reasons = self._caps.unsupported(spec)
        if reasons:
            raise NotSupported(self.name, "attention", reasons)
        return self.attention_cls(spec, self._caps.kv_cache_layout)

    def gemm_kernels(self, dtype: str) -> GemmKernels:
        if dtype not in self._caps.dtypes:
            raise NotSupported(self.name, f"GEMM in {dtype}", "fp32 only")
        return self.gemm_cls(torch.float32)


class PartialBlockBackend(_Broken):
    name = "broken_partial_block"
    attention_cls = _IgnoresPartialBlock


class ReadsPastEndBackend(_Broken):
    name = "broken_reads_past_end"
    attention_cls = _ReadsPastEnd


class KTailBackend(_Broken):
    name = "broken_k_tail"
    gemm_cls = _DropsKTail


class PaddingSlotBackend(_Broken):
    name = "broken_padding_slot"
    attention_cls = _IgnoresPaddingSlot


class LiesAbout80Backend(_Broken):
    """Declares head size 80 and computes it wrong."""

    name = "broken_lies_80"
    attention_cls = _WrongScaleFor80

    def declare(self) -> Capabilities:
        caps = super().declare()
        return Capabilities(**{**_fields(caps), "head_sizes": frozenset({64, 80, 128})})


class Raises80Backend(_Broken):
    """Declares head size 80, then raises a ValueError for it."""

    name = "broken_raises_80"

    def declare(self) -> Capabilities:
        return Capabilities(**{**_fields(super().declare()), "head_sizes": frozenset({64, 80, 128})})

    def attention_kernels(self, spec: AttentionSpec) -> AttentionKernels:
        if spec.head_size == 80:
            raise ValueError("head size 80 is not implemented")
        return super().attention_kernels(spec)


class AcceptsAnythingBackend(_Broken):
    """Never raises NotSupported: undeclared cases return (reference) numbers."""

    name = "broken_accepts_anything"

    def attention_kernels(self, spec: AttentionSpec) -> AttentionKernels:
        return ReferenceAttention(spec, self._caps.kv_cache_layout)

    def gemm_kernels(self, dtype: str) -> GemmKernels:
        return ReferenceGemm({"float64": torch.float64}.get(dtype, torch.float32))


class _Quantized(_Broken):
    """Declares q4_1 and q8_0 (plugin API 1.1) on top of the fp32 profile."""

    api_version = (1, 1)

    def declare(self) -> Capabilities:
        return Capabilities(**{**_fields(super().declare()), "quant_formats": frozenset({"q4_1", "q8_0"})})


class QuantOkBackend(_Quantized):
    """Correct: keeps the blocks, dequantizes them in ``linear`` and multiplies with F.linear."""

    name = "quant_ok"
    gemm_cls = _BlockGemm


class QuantRoundsActivationsBackend(_Quantized):
    """Correct: rounds activations to int8 per 32-block like llama.cpp (inside the allowance)."""

    name = "quant_rounds_activations"
    gemm_cls = _RoundsActivations


class QuantIgnoresMinBackend(_Quantized):
    name = "broken_q4_1_min"
    gemm_cls = _IgnoresQ41Min


class QuantSwapsNibblesBackend(_Quantized):
    name = "broken_nibble_order"
    gemm_cls = _SwapsNibbles


class StaleResidualBackend(_Broken):
    """``add_rms_norm`` normalises the right sum but returns the old residual as the sum."""

    name = "broken_stale_residual"

    def small_ops(self) -> SmallOps:
        return _StaleResidualOps()


class _HeadsOps(SmallOps):
    def rms_norm_heads(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        t, h, d = x.shape
        dense = torch.as_strided(x, (t, h, d), (h * d, d, 1))  # the bug: tokens taken as H * D apart
        return self.rms_norm(dense.reshape(t * h, d), weight, eps).view(t, h, d)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate) * up  # the bug: the erf GELU, not Gemma's tanh form


class HeadsStrideBackend(_Broken):
    """``rms_norm_heads`` ignores the token stride of a fused-QKV view; ``gelu_tanh_and_mul`` is the
    erf GELU (at most ~1e-3 off the tanh form)."""

    name = "broken_heads_stride"
    api_version = (1, 8)

    def small_ops(self) -> SmallOps:
        return _HeadsOps()


class _MoE(_Broken):
    """Declares the fused-MoE op (plugin API 1.8) in fp32, both activations, q4_1 and q8_0 experts."""

    api_version = (1, 8)
    moe_cls: type[MoEKernels] = _GroupedMoE

    def declare(self) -> Capabilities:
        moe = MoECapabilities(
            dtypes=frozenset({"float32"}),
            quant_formats=frozenset({"q4_1", "q8_0"}),
            activations=frozenset({"silu", "gelu_tanh"}),
        )
        return Capabilities(**{**_fields(super().declare()), "fused_moe": moe})

    def moe_kernels(self, spec: MoESpec) -> MoEKernels:
        self._caps.require_moe(self.name, spec)
        return self.moe_cls(spec)


class MoEOkBackend(_MoE):
    """Correct: the grouped reference op, quantized experts dequantized per call."""

    name = "moe_ok"


class MoERoundsActivationsBackend(_MoE):
    name = "moe_rounds_activations"
    moe_cls = _MoERoundsActivations


class MoEAlwaysRenormalizesBackend(_MoE):
    name = "broken_moe_renormalize"
    moe_cls = _MoEAlwaysRenormalizes


class MoEDropsLastExpertBackend(_MoE):
    name = "broken_moe_drops_expert"
    moe_cls = _MoEDropsLastExpert


class MoEAssumesContiguousBackend(_MoE):
    name = "broken_moe_contiguous"
    moe_cls = _MoEAssumesContiguous


class MoEAcceptsAnythingBackend(_MoE):
    """Declares fp32 only, but hands out the op for any spec."""

    name = "broken_moe_accepts_anything"

    def moe_kernels(self, spec: MoESpec) -> MoEKernels:
        return ReferenceMoE(spec)


class DeclaresNothingBackend(_Broken):
    """Declares no capability at all: the mandatory profile must make it fail."""

    name = "broken_declares_nothing"

    def declare(self) -> Capabilities:
        return Capabilities(frozenset(), frozenset(), frozenset(), ())


class StoredBf16InBf16Backend(_Broken):
    """Lists bf16 in its fp32 GEMM's stored_dtypes (API 1.14) and computes such weights in bf16."""

    name = "broken_stored_bf16_in_bf16"
    gemm_cls = _StoredBf16ComputedInBf16


class SpmdWithoutStepsBackend(_Broken):
    """Declares SPMD tensor parallelism (API 1.12) but compiles no static-shape steps."""

    name = "broken_spmd_without_steps"

    def declare(self) -> Capabilities:
        return Capabilities(**{**_fields(super().declare()), "spmd": True})


class OneDeviceForEveryRankBackend(_Broken):
    """Declares a device per rank for Ray (API 1.13) but maps every rank to its one device."""

    name = "broken_one_device_for_every_rank"

    def declare(self) -> Capabilities:
        return Capabilities(**{**_fields(super().declare()), "device_resource": "GPU"})


def _fields(caps: Capabilities) -> dict[str, object]:
    return {name: getattr(caps, name) for name in Capabilities.__dataclass_fields__}


class _Plugin:
    """A plugin object registering one backend class (one entry point per broken backend)."""

    def __init__(self, cls: type[Backend]) -> None:
        self.cls = cls

    @hookimpl
    def plinth_register_backends(self) -> Sequence[Backend]:
        return [self.cls()]


BROKEN: dict[str, type[_Broken]] = {
    cls.name: cls
    for cls in (
        PartialBlockBackend,
        ReadsPastEndBackend,
        KTailBackend,
        PaddingSlotBackend,
        LiesAbout80Backend,
        Raises80Backend,
        AcceptsAnythingBackend,
        DeclaresNothingBackend,
        SpmdWithoutStepsBackend,
        OneDeviceForEveryRankBackend,
        StoredBf16InBf16Backend,
        QuantOkBackend,
        QuantRoundsActivationsBackend,
        QuantIgnoresMinBackend,
        QuantSwapsNibblesBackend,
        StaleResidualBackend,
        HeadsStrideBackend,
        MoEOkBackend,
        MoERoundsActivationsBackend,
        MoEAlwaysRenormalizesBackend,
        MoEDropsLastExpertBackend,
        MoEAssumesContiguousBackend,
        MoEAcceptsAnythingBackend,
    )
}
PLUGINS = {name: _Plugin(cls) for name, cls in BROKEN.items()}
partial_block = PLUGINS["broken_partial_block"]
reads_past_end = PLUGINS["broken_reads_past_end"]
k_tail = PLUGINS["broken_k_tail"]
padding_slot = PLUGINS["broken_padding_slot"]
lies_80 = PLUGINS["broken_lies_80"]
raises_80 = PLUGINS["broken_raises_80"]
accepts_anything = PLUGINS["broken_accepts_anything"]
declares_nothing = PLUGINS["broken_declares_nothing"]
spmd_without_steps = PLUGINS["broken_spmd_without_steps"]
one_device_for_every_rank = PLUGINS["broken_one_device_for_every_rank"]
stored_bf16_in_bf16 = PLUGINS["broken_stored_bf16_in_bf16"]
quant_ok = PLUGINS["quant_ok"]
quant_rounds_activations = PLUGINS["quant_rounds_activations"]
q4_1_min = PLUGINS["broken_q4_1_min"]
nibble_order = PLUGINS["broken_nibble_order"]
stale_residual = PLUGINS["broken_stale_residual"]
heads_stride = PLUGINS["broken_heads_stride"]
moe_ok = PLUGINS["moe_ok"]
moe_rounds_activations = PLUGINS["moe_rounds_activations"]
moe_renormalize = PLUGINS["broken_moe_renormalize"]
moe_drops_expert = PLUGINS["broken_moe_drops_expert"]
moe_contiguous = PLUGINS["broken_moe_contiguous"]
moe_accepts_anything = PLUGINS["broken_moe_accepts_anything"]
