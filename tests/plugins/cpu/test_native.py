"""The CPU backend's native kernels against torch / the reference semantics."""

from __future__ import annotations

import functools
import platform
import shutil
import subprocess
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from plinth.platform.backend import AttentionMetadata, AttentionSpec, SmallOps
from plinth.platform.quant import QuantizedWeight, dequantize, quantize_q8_0
from plinth.runtime.outputs import CompletionOutput
from plinth_cpu import gemm as gemm_mod
from plinth_cpu import native as native_mod
from plinth_cpu.attention import CPU_KV_LAYOUT, CpuAttention, NativeAttention
from plinth_cpu.gemm import DEQUANT_ROWS_MAX_ROWS, NATIVE_QUANT_MAX_ROWS, NativeGemm
from plinth_cpu.native import GRAPH_OPS, GraphError, NativeGraph, NativeKernels, native, native_status
from plinth_cpu.ops import CpuOps


def _can_build() -> bool:
    flags = native_mod._cpu_flags() or set()
    return platform.machine() == "x86_64" and flags >= native_mod.REQUIRED_CPU_FLAGS and bool(shutil.which("cc"))


def test_native_kernels_load_where_they_can() -> None:
    """On an AVX2 host with a compiler (CI's), the kernels build and load: they never silently go missing."""
    if not _can_build():
        assert native() is None and "native kernels" in native_status()
        pytest.skip(native_status())
    assert native() is not None, native_status()
    variant = native_mod.choose_variant()[0]
    assert native_status().startswith(f"native kernels: {variant.label}")
    kernels = native()
    assert kernels is not None and kernels.variant is variant and kernels.lib.plinth_isa() == variant.level


needs_native = pytest.mark.skipif(native() is None, reason=native_status())

#: Every build this CPU runs (best first): the kernel tests run on each, named in their ids.
RUNNABLE = [v.name for v in native_mod.runnable_variants()] if native() is not None else ["none"]


@functools.cache
def _kernels(variant: str) -> NativeKernels:
    """The process-wide kernels where ``variant`` is the loaded build, else that build loaded beside it."""
    loaded = native()
    assert loaded is not None
    if loaded.variant.name == variant:
        return loaded
    compiler = native_mod.build_check()[0]
    assert compiler is not None
    chosen = next(v for v in native_mod.variants() if v.name == variant)
    return NativeKernels(native_mod.build(compiler, chosen), chosen)


def _on_every_build(threads: int, call: Callable[[NativeKernels], torch.Tensor]) -> list[torch.Tensor]:
    """``call``'s result on the kernels of each build this CPU runs, each at ``threads`` threads."""
    results = []
    for variant in RUNNABLE:
        kernels = _kernels(variant)
        before = kernels.num_threads()
        kernels.set_num_threads(threads)
        try:
            results.append(call(kernels))
        finally:
            kernels.set_num_threads(before)
    return results


@pytest.fixture(params=RUNNABLE)
def nk(request: pytest.FixtureRequest) -> NativeKernels:
    """The kernels of each ISA build this CPU runs (AVX-512 and AVX2 on an AVX-512 host)."""
    return _kernels(request.param)


@pytest.fixture
def recording(nk: NativeKernels):  # noqa: ANN201
    """The kernels, never left recording by a test (they are the process-wide instance)."""
    yield nk
    nk.cancel_recording()


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest, nk: NativeKernels):  # noqa: ANN201
    before = nk.num_threads()
    nk.set_num_threads(request.param)
    yield request.param
    nk.set_num_threads(before)


def _q4_1(n: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    """Random q4_1 blocks: fp16 scale and min, random nibbles."""
    nb = n * k // 32
    d = (torch.rand(nb, 1, generator=gen) * 0.05 + 0.01).half()
    m = (torch.rand(nb, 1, generator=gen) * -0.2).half()
    qs = torch.randint(0, 256, (nb, 16), generator=gen, dtype=torch.uint8)
    blocks = torch.cat((d.view(torch.uint8), m.view(torch.uint8), qs), dim=1)
    return QuantizedWeight("q4_1", n, k, blocks.reshape(n, -1).contiguous())


def _activation_error_bound(x: torch.Tensor, w: torch.Tensor, levels: int = 127) -> torch.Tensor:
    """|x @ w.T - xq @ w.T| <= sum_k |w_k| * amax(block of k) / (2 levels): the rounding of
    activations to integers in [-levels, levels] per 32-block (int8: 127, int16: 32767)."""
    M, K = x.shape
    half_step = x.view(M, K // 32, 32).abs().amax(-1, keepdim=True).expand(M, K // 32, 32).reshape(M, K)
    return (half_step / (2 * levels)) @ w.abs().t() * 1.001 + 1e-5


@needs_native
@pytest.mark.parametrize("m", [1, 3, 8, 45, 70, 101])  # 4-row tiles, 1-row tiles, 64-row blocks
@pytest.mark.parametrize("n", [13, 96, 100])
@pytest.mark.parametrize("k", [64, 1544])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_f32_matches_linear(nk: NativeKernels, threads: int, m: int, n: int, k: int, bias: bool) -> None:
    """The row-major weight path (3-row tiles over three far-apart segments)."""
    gen = torch.Generator().manual_seed(m * 100 + n + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    tol = 1e-5 * k**0.5  # sums of k products in another order
    torch.testing.assert_close(nk.gemm_f32(x, w, b), F.linear(x, w, b), rtol=tol, atol=tol)


@needs_native
# up to one tile of rows (4 in the AVX2 build, 8 in the AVX-512 one): K in one pass; 9, 16: two 8-row
# tiles (AVX-512); 17, 45: 4-row tiles that prefetch the next block; 64-row blocks; the blocked path
@pytest.mark.parametrize("m", [1, 4, 5, 8, 9, 16, 17, 45, 70, 263])
@pytest.mark.parametrize("n", [8, 13, 100, 200])  # 13, 100: a last panel of 5 and 4 rows
@pytest.mark.parametrize("k", [64, 1544])  # 1544: 13 blocks of K, the last one shorter
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_f32_panels_matches_linear(nk: NativeKernels, threads: int, m: int, n: int, k: int, bias: bool) -> None:
    """The panel path: triples of panels from three segments, leftover panels, partial last panel."""
    gen = torch.Generator().manual_seed(m * 100 + n + k + 7)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    tol = 1e-5 * k**0.5
    got = nk.gemm_f32_panels(x, nk.pack_f32(w), b, n)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=tol, atol=tol)


@needs_native
# the blocked path: whole 12-row tiles (96), a lone last micro-panel of 4 rows (100), a 12-row tile whose
# second micro-panel has 5 rows (263)
@pytest.mark.parametrize("m", [96, 100, 263])
@pytest.mark.parametrize("n", [13, 200])
@pytest.mark.parametrize("k", [64, 1544])  # K in one pass and in two
def test_gemm_f32_panels_builds_agree_bit_for_bit(threads: int, m: int, n: int, k: int) -> None:
    """The AVX-512 build's many-row tiles (12 rows by 32 columns) sum each output's products in the
    AVX2 build's order (6 rows by 16): the same results, bit for bit."""
    if len(RUNNABLE) < 2:
        pytest.skip(f"one build runs on this CPU ({RUNNABLE[0]}): nothing to compare")
    gen = torch.Generator().manual_seed(m + n + k)
    x, w, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    results = _on_every_build(threads, lambda kernels: kernels.gemm_f32_panels(x, kernels.pack_f32(w), b, n))
    assert all(torch.equal(r, results[0]) for r in results[1:])


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m", [1, 4, 5, 8, 9, 16, 45, 70, 263])  # few-row tiles, 64-row blocks, the blocked path
@pytest.mark.parametrize("n", [8, 13, 200])  # 13: a last panel of 5 rows
@pytest.mark.parametrize("k", [64, 1544])  # 1544: 13 blocks of K, the last one shorter
def test_gemm_panels16_equal_fp32_panels(
    nk: NativeKernels, threads: int, dtype: torch.dtype, m: int, n: int, k: int
) -> None:
    """A 16-bit weight in its own panels gives the sums of the fp32 panels of its values bit for bit
    (widened exactly as read, the same FMA chains), with and without a bias, on every path."""
    gen = torch.Generator().manual_seed(m * 100 + n + k + 11)
    x, w16 = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen)
    panels = nk.pack_16(w16)
    assert panels.dtype == dtype and panels.shape == ((n + 7) // 8, k, 8)
    assert torch.equal(panels.float(), nk.pack_f32(w16.float()))  # the same layout, padding rows zero
    for bias in (None, b):
        got = nk.gemm_panels16(x, panels, bias, n)
        assert torch.equal(got, nk.gemm_f32_panels(x, nk.pack_f32(w16.float()), bias, n))
    tol = 1e-5 * k**0.5
    torch.testing.assert_close(got, F.linear(x, w16.float(), b), rtol=tol, atol=tol)


@needs_native
@pytest.mark.parametrize("m", [1, 48, 100])  # from 48 rows an output this wide takes the blocked path
@pytest.mark.parametrize("k", [64, 264])  # 264: over 16 MiB as fp32, widened block by block in the items
def test_gemm_panels16_wide_output(nk: NativeKernels, m: int, k: int) -> None:
    """An lm_head-wide bf16 weight (16389 outputs, a partial last panel) equals its fp32 panels, on
    the blocked path both when the whole weight is widened once and when each item widens its block."""
    gen = torch.Generator().manual_seed(m + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(16389, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(16389, generator=gen)
    want = nk.gemm_f32_panels(x, nk.pack_f32(w.float()), b, 16389)
    assert torch.equal(nk.gemm_panels16(x, nk.pack_16(w), b, 16389), want)


@needs_native
def test_pack_16_refuses_other_dtypes(nk: NativeKernels) -> None:
    """16-bit panels hold bf16 or fp16; an fp32 weight is a clear error, not reinterpreted bytes."""
    with pytest.raises(ValueError, match="bf16 or fp16, not torch.float32"):
        nk.pack_16(torch.zeros(8, 8))


@needs_native
@pytest.mark.parametrize("m", [47, 48, 95])  # from 48 rows an output this wide takes the blocked path
def test_gemm_f32_panels_wide_output(nk: NativeKernels, threads: int, m: int) -> None:
    """An lm_head-wide product (16389 outputs: a partial last panel) at the rows where the blocked
    path starts early for wide outputs, with a bias."""
    gen = torch.Generator().manual_seed(m)
    x, w, b = (
        torch.randn(m, 64, generator=gen),
        torch.randn(16389, 64, generator=gen),
        torch.randn(16389, generator=gen),
    )
    got = nk.gemm_f32_panels(x, nk.pack_f32(w), b, 16389)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-4, atol=1e-4)


@needs_native
def test_pack_f32_layout(nk: NativeKernels, threads: int) -> None:
    """Panel p holds rows 8p..8p+7 k-major; the last panel's missing rows are zeros."""
    w = torch.randn(21, 32)
    panels = nk.pack_f32(w)
    assert panels.shape == (3, 32, 8)
    padded = torch.cat((w, torch.zeros(3, 32)))  # 24 rows
    assert torch.equal(panels, padded.view(3, 8, 32).transpose(1, 2))


@needs_native
@pytest.mark.parametrize("activations", ["fp32", "int16", "int8"])
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("m", [1, 5, NATIVE_QUANT_MAX_ROWS + 3, 40, max(DEQUANT_ROWS_MAX_ROWS.values()) + 5])
@pytest.mark.parametrize("k", [96, 128])  # 3 and 4 blocks a row: the AVX-512 build's pair loop and its odd block
def test_quantized_linear(nk: NativeKernels, threads: int, fmt: str, m: int, k: int, activations: str) -> None:
    """fp32 activations: the dequantized weight's product. int16/int8 activations (int16 on the
    per-block kernels only): within the rounding bound. On every path (int16: the 16-row panel kernel,
    at every row count under the AVX-512 build and up to 8 rows under AVX2; fp32 and int8: few rows on
    the per-block kernel; more: dequantized rows, or panels, from 17 rows on the AVX-512 build and 65
    on AVX2), and a row's result does not depend on the batch size beyond that."""
    gen = torch.Generator().manual_seed(7)
    n = 40
    qw = _q4_1(n, k, gen) if fmt == "q4_1" else quantize_q8_0(torch.randn(n, k, generator=gen))
    w = dequantize(qw)
    b = torch.randn(n, generator=gen)
    x = torch.randn(m, k, generator=gen)
    gemm = NativeGemm(torch.float32, nk, activations=activations)
    prepared = gemm.prepare_quantized(qw, b)
    # int16 activations take the weight laid out in 16-row panels (the same values) on both builds
    assert prepared.format == (f"{fmt}p16" if activations == "int16" else fmt)
    assert prepared.weight is None  # never dequantized
    y = gemm.linear(x, prepared)
    ref = F.linear(x.double(), w.double(), b.double()).float()
    row = gemm.linear(x[:1], prepared)
    if activations == "int8":
        assert ((y - ref).abs() <= _activation_error_bound(x, w)).all()
        assert (y - ref).abs().max() > 1e-4  # really rounded activations
        torch.testing.assert_close(y[:1], row, rtol=1e-5, atol=1e-5)
    elif activations == "int16" and m <= gemm_mod.native_quant_max_rows(prepared.format, nk.variant.name):
        err = (y - ref).abs()
        assert (err <= _activation_error_bound(x, w, levels=32767)).all()
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=2e-3)
        torch.testing.assert_close(y[:1], row, rtol=1e-5, atol=1e-5)
    else:  # fp32, and int16 past the few-row path: the dequantized weight's product
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
        bound = _activation_error_bound(x[:1], w, levels=32767) if activations == "int16" else 1e-4
        assert ((y[:1] - row).abs() <= bound).all()  # row alone: int16 path


#: The library's own layouts (both builds multiply each): name -> (the GGUF format it holds, bytes of
#: an [n, k] weight).
LAYOUTS = {
    "q4_1x4": ("q4_1", lambda n, k: (n + 3) // 4 * ((k // 32 * 80 + 63) // 64 * 64)),
    "q4_1p16": ("q4_1", lambda n, k: (n + 15) // 16 * (k // 32) * 320),
    "q8_0p16": ("q8_0", lambda n, k: (n + 15) // 16 * (k // 32) * 544),
}


def _weight(layout: str, n: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    """Random GGUF blocks of the format ``layout`` holds."""
    return _q4_1(n, k, gen) if LAYOUTS[layout][0] == "q4_1" else quantize_q8_0(torch.randn(n, k, generator=gen))


def _pack(nk: NativeKernels, layout: str, qw: QuantizedWeight) -> torch.Tensor:
    """``qw`` in ``layout``."""
    return _packer(nk, layout)(qw.blocks, qw.out_features, qw.in_features)


def _packer(nk: NativeKernels, layout: str):  # noqa: ANN202
    return {"q4_1x4": nk.pack_q4_1x4, "q4_1p16": nk.pack_q4_1p16, "q8_0p16": nk.pack_q8_0p16}[layout]


@needs_native
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("n", [1, 6, 13, 17, 64, 100, 1040])  # partial groups and panels; streams and leftovers
@pytest.mark.parametrize("k", [32, 96, 1536])  # 1, 3 and 48 blocks a row (a group of 3 blocks: padded stride)
def test_quant_layouts_hold_the_gguf_values(nk: NativeKernels, threads: int, layout: str, n: int, k: int) -> None:
    """The 4-row groups and the 16-row panels hold each row's values exactly: every dequantizing
    entry point (whole, in panels, the many-row GEMM) gives the GGUF blocks' results bit for bit."""
    gen = torch.Generator().manual_seed(n * 7 + k)
    fmt = LAYOUTS[layout][0]
    qw = _weight(layout, n, k, gen)
    packed = _pack(nk, layout, qw)
    assert packed.numel() == LAYOUTS[layout][1](n, k) and packed.data_ptr() % 64 == 0
    assert torch.equal(nk.dequant(layout, packed, n, k), nk.dequant(fmt, qw.blocks, n, k))
    torch.testing.assert_close(nk.dequant(fmt, qw.blocks, n, k), dequantize(qw), rtol=1e-6, atol=1e-7)
    size = (n + 7) // 8 * 8 * k
    want = nk.dequant_panels(fmt, qw.blocks, n, k, torch.empty(size))
    assert torch.equal(nk.dequant_panels(layout, packed, n, k, torch.empty(size)), want)
    x = torch.randn(NATIVE_QUANT_MAX_ROWS + 5, k, generator=gen)
    assert torch.equal(nk.gemm_dequant(layout, x, packed, None, n), nk.gemm_dequant(fmt, x, qw.blocks, None, n))


@needs_native
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("m", [1, 2, 3, 7, NATIVE_QUANT_MAX_ROWS, 133])  # q4_1p16: 1-4 row tiles, 128-row chunks
@pytest.mark.parametrize("n", [5, 13, 64, 100, 1040])
@pytest.mark.parametrize("k", [32, 96, 1536])
def test_quant_layouts_gemm_matches_the_row_kernel(
    nk: NativeKernels, threads: int, layout: str, m: int, n: int, k: int
) -> None:
    """The int16 kernels over 4-row groups and 16-row panels: the same int16 activations and exact
    integer block sums as the GGUF-order kernel, so they agree up to fp32 rounding; within the
    rounding bound of the dequantized product; and a row's result does not depend on the batch it is
    in."""
    gen = torch.Generator().manual_seed(m * 1000 + n * 7 + k)
    qw, b = _weight(layout, n, k, gen), torch.randn(n, generator=gen)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, k, generator=gen) * 4  # blocks of unlike magnitudes
    packed = _pack(nk, layout, qw)
    got = nk.gemm_quant(layout, x, packed, b, n, "int16")
    rows = nk.gemm_quant(LAYOUTS[layout][0], x, qw.blocks, b, n, "int16")
    torch.testing.assert_close(got, rows, rtol=2e-6 * k**0.5, atol=2e-6 * k**0.5)
    w = dequantize(qw)
    ref = F.linear(x.double(), w.double(), b.double()).float()
    assert ((got - ref).abs() <= _activation_error_bound(x, w, levels=32767)).all()
    assert torch.equal(nk.gemm_quant(layout, x[-1:], packed, b, n, "int16"), got[-1:])
    assert torch.equal(nk.gemm_quant(layout, x[:1], packed, None, n, "int16") + b, got[:1])  # the bias added once


@needs_native
@pytest.mark.parametrize("layout", ["q4_1p16", "q8_0p16"])
@pytest.mark.parametrize("m", [16, 17, 40, 133])  # one tile of rows; a padded one; several; past 128
@pytest.mark.parametrize("n", [13, 48, 100])  # one partial panel; an odd count of panels; a partial pair
@pytest.mark.parametrize("k", [32, 1536])
def test_quant_panels_on_amx_int8_tiles_match_the_vnni_kernel(
    nk: NativeKernels, threads: int, layout: str, m: int, n: int, k: int
) -> None:
    """The 16-row panels on AMX-INT8 tiles (``PLINTH_CPU_AMX_INT8=1``): the int16 activations split
    into a signed high and an unsigned low byte give the VNNI kernel's exact integer block sums, and
    the same scaling after them, so the outputs are the VNNI kernel's bit for bit. Runs where the CPU
    has AMX-INT8 or on the emulated build (``PLINTH_CPU_EMULATE=1``); says which."""
    before = nk.amx_int8
    if not nk.set_amx_int8(True):
        nk.set_amx_int8(before)
        pytest.skip(f"{nk.variant.name} build: no AMX-INT8 tiles here (the emulated build runs this test)")
    gen = torch.Generator().manual_seed(m * 1000 + n * 7 + k)
    qw, b = _weight(layout, n, k, gen), torch.randn(n, generator=gen)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, k, generator=gen) * 4  # blocks of unlike magnitudes
    packed = _pack(nk, layout, qw)
    try:
        tiles = nk.gemm_quant(layout, x, packed, b, n, "int16")
        nk.set_amx_int8(False)
        vnni = nk.gemm_quant(layout, x, packed, b, n, "int16")
    finally:
        nk.set_amx_int8(before)
    print(f"{layout} {m}x{n}x{k}: AMX-INT8 tiles ({nk.variant.label}) against the VNNI kernel")
    assert torch.equal(tiles, vnni)
    w = dequantize(qw)
    ref = F.linear(x.double(), w.double(), b.double()).float()
    assert ((tiles - ref).abs() <= _activation_error_bound(x, w, levels=32767)).all()


@needs_native
def test_amx_int8_tiles_follow_the_environment(nk: NativeKernels, monkeypatch: pytest.MonkeyPatch) -> None:
    """PLINTH_CPU_AMX_INT8 is read when the kernels load: "1" turns the tiles on where the build has
    them (the emulated build, or a CPU with AMX-INT8), PLINTH_CPU_AMX=0 overrides it, "0" and unset
    leave them off, and another value is named."""
    before = nk.amx_int8
    has_tiles = nk.set_amx_int8(True)
    try:
        cases = [("1", "auto", has_tiles), ("1", "0", False), ("0", "auto", False), (None, "auto", False)]
        for env, amx, want in cases:
            if env is None:
                monkeypatch.delenv(native_mod.AMX_INT8_ENV, raising=False)
            else:
                monkeypatch.setenv(native_mod.AMX_INT8_ENV, env)
            monkeypatch.setenv(native_mod.AMX_ENV, amx)
            assert NativeKernels(nk.path, nk.variant).amx_int8 is want, (env, amx)
        monkeypatch.setenv(native_mod.AMX_INT8_ENV, "on")
        with pytest.raises(ValueError, match="PLINTH_CPU_AMX_INT8='on' is not one of 0, 1"):
            NativeKernels(nk.path, nk.variant)
    finally:
        nk.set_amx_int8(before)
        nk.lib.plinth_amx_bf16(int(nk.amx_bf16))  # the other AMX switch, as the library was loaded


@needs_native
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("m", [3, 9])  # a partial 4-row tile; two tiles and a row
def test_quant_layouts_builds_agree_bit_for_bit(threads: int, layout: str, m: int) -> None:
    """The AVX2 build runs the AVX-512 build's lanes in two halves (the same exact integer block
    sums, then the same fp32 chain per block): the same results, bit for bit."""
    if len(RUNNABLE) < 2:
        pytest.skip(f"one build runs on this CPU ({RUNNABLE[0]}): nothing to compare")
    gen = torch.Generator().manual_seed(5)
    qw, x = _weight(layout, 1040, 1536, gen), torch.randn(m, 1536, generator=gen)
    b = torch.randn(1040, generator=gen)

    def product(kernels: NativeKernels) -> torch.Tensor:
        packed = _packer(kernels, layout)(qw.blocks, 1040, 1536)
        return kernels.gemm_quant(layout, x, packed, b, 1040, "int16")

    results = _on_every_build(threads, product)
    assert all(torch.equal(r, results[0]) for r in results[1:])


@needs_native
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_quant_layouts_take_int16_activations_only(nk: NativeKernels, layout: str) -> None:
    """The library's layouts have one kernel each (int16): other activations are a clear error, not
    garbage; so are blocks of another shape."""
    qw = _weight(layout, 8, 64, torch.Generator().manual_seed(0))
    packed = _pack(nk, layout, qw)
    with pytest.raises(ValueError, match=f"{layout} weight takes int16 activations, not int8"):
        nk.gemm_quant(layout, torch.randn(1, 64), packed, None, 8, "int8")
    with pytest.raises(ValueError, match=f"are not the {LAYOUTS[layout][0]} blocks of 8 x 96"):
        _packer(nk, layout)(qw.blocks, 8, 96)


@needs_native
def test_q4_1_groups_follow_the_build_and_the_environment(nk: NativeKernels, monkeypatch: pytest.MonkeyPatch) -> None:
    """``PLINTH_CPU_Q4_1_GROUPS``: "auto" (default) and "16" lay q4_1 and q8_0 rows out in 16-row
    panels under both builds, "4" q4_1 in 4-row groups, "0" GGUF order; fp32 and int8 activations keep
    GGUF order; a bad value is named. Whatever the layout, the results agree up to fp32 rounding."""
    gen = torch.Generator().manual_seed(3)
    qw, x = _q4_1(40, 96, gen), torch.randn(2, 96, generator=gen)
    monkeypatch.delenv("PLINTH_CPU_Q4_1_GROUPS", raising=False)
    auto = NativeGemm(torch.float32, nk)
    assert (auto.q4_1_layout, auto.q8_0_layout) == ("q4_1p16", "q8_0p16")
    gemms = {}
    for mode in ("16", "4", "0"):
        monkeypatch.setenv("PLINTH_CPU_Q4_1_GROUPS", mode)
        gemms[mode] = NativeGemm(torch.float32, nk)
        assert [NativeGemm(torch.float32, nk, activations=a).q4_1_layout for a in ("fp32", "int8")] == [None, None]
    prepared = {mode: g.prepare_quantized(qw, None) for mode, g in gemms.items()}
    want = {"16": "q4_1p16", "4": "q4_1x4", "0": "q4_1"}
    assert {mode: p.format for mode, p in prepared.items()} == {mode: want[mode] for mode in gemms}
    plain = gemms["0"].linear(x, prepared["0"])
    for mode, g in gemms.items():
        torch.testing.assert_close(g.linear(x, prepared[mode]), plain, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("PLINTH_CPU_Q4_1_GROUPS", "yes")
    with pytest.raises(ValueError, match="PLINTH_CPU_Q4_1_GROUPS='yes': expected one of auto, 16, 4, 0"):
        NativeGemm(torch.float32, nk)


@needs_native
@pytest.mark.parametrize(
    "env,attr,default,other,bad",
    [("PLINTH_CPU_ACTIVATIONS", "activations", "int16", "int8", "fp16"),
     ("PLINTH_CPU_QUANT_BATCHED", "quant_batched", "fp32", "bf16", "int8")],
)  # fmt: skip
def test_gemm_modes_from_the_environment(
    nk: NativeKernels, monkeypatch: pytest.MonkeyPatch, env: str, attr: str, default: str, other: str, bad: str
) -> None:
    monkeypatch.delenv(env, raising=False)
    assert getattr(NativeGemm(torch.float32, nk), attr) == default
    monkeypatch.setenv(env, other)
    assert getattr(NativeGemm(torch.float32, nk), attr) == other
    monkeypatch.setenv(env, bad)
    with pytest.raises(ValueError, match=f"{env}='{bad}'"):
        NativeGemm(torch.float32, nk)
    with pytest.raises(ValueError, match=f"{attr}='{bad}'"):
        NativeGemm(torch.float32, nk, **{attr: bad})


@needs_native
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_dequant_matches_reference(nk: NativeKernels, fmt: str) -> None:
    gen = torch.Generator().manual_seed(3)
    qw = _q4_1(24, 96, gen) if fmt == "q4_1" else quantize_q8_0(torch.randn(24, 96, generator=gen))
    torch.testing.assert_close(nk.dequant(fmt, qw.blocks, 24, 96), dequantize(qw), rtol=1e-6, atol=1e-7)


@needs_native
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", *LAYOUTS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_dequant_to_16_bits_rounds_as_torch(nk: NativeKernels, threads: int, fmt: str, dtype: torch.dtype) -> None:
    """Dequantized into a 16-bit tensor: the fp32 values rounded as ``Tensor.to`` rounds, bit for bit
    (fp16 scales times nibbles are rarely bf16 numbers: most values round)."""
    gen = torch.Generator().manual_seed(4)
    n, k = 22, 128
    qw = _weight(fmt, n, k, gen) if fmt in LAYOUTS else _weight("q4_1p16" if fmt == "q4_1" else "q8_0p16", n, k, gen)
    blocks = _pack(nk, fmt, qw) if fmt in LAYOUTS else qw.blocks
    want = dequantize(qw).to(dtype)
    got = nk.dequant(fmt, blocks, n, k, dtype=dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    assert not torch.equal(got.float(), dequantize(qw))  # rounding happened
    with pytest.raises(ValueError, match="not torch.float64"):
        nk.dequant(fmt, blocks, n, k, dtype=torch.float64)


@needs_native
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_quantized_batched_products_in_bf16(nk: NativeKernels, threads: int, fmt: str) -> None:
    """``quant_batched="bf16"``: from QUANT_BF16_MIN_ROWS rows a quantized product is torch's bf16
    ``F.linear`` of the bf16-rounded activations and dequantized weight, widened, plus the fp32 bias
    (bit for bit); below, the fp32 paths' result exactly; within bf16 rounding of the fp32 product."""
    gen = torch.Generator().manual_seed(8)
    n, k = 70, 192
    qw = _q4_1(n, k, gen) if fmt == "q4_1" else quantize_q8_0(torch.randn(n, k, generator=gen))
    bias = torch.randn(n, generator=gen)
    g16, g32 = NativeGemm(torch.float32, nk, quant_batched="bf16"), NativeGemm(torch.float32, nk, quant_batched="fp32")
    w16, w32 = g16.prepare_quantized(qw, bias), g32.prepare_quantized(qw, bias)
    for m in (gemm_mod.QUANT_BF16_MIN_ROWS, 100):
        x = torch.randn(m, k, generator=gen)
        got = g16.linear(x, w16)
        want = F.linear(x.to(torch.bfloat16), dequantize(qw).to(torch.bfloat16)).float() + bias
        assert torch.equal(got, want)
        ref = g32.linear(x, w32)
        assert (got - ref).abs().max() < 0.01 * ref.abs().max()  # bf16 rounding, relative to the outputs' scale
    small = torch.randn(gemm_mod.QUANT_BF16_MIN_ROWS - 1, k, generator=gen)
    assert torch.equal(g16.linear(small, w16), g32.linear(small, w32))


@needs_native
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_dequant_panels_match_packed_reference(nk: NativeKernels, threads: int, fmt: str) -> None:
    """Dequantized straight into panels: the panels of the dequantized weight (19 rows: a partial
    last panel), written over a scratch buffer holding garbage."""
    gen = torch.Generator().manual_seed(4)
    qw = _q4_1(19, 96, gen) if fmt == "q4_1" else quantize_q8_0(torch.randn(19, 96, generator=gen))
    scratch = torch.full((3 * 8 * 96 + 5,), float("nan"))
    panels = nk.dequant_panels(fmt, qw.blocks, 19, 96, scratch)
    torch.testing.assert_close(panels, nk.pack_f32(dequantize(qw)), rtol=1e-6, atol=1e-7)


@needs_native
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n", [13, 40, 200])  # a last group of 1 or 2 rows (of 3 dequantized at a time)
@pytest.mark.parametrize("m", [17, 64, 70])
def test_gemm_dequant_matches_dequantized_product(nk: NativeKernels, threads: int, fmt: str, n: int, m: int) -> None:
    """The many-row quantized path: 3 weight rows dequantized at a time, fp32 tiles over all rows."""
    gen = torch.Generator().manual_seed(n * 1000 + m)
    k = 160
    qw = _q4_1(n, k, gen) if fmt == "q4_1" else quantize_q8_0(torch.randn(n, k, generator=gen))
    x, b = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    got = nk.gemm_dequant(fmt, x, qw.blocks, b, n)
    torch.testing.assert_close(got, F.linear(x, dequantize(qw), b), rtol=1e-4, atol=1e-4)


def test_quantize_q8_0_round_trip() -> None:
    """q8_0 of fp32 weights: error at most half a step per block plus the fp16 rounding of the
    scale (127 steps times 2^-11 relative); zeros stay zeros."""
    w = torch.randn(8, 64)
    w[0, :32] = 0
    back = dequantize(quantize_q8_0(w))
    step = w.view(-1, 32).abs().amax(-1, keepdim=True) / 127
    assert ((back.view(-1, 32) - w.view(-1, 32)).abs() <= step * (0.5 + 127 * 2**-11) + 1e-7).all()
    assert back[0, :32].eq(0).all()


@needs_native
def test_small_ops_match_torch(nk: NativeKernels, threads: int) -> None:
    gen = torch.Generator().manual_seed(1)
    ops, ref = CpuOps(nk), SmallOps()
    x, w = torch.randn(37, 64, generator=gen), torch.randn(64, generator=gen)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    residual = torch.randn(37, 64, generator=gen)
    expected_sum = residual + x
    normed = nk.rms_norm(x, w, 1e-6, residual=residual)
    torch.testing.assert_close(residual, expected_sum)
    torch.testing.assert_close(normed, ref.rms_norm(expected_sum, w, 1e-6))
    gu = torch.randn(37, 2 * 48, generator=gen)
    torch.testing.assert_close(ops.silu_and_mul(gu), ref.silu_and_mul(gu))
    # rotary on a strided view (q inside a fused qkv row), partial rotary_dim: input untouched
    qkv = torch.randn(37, 4 * 32 + 2 * 32, generator=gen)
    q = qkv[:, : 4 * 32].view(37, 4, 32)
    before = qkv.clone()
    positions = torch.randint(0, 100, (37,), generator=gen)
    freqs = torch.arange(100.0)[:, None] * torch.rand(8, generator=gen)[None]
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # rotary_dim 16 < head 32
    torch.testing.assert_close(ops.rotary(q, positions, cos_sin, 16), ref.rotary(q, positions, cos_sin, 16))
    assert torch.equal(qkv, before)
    # Qwen3 / Gemma 3: the q/k norm read in place from the fused qkv (k: 2 heads at column 128), and
    # Gemma's GeGLU, large gate values included (tanh saturates; e^-2u overflows to inf)
    k = qkv[:, 4 * 32 : 6 * 32].view(37, 2, 32)
    wk = torch.randn(32, generator=gen)
    torch.testing.assert_close(ops.rms_norm_heads(k, wk, 1e-6), ref.rms_norm_heads(k, wk, 1e-6))
    assert ops.rms_norm_heads(k, wk, 1e-6).is_contiguous() and torch.equal(qkv, before)
    gu = torch.cat((torch.randn(37, 48, generator=gen) * 6, torch.randn(37, 48, generator=gen)), dim=1)
    torch.testing.assert_close(ops.gelu_tanh_and_mul(gu), ref.gelu_tanh_and_mul(gu), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000, 49152])
def test_apply_token_bitmask_matches_torch(nk: NativeKernels, vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32) + 1  # one word more than needed: its bits are ignored
    bitmask = torch.randint(-(2**31), 2**31, (5, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1  # every token allowed (the skipped words)
    bitmask[2] = 0  # none
    base = torch.randn(5, vocab + 3, generator=gen)
    ours, ref = base.clone(), base.clone()
    CpuOps(nk).apply_token_bitmask(ours[:, 2 : 2 + vocab], bitmask)  # a row-strided view
    SmallOps().apply_token_bitmask(ref[:, 2 : 2 + vocab], bitmask)
    assert torch.equal(ours, ref)
    assert not ours[2, 2 : 2 + vocab].isfinite().any() and torch.equal(ours[1], base[1])


def _decode_batch(  # noqa: ANN202
    seq_lens: list[int], spec: AttentionSpec, num_blocks: int, gen: torch.Generator, dtype: torch.dtype = torch.float32
):
    """A decode batch over a NaN-poisoned head-major ``dtype`` cache with shuffled, padded block tables."""
    bs, hk, d = spec.block_size, spec.num_kv_heads, spec.head_size
    cache = torch.full(CPU_KV_LAYOUT.shape(num_blocks, bs, hk, d), float("nan"), dtype=dtype)
    free = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables, used = [], 0
    for n in seq_lens:
        nb = -(-n // bs)
        tables.append(free[used : used + nb].tolist())
        used += nb
    width = max(len(t) for t in tables) + 1
    block_tables = torch.tensor([t + [99999] * (width - len(t)) for t in tables], dtype=torch.int32)
    attn = CpuAttention(spec)  # torch path writes the cache: real K/V at every used slot
    total = sum(seq_lens)
    k, v = torch.randn(total, hk, d, generator=gen), torch.randn(total, hk, d, generator=gen)
    slots = torch.cat(
        [block_tables[i, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs for i, n in enumerate(seq_lens)]
    )
    attn.write_kv(k, v, cache, slots)
    meta = AttentionMetadata.from_lengths(
        [1] * len(seq_lens), list(seq_lens), block_tables, slot_mapping=torch.zeros(len(seq_lens), dtype=torch.long)
    )
    return cache, meta


#: KV cache dtypes the native attention reads: fp32, and 16-bit and fp8 caches widened as they are loaded.
CACHE_DTYPES = pytest.mark.parametrize(
    "cache_dtype",
    [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn],
    ids=["fp32-cache", "bf16-cache", "fp16-cache", "fp8-cache"],
)


def _same_as_fp32_cache(nk: NativeKernels, spec: AttentionSpec, q: torch.Tensor, cache: torch.Tensor,
                        meta: AttentionMetadata, got: torch.Tensor, scale: float = 0.17) -> None:  # fmt: skip
    """A 16-bit or fp8 cache's values are fp32 values, widened exactly on load into the fp32 cache's
    FMA chains: the native kernels give the fp32 copy's result bit for bit."""
    if cache.dtype != torch.float32:
        fp32 = NativeAttention(spec, CPU_KV_LAYOUT, nk).forward(q, cache.float(), meta, scale)
        assert torch.equal(got, fp32)


@needs_native
@CACHE_DTYPES
@pytest.mark.parametrize(
    "window,soft_cap,group", [(None, None, 3), (5, None, 2), (None, 30.0, 1), (7, 20.0, 4)], ids=str
)
@pytest.mark.parametrize("block_size", [4, 16])  # 16: eight positions of a page at a time
@pytest.mark.parametrize("many", [False, True], ids=["few-seqs", "many-seqs"])  # many: whole sequences as items
def test_decode_attention_matches_torch_path(
    nk: NativeKernels, threads: int, window: int | None, soft_cap: float | None, group: int, block_size: int,
    many: bool, cache_dtype: torch.dtype,
) -> None:  # fmt: skip
    """The native decode kernel against the torch path (which upcasts a 16-bit cache), over pages
    shuffled and NaN-poisoned where no sequence wrote."""
    gen = torch.Generator().manual_seed(11)
    spec = AttentionSpec(
        num_heads=2 * group,
        num_kv_heads=2,
        head_size=32,
        block_size=block_size,
        sliding_window=window,
        logits_soft_cap=soft_cap,
    )
    seq_lens = [1, 6, 13, 4] if block_size == 4 else [1, 9, 37, 16, 70]
    if many:  # at least 4 per thread: each item is a sequence with both kv heads
        seq_lens = seq_lens * 2 + [3, 21]
    cache, meta = _decode_batch(seq_lens, spec, 48, gen, cache_dtype)
    q = torch.randn(len(seq_lens), spec.num_heads, 32, generator=gen)
    got = NativeAttention(spec, CPU_KV_LAYOUT, nk).forward(q, cache, meta, 0.17)
    expected = CpuAttention(spec).forward(q, cache, meta, 0.17)  # the torch path, certified by conformance
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    _same_as_fp32_cache(nk, spec, q, cache, meta, got)


@needs_native
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32-cache", "bf16-cache"])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 7])  # the AVX-512 build takes a group's heads 3 at a time
@pytest.mark.parametrize("head_size", [40, 64, 96])  # 40: an 8-wide tail of the scores; 96: of the values
def test_decode_attention_head_groups_and_sizes(
    nk: NativeKernels, threads: int, cache_dtype: torch.dtype, group: int, head_size: int
) -> None:
    """Query heads per kv head from 1 to 7 (the AVX-512 build reads each key and value element once
    for up to 3 heads of a group: 3 + 1, 3 + 3 + 1 heads) and head sizes past the 16- and 64-wide
    steps, against the torch path."""
    gen = torch.Generator().manual_seed(group * 100 + head_size)
    spec = AttentionSpec(num_heads=2 * group, num_kv_heads=2, head_size=head_size, block_size=16)
    seq_lens = [1, 9, 37, 16, 70]
    cache, meta = _decode_batch(seq_lens, spec, 24, gen, cache_dtype)
    q = torch.randn(len(seq_lens), spec.num_heads, head_size, generator=gen)
    got = NativeAttention(spec, CPU_KV_LAYOUT, nk).forward(q, cache, meta, 0.17)
    expected = CpuAttention(spec).forward(q, cache, meta, 0.17)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    _same_as_fp32_cache(nk, spec, q, cache, meta, got)


def _tiles_against_the_fp32_path(nk: NativeKernels, spec: AttentionSpec, q: torch.Tensor, cache: torch.Tensor,
                                 meta: AttentionMetadata, what: str) -> NativeAttention:  # fmt: skip
    """The native attention of bf16-valued ``q`` over a bf16 cache with the AMX tiles on (where the CPU
    has them) against the torch path and against the same library's fp32 path (tiles off): within
    the fp32 summation order's differences, equal where no tiles run. Returns the attention."""
    attn = NativeAttention(spec, CPU_KV_LAYOUT, nk)
    expected = CpuAttention(spec).forward(q, cache, meta, 0.17)
    try:
        tiles = attn.forward(q, cache, meta, 0.17)
        nk.lib.plinth_amx_bf16(0)
        fp32_path = attn.forward(q, cache, meta, 0.17)
    finally:
        nk.lib.plinth_amx_bf16(int(nk.amx_bf16))  # as the library was loaded (PLINTH_CPU_AMX)
    path = "on AMX tiles" if nk.amx_bf16 else "on the fp32 path (no AMX-BF16)"
    print(f"bf16 {what} over a {cache.dtype} cache {path}: largest difference from the fp32 path "
          f"{(tiles - fp32_path).abs().max().item():.2g}")  # fmt: skip
    torch.testing.assert_close(tiles, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tiles, fp32_path, rtol=1e-5, atol=1e-5)
    if not nk.amx_bf16:
        assert torch.equal(tiles, fp32_path)
    return attn


@needs_native
@pytest.mark.parametrize(
    "window,group,head_size,block_size",
    [(None, 3, 64, 16), (None, 5, 96, 32), (21, 4, 128, 16), (None, 16, 32, 16), (None, 1, 192, 32), (9, 2, 64, 48)],
    ids=str,
)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16-cache", "fp8-cache"])
def test_bf16_decode_attention_on_amx_tiles(
    nk: NativeKernels, threads: int, window: int | None, group: int, head_size: int, block_size: int,
    cache_dtype: torch.dtype,
) -> None:  # fmt: skip
    """A bf16 model's decode over a bf16 or fp8 cache: its queries are bf16 values, so where the CPU
    has AMX-BF16 the scores are tile products (the fp32 sums of the same exact products in another
    order; an fp8 block's keys rounded to bf16 first, exactly). Against the torch path, and against
    the fp32 path of the same library (tiles turned off); queries that are not bf16 values take the
    fp32 path and match the fp32 cache's result bit for bit, tiles on or off. Where the CPU has no
    tiles both runs are the fp32 path."""
    gen = torch.Generator().manual_seed(group * head_size)
    spec = AttentionSpec(num_heads=2 * group, num_kv_heads=2, head_size=head_size, block_size=block_size,
                         sliding_window=window)  # fmt: skip
    seq_lens = [1, 9, 37, 16, 70, 17, 33, 130, 3, 21]  # 10 sequences: whole sequences as items at 2 threads
    cache, meta = _decode_batch(seq_lens, spec, 64, gen, cache_dtype)
    q = torch.randn(len(seq_lens), spec.num_heads, head_size, generator=gen).bfloat16().float()
    attn = _tiles_against_the_fp32_path(nk, spec, q, cache, meta, "decode attention")
    q_fp32 = q + 1e-3  # no longer bf16 values: the fp32 path, tiles or not
    _same_as_fp32_cache(nk, spec, q_fp32, cache, meta, attn.forward(q_fp32, cache, meta, 0.17))


@needs_native
@pytest.mark.parametrize(
    "window,soft_cap,group,head_size,block_size",
    [(None, None, 3, 64, 16), (50, None, 4, 128, 32), (None, 30.0, 1, 96, 16), (19, 20.0, 8, 32, 16)],
    ids=str,
)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16-cache", "fp8-cache"])
def test_bf16_prefill_attention_scores_on_amx_tiles(
    nk: NativeKernels, threads: int, window: int | None, soft_cap: float | None, group: int, head_size: int,
    block_size: int, cache_dtype: torch.dtype,
) -> None:  # fmt: skip
    """Prefill chunks long enough for the GEMM tiles, a bf16 model's queries over a bf16 or fp8 cache:
    where the CPU has AMX-BF16 each block's scores are tile products (an fp8 block's keys rounded to
    bf16 first, exactly). Against the torch path and the library's own fp32 path (tiles off)."""
    gen = torch.Generator().manual_seed(group * head_size + 1)
    spec = AttentionSpec(num_heads=2 * group, num_kv_heads=2, head_size=head_size, block_size=block_size,
                         sliding_window=window, logits_soft_cap=soft_cap)  # fmt: skip
    seq_lens, q_lens = [40, 77, 16, 130, 9], [40, 29, 16, 100, 1]
    cache, decode_meta = _decode_batch(seq_lens, spec, 64, gen, cache_dtype)
    meta = AttentionMetadata.from_lengths(
        q_lens, seq_lens, decode_meta.block_tables, slot_mapping=torch.zeros(sum(q_lens), dtype=torch.long)
    )
    q = torch.randn(sum(q_lens), spec.num_heads, head_size, generator=gen).bfloat16().float()
    _tiles_against_the_fp32_path(nk, spec, q, cache, meta, "prefill attention")


@needs_native
@CACHE_DTYPES
@pytest.mark.parametrize(
    "window,soft_cap,group", [(None, None, 3), (5, None, 2), (None, 30.0, 1), (7, 20.0, 4)], ids=str
)
@pytest.mark.parametrize("block_size,head_size", [(4, 32), (16, 32), (16, 80)])  # 80: a 64-wide and an 8-wide slice
def test_prefill_attention_matches_torch_path(
    nk: NativeKernels, threads: int, window: int | None, soft_cap: float | None, group: int, block_size: int,
    head_size: int, cache_dtype: torch.dtype,
) -> None:  # fmt: skip
    """Prefill chunks (some after earlier context, some shorter than the four-row tile) mixed with
    decodes: the native kernels against the torch path."""
    gen = torch.Generator().manual_seed(13)
    spec = AttentionSpec(
        num_heads=2 * group,
        num_kv_heads=2,
        head_size=head_size,
        block_size=block_size,
        sliding_window=window,
        logits_soft_cap=soft_cap,
    )
    seq_lens, q_lens = [9, 5, 40, 16, 70, 2], [1, 5, 13, 1, 37, 2]
    cache, decode_meta = _decode_batch(seq_lens, spec, 64, gen, cache_dtype)
    meta = AttentionMetadata.from_lengths(
        q_lens, seq_lens, decode_meta.block_tables, slot_mapping=torch.zeros(sum(q_lens), dtype=torch.long)
    )
    q = torch.randn(sum(q_lens), spec.num_heads, head_size, generator=gen)
    got = NativeAttention(spec, CPU_KV_LAYOUT, nk).forward(q, cache, meta, 0.17)
    expected = CpuAttention(spec).forward(q, cache, meta, 0.17)  # the torch path, certified by conformance
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    _same_as_fp32_cache(nk, spec, q, cache, meta, got)


@needs_native
@CACHE_DTYPES
@pytest.mark.parametrize(
    "window,soft_cap,group,head_size,block_size",
    [(None, None, 3, 64, 16), (50, None, 4, 128, 12), (None, 30.0, 1, 64, 32), (90, 20.0, 8, 48, 16)],
    ids=str,
)
def test_long_prefill_chunks_attend_in_gemm_tiles(
    nk: NativeKernels, threads: int, window: int | None, soft_cap: float | None, group: int, head_size: int,
    block_size: int, cache_dtype: torch.dtype,
) -> None:  # fmt: skip
    """Chunks of at least 24 query vectors (rows x group) with a head size a multiple of 16 attend
    in GEMM tiles, 16 keys a block with an online softmax: a fresh 300-token prompt, a chunk after
    earlier context, a short chunk that just qualifies, next to a decode; peaky scores (queries x 8),
    so the running max moves between blocks; pages of 12 split the 16-key blocks. Against the torch
    path, and a 16-bit cache bit for bit against its fp32 copy."""
    gen = torch.Generator().manual_seed(29)
    spec = AttentionSpec(
        num_heads=2 * group,
        num_kv_heads=2,
        head_size=head_size,
        block_size=block_size,
        sliding_window=window,
        logits_soft_cap=soft_cap,
    )
    short = -(-24 // group)  # the fewest rows that take the tiles
    seq_lens, q_lens = [300, 230, 40, 77], [300, 150, short, 1]
    blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    cache, decode_meta = _decode_batch(seq_lens, spec, blocks, gen, cache_dtype)
    meta = AttentionMetadata.from_lengths(
        q_lens, seq_lens, decode_meta.block_tables, slot_mapping=torch.zeros(sum(q_lens), dtype=torch.long)
    )
    q = torch.randn(sum(q_lens), spec.num_heads, head_size, generator=gen) * 8
    got = NativeAttention(spec, CPU_KV_LAYOUT, nk).forward(q, cache, meta, head_size**-0.5)
    expected = CpuAttention(spec).forward(q, cache, meta, head_size**-0.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    _same_as_fp32_cache(nk, spec, q, cache, meta, got, head_size**-0.5)


@needs_native
def test_native_write_kv_matches_torch(nk: NativeKernels) -> None:
    gen = torch.Generator().manual_seed(5)
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=16, block_size=4)
    qkv = torch.randn(6, (4 + 2 + 2) * 16, generator=gen)
    k, v = qkv[:, 64:96].view(6, 2, 16), qkv[:, 96:].view(6, 2, 16)  # strided views, as the model passes
    slots = torch.tensor([3, 4, -1, 17, 0, 9])
    a, b = torch.zeros(CPU_KV_LAYOUT.shape(6, 4, 2, 16)), torch.zeros(CPU_KV_LAYOUT.shape(6, 4, 2, 16))
    NativeAttention(spec, CPU_KV_LAYOUT, nk).write_kv(k, v, a, slots)
    CpuAttention(spec).write_kv(k.contiguous(), v.contiguous(), b, slots)
    assert torch.equal(a, b) and a.abs().sum() > 0


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn], ids=["bf16", "fp16", "fp8"])
@pytest.mark.parametrize("head_size", [16, 12])  # 12: the scalar tail (the native path takes multiples of 8)
def test_native_write_kv_rounds_as_torch(nk: NativeKernels, dtype: torch.dtype, head_size: int) -> None:
    """Into a 16-bit or fp8 cache the kernel stores ``value.to(cache dtype)`` bit for bit: round to
    nearest even (ties included), overflow to infinity (fp8 e4m3fn, which has none: saturated to
    +-448), subnormals kept; a NaN stays a NaN."""
    gen = torch.Generator().manual_seed(6)
    T, Hk, D = 7, 2, head_size
    kv = torch.randn(T, 2 * Hk * D, generator=gen) * torch.logspace(-8, 5, 2 * Hk * D)  # fp16 over/underflows
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 65520.0, 1e-7, 3e38, -3.4e38])
    kv[0, : len(specials)] = specials
    fp8_edges = torch.tensor([448.0, 449.0, 463.9, 464.0, -500.0, 2**-6, 2**-10, 3 * 2**-11, -(2**-7), 1.0625, 1.1875])
    kv[0, len(specials) : len(specials) + len(fp8_edges)] = fp8_edges  # saturation, subnormals, ties
    bits = torch.int8 if dtype.itemsize == 1 else torch.int16
    below = torch.randn(2, 2 * Hk * D, generator=gen).to(dtype)
    above = (below.view(bits) + 1).view(dtype)  # the next value away from zero
    kv[1:3] = (below.float() + above.float()) / 2  # exact ties: midpoints of neighbours (exact in fp32)
    k, v = kv[:, : Hk * D].view(T, Hk, D), kv[:, Hk * D :].view(T, Hk, D)  # strided views, as the model passes
    slots = torch.tensor([3, 4, -1, 17, 0, 9, 22])
    got = torch.zeros(CPU_KV_LAYOUT.shape(6, 4, Hk, D), dtype=dtype)
    want = got.clone()
    nk.write_kv(k, v, got, slots)
    CpuAttention(AttentionSpec(4, Hk, D, 4, kv_cache_dtype=str(dtype).removeprefix("torch."))).write_kv(
        k.contiguous(), v.contiguous(), want, slots
    )
    # NaN: torch's vectorised bf16 cast writes 0xFFFF, its scalar one (and the kernel) 0x7FC0; both NaN
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and nan.any()
    assert torch.equal(got.view(bits)[~nan], want.view(bits)[~nan]) and got.view(bits)[~nan].any()


@needs_native
def test_native_kernels_refuse_other_cache_dtypes(nk: NativeKernels) -> None:
    cache = torch.zeros(CPU_KV_LAYOUT.shape(4, 4, 1, 8), dtype=torch.float64)
    k = torch.zeros(1, 1, 8)
    with pytest.raises(ValueError, match="KV cache, not torch.float64"):
        nk.write_kv(k, k, cache, torch.zeros(1, dtype=torch.long))
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="KV cache, not torch.float64"):
        nk.decode_attention(k, cache, tables, lens, 0.1, None, None)


@needs_native
def test_native_attention_covers_16_bit_caches() -> None:
    """fp32, bf16 or fp16 compute over an fp32, bf16, fp16 or fp8 cache runs natively; fp64 does not
    (nor fp8 compute: a KV-cache dtype only)."""
    assert not NativeAttention.covers(AttentionSpec(9, 3, 64, 16, "float8_e4m3fn", "float8_e4m3fn"))
    for cache_dtype in ("float32", "bfloat16", "float16", "float8_e4m3fn"):
        assert NativeAttention.covers(AttentionSpec(9, 3, 64, 16, "float32", cache_dtype))
    assert not NativeAttention.covers(AttentionSpec(9, 3, 64, 16, "float32", "float64"))
    assert NativeAttention.covers(AttentionSpec(9, 3, 64, 16, "bfloat16", "bfloat16"))  # a 16-bit model too
    assert not NativeAttention.covers(AttentionSpec(9, 3, 64, 16, "float64", "float64"))
    assert not NativeAttention.covers(AttentionSpec(9, 3, 60, 16, "float32", "bfloat16"))


def _greedy_agreed(a: CompletionOutput, b: CompletionOutput, within: float) -> int:
    """How many greedy tokens ``a`` shares with the reference ``b`` before they part; they may part
    only where ``b``'s top two log-probabilities are within ``within`` of each other (a near tie that
    rounding elsewhere may tip)."""
    n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y), len(a.token_ids))
    if n < len(a.token_ids):
        assert b.logprobs is not None
        best, second = sorted((lp for _, lp in b.logprobs[n].top), reverse=True)[:2]
        assert best - second < within, f"token {n} parts from {b.logprobs[n].top} on no near tie"
    return n


@pytest.mark.slow
@needs_native
@pytest.mark.parametrize("kv_cache_dtype,within", [("bfloat16", 0.1), ("float16", 0.01), ("float8_e4m3fn", 0.3)])
def test_engine_runs_native_attention_over_a_16_bit_cache(
    kv_cache_dtype: str, within: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SmolLM2 (fp32 compute, its q4_1 weights) over a 16-bit or fp8 KV cache: the native kernels write
    and read it (the torch fallbacks are made to fail), the greedy tokens are the fp32 cache's up to a
    near tie (the first prompt's ninth token, 0.018 nats ahead, on the bf16 cache; on the fp8 cache
    the first prompt's fourth, 0.044 ahead, and the second's tenth, 0.071 ahead) and the log-probs
    stay close until then (measured: bf16 0.044 nats at most, fp16 0.004, fp8 0.22: 3 mantissa bits)."""
    from plinth import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    prompts = ["The three primary colors are", "Write a haiku about the sea. " * 6]  # 43 tokens: 3 pages
    ref = LLM(backend="cpu", max_model_len=256, num_kv_blocks=64).generate(prompts, params)

    def torch_path(*args: object, **kwargs: object) -> None:
        raise AssertionError("the torch attention path ran")

    for name in ("write_kv", "_decode", "_prefill"):
        monkeypatch.setattr(CpuAttention, name, torch_path)
    llm = LLM(backend="cpu", max_model_len=256, num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype)
    attn = llm.engine.model.layers[0].self_attn.attn_kernels
    assert isinstance(attn, NativeAttention) and attn.spec.kv_cache_dtype == kv_cache_dtype
    assert attn.spec.dtype == "float32"
    for got, want in zip(llm.generate(prompts, params), ref, strict=True):
        a, b = got.outputs[0], want.outputs[0]
        n = _greedy_agreed(a, b, within)
        assert a.logprobs is not None and b.logprobs is not None
        for top, ref_top in zip(a.logprobs[:n], b.logprobs[:n], strict=True):
            mine, theirs = dict(top.top), dict(ref_top.top)
            shared = mine.keys() & theirs.keys()  # near-tied runners-up may swap places, not vanish
            assert len(shared) >= 2 and max(abs(mine[t] - theirs[t]) for t in shared) < within


@pytest.mark.slow
@needs_native
@pytest.mark.parametrize("dtype,within", [("bfloat16", 0.25), ("float16", 0.05)])
def test_engine_runs_a_16bit_model_natively_in_step_graphs(
    dtype: str, within: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SmolLM2 in bf16/fp16 (``--dtype``): every decode step records into a step graph (nothing ran
    as torch ops), attention never takes the torch path, and the greedy tokens' log-probabilities
    stay near the fp32 model's while the tokens agree (the 16-bit model rounds every op's result;
    measured at most 0.06 nats in bf16 and 0.015 in fp16). The tokens may part only where the fp32
    model's top two are within that tolerance of each other (a near tie: the second prompt's second
    token is 0.005 nats ahead of the next, and fp16 on the AVX2 paths picks the other)."""
    from plinth import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    prompts = ["The three primary colors are", "Write a haiku about the sea. " * 6]
    ref = LLM(backend="cpu", max_model_len=256, num_kv_blocks=64, quantization="none").generate(prompts, params)

    def torch_path(*args: object, **kwargs: object) -> None:
        raise AssertionError("the torch attention path ran")

    for name in ("_decode", "_prefill"):
        monkeypatch.setattr(CpuAttention, name, torch_path)
    llm = LLM(backend="cpu", max_model_len=256, num_kv_blocks=64, quantization="none", dtype=dtype)
    layer = llm.engine.model.layers[0]
    assert isinstance(layer.self_attn.attn_kernels, NativeAttention)
    gate_up = layer.mlp.gate_up_proj.weight
    held = gate_up.weight if gate_up.format == "dense" else gate_up.data["pairs"]  # pairs: bf16 with AVX512-BF16
    assert held is not None and held.dtype == getattr(torch, dtype), gate_up.format  # in the model's dtype
    outs = llm.generate(prompts, params)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.stats.captures >= 1 and graphs.stats.eager == 0
    for got, want in zip(outs, ref, strict=True):
        a, b = got.outputs[0], want.outputs[0]
        assert a.logprobs is not None and b.logprobs is not None
        n = _greedy_agreed(a, b, within)
        for top, ref_top in zip(a.logprobs[:n], b.logprobs[:n], strict=True):
            tok_a, tok_b = dict(top.top), dict(ref_top.top)
            shared = tok_a.keys() & tok_b.keys()
            assert shared and max(abs(tok_a[t] - tok_b[t]) for t in shared) < within


@pytest.mark.slow
@needs_native
def test_engine_runs_a_q4_1_models_batched_products_on_amx_int8_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2 Q4_1 (the default: q4_1/q8_0 weights in 16-row panels) with the AMX-INT8 tiles on, where
    the loaded build has them (an AMX host, or PLINTH_CPU_EMULATE=1): the prompt's products of 16 rows
    or more run on the tiles, and the greedy tokens and their log-probabilities are exactly those of the
    VNNI kernel (the same integer block sums, the same scaling after them)."""
    kernels = native()
    assert kernels is not None
    before = kernels.amx_int8
    if not kernels.set_amx_int8(True):
        kernels.set_amx_int8(before)
        pytest.skip(f"the loaded {kernels.variant.name} build has no AMX-INT8 tiles")
    from plinth import LLM, SamplingParams

    rows: list[int] = []
    gemm_quant = NativeKernels.gemm_quant

    def counting(self: NativeKernels, fmt: str, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if fmt in ("q4_1p16", "q8_0p16"):
            rows.append(x.shape[0])
        return gemm_quant(self, fmt, x, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(NativeKernels, "gemm_quant", counting)
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)
    prompts = ["Write a haiku about the sea. " * 4]  # a prompt of more than 16 tokens
    llm = LLM(backend="cpu", max_model_len=256, num_kv_blocks=64, enable_prefix_caching=False)
    assert llm.engine.model.layers[0].mlp.down_proj.weight.format == "q4_1p16"
    try:
        tiles = llm.generate(prompts, params)
        kernels.set_amx_int8(False)
        vnni = llm.generate(prompts, params)
    finally:
        kernels.set_amx_int8(before)
    assert max(rows) >= native_mod.AMX_I8_MIN_ROWS  # the prompt's products took the tiles
    a, b = tiles[0].outputs[0], vnni[0].outputs[0]
    assert a.token_ids == b.token_ids and a.logprobs is not None and b.logprobs is not None
    assert [dict(t.top) for t in a.logprobs] == [dict(t.top) for t in b.logprobs]


@pytest.mark.slow
@needs_native
def test_engine_runs_an_fp32_models_prefill_as_bf16x3_products(monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2 in fp32 with PLINTH_CPU_FP32_BF16X3=16 where the loaded build has AMX tiles (an AMX host,
    or PLINTH_CPU_EMULATE=1): the prompt's products of 16 rows or more run as three bf16 products, and
    the greedy tokens and their log-probabilities are the fp32 model's (within 2e-3 nats; plain bf16
    moves them by up to 0.06)."""
    kernels = native()
    assert kernels is not None
    if not kernels.amx_bf16:
        pytest.skip(f"the loaded {kernels.variant.name} build has no AMX-BF16 tiles")
    from plinth import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)
    prompts = ["Write a haiku about the sea. " * 3]
    monkeypatch.delenv(gemm_mod.BF16X3_ENV, raising=False)
    ref = LLM(backend="cpu", max_model_len=128, num_kv_blocks=16, quantization="none").generate(prompts, params)
    monkeypatch.setenv(gemm_mod.BF16X3_ENV, "16")
    llm = LLM(backend="cpu", max_model_len=128, num_kv_blocks=16, quantization="none")
    assert "bf16x3" in llm.engine.model.layers[0].mlp.gate_up_proj.weight.data
    a, b = llm.generate(prompts, params)[0].outputs[0], ref[0].outputs[0]
    assert a.token_ids == b.token_ids and a.logprobs is not None and b.logprobs is not None
    for top, ref_top in zip(a.logprobs, b.logprobs, strict=True):
        got, want = dict(top.top), dict(ref_top.top)
        assert got.keys() == want.keys() and max(abs(got[t] - want[t]) for t in got) < 2e-3


@needs_native
def test_read_probe_sums(nk: NativeKernels, threads: int) -> None:
    x = torch.rand(64 * 4096)
    assert nk.read_probe(x) == pytest.approx(float(x.double().sum()), rel=1e-4)


@needs_native
def test_pool_survives_many_alternating_calls(nk: NativeKernels) -> None:
    """Back-to-back parallel calls whose item counts differ give the right answers (a stale worker
    once claimed an item of the next call while its fields were being written)."""
    nk.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, 64, generator=gen) for n in (4, 40, 400)]
    x = torch.randn(2, 64, generator=gen)
    expected = [F.linear(x, w) for w in ws]
    for i in range(20000):
        torch.testing.assert_close(nk.gemm_f32(x, ws[i % 3], None), expected[i % 3], rtol=1e-5, atol=1e-5)


def _gemm_in_child(variant: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    kernels = _kernels(variant)  # the parent's object, its pool started before the fork
    assert kernels is not None and kernels.num_threads() == 2
    return kernels.gemm_f32(x, w, None)


@needs_native
def test_pool_works_in_a_forked_child(nk: NativeKernels) -> None:
    """A child forked after the workers started runs parallel calls with fresh workers."""
    import multiprocessing

    nk.set_num_threads(2)
    w, x = torch.randn(400, 64), torch.randn(2, 64)
    nk.gemm_f32(x, w, None)  # workers started in the parent
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        got = pool.apply(_gemm_in_child, (nk.variant.name, x, w))
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)


# -- step graphs -------------------------------------------------------------------------------------


class _GraphInputs:
    """Fixed buffers for one call of each recordable op, refillable in place (as a step graph's are)."""

    def __init__(self, gen: torch.Generator, cache_dtype: torch.dtype = torch.float32) -> None:
        self.gen = gen
        self.spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, block_size=4)
        T, H, Hk, D = 3, 4, 2, 32
        self.x = torch.empty(T, 64)  # gemm / rms_norm / quantized gemm activations
        self.residual = torch.empty(T, 64)
        self.gate_up = torch.empty(T, 2 * 48)
        self.qkv = torch.empty(T, (H + 2 * Hk) * D)  # q, k, v are strided views, as the model passes them
        self.positions = torch.empty(T, dtype=torch.long)
        self.slots = torch.empty(T, dtype=torch.long)
        self.block_tables = torch.empty(T, 4, dtype=torch.int32)
        self.seq_lens = torch.empty(T, dtype=torch.int32)
        self.cache = torch.zeros(CPU_KV_LAYOUT.shape(16, 4, Hk, D), dtype=cache_dtype)
        # weights: fixed for the graph's life
        self.w = torch.randn(40, 64, generator=gen)
        self.panels = torch.cat((self.w, torch.zeros(8, 64))).view(6, 8, 64).transpose(1, 2).contiguous()
        self.bias = torch.randn(40, generator=gen)
        self.norm_w = torch.randn(64, generator=gen)
        self.head_norm_w = torch.randn(32, generator=gen)
        freqs = torch.arange(64.0)[:, None] * torch.rand(8, generator=gen)[None]
        self.cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # rotary_dim 16 < head 32
        self.q4 = _q4_1(40, 64, gen)
        self.q8 = quantize_q8_0(torch.randn(24, 64, generator=gen))
        self.panels16 = self.panels.to(torch.bfloat16)  # a bf16 checkpoint's weight in its own panels
        self.refill()

    def refill(self) -> None:
        """New values in every input buffer, in place; each sequence's new token in another block."""
        gen = self.gen
        for t in (self.x, self.residual, self.gate_up, self.qkv):
            t.copy_(torch.randn(t.shape, generator=gen))
        lens = torch.randint(1, 13, (3,), generator=gen)  # up to 3 blocks of 4
        tables = torch.stack([torch.randperm(15, generator=gen)[:4] + 1 for _ in range(3)])  # block 0 unused
        self.seq_lens.copy_(lens)
        self.block_tables.copy_(tables)
        self.positions.copy_(lens - 1)
        pos = lens - 1
        self.slots.copy_(tables[torch.arange(3), pos // 4] * 4 + pos % 4)
        self.slots[1] = -1  # a padding row: writes nothing

    def run(self, nk: NativeKernels, cache: torch.Tensor, residual: torch.Tensor) -> list[torch.Tensor]:
        """One call of each op, in a step's order (the KV write before the attention that reads it)."""
        H, Hk, D = 4, 2, 32
        q = self.qkv[:, : H * D].view(3, H, D)
        k = self.qkv[:, H * D : (H + Hk) * D].view(3, Hk, D)
        v = self.qkv[:, (H + Hk) * D :].view(3, Hk, D)
        out = [
            nk.gemm_f32(self.x, self.w, self.bias),
            nk.gemm_f32_panels(self.x, self.panels, self.bias, 40),
            nk.rms_norm(self.x, self.norm_w, 1e-5, residual=residual),
            nk.silu_and_mul(self.gate_up),
            nk.gelu_tanh_and_mul(self.gate_up),
            nk.rms_norm_heads(k, self.head_norm_w, 1e-6),  # Qwen3's k norm, read from the fused qkv
            nk.rotary(q, self.positions, self.cos_sin, 16),
        ]
        nk.write_kv(k, v, cache, self.slots)
        out += [
            nk.decode_attention(out[-1], cache, self.block_tables, self.seq_lens, 0.2, None, None),
            nk.gemm_quant("q4_1", self.x, self.q4.blocks, self.bias, 40),
            nk.gemm_quant("q8_0", self.x, self.q8.blocks, None, 24),
            nk.gemm_panels16(self.x, self.panels16, self.bias, 40),
        ]
        return out


@needs_native
@pytest.mark.parametrize(
    "cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=["fp32-cache", "bf16-cache", "fp8-cache"]
)
def test_recorded_calls_replay_over_refilled_inputs(
    threads: int, recording: NativeKernels, cache_dtype: torch.dtype
) -> None:
    """A replay computes exactly what fresh calls on the refilled inputs compute, into the recorded
    outputs, and updates the recorded residual and cache in place (skipping slot -1); the KV write
    and attention record the cache's element kind with their other arguments."""
    nk = recording
    inputs = _GraphInputs(torch.Generator().manual_seed(21), cache_dtype)
    nk.begin_recording()
    outputs = inputs.run(nk, inputs.cache, inputs.residual)  # the calls run while recording
    graph = nk.end_recording()
    expected_names = [
        "gemm_f32", "gemm_f32_panels", "rms_norm", "silu_and_mul", "gelu_tanh_and_mul", "rms_norm_heads", "rotary",
        "write_kv", "decode_attention",
    ]  # fmt: skip
    assert graph.names == [f"plinth_{n}" for n in expected_names + ["gemm_quant"] * 2 + ["gemm_panels16"]]
    assert len(graph) == 12 and set(graph.names) <= set(GRAPH_OPS)
    for out in outputs[:2]:
        torch.testing.assert_close(out, F.linear(inputs.x, inputs.w, inputs.bias), rtol=1e-5, atol=1e-5)

    for _ in range(3):
        before, cache_before = [o.clone() for o in outputs], inputs.cache.clone()
        inputs.refill()
        cache, residual = inputs.cache.clone(), inputs.residual.clone()
        expected = inputs.run(nk, cache, residual)  # eager, on copies of the state the replay updates
        graph.replay()
        names = [n for n in expected_names if n != "write_kv"] + ["gemm_quant"] * 2 + ["gemm_panels16"]
        for name, got, want, old in zip(names, outputs, expected, before, strict=True):
            assert torch.equal(got, want), f"{name}: the replay differs from a fresh call"
            assert not torch.equal(got, old), f"{name}: the replay left its output as it was"
        assert torch.equal(inputs.residual, residual)
        assert torch.equal(inputs.cache, cache) and not torch.equal(inputs.cache, cache_before)


@needs_native
def test_replay_over_fewer_rows_than_recorded(threads: int, recording: NativeKernels) -> None:
    """Recorded over 3 rows, replayed over 2: every call's first 2 rows are what a fresh call
    computes, the third row's outputs keep their old values and its KV slot is not written."""
    nk = recording
    inputs = _GraphInputs(torch.Generator().manual_seed(22))
    nk.begin_recording()
    outputs = inputs.run(nk, inputs.cache, inputs.residual)
    graph = nk.end_recording()
    for _ in range(2):
        before, cache_before = [o.clone() for o in outputs], inputs.cache.clone()
        inputs.refill()  # rows 0 and 2 write a KV slot, row 1 is padding
        cache, residual = inputs.cache.clone(), inputs.residual.clone()
        expected = inputs.run(nk, cache, residual)  # all 3 rows, eager
        graph.replay(rows=2, captured=3)
        for got, want, old in zip(outputs, expected, before, strict=True):
            assert torch.equal(got[:2], want[:2])
            assert torch.equal(got[2:], old[2:])  # the third row: not computed
        assert torch.equal(inputs.residual[:2], residual[:2])
        # the cache: row 0's K/V written, the third row's not
        blk, off = divmod(int(inputs.slots[2]), 4)
        assert torch.equal(inputs.cache[:, blk, :, off], cache_before[:, blk, :, off])
        assert not torch.equal(cache[:, blk, :, off], cache_before[:, blk, :, off])
        inputs.cache[:, blk, :, off] = cache[:, blk, :, off]
        assert torch.equal(inputs.cache, cache)
    with pytest.raises(ValueError, match="replay of 4 rows of a graph recorded with 3"):
        graph.replay(rows=4, captured=3)


@needs_native
def test_unrecordable_calls_and_nested_recording_are_refused(recording: NativeKernels) -> None:
    nk = recording
    x, w = torch.randn(2, 64), torch.randn(8, 64)
    nk.begin_recording()
    with pytest.raises(GraphError, match="plinth_set_num_threads cannot be recorded"):
        nk.set_num_threads(2)
    with pytest.raises(GraphError, match="plinth_read_probe cannot be recorded"):
        nk.read_probe(torch.rand(4096))
    with pytest.raises(GraphError, match="already recording"):
        nk.begin_recording()
    nk.gemm_f32(x, w, None)
    nk.cancel_recording()
    # calls run normally again, and the cancelled call is in no later graph
    assert nk.num_threads() >= 1
    with pytest.raises(GraphError, match="no step graph is recording"):
        nk.end_recording()
    nk.begin_recording()
    nk.silu_and_mul(torch.randn(2, 16))
    assert nk.end_recording().names == ["plinth_silu_and_mul"]
    nk.cancel_recording()  # not recording: a no-op
    torch.testing.assert_close(nk.gemm_f32(x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-5)


@needs_native
def test_replay_names_a_call_the_library_does_not_know(nk: NativeKernels, monkeypatch: pytest.MonkeyPatch) -> None:
    """A recorded kind the library lacks (a Python table out of step with the library) is reported
    with its index and name; the calls before it ran."""
    x = torch.randn(2, 32)
    out = torch.zeros(2, 16)
    y = torch.zeros(2, 8)
    w = torch.randn(8, 16)
    monkeypatch.setitem(GRAPH_OPS, "plinth_gemm_f32", 99)
    graph = NativeGraph(
        nk.lib,
        [
            ("plinth_silu_and_mul", (0, x.data_ptr(), out.data_ptr(), 2, 16)),
            ("plinth_gemm_f32", (out.data_ptr(), w.data_ptr(), None, y.data_ptr(), 2, 8, 16)),
        ],
    )
    with pytest.raises(GraphError, match=r"call 1 \(plinth_gemm_f32\) is of a kind the library does not know"):
        graph.replay()
    torch.testing.assert_close(out, SmallOps().silu_and_mul(x))
    assert y.eq(0).all()


# -- ISA builds --------------------------------------------------------------------------------------

_AVX512_HOST = set(native_mod.AVX512.cpu_flags)
_AVX2_HOST = set(native_mod.AVX2.cpu_flags) | {"sse4_2", "avx512f"}  # some AVX-512, not what the build needs


def test_the_best_build_the_cpu_runs_is_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(native_mod.ISA_ENV, raising=False)
    monkeypatch.delenv(native_mod.EMULATE_ENV, raising=False)
    variant, why = native_mod.choose_variant(_AVX512_HOST)
    assert variant is native_mod.AVX512 and "avx512_vnni" in why
    variant, why = native_mod.choose_variant(_AVX2_HOST)
    assert variant is native_mod.AVX2
    assert "avx512 needs" in why and "avx512_vnni" in why and "avx512f," not in why  # names what is missing
    assert native_mod.runnable_variants(_AVX2_HOST) == [native_mod.AVX2]


def test_the_environment_forces_a_build_the_cpu_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(native_mod.EMULATE_ENV, raising=False)
    monkeypatch.setenv(native_mod.ISA_ENV, "avx2")
    assert native_mod.choose_variant(_AVX512_HOST) == (native_mod.AVX2, "forced by PLINTH_CPU_ISA=avx2")
    monkeypatch.setenv(native_mod.ISA_ENV, "avx512")
    with pytest.raises(ValueError, match=r"PLINTH_CPU_ISA=avx512: this CPU lacks avx512_vnni, avx512bw"):
        native_mod.choose_variant(_AVX2_HOST)
    monkeypatch.setenv(native_mod.ISA_ENV, "sse2")
    with pytest.raises(ValueError, match=r"PLINTH_CPU_ISA='sse2': expected auto or one of avx512, avx2"):
        native_mod.choose_variant(_AVX512_HOST)


def test_the_emulated_build_is_chosen_on_any_avx2_host_where_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """PLINTH_CPU_EMULATE=1 puts the emulated AVX-512 build first whatever the CPU has beyond AVX2;
    PLINTH_CPU_ISA=avx2 still forces the AVX2 build; a bad value is named."""
    monkeypatch.delenv(native_mod.ISA_ENV, raising=False)
    monkeypatch.setenv(native_mod.EMULATE_ENV, "1")
    emulated = native_mod.EMULATED_AVX512
    for host in (_AVX2_HOST, _AVX512_HOST):
        variant, why = native_mod.choose_variant(host)
        assert variant is emulated and "PLINTH_CPU_EMULATE=1" in why and "emulated" in variant.label
        assert native_mod.runnable_variants(host) == [emulated, native_mod.AVX2]
    assert variant.name == native_mod.AVX512.name  # the AVX-512 build's tuning and routing apply to it
    assert {"avx512_bf16", "amx_bf16"} <= (native_mod.native_cpu_flags() or set())
    monkeypatch.setenv(native_mod.ISA_ENV, "avx2")
    assert native_mod.choose_variant(_AVX2_HOST)[0] is native_mod.AVX2
    monkeypatch.setenv(native_mod.EMULATE_ENV, "yes")
    with pytest.raises(ValueError, match=r"PLINTH_CPU_EMULATE='yes' is not one of 0, 1"):
        native_mod.choose_variant(_AVX2_HOST)
    monkeypatch.setenv(native_mod.EMULATE_ENV, "0")
    assert native_mod.native_cpu_flags() == native_mod._cpu_flags()


def test_the_emulated_build_without_simde_is_named_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """PLINTH_CPU_EMULATE=1 without the simde-py package: the status line says what to install (the probe
    never raises), and building says the same."""
    import builtins

    real_import = builtins.__import__

    def no_simde(name: str, *args: object, **kwargs: object) -> object:
        if name == "simde_py":
            raise ImportError("No module named 'simde_py'")
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setenv(native_mod.EMULATE_ENV, "1")
    monkeypatch.delenv(native_mod.ISA_ENV, raising=False)
    monkeypatch.setattr(native_mod, "native_loaded", lambda: False)
    monkeypatch.setattr(builtins, "__import__", no_simde)
    if native_mod.build_check()[0] is None:
        pytest.skip(native_mod.build_check()[1])
    assert "pip install simde-py" in native_status()
    with pytest.raises(native_mod.NativeBuildError, match="pip install simde-py"):
        native_mod.build("cc", native_mod.EMULATED_AVX512)


#: Instructions of the AVX-512 and AMX extensions as objdump writes them (zmm and mask registers, the
#: AMX tile instructions, the bf16 and VNNI ones that have 256-bit forms).
_EMULATED_AWAY = ("%zmm", "%k1", "%k2", "%k3", "%k4", "%k5", "%k6", "%k7", "tileloadd", "tdpbf16ps", "ldtilecfg",
                  "vcvtneps2bf16", "vdpbf16ps", "vpdpwssd", "vpdpbusd")  # fmt: skip


@pytest.mark.skipif(not _can_build() or not shutil.which("objdump"), reason="needs a compiler and objdump")
def test_the_emulated_build_has_no_avx512_or_amx_instruction(monkeypatch: pytest.MonkeyPatch) -> None:
    """The emulated build runs on a CPU without AVX-512 or AMX only if none of their instructions is
    in it: its disassembly has none, where the AVX-512 build's has them (so the check can fail)."""
    pytest.importorskip("simde_py", reason="the emulated build needs simde-py (the [test] extra)")
    compiler = native_mod.build_check()[0]
    assert compiler is not None
    monkeypatch.setenv(native_mod.EMULATE_ENV, "1")

    def found(path: object) -> set[str]:
        text = subprocess.run(["objdump", "-d", str(path)], capture_output=True, text=True, check=True).stdout
        return {i for i in _EMULATED_AWAY if i in text}

    assert found(native_mod.build(compiler, native_mod.EMULATED_AVX512)) == set()
    try:
        real = native_mod.build(compiler, native_mod.AVX512)  # compiling needs no AVX-512 CPU
    except native_mod.NativeBuildError as e:
        pytest.skip(f"this compiler cannot build the AVX-512 variant to compare: {e}")
    assert {"%zmm", "tdpbf16ps", "vdpbf16ps"} <= found(real)


def test_status_names_a_refused_build_without_raising(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe reads the status: a bad PLINTH_CPU_ISA is reported there, not raised (the kernel
    request raises it)."""
    if native_mod.build_check()[0] is None:
        pytest.skip(native_mod.build_check()[1])
    monkeypatch.setattr(native_mod, "native_loaded", lambda: False)
    monkeypatch.setenv(native_mod.ISA_ENV, "sse2")
    assert native_status().startswith("native kernels refused: PLINTH_CPU_ISA='sse2'")


@needs_native
def test_a_library_built_for_another_isa_is_refused() -> None:
    """A cached file is loaded only as the build it is (``plinth_isa``), never as another."""
    loaded = native()
    assert loaded is not None
    other = next(v for v in native_mod.variants() if v.level != loaded.variant.level)
    with pytest.raises(native_mod.NativeBuildError, match="built for ISA level"):
        NativeKernels(loaded.path, other)


@needs_native
def test_forced_avx2_build_loads_and_says_so() -> None:
    """``PLINTH_CPU_ISA=avx2`` in a fresh process loads the AVX2 build (on an AVX-512 host too) and
    the backend's probe says it was forced."""
    import os
    import sys

    code = (
        "from plinth_cpu.native import native, native_status; k = native(); "
        "print(k.variant.name, k.lib.plinth_isa()); print(native_status())"
    )
    env = {**os.environ, native_mod.ISA_ENV: "avx2"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    first, status = proc.stdout.strip().splitlines()[-2:]
    assert first == "avx2 2"
    assert status.startswith("native kernels: AVX2/FMA") and "forced by PLINTH_CPU_ISA=avx2" in status


@needs_native
@pytest.mark.skipif(len(RUNNABLE) < 2, reason=f"this CPU runs one build only ({RUNNABLE[0]})")
@pytest.mark.parametrize("m", [1, 7, 101, 230])  # few-row tiles and the blocked (prefill) path
def test_builds_agree_on_fp32_panels(m: int) -> None:
    """From 96 rows (prefill) each output is the same FMA chain over k in every build: the AVX-512
    tile changes which registers hold which columns, not the arithmetic, so the builds agree bit for
    bit. Below, the AVX-512 tiles sum even and odd k apart (fp32 rounding apart)."""
    gen = torch.Generator().manual_seed(3)
    n, k = 200, 776  # a last panel group of 1 panel, K in two blocks of the prefill path
    w, x, b = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    ys = []
    for name in RUNNABLE:
        lib = _kernels(name)
        ys.append(lib.gemm_f32_panels(x, lib.pack_f32(w), b, n))
    for y in ys[1:]:
        if m >= 96:
            assert torch.equal(y, ys[0])
        torch.testing.assert_close(y, ys[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ys[0], F.linear(x, w, b), rtol=1e-4, atol=1e-4)


# ---- 16-bit activations (a bf16/fp16 model on the native kernels) --------------------------------

HALVES = pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The values' bit patterns with every NaN made one pattern (torch.equal treats NaN as unequal)."""
    ints = t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)
    return torch.where(t.isnan(), torch.zeros_like(ints), ints)


def _awkward(rows: int, cols: int, seed: int) -> torch.Tensor:
    """fp32 values that exercise rounding: ties, specials, values past the 16-bit ranges."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * 300
    x[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.4e38, -0.0, 1e-40])
    x[1] = (torch.randint(-(2**15), 2**15, (cols,), generator=gen).float() + 0.5) / 256  # ties at 16 bits
    return x


@needs_native
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "fp16"])
@pytest.mark.parametrize("dst", [torch.float32, torch.bfloat16, torch.float16], ids=["to_f32", "to_bf16", "to_fp16"])
def test_convert_is_torchs_cast_bit_for_bit(nk: NativeKernels, src: torch.dtype, dst: torch.dtype) -> None:
    """Widening is exact and rounding is torch's (nearest, ties to even; NaN, infinities, overflow),
    over rows of a strided view (cols 203: an 8-wide loop and a scalar tail)."""
    wide = _awkward(37, 230, seed=1).to(src)
    x = wide[:, 11:214]  # [37, 203], rows 230 apart
    assert torch.equal(_bits(nk.convert(x, dst)), _bits(x.to(dst)))
    out = torch.empty(37, 203, dtype=dst)
    assert nk.convert(x, dst, out=out) is out


@needs_native
def test_convert_names_what_it_cannot_take(nk: NativeKernels) -> None:
    with pytest.raises(ValueError, match="float64"):
        nk.convert(torch.zeros(2, 8, dtype=torch.float64), torch.float32)
    with pytest.raises(ValueError, match="dense rows"):
        nk.convert(torch.zeros(8, 2).t(), torch.bfloat16)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        nk.convert(torch.zeros(2, 8), torch.bfloat16, out=torch.empty(2, 8))


@needs_native
@HALVES
def test_16bit_small_ops_are_the_fp32_ops_rounded_once(nk: NativeKernels, half: torch.dtype) -> None:
    """Each op on 16-bit tensors computes in fp32 from the exactly widened values and rounds its
    result once: bit for bit the fp32 kernel's result cast to the 16-bit dtype."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(7, 64, generator=gen) * 4).to(half)
    res = (torch.randn(7, 64, generator=gen) * 4).to(half)
    w = (torch.rand(64, generator=gen) + 0.5).to(half)
    f = torch.float32
    assert torch.equal(nk.rms_norm(x, w, 1e-6), nk.rms_norm(x.to(f), w.to(f), 1e-6).to(half))
    # with the residual: the 16-bit sum is stored, and that rounded sum is normed
    r16, r32 = res.clone(), (res.to(f) + x.to(f)).to(half).to(f)
    out16 = nk.rms_norm(x, w, 1e-6, residual=r16)
    assert torch.equal(r16, r32.to(half))
    assert torch.equal(out16, nk.rms_norm(r32, w.to(f), 1e-6).to(half))
    heads = (torch.randn(5, 3 * 4 * 32, generator=gen) * 3).to(half)[:, 32:].view(5, -1)[:, : 2 * 4 * 32]
    q = heads.view(5, 8, 32)  # [5, 8, 32], tokens 352 apart: a view of a fused QKV
    hw = (torch.rand(32, generator=gen) + 0.5).to(half)
    assert torch.equal(nk.rms_norm_heads(q, hw, 1e-6), nk.rms_norm_heads(q.to(f), hw.to(f), 1e-6).to(half))
    gu = (torch.randn(6, 2 * 44, generator=gen) * 3).to(half)  # I = 44: an 8-wide loop and a tail
    assert torch.equal(nk.silu_and_mul(gu), nk.silu_and_mul(gu.to(f)).to(half))
    assert torch.equal(nk.gelu_tanh_and_mul(gu), nk.gelu_tanh_and_mul(gu.to(f)).to(half))
    pos = torch.tensor([0, 5, 17, 2, 9], dtype=torch.int64)
    cs = torch.randn(32, 24, generator=gen)  # rotary_dim 24 of 32: a copied tail
    assert torch.equal(nk.rotary(q, pos, cs, 24), nk.rotary(q.to(f), pos, cs, 24).to(half))


@needs_native
@HALVES
def test_cpu_ops_take_16bit_activations_natively(nk: NativeKernels, half: torch.dtype) -> None:
    """CpuOps runs a 16-bit model's norms, activations and rotary natively, near torch's own
    (which rounds after every intermediate op) and nearer the fp32 result."""
    gen = torch.Generator().manual_seed(4)
    ops, ref = CpuOps(nk), SmallOps()
    x = torch.randn(9, 128, generator=gen).to(half)
    w = (torch.rand(128, generator=gen) + 0.5).to(half)
    calls: list[str] = []
    lib = nk.lib

    class Spy:
        def __getattr__(self, name: str) -> object:
            calls.append(name)
            return getattr(lib, name)

    nk.lib = Spy()  # type: ignore[assignment]
    try:
        got = {
            "rms_norm": ops.rms_norm(x, w, 1e-5),
            "silu": ops.silu_and_mul(x),
            "gelu": ops.gelu_tanh_and_mul(x),
            "rotary": ops.rotary(x.view(9, 2, 64), torch.arange(9), torch.randn(16, 64, generator=gen), 64),
        }
    finally:
        nk.lib = lib
    assert calls == ["plinth_rms_norm", "plinth_silu_and_mul", "plinth_gelu_tanh_and_mul", "plinth_rotary"]
    assert all(t.dtype == half for t in got.values())
    tol = {"rtol": 1e-2, "atol": 1e-2} if half == torch.bfloat16 else {"rtol": 2e-3, "atol": 2e-3}
    torch.testing.assert_close(got["rms_norm"], ref.rms_norm(x, w, 1e-5), **tol)
    torch.testing.assert_close(got["silu"].float(), ref.silu_and_mul(x.float()), **tol)
    torch.testing.assert_close(got["gelu"].float(), ref.gelu_tanh_and_mul(x.float()), **tol)


@needs_native
@HALVES
@pytest.mark.parametrize("m", [1, 4, 5, 8])  # the 4x3 tile, the 1x3 tile after it
def test_16bit_model_gemm_is_the_fp32_product_rounded_once(nk: NativeKernels, half: torch.dtype, m: int) -> None:
    """A bf16/fp16 model keeps its weights dense in its dtype; up to ``rows16_max_rows`` rows the
    native row tiles read them widened and round the fp32 product once: bit for bit
    ``gemm_f32`` over the widened weights and ``x``, cast to the 16-bit dtype (the bias is the model
    dtype's value). A strided ``x`` is read in place; N = 74 leaves rows past the 3-row groups."""
    gen = torch.Generator().manual_seed(m)
    w, b = torch.randn(74, 96, generator=gen), torch.randn(74, generator=gen)
    wide = (torch.randn(m, 200, generator=gen) * 2).to(half)
    x = wide[:, 7:103]  # [m, 96], rows 200 apart
    g16 = NativeGemm(half, nk, onednn_packed="0", bf16_pairs="0")  # the bound with oneDNN reordering per call
    lw = g16.prepare(w, b)
    assert lw.format == "dense" and lw.weight is not None and lw.weight.dtype == half
    onednn = half == torch.bfloat16 and gemm_mod.onednn_runs_bf16(gemm_mod._cpu_flags())
    assert m <= g16.rows16_max_rows == (gemm_mod.ROWS16_BF16_ONEDNN if onednn else gemm_mod.UNBOUNDED)
    y = g16.linear(x, lw)
    w16 = w.to(half)
    assert y.dtype == half and torch.equal(y, nk.gemm_f32(x.float(), w16.float(), b.to(half).float()).to(half))
    assert torch.equal(nk.gemm_rows16(x.float(), w16, None), nk.gemm_f32(x.float(), w16.float(), None))


def test_amx_is_named_where_onednn_runs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN multiplies bf16 on AMX tiles where the CPU has AMX-BF16 and ``ONEDNN_MAX_CPU_ISA`` does
    not hold it below AMX; there the pair panels keep the row tiles' bound unless the kernel runs on AMX
    tiles itself (then it takes every product and no oneDNN copy is made), and the backends lines say so."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("PLINTH_CPU_16BIT_NATIVE_ROWS", raising=False)
    monkeypatch.delenv("PLINTH_CPU_BF16_PAIRS", raising=False)
    monkeypatch.delenv("PLINTH_CPU_ONEDNN_PACKED", raising=False)
    monkeypatch.setattr(gemm_mod, "_cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    monkeypatch.setattr(
        gemm_mod, "native_cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
    )
    assert gemm_mod.amx_bf16_onednn()
    if native_mod.choose_variant()[0] is native_mod.AVX512 and gemm_mod.onednn_packing("auto")[0]:
        # the status lines name the kernel only there
        monkeypatch.setenv("PLINTH_CPU_AMX", "auto")
        assert gemm_mod.amx_kernel_takes_every_product()
        assert "every row count by the native AMX-BF16 tile kernel" in gemm_mod.bf16_pairs_status()
        assert "not pre-packed for oneDNN: the native AMX-BF16 tile kernel" in gemm_mod.onednn_packing_status()
        monkeypatch.setenv("PLINTH_CPU_AMX", "0")
        assert not gemm_mod.amx_kernel_takes_every_product()
        assert "oneDNN's AMX GEMM" in gemm_mod.bf16_pairs_status()
        assert "bf16 weights pre-packed for oneDNN" in gemm_mod.onednn_packing_status()
        monkeypatch.setenv("PLINTH_CPU_AMX", "auto")
        monkeypatch.setenv("PLINTH_CPU_16BIT_NATIVE_ROWS", "64")
        assert "up to 64 rows by the native AMX-BF16 tile kernel" in gemm_mod.bf16_pairs_status()
        monkeypatch.delenv("PLINTH_CPU_16BIT_NATIVE_ROWS")
    for held in ("AVX512_CORE_BF16", "avx2"):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", held)
        assert not gemm_mod.amx_bf16_onednn()
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr(gemm_mod, "_cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    monkeypatch.setattr(gemm_mod, "native_cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    assert not gemm_mod.amx_bf16_onednn()


def test_bf16_goes_to_onednn_only_where_it_has_bf16_instructions(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN's bf16 GEMM pays only with AVX512-BF16 or AMX-BF16 (held to AVX2 it ran at 38 GFLOP/s
    here): elsewhere, and where ONEDNN_MAX_CPU_ISA holds oneDNN below them, a bf16 model's products
    take the native row tiles at every row count."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert gemm_mod.onednn_runs_bf16({"avx2", "avx512f", "avx512_bf16"})
    assert gemm_mod.onednn_runs_bf16({"avx2", "amx_bf16", "amx_tile"})
    assert not gemm_mod.onednn_runs_bf16({"avx2", "fma", "f16c"})
    assert not gemm_mod.onednn_runs_bf16(None)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
    assert not gemm_mod.onednn_runs_bf16({"avx2", "avx512f", "avx512_bf16"})
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert gemm_mod.onednn_runs_bf16({"avx2", "avx512f", "avx512_bf16"})


@needs_native
@pytest.mark.parametrize(
    "flags,packed,bound",
    [
        ({"avx2", "avx512_bf16"}, "auto", 4),
        ({"avx2", "avx512_bf16"}, "0", 8),
        ({"avx2", "fma"}, "auto", 1 << 62),
        ({"avx2", "avx512_bf16", "amx_bf16", "amx_tile"}, "auto", 4),
    ],
    ids=["bf16-packed", "bf16", "avx2", "amx-packed"],
)
def test_bf16_model_native_rows_follow_the_cpu(
    nk: NativeKernels, monkeypatch: pytest.MonkeyPatch, flags: set[str], packed: str, bound: int
) -> None:
    """Where oneDNN runs bf16, a bf16 model's native row tiles stop at 8 rows, at 4 where its weights
    are pre-packed for oneDNN (then faster from 8 rows); elsewhere they take every row count."""
    monkeypatch.delenv("PLINTH_CPU_16BIT_NATIVE_ROWS", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("PLINTH_CPU_ONEDNN_PACKED", packed)
    monkeypatch.setattr(gemm_mod, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(gemm_mod, "native_cpu_flags", lambda: flags)
    if packed == "auto" and bound == 4 and not torch.backends.mkldnn.is_available():
        bound = 8  # a torch without oneDNN packs nothing
    assert NativeGemm(torch.bfloat16, nk, bf16_pairs="0").rows16_max_rows == bound
    assert NativeGemm(torch.float16, nk).rows16_max_rows == gemm_mod.UNBOUNDED
    # with the AVX512-BF16 dot-product kernel (this CPU's own CPUID says) every decode-sized product is native
    pairs = NativeGemm(torch.bfloat16, nk)
    assert pairs.bf16_pairs == nk.bf16_dot
    # ... but where oneDNN multiplies on AMX tiles and the kernel does not (this CPU's own CPUID says),
    # only up to the row tiles' bound; where the kernel runs on AMX tiles itself, every row count
    amx = "amx_bf16" in flags and not nk.amx_bf16
    expected = gemm_mod.ROWS16_BF16_PAIRS if nk.bf16_dot and not amx else bound
    assert pairs.rows16_max_rows == (gemm_mod.UNBOUNDED if nk.amx_bf16 else expected)
    if nk.amx_bf16:
        assert not pairs.onednn_packed  # no oneDNN copy of the weights to keep


@needs_native
@pytest.mark.parametrize("rows", ["0", "8", "x"])
def test_16bit_model_gemm_rows_switch(nk: NativeKernels, monkeypatch: pytest.MonkeyPatch, rows: str) -> None:
    """``PLINTH_CPU_16BIT_NATIVE_ROWS`` sets the most rows the native tiles take (above: torch's
    oneDNN GEMM, within bf16 rounding of the native result); a bad value is named."""
    monkeypatch.setenv("PLINTH_CPU_16BIT_NATIVE_ROWS", rows)
    if rows == "x":
        with pytest.raises(ValueError, match="PLINTH_CPU_16BIT_NATIVE_ROWS='x'"):
            NativeGemm(torch.bfloat16, nk)
        return
    g = NativeGemm(torch.bfloat16, nk, onednn_packed="0", bf16_pairs="0")  # above the bound: F.linear itself
    assert g.rows16_max_rows == int(rows)
    gen = torch.Generator().manual_seed(2)
    lw = g.prepare(torch.randn(40, 64, generator=gen), torch.randn(40, generator=gen))
    x = torch.randn(4, 64, generator=gen).bfloat16()
    y, torch_y = g.linear(x, lw), F.linear(x, lw.weight, lw.bias)
    if rows == "0":
        assert torch.equal(y, torch_y)  # torch's GEMM itself
    else:
        assert lw.weight is not None
        assert torch.equal(y, nk.gemm_f32(x.float(), lw.weight.float(), lw.bias.float()).to(torch.bfloat16))
        torch.testing.assert_close(y.float(), torch_y.float(), rtol=1e-2, atol=5e-2)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        nk.gemm_rows16(x.float(), torch.zeros(40, 64), None)


@needs_native
@HALVES
def test_16bit_model_quantized_gemm_rounds_the_fp32_product(nk: NativeKernels, half: torch.dtype) -> None:
    """GGUF blocks in a 16-bit model: the fp32 kernels over the widened ``x``, rounded once."""
    gen = torch.Generator().manual_seed(9)
    qw = quantize_q8_0(torch.randn(40, 64, generator=gen))
    x = torch.randn(3, 64, generator=gen).to(half)
    y = NativeGemm(half, nk).linear(x, NativeGemm(half, nk).prepare_quantized(qw, None))
    g32 = NativeGemm(torch.float32, nk)
    assert y.dtype == half and torch.equal(y, g32.linear(x.float(), g32.prepare_quantized(qw, None)).to(half))


@needs_native
@pytest.mark.skipif(len(RUNNABLE) < 2, reason=f"this CPU runs one build only ({RUNNABLE[0]})")
@CACHE_DTYPES
def test_builds_agree_on_attention(cache_dtype: torch.dtype) -> None:
    """Decodes and prefill chunks in one batch, SmolLM2's head shape, in every build: the AVX-512
    build sums each key's products 16 at a time (then folds the halves), AVX2 8 at a time, so the
    scores differ by fp32 rounding; the weighted sums of V are the same FMA chains."""
    gen = torch.Generator().manual_seed(17)
    spec = AttentionSpec(num_heads=9, num_kv_heads=3, head_size=64, block_size=16, sliding_window=40)
    seq_lens, q_lens = [33, 70, 17, 5], [1, 21, 1, 5]
    cache, decode_meta = _decode_batch(seq_lens, spec, 24, gen, cache_dtype)
    meta = AttentionMetadata.from_lengths(
        q_lens, seq_lens, decode_meta.block_tables, slot_mapping=torch.zeros(sum(q_lens), dtype=torch.long)
    )
    q = torch.randn(sum(q_lens), spec.num_heads, spec.head_size, generator=gen)
    outs = [NativeAttention(spec, CPU_KV_LAYOUT, _kernels(name)).forward(q, cache, meta, 0.125) for name in RUNNABLE]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0], CpuAttention(spec).forward(q, cache, meta, 0.125), rtol=1e-5, atol=1e-5)


@needs_native
@HALVES
def test_16bit_model_attention_is_the_fp32_attention_rounded_once(nk: NativeKernels, half: torch.dtype) -> None:
    """A bf16/fp16 model's attention runs natively: its queries widened exactly, the fp32 kernels over
    its 16-bit cache, the output rounded once (bit for bit the fp32 query's result cast to the
    model dtype); 16-bit K/V are written into the cache as they are. A batch of decodes and prefill
    chunks (both kernels), GQA, a sliding window."""
    gen = torch.Generator().manual_seed(23)
    name = str(half).removeprefix("torch.")
    spec = AttentionSpec(6, 2, 32, 16, dtype=name, kv_cache_dtype=name, sliding_window=40)
    assert NativeAttention.covers(spec)
    seq_lens, q_lens = [33, 70, 17, 5], [1, 21, 1, 5]
    cache, decode_meta = _decode_batch(seq_lens, spec, 24, gen, half)
    meta = AttentionMetadata.from_lengths(
        q_lens, seq_lens, decode_meta.block_tables, slot_mapping=torch.zeros(sum(q_lens), dtype=torch.long)
    )
    q = torch.randn(sum(q_lens), spec.num_heads, spec.head_size, generator=gen).to(half)
    attn = NativeAttention(spec, CPU_KV_LAYOUT, nk)
    got = attn.forward(q, cache, meta, 0.17)
    assert got.dtype == half
    assert torch.equal(got, attn.forward(q.float(), cache, meta, 0.17).to(half))
    torch.testing.assert_close(
        got.float(), CpuAttention(spec).forward(q, cache, meta, 0.17).float(), rtol=2e-2, atol=2e-2
    )
    # K/V of the model's dtype, values a view of a fused projection: stored exactly
    kv = torch.randn(3, 3 * spec.num_kv_heads * 32, generator=gen).to(half)
    k, v = kv[:, :64].view(3, 2, 32), kv[:, 64:128].view(3, 2, 32)
    slots = torch.tensor([5, 40, 77])
    before = cache.clone()
    attn.write_kv(k, v, cache, slots)
    blk, off = slots // 16, slots % 16
    assert torch.equal(cache[0, blk, :, off], k) and torch.equal(cache[1, blk, :, off], v)
    untouched = torch.ones_like(cache, dtype=torch.bool)
    untouched[:, blk, :, off] = False
    assert torch.equal(cache[untouched].nan_to_num(), before[untouched].nan_to_num())


# -- bf16 x bf16 on AVX512-BF16 dot products (pair panels) --------------------------------------------


def _needs_bf16_dot(nk: NativeKernels) -> None:
    """Skip, saying why, where ``nk`` cannot run the pair-panel kernel (the AVX2 build, or a CPU
    without AVX512-BF16); the tests that run it say which build did in their ids."""
    if not nk.bf16_dot:
        pytest.skip(f"the {nk.variant.name} build on this CPU has no AVX512-BF16 dot products")


@needs_native
def test_bf16_pair_panels_hold_the_weight_pairs(nk: NativeKernels) -> None:
    """Panel p, pair kp holds w[16p + j, 2kp + t] at [p, kp, j, t]; the last panel's missing columns
    are zeros. The layout needs no AVX512-BF16 (it is made at load on any build)."""
    gen = torch.Generator().manual_seed(40)
    w = torch.randn(37, 24, generator=gen).bfloat16()
    P = nk.pack_bf16_pairs(w)
    assert P.shape == (3, 12, 16, 2) and P.dtype == torch.bfloat16
    padded = torch.zeros(48, 24, dtype=torch.bfloat16)
    padded[:37] = w
    assert torch.equal(P, padded.view(3, 16, 12, 2).transpose(1, 2))
    with pytest.raises(ValueError, match="K even"):
        nk.pack_bf16_pairs(torch.zeros(4, 7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous bf16"):
        nk.pack_bf16_pairs(torch.zeros(4, 8))


@needs_native
@pytest.mark.parametrize(
    "m,n,k", [(1, 576, 576), (3, 37, 24), (8, 100, 96), (9, 48, 8), (17, 200, 96), (64, 61, 130), (40, 61, 64)]
)
def test_bf16_pairs_gemm_sums_the_exact_products(nk: NativeKernels, threads: int, m: int, n: int, k: int) -> None:
    """The pair-panel kernel: each output is the sum of the exact bf16 x bf16 products (fp32 sums,
    off the float64 sum only by their rounding), plus the fp32 bias; the bf16 output is that fp32
    result rounded once, as torch rounds. ``x`` is read in place from a strided view whose gaps hold
    NaN. Covers every row-block size (1-8 and a 64-row batch) and strips of 1-3 panels with a
    partial last panel; on an AMX host the cases with K a multiple of 32 and 2 rows or more run on
    AMX tiles (16-row blocks with a partial last one, a last panel pair of one panel)."""
    _needs_bf16_dot(nk)
    gen = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen)
    wide = torch.full((m, k + 10), float("nan"), dtype=torch.bfloat16)
    wide[:, 5 : 5 + k] = torch.randn(m, k, generator=gen).bfloat16()
    x = wide[:, 5 : 5 + k]
    P = nk.pack_bf16_pairs(w)
    exact = x.double() @ w.double().T
    bound = (x.double().abs() @ w.double().abs().T) * k * 2.0**-24  # fp32 summation of k exact terms
    y = nk.gemm_bf16_pairs(x, P, b, n, torch.float32)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert ((y.double() - b.double() - exact).abs() <= bound + 1e-6).all()
    y16 = nk.gemm_bf16_pairs(x, P, b, n, torch.bfloat16)
    assert y16.dtype == torch.bfloat16 and torch.equal(y16, y.bfloat16())
    assert ((nk.gemm_bf16_pairs(x, P, None, n, torch.float32).double() - exact).abs() <= bound + 1e-6).all()


@needs_native
@pytest.mark.parametrize("m,n,k", [(1, 100, 256), (17, 100, 256), (96, 200, 576), (64, 61, 64)])
def test_bf16x3_products_are_near_fp32(nk: NativeKernels, m: int, n: int, k: int) -> None:
    """An fp32 product as three bf16 products (hi/lo parts of both operands, summed in fp32): within
    1e-5 of |x| |w| of the float64 product (the parts' rounding: ~2^-17 each), where the plain bf16
    product is off by more than 1e-4 (so the test tells them apart), plus the fp32 bias; on AMX tiles
    (K a multiple of 32, 2 rows or more) where the build has them."""
    _needs_bf16_dot(nk)
    gen = torch.Generator().manual_seed(m + n + k)
    x, w, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    exact = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    y = nk.gemm_bf16x3(x, nk.pack_bf16x3(w), b, n)
    assert y.shape == (m, n) and y.dtype == torch.float32
    err = ((y.double() - b.double() - exact).abs() / scale).max().item()
    plain = ((x.bfloat16().double() @ w.bfloat16().double().T - exact).abs() / scale).max().item()
    print(f"bf16x3 {m}x{n}x{k} on {'AMX tiles' if nk.amx_bf16 and m >= 2 else 'dot products'}: {err:.2e} of "
          f"|x||w| (plain bf16 {plain:.2e})")  # fmt: skip
    assert err < 1e-5 and plain > 1e-4


@needs_native
def test_bf16x3_products_keep_non_finite_values_as_fp32_does(nk: NativeKernels) -> None:
    """An infinite activation or weight meets the other operand once (its lo part and the second hi
    copy are zero): the infinities and NaNs land where fp32's do, with their signs, at 1 row (dot
    products) and at several (tiles)."""
    _needs_bf16_dot(nk)
    gen = torch.Generator().manual_seed(3)
    for m in (1, 4, 33):
        x, w = torch.randn(m, 64, generator=gen), torch.randn(8, 64, generator=gen)
        x[0, 3], x[m // 2, 5], x[-1, 7], w[2, 9] = float("inf"), float("-inf"), float("nan"), float("inf")
        y, ref = nk.gemm_bf16x3(x, nk.pack_bf16x3(w), None, 8), x @ w.T
        assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.equal(torch.isinf(y), torch.isinf(ref))
        assert torch.equal(y[torch.isinf(y)], ref[torch.isinf(ref)])
        finite = torch.isfinite(ref)
        assert torch.allclose(y[finite], ref[finite], rtol=1e-5, atol=1e-3)  # the bound: the test above


@needs_native
def test_fp32_models_take_bf16x3_products_from_the_rows_asked_for(
    recording: NativeKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PLINTH_CPU_FP32_BF16X3=16 on a build with AMX tiles: an fp32 weight with K a multiple of 32 keeps
    bf16x3 panels beside its fp32 panels, products of 16 rows or more run on them, fewer rows, a step
    graph being recorded and other K on the fp32 panels (bit for bit); without AMX, or by default,
    none is made; a bad value is named."""
    nk = recording
    gen = torch.Generator().manual_seed(5)
    w, w_odd, b = torch.randn(48, 64, generator=gen), torch.randn(48, 40, generator=gen), torch.randn(48)
    monkeypatch.delenv(gemm_mod.BF16X3_ENV, raising=False)
    assert "bf16x3" not in NativeGemm(torch.float32, nk).prepare(w, b).data
    monkeypatch.setenv(gemm_mod.BF16X3_ENV, "16")
    gemm = NativeGemm(torch.float32, nk)
    lw = gemm.prepare(w, b)
    assert gemm.prepare(w_odd, b).data.keys() == {"panels"}
    if not nk.amx_bf16:
        assert gemm.bf16x3_min_rows == 0 and lw.data.keys() == {"panels"}
        pytest.skip(f"the {nk.variant.name} build here has no AMX-BF16 tiles: fp32 panels only")
    assert gemm.bf16x3_min_rows == 16 and lw.format == gemm_mod.PANELS and "bf16x3" in lw.data
    x = torch.randn(16, 64, generator=gen)
    assert torch.equal(gemm.linear(x, lw), nk.gemm_bf16x3(x, lw.data["bf16x3"], b, 48))
    assert torch.equal(gemm.linear(x[:15], lw), nk.gemm_f32_panels(x[:15], lw.data["panels"], b, 48))
    nk.begin_recording()
    assert torch.equal(gemm.linear(x, lw), nk.gemm_f32_panels(x, lw.data["panels"], b, 48))
    nk.cancel_recording()
    monkeypatch.setenv(gemm_mod.BF16X3_ENV, "many")
    with pytest.raises(ValueError, match=r"PLINTH_CPU_FP32_BF16X3='many': expected a row count"):
        NativeGemm(torch.float32, nk)


@needs_native
@pytest.mark.parametrize("m", [2, 16, 33, 64, 200])  # 33: a 32-row step and a 1-row one; 200: two row chunks
def test_bf16_pairs_on_amx_tiles_sum_what_the_dot_products_sum(nk: NativeKernels, m: int) -> None:
    """Where the CPU has AMX-TILE and AMX-BF16 the pair kernel runs on tiles from 2 rows; the sums are
    those of the AVX512-BF16 dot products up to the order of their fp32 additions (both within the
    fp32 summation bound of the exact products), the bf16 result each rounded once. Elsewhere the
    library says it has no tiles, and turning them on changes nothing."""
    _needs_bf16_dot(nk)
    if not nk.amx_bf16:
        if native_mod.amx_mode() == "0":
            pytest.skip("PLINTH_CPU_AMX=0: the dot-product path only")
        try:
            assert nk.lib.plinth_amx_bf16(1) == 0
        finally:
            nk.lib.plinth_amx_bf16(0)
        pytest.skip("no AMX-TILE/AMX-BF16 on this CPU (or not granted by Linux): the dot-product path only")
    gen = torch.Generator().manual_seed(m)
    n, k = 200, 576
    w, x = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(m, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen)
    P = nk.pack_bf16_pairs(w)
    exact = x.double() @ w.double().T + b.double()
    bound = (x.double().abs() @ w.double().abs().T) * k * 2.0**-24 + 1e-6
    try:
        tiles = nk.gemm_bf16_pairs(x, P, b, n, torch.float32)
        tiles16 = nk.gemm_bf16_pairs(x, P, b, n, torch.bfloat16)
        assert nk.lib.plinth_amx_bf16(0) == 0
        dots = nk.gemm_bf16_pairs(x, P, b, n, torch.float32)
    finally:
        nk.lib.plinth_amx_bf16(int(nk.amx_bf16))
    print(f"AMX tiles against AVX512-BF16 dot products at {m} rows: largest difference "
          f"{(tiles - dots).abs().max().item():.2g}")  # fmt: skip
    assert ((tiles.double() - exact).abs() <= bound).all() and ((dots.double() - exact).abs() <= bound).all()
    assert torch.equal(tiles16, tiles.bfloat16())


@needs_native
def test_bf16_pairs_gemm_records_and_replays_over_fewer_rows(recording: NativeKernels) -> None:
    """The kernel is a step-graph call: replayed over fewer rows than recorded, the first rows are a
    fresh call's and the rest keep their values."""
    nk = recording
    _needs_bf16_dot(nk)
    gen = torch.Generator().manual_seed(41)
    w, x = torch.randn(40, 64, generator=gen).bfloat16(), torch.randn(5, 64, generator=gen).bfloat16()
    P = nk.pack_bf16_pairs(w)
    nk.begin_recording()
    y = nk.gemm_bf16_pairs(x, P, None, 40, torch.bfloat16)
    graph = nk.end_recording()
    assert graph.names == ["plinth_gemm_bf16_pairs"]
    old = y.clone()
    x.copy_(torch.randn(5, 64, generator=gen).bfloat16())
    graph.replay(rows=3, captured=5)
    assert torch.equal(y[:3], nk.gemm_bf16_pairs(x[:3], P, None, 40, torch.bfloat16))
    assert torch.equal(y[3:], old[3:])


@needs_native
def test_bf16_pairs_gemm_refuses_what_it_cannot_run(nk: NativeKernels) -> None:
    """Where the build or CPU has no AVX512-BF16 (the AVX2 build always) the call says so instead of
    computing; everywhere, a non-bf16 ``x``, another output dtype or panels of another shape are named."""
    P = nk.pack_bf16_pairs(torch.zeros(16, 8, dtype=torch.bfloat16))
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    if nk.variant.name == "avx2":
        assert not nk.bf16_dot
    if not nk.bf16_dot:
        with pytest.raises(ValueError, match="no AVX512-BF16"):
            nk.gemm_bf16_pairs(x, P, None, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="takes bf16"):
        nk.gemm_bf16_pairs(x.float(), P, None, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="writes fp32 or bf16"):
        nk.gemm_bf16_pairs(x, P, None, 16, torch.float16)
    with pytest.raises(ValueError, match="do not hold a 17 x 8 weight"):
        nk.gemm_bf16_pairs(x, P, None, 17, torch.bfloat16)
