"""GEMM for the CPU backend: dense fp32/bf16/fp16 weights and ggml q4_1/q8_0 blocks.

With the native kernels, fp32 weights are laid out once at load in 8-row panels
(``[ceil(N/8), K, 8]``, format ``"f32_panels"``, replacing the ``[N, K]`` tensor): one k of a
panel is one vector of 8 outputs' weights, so the register tiles need no horizontal sums and keep
a tile's weights in L1 across a decode batch (see ``csrc/kernels.c``). At batch 1 the kernel
streams the weights at close to read bandwidth (torch's M=1 GEMM reaches about a third of it
here), and batched it runs on the backend's own thread pool, which keeps going when a thread is
descheduled. A bf16/fp16 checkpoint's weights in an fp32 model (``stored_dtypes``, plugin API 1.14)
keep their 16 bits in the same panels (format ``"w16_panels"``): the kernels widen them exactly as
they read them, so the products are the fp32 panels' bit for bit and a decode step streams half the
bytes. A bf16/fp16 model's weights stay ``[N, K]`` in its dtype: the native row tiles read them widened
(``x`` widened and the fp32 product rounded once, by native calls a step graph records), in a bf16
model on a CPU with AVX512-BF16 or AMX up to 4 rows and above that oneDNN's bf16 GEMM on a copy of
the weight it reordered once at load (:data:`ONEDNN_PACKED_ENV`; 8 rows and ``F.linear`` without
it), else at every row count (see :data:`ROWS16_ENV`). Where the native build runs AVX512-BF16 dot
products, a bf16 model's weights are laid out instead in 16-column pair panels (format
``"bf16_pairs"``, :data:`PAIRS_ENV`) for the native ``vdpbf16ps`` kernel (on AMX tiles, ``tdpbf16ps``,
where the CPU has them: :data:`~plinth_cpu.native.AMX_ENV`), which takes every product up to 64 rows
(so every decode step records in a step graph; where oneDNN has AMX and the kernel does not, only up to
the row tiles' bound), oneDNN's pre-packed copy the larger ones. float64, and every dtype without
native kernels, use ``F.linear``. A row-major ``[K, N]`` right operand in bf16 is ~100x slower on AVX2
hosts, so the weight is never pre-transposed.

Quantized weights keep their GGUF blocks' values (never dequantized at load). Few rows (decode; in
4-row groups up to :data:`Q4_1X4_MAX_ROWS`): the native kernel unpacks each block in registers and
multiplies it with the activations rounded to int16 per 32-block (``PLINTH_CPU_ACTIVATIONS``,
default "int16"): exact integer products, and a rounding at most 2^-16 of the block's largest
activation, which kept SmolLM2-135M's log-probs within 1.5e-3 nats of the dequantized fp32 model.
Int16 activations take a q4_1 weight laid out once at load in 16-row panels (format ``"q4_1p16"``,
``PLINTH_CPU_Q4_1_GROUPS``): one 512-bit vector holds a pair of columns of 16 rows as int16 lanes
for VNNI's ``vpdpwssd``, each block is unpacked once for up to 4 activation rows, and the AVX-512
build's kernel takes every row count, prefill included (1.1x the 4-row groups at 1 row, 1.5-1.6x at
8-64, 2x the dequantized fp32 panels at 512 on a Zen 4); the AVX2 build's (two 256-bit halves,
``vpmaddwd``) takes up to :data:`P16_MAX_ROWS` rows. On request (``"4"``) 4-row
groups (format ``"q4_1x4"``: a block of four rows is one 512-bit load whose nibbles are int16 lanes)
serve up to :data:`Q4_1X4_MAX_ROWS` rows. q8_0 weights take the same 16-row panels (format
``"q8_0p16"``). Multiplying fp32 activations as given ("fp32") is exact up to fp32 rounding but
slower: AVX2 has to convert every weight to float, and that, not memory, bounds the kernel. More
rows, on the AVX2 build up to 64: each group of 3 weight rows is dequantized into a cache-resident
buffer and multiplied with the fp32 register tiles (fp32 activations); the dequantization is then a
small share of the work. Above that (on the AVX-512 build from 17 rows:
:data:`DEQUANT_ROWS_MAX_ROWS`) the whole weight is dequantized into panels in a reused scratch
buffer (at most a few MB per layer) for the panel kernel. With ``PLINTH_CPU_QUANT_BATCHED=bf16``
products of 96 rows or more instead dequantize the weight to bf16 and run oneDNN's bf16 GEMM
(AVX512-BF16 / AMX) on the activations rounded to bf16 (faster, less exact: see
:data:`QUANT_BATCHED_ENV`). "int8" rounds activations to int8 per 32-block first on every path, as
llama.cpp does: logits off by the rounding (measured up to 0.3 nats on SmolLM2-135M, enough to flip
near-tied greedy choices).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from plinth.platform.backend import GemmKernels, LinearWeight, host_memory_info
from plinth.platform.quant import QuantizedWeight
from plinth_cpu.native import (
    AMX_ENV,
    AMX_I8_MIN_ROWS,
    AMX_INT8_ENV,
    AMX_INT8_MODES,
    AVX512,
    ELEMENT_TYPES,
    INT16_LAYOUTS,
    PANEL16_DTYPES,
    Q4_1P16,
    Q4_1X4,
    Q8_0P16,
    QUANT_FORMATS,
    NativeKernels,
    amx_mode,
    choose_variant,
    native_cpu_flags,
)
from plinth_cpu.preflight import _cpu_flags

log = logging.getLogger(__name__)

#: ``LinearWeight.format`` of an fp32 weight laid out in 8-row panels for the native kernels.
PANELS = "f32_panels"
#: ... of a bf16/fp16 checkpoint weight in an fp32 model, kept in its 16 bits in those panels.
PANELS16 = "w16_panels"
#: "0": bf16/fp16 checkpoint weights of an fp32 model are cast to fp32 panels too (default "1": kept in 16 bits).
KEEP16_ENV = "PLINTH_CPU_KEEP_16BIT"
#: An fp32 model's products of at least this many rows on AMX tiles as three bf16 products (the weight
#: also kept as bf16 hi/lo parts, :meth:`NativeKernels.pack_bf16x3`: 6 more bytes a weight; products
#: within 2^-16 of |x| |w| of the exact ones, where fp32 FMAs are within ~2^-24 K); "0" (default): never.
#: Where the native build runs AMX-BF16 (or its emulation), for weights with K a multiple of 32, outside
#: step graphs (their decode products stay on the fp32 panels). Off by default: its speed against the
#: fp32 panels has not been measured on an AMX host yet.
BF16X3_ENV = "PLINTH_CPU_FP32_BF16X3"
#: Activation handling for quantized weights at few rows: "int16" (default), "fp32" or "int8".
ACTIVATIONS_ENV = "PLINTH_CPU_ACTIVATIONS"
ACTIVATION_MODES = ("int16", "fp32", "int8")
#: q4_1 weights under int16 activations: "16" laid out in 16-row panels (``q4_1p16``, and q8_0 in
#: ``q8_0p16``), "4" in 4-row groups (``q4_1x4``), "0" kept in GGUF row order; "auto" (default): the
#: 16-row panels under either build (the AVX2 build's: see :data:`P16_MAX_ROWS`). Measured (Zen 4, AVX-512 build, 2
#: threads, 30 SmolLM2-shaped q4_1 layers from memory, ``benchmarks/q4_1_layouts.py``; GFLOP/s
#: q4_1x4 / q4_1p16): see :data:`Q4_1X4_MAX_ROWS` and the cpu README. 4-row groups against GGUF order
#: (Zen 5, ``benchmarks/q4_1_layouts.py``): the AVX-512 build's 1.20x at 1 row, 1.5x at 4-16; the AVX2
#: build's 0.71-0.80x at 1 row (its two-half kernel keeps fewer reads in flight).
GROUPS_ENV = "PLINTH_CPU_Q4_1_GROUPS"
GROUPS_MODES = ("auto", "16", "4", "0")

#: A bf16 model's dense products up to this many rows run the native row tiles (x widened, the fp32
#: product rounded once: recorded in step graphs); above, torch's ``F.linear`` (oneDNN's AVX512-BF16 /
#: AMX kernels). Measured (Zen 5, AVX-512 build, 2 threads, 30 SmolLM2-shaped layers of bf16 weights
#: from memory, GFLOP/s native / oneDNN): 1 row 33 / 19, 4 rows 126 / 74, 8 rows 140 / 133, 16 rows
#: 149 / 238, 64 rows - / 494. An fp16 model's products take the native tiles at every row count:
#: torch's fp16 GEMM ran at 38-45 GFLOP/s from 8 to 256 rows here (no AVX512-FP16), the tiles at
#: 163-254. Nor does a bf16 model on a CPU without AVX512-BF16 or AMX (or with oneDNN held below them
#: by ``ONEDNN_MAX_CPU_ISA``): oneDNN's bf16 GEMM then ran at 38 GFLOP/s, and the 64-request workload
#: (Zen 5 held to its AVX2 paths) at 66.3 output tok/s with oneDNN above 8 rows against 281.1 with the
#: tiles throughout. ``PLINTH_CPU_16BIT_NATIVE_ROWS`` sets one bound for both dtypes.
ROWS16_ENV = "PLINTH_CPU_16BIT_NATIVE_ROWS"
#: ``LinearWeight.format`` of a bf16 model's weight laid out in 16-column pair panels for the native
#: AVX512-BF16 dot-product kernel (:meth:`NativeKernels.gemm_bf16_pairs`).
PAIRS = "bf16_pairs"
#: "auto" (default): a bf16 model's weights go into pair panels where the native build runs AVX512-BF16
#: dot products (:attr:`NativeKernels.bf16_dot`); "0": never (the row tiles and oneDNN as without them).
PAIRS_ENV = "PLINTH_CPU_BF16_PAIRS"
PAIRS_MODES = ("auto", "0")
#: The default bound of the pair-panel kernel: every decode-sized product (the largest step-graph
#: bucket), so a bf16 model's decode steps record in step graphs; above, oneDNN on its pre-packed copy.
#: Measured (Zen 4, AVX512-BF16, no AMX; 2 threads; ``benchmarks/onednn_packed.py``, 30 SmolLM2-shaped
#: layers from memory, GFLOP/s pairs / oneDNN pre-packed): 1 row 16.2 / 14.8, 4 rows 83.9 / 76.2, 8 rows
#: 124 / 150, 16 rows 184 / 218, 32 rows 272 / 278, 64 rows 352 / 351, 128 rows 339 / 348.
ROWS16_BF16_PAIRS = 64


def amx_bf16_onednn() -> bool:
    """Whether torch's oneDNN runs bf16 GEMMs on AMX tiles here (AMX-BF16, not held below it by
    ``ONEDNN_MAX_CPU_ISA``). There the pair panels keep the row tiles' bound (4 rows pre-packed, 8
    not) rather than :data:`ROWS16_BF16_PAIRS`: oneDNN's AMX GEMM on its pre-packed copy overtakes
    the pair kernel from 6 rows. Measured (Intel Xeon family 6 model 207 with AMX-BF16, 2 threads,
    ``benchmarks/onednn_packed.py``: 30 SmolLM2-shaped layers of bf16 weights, GFLOP/s pairs /
    pre-packed, 11 passes): 1 row 22.0 / 18.4, 2 rows 38.1 / 37.4, 4 rows 80.7 / 76.3, 5 rows 95.9 /
    92.8, 6 rows 99.0 / 115.0, 8 rows 122.1 / 159.9; 7 passes: 16 rows 118 / 271, 64 rows 155 / 838,
    128 rows 167 / 1,484, 512 rows 173 / 1,908."""
    if _onednn_max_isa() in _ONEDNN_BELOW_BF16 | _ONEDNN_BELOW_AMX:
        return False
    return "amx_bf16" in (_cpu_flags() or set())


def pairs_max_rows(onednn_packed: bool, native_amx: bool) -> int:
    """The most rows a bf16 model's products take on the pair kernel by default: every row count where
    the kernel runs on AMX tiles (``native_amx``: :attr:`NativeKernels.amx_bf16`), else
    :data:`ROWS16_BF16_PAIRS`, or where oneDNN has AMX (:func:`amx_bf16_onednn`) and the kernel does not
    the row tiles' bound (4 rows with ``onednn_packed`` weights, 8 without).

    On AMX tiles the kernel beat oneDNN's pre-packed AMX GEMM up to 64 rows (Intel Xeon family 6 model
    207, 2 threads, PASSIVE OpenMP as the backend runs, 30 SmolLM2-shaped layers of bf16 weights, GFLOP/s
    AMX kernel / oneDNN: 4 rows 163 / 77, 16 rows 577 / 300, 64 rows 1,126 / 992), and with 32 rows a step
    above it too (256 rows 1,826 / 1,705, 1024 rows 2,069 / 1,806); end to end a bf16 prefill ran the
    same either way (3,749 and 3,634 tok/s with oneDNN above 64 rows, 3,752 and 3,767 without). oneDNN
    compiles a kernel for each row count it has not seen (5-10 ms each, per weight shape; its cache holds
    1,024), which continuous batching keeps producing: 150 products of random row counts in 65..1024 ran at
    306 GFLOP/s on first sight, 1,225 cached, and 1,041 on the AMX kernel, which compiles nothing. So there
    the kernel takes every product and the weights get no oneDNN copy (half a bf16 model's memory)."""
    if native_amx:
        return UNBOUNDED
    if amx_bf16_onednn():
        return ROWS16_BF16_PACKED if onednn_packed else ROWS16_BF16_ONEDNN
    return ROWS16_BF16_PAIRS


#: The default bound for a bf16 model where oneDNN has bf16 instructions to run; otherwise no bound.
ROWS16_BF16_ONEDNN = 8
#: ... where the weights are pre-packed for oneDNN (:data:`ONEDNN_PACKED_ENV`). Measured (Zen 5, as
#: above, ``benchmarks/onednn_packed.py``, GFLOP/s native / pre-packed): 4 rows 129-134 / 121-124, 8
#: rows 180 / 215, 16 rows 202 / 358.
ROWS16_BF16_PACKED = 4
UNBOUNDED = 1 << 62
#: ``ONEDNN_MAX_CPU_ISA`` values below AVX512_CORE_BF16 (oneDNN then has no bf16 dot products).
_ONEDNN_BELOW_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"})
#: ... and the AVX-512 levels below AMX (oneDNN then multiplies bf16 without its tiles).
_ONEDNN_BELOW_AMX = frozenset({"AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16"})


def onednn_runs_bf16(flags: set[str] | None) -> bool:
    """Whether torch's oneDNN has bf16 dot products on a CPU with these /proc/cpuinfo ``flags``
    (AVX512-BF16 or AMX-BF16) and ``ONEDNN_MAX_CPU_ISA`` does not hold it below them."""
    if _onednn_max_isa() in _ONEDNN_BELOW_BF16:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & (flags or set()))


def _onednn_max_isa() -> str:
    """``ONEDNN_MAX_CPU_ISA`` as oneDNN reads it (upper case; "" when unset)."""
    return os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()


#: A bf16 model's weights also reordered once at load into oneDNN's own blocked layout, for the
#: products ``F.linear`` would run (above :data:`ROWS16_ENV`'s bound with the native kernels, every
#: one without them): "auto" (default) where oneDNN has bf16 dot products (:func:`onednn_runs_bf16`),
#: "1" wherever torch has oneDNN, "0" never. ``F.linear`` on the ``[N, K]`` weight reorders it on every
#: call. The native row tiles keep reading the ``[N, K]`` weight (oneDNN's layout is its own and
#: differs by ISA), so a bf16 model holds its linear weights twice. Measured (Zen 5, AVX512-BF16, no
#: AMX; 2 threads; ``benchmarks/onednn_packed.py``, 30 SmolLM2-shaped layers from memory): see the
#: cpu backend's README.
ONEDNN_PACKED_ENV = "PLINTH_CPU_ONEDNN_PACKED"
ONEDNN_PACKED_MODES = ("auto", "1", "0")
#: Under "auto" a weight is packed only while the host's available memory (:func:`host_memory_info`)
#: stays above this share of its total after the copy: a model that fits once but not twice loads with its later weights
#: unpacked (``F.linear``) instead of running the host out of memory ("1" packs regardless).
ONEDNN_PACK_RESERVE = 0.25


@dataclass(frozen=True, slots=True)
class OneDnnPacked:
    """A weight reordered by oneDNN into its blocked layout (an opaque ``torch._mkldnn`` tensor).

    Held in ``LinearWeight.data`` wrapped, not as a tensor: a decode step never reads it (the bytes a
    batch-1 step streams are the ``[N, K]`` weight's) and a step program's tracer must not swap it."""

    tensor: torch.Tensor


def onednn_pack(weight: torch.Tensor) -> OneDnnPacked:
    """``weight`` [N, K] (bf16 or fp32) reordered once into oneDNN's layout for this CPU."""
    return OneDnnPacked(torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()))


def onednn_packed_linear(x: torch.Tensor, packed: OneDnnPacked, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` [M, K] (in the packed weight's dtype) times a pre-packed weight, plus ``bias``: oneDNN's
    GEMM without its per-call reorder. A strided ``x`` is copied first (see :func:`_torch_linear`)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed.tensor, bias, "none", [], "")


def onednn_packing(mode: str) -> tuple[bool, str]:
    """Whether a bf16 model's weights get pre-packed for oneDNN under ``mode`` (one of
    :data:`ONEDNN_PACKED_MODES`), and why, in a line for ``plinth backends``. Packs nothing."""
    if mode == "0":
        return False, f"bf16 weights not pre-packed for oneDNN ({ONEDNN_PACKED_ENV}=0)"
    if not torch.backends.mkldnn.is_available():
        return False, "bf16 weights not pre-packed for oneDNN: torch was built without it"
    if mode == "1":
        return True, f"bf16 weights pre-packed for oneDNN ({ONEDNN_PACKED_ENV}=1)"
    if onednn_runs_bf16(_cpu_flags()):
        return True, "bf16 weights pre-packed for oneDNN (it has AVX512-BF16 or AMX-BF16 here)"
    return False, "bf16 weights not pre-packed for oneDNN: it has no bf16 dot products here (or ONEDNN_MAX_CPU_ISA)"


def onednn_packs(dtype: torch.dtype, mode: str | None = None) -> bool:
    """Whether a model in ``dtype`` gets pre-packed oneDNN weights (:data:`ONEDNN_PACKED_ENV`, or
    ``mode``; see :func:`onednn_packing`): bf16 only (torch's fp16 reorder needs AVX512-FP16 or
    AVX-NE-CONVERT, and the fp32 panels beat oneDNN). Under "1" one small weight is packed first, so a
    CPU or torch build oneDNN refuses is named now, not at the first weight."""
    mode = _mode("onednn_packed", mode, ONEDNN_PACKED_ENV, ONEDNN_PACKED_MODES)
    if dtype != torch.bfloat16 or not onednn_packing(mode)[0]:
        return False
    if mode == "1":
        try:
            onednn_pack(torch.zeros(8, 8, dtype=dtype))
        except (RuntimeError, AttributeError) as e:
            raise ValueError(f"{ONEDNN_PACKED_ENV}=1: torch's oneDNN cannot pre-pack bf16 weights here ({e})") from e
    return True


#: Quantized products up to this many rows (by the native build) dequantize 3 weight rows at a time
#: (per 32-row block of activations); above, the whole weight is dequantized once into panels in
#: scratch for the panel kernel. Measured (Zen 5, 2 threads, 30 SmolLM2-shaped q4_1 layers out of
#: cache, GFLOP/s 3-row / panels): AVX-512 build 17 rows 186 / 187, 24 rows 210 / 238, 32 rows 220 /
#: 268, 64 rows 244 / 328; AVX2 build 17 rows 172 / 132, 64 rows 225 / 203, 96 rows 232 / 218.
DEQUANT_ROWS_MAX_ROWS: dict[str, int] = {"avx512": 16, "avx2": 64}

#: How a quantized weight's batched products (at least QUANT_BF16_MIN_ROWS rows) compute: "fp32"
#: (default): the weight dequantized into fp32 panels, the activations as
#: given; "bf16": the weight dequantized to bf16 into scratch and the activations rounded to bf16,
#: through torch's ``F.linear`` (oneDNN's AVX512-BF16 or AMX kernels), the bf16 product widened
#: back. Measured on a Zen 5 (AVX512-BF16, no AMX; 2 threads): 30 SmolLM2-shaped q4_1 layers out of
#: cache, GFLOP/s fp32 panels / bf16, 96 rows 322 / 409, 128 rows 366 / 476, 256 rows 408 / 630, 512
#: rows 431 / 716; SmolLM2-135M Q4_1 prefill (8 prompts of 512 tokens) 1.1-1.4x; a 1,932-token text's
#: prompt log-probs off the fp32 path's by 0.032 nats on average (0.23 at most; its total
#: log-likelihood 0.06% lower). So it is not the default there. On an Intel AMX host (Xeon family 6
#: model 207, 2 threads) the same prefill ran 1.3-2.4x faster and the 64-request workload 1.19x: still
#: not the default, for the same accuracy (the cpu README).
QUANT_BATCHED_ENV = "PLINTH_CPU_QUANT_BATCHED"
QUANT_BATCHED_MODES = ("fp32", "bf16")
#: The fewest rows the "bf16" mode takes: below, the fp32 panels were as fast (Zen 5, AVX-512 build, the
#: same layers, GFLOP/s fp32 panels / bf16: 64 rows 328 / 322, 96 rows 322 / 409, 128 rows 366 / 476).
QUANT_BF16_MIN_ROWS = 96

#: Quantized products with at most this many rows use the per-block kernel (GGUF order: with the
#: 16-row panels the default on both builds, under ``PLINTH_CPU_Q4_1_GROUPS=0`` and int8 activations).
#: Measured on a Zen 5's AVX2 build; on a Zen 1 (AVX2 build, int16) the dequantized rows won from 6-8.
NATIVE_QUANT_MAX_ROWS = 16
#: ... and q4_1 weights in 4-row groups (``q4_1x4``, int16 activations) up to this many: a group's
#: blocks stay in L1 while every activation row passes them, so the kernel keeps its speed as rows
#: grow, where the alternative dequantizes the whole weight per call. Measured (Zen 5, AVX-512 build,
#: 2 threads, 30 SmolLM2-shaped q4_1 layers out of cache, ms per pass, ``q4_1x4`` kernel / weight
#: dequantized into panels): 16 rows 12.5 / 19.4, 24 rows 17.2 / 27.9, 32 rows 22.7 / 28.2, 48 rows
#: 32.1 / 36.2, 64 rows 41.4 / 43.8, 80 rows 52.1 / 54.3, 96 rows 61.6 / 56.2.
Q4_1X4_MAX_ROWS = 64


#: The most rows the 16-row panel kernel takes, by native build. The AVX-512 build's (dpwssd, a block
#: unpacked once for 4 rows) takes every row count. The AVX2 build's pays a vpmaddwd and a vpaddd
#: per 16 products, no fewer operations than fp32 FMAs on dequantized weights: measured (AMD EPYC Zen 1,
#: AVX2 build, 2 threads, 30 SmolLM2-shaped q4_1 layers from memory, GFLOP/s panel kernel / GGUF
#: blocks dequantized 3 rows at a time): 1 row 24.7 / 10.4, 2 rows 35.8 / 17.0, 4 rows 38.1 / 29.4,
#: 6 rows 39.6 / 34.0, 8 rows 38.4 / 38.5, 12 rows 36.1 / 46.3, 16 rows 39.6 / 51.2, 24 rows 42.2 / 56.5.
#: On a Zen 3 (family 25, full 256-bit datapaths; the same layers, quiet host) the panels held on further
#: (1.30x at 8 rows, 1.10-1.15x at 12-16, 0.82-1.02x at 20-24, 0.89x at 32), but a bound of 16 left the
#: Q4_1 64-request workload where it was (output tok/s, alternating 8 / 16: 185.7, 194.2 / 196.4, 166.8),
#: so one bound serves both.
P16_MAX_ROWS: dict[str, int] = {"avx512": UNBOUNDED, "avx2": 8}


def native_quant_max_rows(fmt: str, variant: str) -> int:
    """The most rows of a product the per-block kernel of the native build ``variant`` takes for a
    weight of ``LinearWeight.format`` ``fmt``: above, the weight is dequantized (3 rows at a time, or
    whole into panels). See :data:`P16_MAX_ROWS` for the 16-row panels."""
    if fmt in (Q4_1P16, Q8_0P16):
        return P16_MAX_ROWS[variant]
    return Q4_1X4_MAX_ROWS if fmt == Q4_1X4 else NATIVE_QUANT_MAX_ROWS


def onednn_packing_status() -> str:
    """:func:`onednn_packing`'s line for ``plinth backends`` under :data:`ONEDNN_PACKED_ENV`; a bad
    value is named there (the probe never raises)."""
    mode = os.environ.get(ONEDNN_PACKED_ENV, "auto")
    if mode not in ONEDNN_PACKED_MODES:
        return (
            f"{ONEDNN_PACKED_ENV}={mode!r} is not one of {', '.join(ONEDNN_PACKED_MODES)}: a bf16 model will not start"
        )
    packs, line = onednn_packing(mode)
    if packs and mode == "auto" and amx_kernel_takes_every_product():
        return (f"bf16 weights not pre-packed for oneDNN: the native AMX-BF16 tile kernel takes every product "
                f"({ONEDNN_PACKED_ENV}=1 packs them)")  # fmt: skip
    return line


def amx_kernel_takes_every_product() -> bool:
    """Whether a bf16 model's every product will run the native pair kernel on AMX tiles with no oneDNN
    copy of the weights (:func:`pairs_max_rows`): the pair kernel on (:data:`PAIRS_ENV`), the AVX-512
    build on a CPU with AVX512-BF16, AMX tiles expected (:func:`amx_tiles_expected`), and neither
    :data:`ROWS16_ENV` nor ``PLINTH_CPU_ONEDNN_PACKED=1`` asking for oneDNN. From the environment and
    /proc/cpuinfo alone; never raises."""
    if ROWS16_ENV in os.environ or os.environ.get(ONEDNN_PACKED_ENV, "auto") == "1":
        return False
    return _pairs_kernel_missing() is None and amx_tiles_expected()


def _pairs_kernel_missing() -> str | None:
    """Why a bf16 model's products will not run the native pair kernel here (:data:`PAIRS_ENV`, a bad
    :data:`~plinth_cpu.native.AMX_ENV`, no AVX512-BF16, another build), in a line for ``plinth
    backends``; None where they will. Loads and compiles nothing, never raises."""
    mode = os.environ.get(PAIRS_ENV, "auto")
    if mode not in PAIRS_MODES:
        return f"{PAIRS_ENV}={mode!r} is not one of {', '.join(PAIRS_MODES)}: a bf16 model will not start"
    if mode == "0":
        return f"bf16 models: no AVX512-BF16 dot-product kernel ({PAIRS_ENV}=0)"
    if bad := amx_status():
        return bad
    if "avx512_bf16" not in (native_cpu_flags() or set()):
        return "bf16 models: no AVX512-BF16 dot-product kernel (the CPU has no AVX512-BF16)"
    try:
        variant, _ = choose_variant()
    except ValueError as e:
        return f"bf16 models: no AVX512-BF16 dot-product kernel ({e})"
    if variant.name != AVX512.name:  # the AVX-512 build, or its emulation
        return f"bf16 models: no AVX512-BF16 dot-product kernel (the {variant.name} build is chosen)"
    return None


def bf16x3_status() -> str | None:
    """Where :data:`BF16X3_ENV` asks for three-bf16 products, whether an fp32 model will run them (the
    AVX-512 build or its emulation, AMX tiles expected), in a line for ``plinth backends``; None where
    it is unset or 0. Loads and compiles nothing, never raises."""
    rows = os.environ.get(BF16X3_ENV, "0")
    if rows == "0":
        return None
    if not rows.isdigit():
        return f"{BF16X3_ENV}={rows!r} is not a row count: an fp32 model will not start"
    if (missing := _pairs_kernel_missing()) is None and amx_tiles_expected():
        return f"fp32 models: products of {rows} rows or more as three bf16 products on AMX tiles ({BF16X3_ENV})"
    why = missing.removeprefix("bf16 models: ") if missing else "no AMX-BF16 tiles expected here"
    return f"fp32 models: {BF16X3_ENV}={rows} asked for, but fp32 panels only ({why})"


def amx_int8_status() -> str | None:
    """Where :data:`~plinth_cpu.native.AMX_INT8_ENV` asks for AMX-INT8 tiles, whether quantized models'
    batched products will run on them (the AVX-512 build or its emulation on a CPU with AMX-TILE and
    AMX-INT8, :data:`~plinth_cpu.native.AMX_ENV` not "0"), in a line for ``plinth backends``; None where
    it is unset or "0". Loads and compiles nothing, never raises."""
    mode = os.environ.get(AMX_INT8_ENV, "0")
    if mode == "0":
        return None
    if mode not in AMX_INT8_MODES:
        return f"{AMX_INT8_ENV}={mode!r} is not one of {', '.join(AMX_INT8_MODES)}: the native kernels will not load"
    if bad := amx_status():
        return bad
    why = None
    if amx_mode() == "0":
        why = f"{AMX_ENV}=0"
    elif not {"amx_tile", "amx_int8"} <= (native_cpu_flags() or set()):
        why = "the CPU has no AMX-INT8"
    else:
        try:
            variant, _ = choose_variant()
        except ValueError as e:
            why = str(e)
        else:
            if variant.name != AVX512.name:
                why = f"the {variant.name} build is chosen"
    if why:
        return f"q4_1/q8_0 models: {AMX_INT8_ENV}=1 asked for, but the VNNI kernel only ({why})"
    return f"q4_1/q8_0 models: products of {AMX_I8_MIN_ROWS} rows or more on AMX-INT8 tiles ({AMX_INT8_ENV}=1)"


def bf16_pairs_status() -> str:
    """Whether a bf16 model's decode-sized products run the native AVX512-BF16 kernel on pair panels
    (:data:`PAIRS_ENV`), in a line for ``plinth backends``; loads and compiles nothing, never raises."""
    if missing := _pairs_kernel_missing():
        return missing
    packing = os.environ.get(ONEDNN_PACKED_ENV, "auto")
    packed = packing in ONEDNN_PACKED_MODES and onednn_packing(packing)[0]
    kernel = "the native AVX512-BF16 dot-product kernel (pair panels)"
    amx = amx_tiles_expected()
    if amx:
        kernel = "the native AMX-BF16 tile kernel (pair panels; AVX512-BF16 dot products for 1 row)"
    if not packed:  # no oneDNN copy to hand larger products to
        return f"bf16 models: products of every row count by {kernel}"
    if amx and amx_kernel_takes_every_product():
        return f"bf16 models: products of every row count by {kernel}, no oneDNN copy of the weights"
    rows = os.environ.get(ROWS16_ENV, str(pairs_max_rows(packed, amx)))
    above = "oneDNN's AMX GEMM" if amx_bf16_onednn() else "oneDNN"
    return f"bf16 models: products of up to {rows} rows by {kernel}, larger ones by {above} on its pre-packed copy"


def amx_tiles_expected() -> bool:
    """Whether the pair kernel will run on AMX tiles here (:attr:`NativeKernels.amx_bf16`), from
    /proc/cpuinfo and :func:`~plinth_cpu.native.amx_mode` alone (loads nothing; whether Linux grants the
    tile data is known only once the library asks)."""
    try:
        on = amx_mode() == "auto"
    except ValueError:  # named by amx_status
        return False
    return on and {"amx_tile", "amx_bf16", "avx512_bf16"} <= (native_cpu_flags() or set())


def amx_status() -> str | None:
    """A bad :data:`~plinth_cpu.native.AMX_ENV` named (by :func:`~plinth_cpu.native.amx_mode`) in a line
    for ``plinth backends``; None when it is fine."""
    try:
        amx_mode()
    except ValueError as e:
        return f"{e}: the native kernels will not load"
    return None


class CpuGemm(GemmKernels):
    """``x @ w.T + b`` in one compute dtype through torch's ``F.linear`` (the backend without native
    kernels, and the base of :class:`NativeGemm`)."""

    def __init__(self, dtype: torch.dtype, onednn_packed: str | None = None) -> None:
        self.dtype = dtype
        mode = _mode("onednn_packed", onednn_packed, ONEDNN_PACKED_ENV, ONEDNN_PACKED_MODES)
        self.onednn_packed = onednn_packs(dtype, mode)
        #: "1" asked for: pack whatever the memory; "auto": only while :data:`ONEDNN_PACK_RESERVE` holds
        self.onednn_pack_always = self.onednn_packed and mode == "1"
        self.onednn_unpacked = 0  # weights left unpacked for want of memory

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearWeight:
        """Cast ``weight`` [N, K] (and ``bias`` [N]) to the compute dtype, contiguous on the CPU; in a
        bf16 model also reordered once for oneDNN (``data["onednn"]``, :data:`ONEDNN_PACKED_ENV`)."""
        w = weight.to(device="cpu", dtype=self.dtype).contiguous()  # [N, K]
        b = None if bias is None else bias.to(device="cpu", dtype=self.dtype).contiguous()  # [N]
        n, k = w.shape
        data = {"onednn": onednn_pack(w)} if self.onednn_packed and self._room_to_pack(w) else {}
        return LinearWeight(out_features=n, in_features=k, weight=w, bias=b, data=data)

    def _room_to_pack(self, w: torch.Tensor) -> bool:
        """Whether a packed copy of ``w`` leaves the host :data:`ONEDNN_PACK_RESERVE` of its memory
        (always under "1"); the first weight refused says so in the log."""
        if self.onednn_pack_always:
            return True
        available, total = host_memory_info()
        nbytes = w.numel() * w.element_size()
        if available - nbytes >= ONEDNN_PACK_RESERVE * total:
            return True
        if not self.onednn_unpacked:
            log.warning(
                "%s: bf16 weights from here on are not pre-packed for oneDNN (a copy of %.1f MiB would leave "
                "%.2f GiB of %.2f GiB available, under the %d%% reserve); their products take F.linear",
                ONEDNN_PACKED_ENV, nbytes / 2**20, (available - nbytes) / 2**30, total / 2**30,
                round(ONEDNN_PACK_RESERVE * 100),
            )  # fmt: skip
        self.onednn_unpacked += 1
        return False

    def linear(self, x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
        """``x`` [M, K] (any strides) -> [M, N]."""
        if weight.format != "dense" or weight.weight is None:
            raise ValueError(f"{type(self).__name__} got a {weight.format!r} weight without a dense tensor")
        packed = weight.data.get("onednn")
        if packed is not None and x.dtype == weight.weight.dtype:
            return onednn_packed_linear(x, packed, weight.bias)
        return _torch_linear(x, weight.weight, weight.bias)


def _torch_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear``, never handing its bf16/fp16 path a strided ``x``.

    torch 2.13's bf16 ``F.linear`` on Intel AMX hosts (oneDNN) reads outside a strided view of ``x``
    at M = 33 (issue 23: NaN in the conformance case ``gemm-bf16-33x255x513-bias-x-strided``; fine at
    M <= 16 and in fp32), and a model hands the GEMM such views (the halves of a fused projection). The
    copy costs little next to the product. Measured on AMD EPYC Zen 3 (AVX2/FMA only; 2 threads, a
    machine shared at load ~15, so each figure is the fastest of 200 runs, 20 at M = 512): a bf16
    ``[M, 576]`` view of ``[M, 1152]`` copies in 2.5 us at M = 16, 6 us at M = 64 and 28 us at M = 512,
    against 1.2-1.5 ms for the [576 -> 1536] product at M = 16 alone (fp16 alike). At M = 1 a row view
    is already contiguous and nothing is copied. fp32 keeps the view
    (its path reads it correctly, and the fp32 speed stays as it was)."""
    if x.dtype in _COPY_STRIDED and not x.is_contiguous():
        x = x.contiguous()
    return F.linear(x, w, bias)


#: Dtypes whose torch GEMM gets a contiguous copy of a strided ``x`` (see :func:`_torch_linear`).
_COPY_STRIDED = frozenset({torch.bfloat16, torch.float16})


def _mode(name: str, given: str | None, env: str, modes: tuple[str, ...]) -> str:
    """``given``, else ``$env``, else the first of ``modes``; a value not in ``modes`` is refused,
    naming where it came from."""
    value = os.environ.get(env, modes[0]) if given is None else given
    if value not in modes:
        where = f"{env}={value!r}" if given is None else f"{name}={value!r}"
        raise ValueError(f"{where}: expected one of {', '.join(modes)}")
    return value


class NativeGemm(CpuGemm):
    """:class:`CpuGemm` with the native kernels: fp32 weights in panels, q4_1/q8_0 blocks kept.

    Both native paths take a contiguous fp32 copy of ``x`` unless it is one already, so the library
    never sees a strided view."""

    def __init__(
        self,
        dtype: torch.dtype,
        native: NativeKernels,
        activations: str | None = None,
        quant_batched: str | None = None,
        onednn_packed: str | None = None,
        bf16_pairs: str | None = None,
    ) -> None:
        super().__init__(dtype, onednn_packed)
        self.native = native
        self.quant_batched = _mode("quant_batched", quant_batched, QUANT_BATCHED_ENV, QUANT_BATCHED_MODES)
        self._scratch16: torch.Tensor | None = None  # a bf16-dequantized weight of a batched product
        self.dequant_rows_max_rows = DEQUANT_ROWS_MAX_ROWS.get(native.variant.name, DEQUANT_ROWS_MAX_ROWS["avx2"])
        self.activations = activations = _mode("activations", activations, ACTIVATIONS_ENV, ACTIVATION_MODES)
        # int16 activations take q4_1 weights in 16-row panels (NativeKernels.pack_q4_1p16) or 4-row
        # groups (pack_q4_1x4) where that pays
        groups = _mode("groups", None, GROUPS_ENV, GROUPS_MODES)
        if groups == "auto":
            groups = "16"
        #: the layout int16 activations take q4_1 weights in (None: GGUF order)
        self.q4_1_layout = {"16": Q4_1P16, "4": Q4_1X4}.get(groups) if activations == "int16" else None
        #: ... and q8_0 weights: the 16-row panels with q4_1's
        self.q8_0_layout = Q8_0P16 if self.q4_1_layout == Q4_1P16 else None
        rows16 = os.environ.get(ROWS16_ENV)
        if rows16 is not None and not rows16.isdigit():
            raise ValueError(f"{ROWS16_ENV}={rows16!r}: expected a row count (0: never the native tiles)")
        pairs = _mode("bf16_pairs", bf16_pairs, PAIRS_ENV, PAIRS_MODES)
        #: a bf16 model's weights in pair panels for the AVX512-BF16 kernel (dense [N, K] otherwise)
        self.bf16_pairs = dtype == torch.bfloat16 and pairs == "auto" and native.bf16_dot
        #: the AMX tile kernel takes every product of a weight with K a multiple of 32 (pairs_max_rows); a
        #: weight with another K runs the dot-product kernel, which keeps the oneDNN copy above 64 rows
        self.amx_takes_all = self.bf16_pairs and native.amx_bf16 and rows16 is None and not self.onednn_pack_always
        self._onednn_for_odd_k = self.amx_takes_all and self.onednn_packed
        if self.amx_takes_all:
            self.onednn_packed = False  # no copy of the tile kernel's weights to keep
        if rows16 is not None:
            self.rows16_max_rows = int(rows16)
        elif self.bf16_pairs:
            self.rows16_max_rows = pairs_max_rows(self.onednn_packed, native.amx_bf16)
        elif dtype == torch.bfloat16 and onednn_runs_bf16(_cpu_flags()):
            self.rows16_max_rows = ROWS16_BF16_PACKED if self.onednn_packed else ROWS16_BF16_ONEDNN
        else:
            self.rows16_max_rows = UNBOUNDED
        self._scratch: torch.Tensor | None = None  # dequantized weight of a prefill-sized product
        # an fp32 model takes a 16-bit checkpoint's weights as stored and keeps them in 16-bit panels
        keep16 = dtype == torch.float32 and os.environ.get(KEEP16_ENV, "1") != "0"
        self.stored_dtypes = frozenset(PANEL16_DTYPES) if keep16 else frozenset()
        bf16x3 = os.environ.get(BF16X3_ENV, "0")
        if not bf16x3.isdigit():
            raise ValueError(f"{BF16X3_ENV}={bf16x3!r}: expected a row count (0: never)")
        #: an fp32 model's products from this many rows as three bf16 products on AMX tiles (0: never)
        self.bf16x3_min_rows = int(bf16x3) if dtype == torch.float32 and native.amx_bf16 else 0

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearWeight:
        """As :meth:`CpuGemm.prepare`; in an fp32 model, weights with K a multiple of 8 are laid out in
        panels instead: a bf16/fp16 weight (a checkpoint stored in 16 bits) keeps its 16 bits (format
        ``"w16_panels"``: half the bytes to read, the same products as its fp32 values), any other
        one is cast to fp32 (format ``"f32_panels"``). A bf16 or fp16 model keeps its weights dense
        ``[N, K]`` in its dtype, for the native row tiles at few rows and oneDNN above (see
        :meth:`linear`); the bias also as fp32 for the native tiles."""
        if weight.dtype in self.stored_dtypes and weight.shape[1] % 8 == 0:
            b = None if bias is None else bias.to(device="cpu", dtype=torch.float32).contiguous()
            panels = self.native.pack_16(weight.to(device="cpu").contiguous())
            n, k = weight.shape
            return LinearWeight(n, k, weight=None, bias=b, format=PANELS16, data={"panels": panels})
        prepared = super().prepare(weight, bias)
        if self.dtype in PANEL16_DTYPES and prepared.bias is not None:
            prepared.data["bias_f32"] = prepared.bias.to(torch.float32)
        w = prepared.weight
        if self._onednn_for_odd_k and w is not None and prepared.in_features % 32 and self._room_to_pack(w):
            prepared.data["onednn"] = onednn_pack(w)  # the dot-product kernel's K: oneDNN above ROWS16_BF16_PAIRS
        if self.bf16_pairs and w is not None and prepared.in_features % 2 == 0:
            # the pair panels replace the [N, K] weight: oneDNN's copy (when made) serves larger products
            prepared.data["pairs"] = self.native.pack_bf16_pairs(w)
            return LinearWeight(prepared.out_features, prepared.in_features, weight=None, bias=prepared.bias,
                                format=PAIRS, data=prepared.data)  # fmt: skip
        if self.dtype != torch.float32 or w is None or prepared.in_features % 8:
            return prepared
        panels = self.native.pack_f32(w)  # [ceil(N/8), K, 8]
        data = {"panels": panels}
        if self.bf16x3_min_rows and prepared.in_features % 32 == 0:
            data["bf16x3"] = self.native.pack_bf16x3(w)  # fp32 and contiguous, as prepared
        return LinearWeight(prepared.out_features, prepared.in_features, weight=None, bias=prepared.bias,
                            format=PANELS, data=data)  # fmt: skip

    def prepare_quantized(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> LinearWeight:
        """Keep q4_1/q8_0 blocks (the bias in fp32); other formats are dequantized.

        With int16 activations (the default; ``PLINTH_CPU_Q4_1_GROUPS``), a q4_1 weight is laid out
        once in 16-row panels (format ``"q4_1p16"``, the same values: see
        :meth:`NativeKernels.pack_q4_1p16`) for the int16 panel kernel (up to
        :func:`native_quant_max_rows` rows), and a q8_0 weight in the same panels (``"q8_0p16"``);
        or on request q4_1 in 4-row groups (``"q4_1x4"``, :meth:`NativeKernels.pack_q4_1x4`).
        Otherwise both keep their GGUF blocks as they are. float64
        dequantizes too (exactly: the blocks' values are fp32 numbers): the native kernels multiply
        and accumulate in fp32, an fp32 result in a float64 GEMM (conformance 1.3 found it)."""
        if weight.format not in QUANT_FORMATS or self.dtype == torch.float64:
            return super().prepare_quantized(weight, bias)
        b = None if bias is None else bias.to(device="cpu", dtype=torch.float32).contiguous()
        n, k = weight.out_features, weight.in_features
        layout = self.q4_1_layout if weight.format == "q4_1" else self.q8_0_layout
        if layout is not None:
            pack = {Q4_1P16: self.native.pack_q4_1p16, Q8_0P16: self.native.pack_q8_0p16}.get(layout)
            packed = (pack or self.native.pack_q4_1x4)(weight.blocks, n, k)
            return LinearWeight(n, k, weight=None, bias=b, format=layout, data={"blocks": packed})
        blocks = weight.blocks.contiguous()
        return LinearWeight(n, k, weight=None, bias=b, format=weight.format, data={"blocks": blocks})

    def linear(self, x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
        """``x`` [M, K] -> [M, N]. A bf16/fp16 ``x`` is widened to fp32 and the fp32 result rounded
        back to its dtype once, by native calls (so a 16-bit model's step records in a graph)."""
        if "bf16x3" in weight.data and x.shape[0] >= self.bf16x3_min_rows and not self.native.recording:
            y = self.native.gemm_bf16x3(x, weight.data["bf16x3"], weight.bias, weight.out_features)
            return self._as_dtype(y, x.dtype)
        if weight.format in (PANELS, PANELS16):
            gemm = self.native.gemm_f32_panels if weight.format == PANELS else self.native.gemm_panels16
            y = gemm(self._as_f32(x), weight.data["panels"], weight.bias, weight.out_features)
            return self._as_dtype(y, x.dtype)
        if weight.format in QUANT_FORMATS or weight.format in INT16_LAYOUTS:
            return self._linear_quantized(x, weight)
        if weight.format == PAIRS:
            return self._linear_pairs(x, weight)
        w = weight.weight
        if (
            w is not None
            and w.dtype == x.dtype in PANEL16_DTYPES
            and x.shape[0] <= self.rows16_max_rows
            and weight.in_features % 8 == 0
            and w.is_contiguous()
        ):  # a 16-bit model's few-row product: the native row tiles, recorded in step graphs
            bias = weight.data.get("bias_f32")
            if bias is None and weight.bias is not None:
                bias = weight.bias.to(torch.float32)
            return self._as_dtype(self.native.gemm_rows16(self._as_f32(x), w, bias), x.dtype)
        return super().linear(x, weight)

    def _linear_pairs(self, x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
        """A bf16 model's product over pair panels: the AVX512-BF16 kernel (a native call, recorded in
        step graphs) up to :attr:`rows16_max_rows` rows, or at any count when the weight has no
        oneDNN copy; above, oneDNN on its pre-packed copy. ``x`` of another dtype is rounded to bf16
        first, as ``F.linear`` on the bf16 weight would need."""
        dtype = x.dtype
        packed = weight.data.get("onednn")
        bound = self.rows16_max_rows if weight.in_features % 32 == 0 or not self.amx_takes_all else ROWS16_BF16_PAIRS
        if packed is not None and x.shape[0] > bound:
            return onednn_packed_linear(x.to(torch.bfloat16), packed, weight.bias).to(dtype)
        if dtype != torch.bfloat16:
            x = self.native.convert(self._as_f32(x), torch.bfloat16)
        elif x.shape[1] > 1 and x.stride(1) != 1:
            x = x.contiguous()
        y = self.native.gemm_bf16_pairs(x, weight.data["pairs"], weight.data.get("bias_f32"), weight.out_features,
                                        torch.float32 if dtype == torch.float32 else torch.bfloat16)  # fmt: skip
        return y.to(dtype)

    def _linear_quantized(self, x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
        native = self.native
        xf = self._as_f32(x)
        blocks = weight.data["blocks"]
        n = weight.out_features
        m = x.shape[0]
        if self.quant_batched == "bf16" and m >= QUANT_BF16_MIN_ROWS and self.activations != "int8":
            y = self._linear_bf16(xf, weight)  # in bf16 through oneDNN
        elif m <= native_quant_max_rows(weight.format, native.variant.name):
            y = native.gemm_quant(weight.format, xf, blocks, weight.bias, n, activations=self.activations)
        else:  # fp32 activations, or int8 as in the few-row path
            if self.activations == "int8":
                xf = native.round_trip_q8(xf)
            if m <= self.dequant_rows_max_rows:  # fp32 tiles on 3 rows dequantized at a time
                y = native.gemm_dequant(weight.format, xf, blocks, weight.bias, n)
            else:  # prefill-sized: the whole weight dequantized once into panels in scratch
                k = weight.in_features
                size = (n + 7) // 8 * 8 * k
                if self._scratch is None or self._scratch.numel() < size:
                    self._scratch = torch.empty(size, dtype=torch.float32)
                panels = native.dequant_panels(weight.format, blocks, n, k, self._scratch)
                y = native.gemm_f32_panels(xf, panels, weight.bias, n)
        return self._as_dtype(y, x.dtype)

    def _linear_bf16(self, xf: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
        """``xf`` (fp32) times a quantized weight in bf16 (:data:`QUANT_BATCHED_ENV`): the weight
        dequantized to bf16 into scratch and ``xf`` rounded to bf16 by native calls, the product by
        ``F.linear``, widened to fp32, then the fp32 bias."""
        n, k = weight.out_features, weight.in_features
        if self._scratch16 is None or self._scratch16.numel() < n * k:
            self._scratch16 = torch.empty(n * k, dtype=torch.bfloat16)
        w = self.native.dequant(weight.format, weight.data["blocks"], n, k, self._scratch16[: n * k].view(n, k),
                                torch.bfloat16)  # fmt: skip
        y = self.native.convert(F.linear(self.native.convert(xf, torch.bfloat16), w), torch.float32)
        return y if weight.bias is None else y.add_(weight.bias)

    def _as_f32(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as a contiguous fp32 tensor: itself, a native widening of a bf16/fp16 ``x``, or torch's."""
        if x.dtype == torch.float32 and x.is_contiguous():
            return x
        if x.dtype in ELEMENT_TYPES and x.stride(-1) == 1:
            return self.native.convert(x, torch.float32)
        return x.to(torch.float32).contiguous()

    def _as_dtype(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The fp32 result ``y`` in ``dtype``, rounded by a native call where it is bf16/fp16."""
        if dtype == torch.float32:
            return y
        return self.native.convert(y, dtype) if dtype in ELEMENT_TYPES else y.to(dtype)
