"""Launch configurations per GPU architecture: a small table, looked up once per (arch, shape class).

Why a table and not ``triton.autotune``: autotuning benchmarks every config on first use (seconds
per shape, at engine start, with noisy results on a busy GPU), and it cannot run in the
interpreter. These configs are the ones vLLM's and Triton's tutorials converge on for each
architecture; ``scripts/gpu-check.sh`` measures them against the hardware's roofline.

Keys: ``"sm80"``-style for NVIDIA (compute capability), ``"gfx942"``-style for AMD (the LLVM
target, without feature suffixes), and ``"interpreter"``. AMD GPUs run 64-wide wavefronts, so a
"warp" there is twice as wide: the same tile takes half the ``num_warps``; ``waves_per_eu`` is an
AMD-only occupancy hint.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """Tiles of the unified attention kernel.

    ``block_m`` query rows per program (query tokens x the query heads of one KV head), ``tile_n``
    keys per inner iteration; ``split_kv_min_len``: a pure-decode batch whose longest sequence has
    at least that many tokens is split into ``num_segments`` KV segments (then reduced), so that a
    small batch still fills the GPU.
    """

    block_m: int = 16
    tile_n: int = 32
    decode_block_m: int = 16  # rows per program when every sequence has one query token
    num_warps: int = 4
    num_stages: int = 2
    split_kv_min_len: int = 2048
    num_segments: int = 16
    extra: dict[str, int] = field(default_factory=dict)  # backend-specific launch options


@dataclass(frozen=True, slots=True)
class GemmConfig:
    """Tiles of the GEMM kernel for one class of M (rows of the activation)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8  # programs along M that share weight tiles in L2 (grouped ordering)
    num_warps: int = 4
    num_stages: int = 3
    extra: dict[str, int] = field(default_factory=dict)


# M classes: decode-sized (<= 16), small batches (<= 64), everything else.
_GEMM_SM80 = (
    GemmConfig(16, 64, 128, num_warps=4, num_stages=4),
    GemmConfig(64, 64, 64, num_warps=4, num_stages=4),
    GemmConfig(128, 128, 32, num_warps=4, num_stages=4),
)
_GEMM_SM90 = (
    GemmConfig(16, 128, 128, num_warps=4, num_stages=4),
    GemmConfig(64, 128, 64, num_warps=4, num_stages=4),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3),
)
_AMD = {"waves_per_eu": 2}
_GEMM_GFX9 = (
    GemmConfig(16, 64, 128, num_warps=4, num_stages=2, extra=_AMD),
    GemmConfig(64, 128, 64, num_warps=4, num_stages=2, extra=_AMD),
    GemmConfig(128, 128, 64, num_warps=4, num_stages=2, extra={"waves_per_eu": 0}),
)
_GEMM_RDNA = (  # gfx11: 32-wide wavefront mode, no MFMA
    GemmConfig(16, 64, 64, num_warps=4, num_stages=2),
    GemmConfig(64, 64, 64, num_warps=4, num_stages=2),
    GemmConfig(64, 128, 64, num_warps=8, num_stages=2),
)
# The interpreter runs one program at a time in Python and pays ~0.3 ms per op, not per element:
# few, wide tiles are fastest. Its dot is a non-BLAS numpy loop, so M is padded as little as
# possible (16 rows).
_GEMM_INTERPRETER = (GemmConfig(16, 8192, 128, group_m=1, num_warps=1, num_stages=1),) * 3


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """Tiles of the fused-MoE grouped GEMM: ``block_m`` sorted (token, expert) slots per program
    (each expert's run is padded to it), ``block_n`` / ``block_k`` as the GEMM's."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    extra: dict[str, int] = field(default_factory=dict)


# Slot classes by the mean rows per expert (T * k / E): decode-like (<= 16) pads least with 16-row
# blocks; prefill-sized groups use 64 rows, as vLLM's default fused-MoE configs do. Not measured on
# hardware yet (scripts/gpu-check.sh does not time MoE): a starting point, like the GEMM table's.
_MOE_NV = (MoEConfig(16, 64, 64, num_warps=4, num_stages=3), MoEConfig(64, 128, 64, num_warps=4, num_stages=3))
_MOE_AMD = (
    MoEConfig(16, 64, 64, num_warps=4, num_stages=2, extra=_AMD),
    MoEConfig(64, 128, 64, num_warps=4, num_stages=2, extra=_AMD),
)
# The interpreter pays per op: wide N/K tiles (clamped to the matrix by gemm_tiles), 16-row blocks.
_MOE_INTERPRETER = (MoEConfig(16, 8192, 128, num_warps=1, num_stages=1),) * 2
MOE_TABLE: dict[str, tuple[MoEConfig, MoEConfig]] = {
    "sm80": _MOE_NV,
    "sm90": _MOE_NV,
    "sm100": _MOE_NV,
    "gfx90a": _MOE_AMD,
    "gfx942": _MOE_AMD,
    "gfx1100": _MOE_AMD,
    "interpreter": _MOE_INTERPRETER,
}

ATTENTION_TABLE: dict[str, AttentionConfig] = {
    "sm80": AttentionConfig(block_m=16, tile_n=32, num_warps=4, num_stages=2),
    "sm90": AttentionConfig(block_m=64, tile_n=64, num_warps=4, num_stages=2, num_segments=16),
    "sm100": AttentionConfig(block_m=64, tile_n=64, num_warps=4, num_stages=2, num_segments=16),
    "gfx90a": AttentionConfig(block_m=32, tile_n=32, num_warps=2, num_stages=1, extra=_AMD),
    "gfx942": AttentionConfig(block_m=64, tile_n=32, num_warps=4, num_stages=1, num_segments=16, extra=_AMD),
    "gfx1100": AttentionConfig(block_m=16, tile_n=32, num_warps=4, num_stages=1),
    # Large tiles (the interpreter pays per op); a low split threshold so tests reach split-KV.
    "interpreter": AttentionConfig(
        block_m=64, tile_n=64, decode_block_m=16, num_warps=1, num_stages=1, split_kv_min_len=200, num_segments=4
    ),
}
GEMM_TABLE: dict[str, tuple[GemmConfig, GemmConfig, GemmConfig]] = {
    "sm80": _GEMM_SM80,
    "sm90": _GEMM_SM90,
    "sm100": _GEMM_SM90,
    "gfx90a": _GEMM_GFX9,
    "gfx942": _GEMM_GFX9,
    "gfx1100": _GEMM_RDNA,
    "interpreter": _GEMM_INTERPRETER,
}


def _table_key(arch: str, table: dict) -> str:
    """The entry for ``arch``: itself, else the newest entry of its family not newer than it.

    ``sm86``/``sm89`` use ``sm80``; ``sm120`` uses ``sm100``; an unknown ``gfx`` target uses the
    first gfx entry of its generation (gfx9xx -> gfx90a, gfx1xxx -> gfx1100).
    """
    if arch in table:
        return arch
    if arch.startswith("sm") and arch[2:].isdigit():
        older = [k for k in table if k.startswith("sm") and int(k[2:]) <= int(arch[2:])]
        return max(older, key=lambda k: int(k[2:])) if older else "sm80"
    if arch.startswith("gfx"):  # gfx1xxx: RDNA; gfx94x/95x: CDNA3+; other gfx9xx: CDNA1/2
        return "gfx1100" if len(arch) >= 7 else "gfx942" if arch >= "gfx940" else "gfx90a"
    return "sm80"


@functools.cache
def attention_config(arch: str) -> AttentionConfig:
    """Attention tiles for ``arch`` (cached: looked up once per architecture)."""
    return ATTENTION_TABLE[_table_key(arch, ATTENTION_TABLE)]


@functools.cache
def gemm_config(arch: str, m: int) -> GemmConfig:
    """GEMM tiles for ``arch`` and ``m`` activation rows (cached per (arch, m))."""
    small, medium, large = GEMM_TABLE[_table_key(arch, GEMM_TABLE)]
    return small if m <= 16 else medium if m <= 64 else large


@functools.cache
def moe_config(arch: str, rows_per_expert: int) -> MoEConfig:
    """Fused-MoE tiles for ``arch`` when experts get ``rows_per_expert`` slots on average."""
    small, large = MOE_TABLE[_table_key(arch, MOE_TABLE)]
    return small if rows_per_expert <= 16 else large
