"""The kernel objects the step loop calls (attention, GEMM, small ops), launching the Triton kernels.

Kernel modules import triton, so they are imported here lazily, when a kernel object is built
(after a backend was selected), never when a plugin is loaded.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar

import torch

from plinth.platform.backend import (
    AttentionKernels,
    AttentionMetadata,
    AttentionSpec,
    ExpertWeights,
    GemmKernels,
    KVCacheLayout,
    LinearWeight,
    MoEKernels,
    MoESpec,
    SmallOps,
    route_experts,
    torch_dtype,
)
from plinth_triton.configs import AttentionConfig, attention_config, gemm_config, moe_config
from plinth_triton.quant import QUANT_CODES

#: Activation dtypes the Triton kernels take; anything else (fp64) goes to the torch defaults.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernels(name: str) -> ModuleType:
    """``plinth_triton.kernels.<name>``, imported on first use (it imports triton)."""
    return importlib.import_module(f"plinth_triton.kernels.{name}")


@dataclass(frozen=True, slots=True)
class KernelTarget:
    """Where kernels launch on a GPU: an architecture key of the config tables, and how.

    ``amd``: pass AMD-only launch options (``waves_per_eu``) from the tables. Interpreter runs get an
    :class:`InterpreterTarget` instead, chosen once by the backend, so no kernel asks which it has.
    """

    arch: str
    amd: bool = False

    #: Upcast bf16/fp16 operands to fp32 before ``tl.dot`` (the interpreter's bug, not a GPU's).
    upcast: ClassVar[bool] = False
    #: Tokens per program of the KV write.
    write_kv_block_t: ClassVar[int] = 4
    #: Rows per program of RMSNorm: a GPU pays per row.
    rows_per_program: ClassVar[int] = 1

    def launch(self, num_warps: int, num_stages: int, extra: dict[str, int] | None = None) -> dict[str, int]:
        """Launch options for one kernel call."""
        options = {"num_warps": num_warps, "num_stages": num_stages}
        if self.amd and extra:
            options.update(extra)
        return options

    def gemm_tiles(self, block_n: int, block_k: int, n: int, k: int) -> tuple[int, int]:
        """The GEMM's ``(block_n, block_k)`` for an ``[n, k]`` weight: the config table's on a GPU."""
        return block_n, block_k

    def attention(self) -> AttentionConfig:
        """The attention tiles for this target."""
        return attention_config(self.arch)


@dataclass(frozen=True, slots=True)
class InterpreterTarget(KernelTarget):
    """Triton's interpreter on CPU tensors: one config, dots upcast to fp32, no launch options."""

    arch: str = "interpreter"

    upcast: ClassVar[bool] = True
    write_kv_block_t: ClassVar[int] = 16
    rows_per_program: ClassVar[int] = 16  # the interpreter pays per program

    def launch(self, num_warps: int, num_stages: int, extra: dict[str, int] | None = None) -> dict[str, int]:
        """None: the interpreter ignores launch options."""
        return {}

    def gemm_tiles(self, block_n: int, block_k: int, n: int, k: int) -> tuple[int, int]:
        """The table's tiles are wide (see configs): never wider than the matrix here."""
        return min(block_n, max(16, 1 << (n - 1).bit_length())), min(block_k, max(16, 1 << (k - 1).bit_length()))


class TritonAttention(AttentionKernels):
    """KV write and unified paged attention over the default cache layout ``[2, NB, bs, Hkv, D]``."""

    def __init__(self, spec: AttentionSpec, layout: KVCacheLayout, target: KernelTarget) -> None:
        if layout.dims != KVCacheLayout().dims:
            raise ValueError(f"TritonAttention reads the layout {KVCacheLayout().dims}, got {layout.dims}")
        super().__init__(spec, layout)
        self.target = target
        self.config = target.attention()
        self._attention = _kernels("attention")
        self._kv_cache = _kernels("kv_cache")

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store ``key``/``value`` ([T, Hkv, D]) at ``slot_mapping`` ([T]); slots < 0 are skipped."""
        self._kv_cache.write_kv(
            key,
            value,
            kv_cache[0],
            kv_cache[1],
            slot_mapping,
            block_t=self.target.write_kv_block_t,
            launch=self.target.launch(4, 1),
        )

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Paged attention: ``query`` [T, H, D] -> [T, H, D]; tokens past the batch's get zeros.

        Assumes ``query_start_loc[0] == 0`` (as the runner builds it), so the grid is sized from
        the host lengths without reading device memory.
        """
        num_tokens = sum(meta.query_lens_host)
        if query.stride(-1) != 1:
            query = query.contiguous()
        if num_tokens < query.shape[0]:
            out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
        else:
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if num_tokens == 0:
            return out
        cfg = self.config
        decode_only = max(meta.query_lens_host) == 1
        split = decode_only and max(meta.seq_lens_host) >= cfg.split_kv_min_len
        self._attention.unified_attention(
            query,
            kv_cache[0],
            kv_cache[1],
            out,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            num_tokens,
            scale,
            sliding_window=self.spec.sliding_window,
            soft_cap=self.spec.logits_soft_cap,
            block_m=cfg.decode_block_m if decode_only else cfg.block_m,  # a decode has 1 token: fewer rows
            tile_n=cfg.tile_n,
            num_segments=cfg.num_segments if split else 1,
            upcast=self.target.upcast,
            launch=self.target.launch(cfg.num_warps, cfg.num_stages, cfg.extra),
        )
        return out


class TritonGemm(GemmKernels):
    """``x @ w.T + b`` with the Triton GEMM; dense weights, or int8/int4 weight-only (see ``quant``)."""

    def __init__(self, dtype: torch.dtype, device: torch.device, target: KernelTarget) -> None:
        self.dtype = dtype
        self.device = device
        self.target = target
        self._gemm = _kernels("gemm")

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearWeight:
        """Cast ``weight`` [N, K] (and ``bias`` [N]) to the compute dtype on the device, contiguous."""
        w = weight.to(device=self.device, dtype=self.dtype).contiguous()  # [N, K], read transposed
        b = None if bias is None else bias.to(device=self.device, dtype=self.dtype).contiguous()
        return LinearWeight(out_features=w.shape[0], in_features=w.shape[1], weight=w, bias=b)

    def prepare_quantized(
        self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, group_size: int = 32
    ) -> LinearWeight:
        """Quantize ``weight`` [N, K] to ``fmt`` ("int8": per channel, "int4": per ``group_size``)."""
        from plinth_triton.quant import quantize

        q = quantize(weight.to(self.device), fmt, group_size)
        b = None if bias is None else bias.to(device=self.device, dtype=self.dtype).contiguous()
        return LinearWeight(
            out_features=weight.shape[0],
            in_features=weight.shape[1],
            weight=None,
            bias=b,
            format=fmt,
            data={"qweight": q.qweight, "scale": q.scale, "group_size": q.group_size},
        )

    def linear(self, x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
        """``x`` [..., K] -> [..., N] in the compute dtype."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).to(self.dtype)  # [M, K], any strides
        out = torch.empty(x2.shape[0], weight.out_features, dtype=self.dtype, device=x.device)
        if weight.format == "dense":
            assert weight.weight is not None
            w, scale, group = weight.weight, None, 1
        else:
            w, scale, group = weight.data["qweight"], weight.data["scale"], weight.data["group_size"]
        cfg = gemm_config(self.target.arch, x2.shape[0])
        block_n, block_k = self.target.gemm_tiles(cfg.block_n, cfg.block_k, weight.out_features, weight.in_features)
        self._gemm.gemm(
            x2,
            w,
            weight.bias,
            out,
            quant=QUANT_CODES[weight.format],
            scale=scale,
            quant_group=group,
            in_features=weight.in_features,
            block_m=cfg.block_m,
            block_n=block_n,
            block_k=block_k,
            group_m=cfg.group_m,
            upcast=self.target.upcast,
            launch=self.target.launch(cfg.num_warps, cfg.num_stages, cfg.extra),
        )
        return out.view(*lead, weight.out_features)


class TritonMoE(MoEKernels):
    """Fused MoE: routing in torch on the device, then the grouped-GEMM kernels of
    :mod:`plinth_triton.kernels.moe` over the slots sorted by expert (dense experts only)."""

    def __init__(self, spec: MoESpec, device: torch.device, target: KernelTarget) -> None:
        super().__init__(spec)
        self.device = device
        self.target = target
        self.dtype = torch_dtype(spec.dtype)
        self._moe = _kernels("moe")

    def prepare(self, gate_up: torch.Tensor, down: torch.Tensor) -> ExpertWeights:
        """``gate_up`` [E, 2I, H] and ``down`` [E, H, I] in the compute dtype on the device, contiguous."""
        s = self.spec
        self.check_experts(gate_up, down)
        gu = gate_up.to(device=self.device, dtype=self.dtype).contiguous()
        dn = down.to(device=self.device, dtype=self.dtype).contiguous()
        return ExpertWeights(s, gu, dn)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, weights: ExpertWeights) -> torch.Tensor:
        """``x`` [T, H] (any strides), ``router_logits`` [T, E] -> [T, H] in the compute dtype."""
        s = self.spec
        self.check_call(x, router_logits, weights)
        if weights.gate_up is None or weights.down is None:
            raise ValueError(f"expert weights in {weights.format}: this op multiplies dense experts only ({s})")
        route_w, route_ids = route_experts(router_logits, s.top_k, s.renormalize)  # [T, k] each
        cfg = moe_config(self.target.arch, x.shape[0] * s.top_k // s.num_experts)
        h, i = s.hidden_size, s.intermediate_size
        return self._moe.fused_moe(
            x.to(self.dtype),
            route_w,
            route_ids,
            weights.gate_up,
            weights.down,
            activation=s.activation,
            block_m=cfg.block_m,
            tiles_up=self.target.gemm_tiles(cfg.block_n, cfg.block_k, i, h),
            tiles_down=self.target.gemm_tiles(cfg.block_n, cfg.block_k, h, i),
            upcast=self.target.upcast,
            launch=self.target.launch(cfg.num_warps, cfg.num_stages, cfg.extra),
        )


class TritonSmallOps(SmallOps):
    """RMSNorm and rotary in Triton (fp32 inside); silu_and_mul and fp64 inputs use the torch defaults."""

    def __init__(self, target: KernelTarget) -> None:
        self.target = target
        self._norm_rope = _kernels("norm_rope")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim: ``x / rms(x) * weight``, computed in fp32."""
        if x.dtype not in KERNEL_DTYPES:
            return super().rms_norm(x, weight, eps)
        return self._norm_rope.rms_norm(
            x, weight, eps, None, block_r=self.target.rows_per_program, launch=self.target.launch(4, 1)
        )

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual += x`` (in place), then ``(RMSNorm(residual), residual)``: one pass over memory."""
        if x.dtype not in KERNEL_DTYPES or residual.dtype != x.dtype or not residual.is_contiguous():
            return super().add_rms_norm(x, residual, weight, eps)
        normed = self._norm_rope.rms_norm(
            x, weight, eps, residual, block_r=self.target.rows_per_program, launch=self.target.launch(4, 1)
        )
        return normed, residual

    def rotary(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
        """NeoX rotary of ``x`` [T, H, D] at ``positions`` [T]; ``cos_sin`` [max_pos, rotary_dim]."""
        if x.dtype not in KERNEL_DTYPES or cos_sin.dtype not in KERNEL_DTYPES:
            return super().rotary(x, positions, cos_sin, rotary_dim)
        if x.stride(-1) != 1:
            x = x.contiguous()
        return self._norm_rope.rotary(x, positions, cos_sin.contiguous(), rotary_dim, launch=self.target.launch(4, 1))
