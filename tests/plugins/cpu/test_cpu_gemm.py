"""The cpu backend's GEMM: a bf16 model's weights pre-packed for oneDNN (``PLINTH_CPU_ONEDNN_PACKED``) and in
pair panels for the AVX512-BF16 kernel (``PLINTH_CPU_BF16_PAIRS``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plinth_cpu import gemm as gemm_mod
from plinth_cpu.gemm import CpuGemm, NativeGemm, OneDnnPacked, onednn_packs
from plinth_cpu.native import native, native_status

#: This host's oneDNN packs bf16 weights by default (AVX512-BF16 or AMX-BF16, torch built with oneDNN).
PACKS_HERE = onednn_packs(torch.bfloat16, "auto")
needs_packing = pytest.mark.skipif(
    not PACKS_HERE, reason="oneDNN has no bf16 dot products on this CPU: bf16 weights stay [N, K] only"
)


@pytest.mark.parametrize(
    "flags,mode,dtype,packs",
    [
        ({"avx2", "avx512_bf16"}, "auto", torch.bfloat16, True),
        ({"avx2", "amx_bf16", "amx_tile"}, "auto", torch.bfloat16, True),
        ({"avx2", "fma"}, "auto", torch.bfloat16, False),
        ({"avx2", "avx512_bf16"}, "0", torch.bfloat16, False),
        ({"avx2", "avx512_bf16"}, "auto", torch.float32, False),
        ({"avx2", "avx512_bf16"}, "1", torch.float16, False),
    ],
    ids=["avx512-bf16", "amx", "avx2", "off", "fp32", "fp16"],
)
def test_bf16_weights_are_packed_where_onednn_runs_bf16(
    monkeypatch: pytest.MonkeyPatch, flags: set[str], mode: str, dtype: torch.dtype, packs: bool
) -> None:
    """The "auto" mode packs a bf16 model's weights only where oneDNN has bf16 dot products; fp32 (the native
    panels beat oneDNN) and fp16 (its reorder needs AVX512-FP16) never."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("PLINTH_CPU_ONEDNN_PACKED", mode)
    monkeypatch.setattr(gemm_mod, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(gemm_mod, "native_cpu_flags", lambda: flags)
    expected = packs and torch.backends.mkldnn.is_available()
    assert onednn_packs(dtype) is expected
    assert CpuGemm(dtype).onednn_packed is expected


def test_packing_switch_names_bad_values_and_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value outside auto/1/0 is named; "1" where oneDNN refuses to pack says so when the GEMM is
    made (not at the first weight), with torch's reason."""
    monkeypatch.setenv("PLINTH_CPU_ONEDNN_PACKED", "yes")
    with pytest.raises(ValueError, match="PLINTH_CPU_ONEDNN_PACKED='yes': expected one of auto, 1, 0"):
        CpuGemm(torch.bfloat16)

    def refuse(weight: torch.Tensor) -> OneDnnPacked:
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(gemm_mod, "onednn_pack", refuse)
    monkeypatch.setenv("PLINTH_CPU_ONEDNN_PACKED", "1")
    with pytest.raises(ValueError, match="PLINTH_CPU_ONEDNN_PACKED=1: .*cannot pre-pack.*avx512bw"):
        CpuGemm(torch.bfloat16)
    monkeypatch.setenv("PLINTH_CPU_ONEDNN_PACKED", "0")
    assert not CpuGemm(torch.bfloat16).onednn_packed


def _strided_between_nan(m: int, gen: torch.Generator) -> torch.Tensor:
    """A bf16 ``x`` [m, 96] viewed in rows of 250 whose other elements are NaN (a GEMM that reads outside
    the view, as issue 23's AMX host did, puts NaN in its result)."""
    wide = torch.full((m, 250), float("nan"), dtype=torch.bfloat16)
    wide[:, 3:99] = torch.randn(m, 96, generator=gen).to(torch.bfloat16)
    return wide[:, 3:99]


def _spy_packed_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row counts of the products that run on oneDNN's pre-packed weight from now on."""
    calls: list[int] = []
    real = gemm_mod.onednn_packed_linear

    def spy(x: torch.Tensor, packed: OneDnnPacked, bias: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, packed, bias)

    monkeypatch.setattr(gemm_mod, "onednn_packed_linear", spy)
    return calls


@needs_packing
@pytest.mark.parametrize("native_kernels", [True, False], ids=["native", "torch-only"])
@pytest.mark.parametrize("m", [1, 4, 5, 33, 130])
def test_bf16_products_run_on_the_packed_weight(monkeypatch: pytest.MonkeyPatch, native_kernels: bool, m: int) -> None:
    """With the native kernels, a bf16 model's products of more than 4 rows (without them, all) take
    the weight oneDNN reordered at load, and give ``F.linear``'s result on the ``[N, K]`` weight
    within bf16 rounding; a strided ``x`` (NaN between its rows, as issue 23's AMX host leaked them)
    is copied first. The packed weight is held wrapped, not as a tensor in ``data`` for a step tracer
    to swap or for the weight-stream probes to count."""
    monkeypatch.delenv("PLINTH_CPU_ONEDNN_PACKED", raising=False)
    monkeypatch.delenv("PLINTH_CPU_16BIT_NATIVE_ROWS", raising=False)
    nk = native()
    if native_kernels and nk is None:
        pytest.skip(native_status())
    # the dense [N, K] weight's path (a CPU with AVX512-BF16 takes pair panels instead: the test below)
    native_gemm = native_kernels and nk is not None
    gemm = NativeGemm(torch.bfloat16, nk, bf16_pairs="0") if native_gemm else CpuGemm(torch.bfloat16)
    gen = torch.Generator().manual_seed(m)
    w, b = torch.randn(200, 96, generator=gen), torch.randn(200, generator=gen)
    lw = gemm.prepare(w, b)
    assert lw.format == "dense" and lw.weight is not None and lw.weight.dtype == torch.bfloat16
    assert isinstance(lw.data["onednn"], OneDnnPacked)
    assert not isinstance(lw.data["onednn"], torch.Tensor)
    x = _strided_between_nan(m, gen)
    packed_calls = _spy_packed_calls(monkeypatch)
    y = gemm.linear(x, lw)
    assert packed_calls == ([] if native_kernels and m <= gemm_mod.ROWS16_BF16_PACKED else [m])
    assert y.dtype == torch.bfloat16 and y.shape == (m, 200) and not y.isnan().any()
    ref = F.linear(x.contiguous(), lw.weight, lw.bias)
    torch.testing.assert_close(y.float(), ref.float(), rtol=1.6e-2, atol=5e-2)


NK = native()
#: This host runs the native AVX512-BF16 kernel (the loaded build has it and CPUID reports AVX512-BF16).
PAIRS_HERE = NK is not None and NK.bf16_dot
needs_pairs = pytest.mark.skipif(
    not PAIRS_HERE, reason="no AVX512-BF16 dot products in the loaded native build on this CPU: " + native_status()
)


@needs_pairs
@pytest.mark.parametrize("onednn", ["auto", "0"], ids=["with-onednn-copy", "pairs-only"])
@pytest.mark.parametrize("m", [1, 5, 64, 65, 130])
def test_bf16_products_run_on_pair_panels(monkeypatch: pytest.MonkeyPatch, onednn: str, m: int) -> None:
    """On a CPU with AVX512-BF16 a bf16 model's weights go into pair panels (no ``[N, K]`` copy is
    kept): products up to ROWS16_BF16_PAIRS rows (every decode step graph bucket) run the native
    kernel, larger ones oneDNN's pre-packed copy (where oneDNN has AMX and the kernel does not run on
    it, above ROWS16_BF16_PACKED rows: oneDNN's tiles win from 6 rows there); without that copy, or
    where the kernel runs on AMX tiles (then no copy is made), the kernel takes every row count.
    Either way the result is ``F.linear``'s on the bf16 weight within bf16 rounding, a strided ``x``
    with NaN between its rows included, and the bias in fp32."""
    monkeypatch.delenv("PLINTH_CPU_16BIT_NATIVE_ROWS", raising=False)
    monkeypatch.delenv("PLINTH_CPU_BF16_PAIRS", raising=False)
    assert NK is not None
    gemm = NativeGemm(torch.bfloat16, NK, onednn_packed=onednn)
    amx = gemm_mod.amx_bf16_onednn()
    bound = gemm_mod.ROWS16_BF16_PAIRS
    if NK.amx_bf16:
        bound = gemm_mod.UNBOUNDED
        assert not gemm.onednn_packed  # every product on the tile kernel: no copy to keep
    elif amx:
        bound = gemm_mod.ROWS16_BF16_PACKED if gemm.onednn_packed else gemm_mod.ROWS16_BF16_ONEDNN
    print(f"oneDNN {'has' if amx else 'lacks'} AMX-BF16 here, the kernel {'runs' if NK.amx_bf16 else 'lacks'} "
          f"AMX tiles: its bound is {bound} rows")  # fmt: skip
    assert gemm.bf16_pairs and gemm.rows16_max_rows == bound
    gen = torch.Generator().manual_seed(m)
    w, b = torch.randn(200, 96, generator=gen), torch.randn(200, generator=gen)
    lw = gemm.prepare(w, b)
    assert lw.format == gemm_mod.PAIRS and lw.weight is None and lw.data["pairs"].dtype == torch.bfloat16
    assert ("onednn" in lw.data) == (onednn == "auto" and PACKS_HERE and not NK.amx_bf16)
    x = _strided_between_nan(m, gen)
    packed_calls = _spy_packed_calls(monkeypatch)
    y = gemm.linear(x, lw)
    onednn_rows = "onednn" in lw.data and m > bound
    assert packed_calls == ([m] if onednn_rows else [])
    assert y.dtype == torch.bfloat16 and y.shape == (m, 200) and not y.isnan().any()
    w16 = w.to(torch.bfloat16)
    ref = F.linear(x.contiguous(), w16, b.to(torch.bfloat16))
    torch.testing.assert_close(y.float(), ref.float(), rtol=1.6e-2, atol=5e-2)
    if not onednn_rows:  # the kernel's own sums: exact products in fp32 plus the fp32 bias, rounded once
        exact = x.double() @ w16.double().T + b.to(torch.bfloat16).double()
        torch.testing.assert_close(y.double(), exact.bfloat16().double(), rtol=1e-2, atol=2e-2)


@needs_pairs
def test_amx_tiles_take_every_product_where_k_suits_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """On AMX tiles a weight whose K is a multiple of 32 gets no oneDNN copy: the tile kernel takes
    every product. A weight of another K runs the AVX512-BF16 dot-product kernel, which keeps the copy
    (where oneDNN packs) for products above ROWS16_BF16_PAIRS rows."""
    for env in ("PLINTH_CPU_16BIT_NATIVE_ROWS", "PLINTH_CPU_BF16_PAIRS", "PLINTH_CPU_ONEDNN_PACKED"):
        monkeypatch.delenv(env, raising=False)
    assert NK is not None
    if not NK.amx_bf16:
        pytest.skip("no AMX tiles here (CPUID AMX-BF16, or PLINTH_CPU_AMX=0): the 64-row bound holds (above)")
    gemm = NativeGemm(torch.bfloat16, NK)
    assert gemm.amx_takes_all and gemm.rows16_max_rows == gemm_mod.UNBOUNDED
    gen = torch.Generator().manual_seed(5)
    w96, w72 = torch.randn(40, 96, generator=gen), torch.randn(40, 72, generator=gen)
    tiles, dots = gemm.prepare(w96, None), gemm.prepare(w72, None)
    assert "onednn" not in tiles.data and ("onednn" in dots.data) == PACKS_HERE
    calls = _spy_packed_calls(monkeypatch)
    for m, w, lw in ((130, w96, tiles), (130, w72, dots), (64, w72, dots)):
        x = torch.randn(m, w.shape[1], generator=gen).bfloat16()
        ref = F.linear(x, w.bfloat16())  # whichever kernel ran: F.linear's within bf16 rounding
        torch.testing.assert_close(gemm.linear(x, lw).float(), ref.float(), rtol=1.6e-2, atol=5e-2)
    assert calls == ([130] if PACKS_HERE else [])


def test_amx_switch_names_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PLINTH_CPU_AMX`` takes auto or 0; another value is named by the check the library's load
    runs and by the backends line, and "0" keeps the kernel off AMX tiles in that line."""
    from plinth_cpu import native as native_mod

    monkeypatch.setenv("PLINTH_CPU_AMX", "yes")
    with pytest.raises(ValueError, match="PLINTH_CPU_AMX='yes' is not one of auto, 0"):
        native_mod.amx_mode()
    assert "PLINTH_CPU_AMX='yes'" in (gemm_mod.amx_status() or "")
    monkeypatch.setenv("PLINTH_CPU_AMX", "0")
    assert native_mod.amx_mode() == "0" and gemm_mod.amx_status() is None
    assert not gemm_mod.amx_tiles_expected() and "AMX-BF16 tile" not in gemm_mod.bf16_pairs_status()


def test_pairs_switch_names_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PLINTH_CPU_BF16_PAIRS`` takes auto or 0; "0" keeps a bf16 model's weights ``[N, K]``, and
    other dtypes never take pair panels."""
    if NK is None:
        pytest.skip(native_status())
    monkeypatch.setenv("PLINTH_CPU_BF16_PAIRS", "yes")
    with pytest.raises(ValueError, match="PLINTH_CPU_BF16_PAIRS='yes'"):
        NativeGemm(torch.bfloat16, NK)
    assert "is not one of auto, 0" in gemm_mod.bf16_pairs_status()
    monkeypatch.setenv("PLINTH_CPU_BF16_PAIRS", "0")
    g = NativeGemm(torch.bfloat16, NK)
    assert not g.bf16_pairs and g.prepare(torch.randn(16, 8), None).format == "dense"
    assert "PLINTH_CPU_BF16_PAIRS=0" in gemm_mod.bf16_pairs_status()
    monkeypatch.delenv("PLINTH_CPU_BF16_PAIRS")
    for dtype in (torch.float32, torch.float16):
        assert not NativeGemm(dtype, NK).bf16_pairs
    assert NativeGemm(torch.bfloat16, NK).bf16_pairs == NK.bf16_dot


@pytest.mark.parametrize("mode", ["auto", "1"])
def test_packing_stops_where_the_copy_would_crowd_the_host(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, mode: str
) -> None:
    """Under "auto" a weight is packed only while the host keeps ONEDNN_PACK_RESERVE of its memory
    after the copy: a model that fits once but not twice loads, its later weights unpacked (said once
    in the log); "1" packs regardless. The reorder itself is stubbed, so this runs on every host."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(gemm_mod, "_cpu_flags", lambda: {"avx2", "avx512_bf16"})
    monkeypatch.setattr(gemm_mod, "native_cpu_flags", lambda: {"avx2", "avx512_bf16"})
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    monkeypatch.setattr(gemm_mod, "onednn_pack", lambda w: OneDnnPacked(w))
    gib = 1 << 30
    available = [6 * gib]
    monkeypatch.setattr(gemm_mod, "host_memory_info", lambda: (available[0], 8 * gib))
    gemm = CpuGemm(torch.bfloat16, mode)
    assert gemm.onednn_packed
    w = torch.randn(64, 32)
    assert "onednn" in gemm.prepare(w, None).data  # 6 GiB of 8 available: room
    available[0] = 2 * gib + w.numel() * 2 - 1  # the copy would leave a byte under 2 GiB (25% of 8)
    with caplog.at_level("WARNING", logger="plinth_cpu.gemm"):
        first, second = gemm.prepare(w, None), gemm.prepare(w, None)
    if mode == "1":
        assert "onednn" in first.data and "onednn" in second.data and gemm.onednn_unpacked == 0
        assert not caplog.records
        return
    assert "onednn" not in first.data and "onednn" not in second.data and gemm.onednn_unpacked == 2
    assert len(caplog.records) == 1 and "not pre-packed" in caplog.records[0].getMessage()
    assert "under the 25% reserve" in caplog.records[0].getMessage()
    available[0] += 1  # exactly the reserve left: packed again
    assert "onednn" in gemm.prepare(w, None).data


@pytest.mark.parametrize(
    "mode,flags,says",
    [
        ("auto", {"avx2", "avx512_bf16"}, "bf16 weights pre-packed for oneDNN (it has AVX512-BF16"),
        ("auto", {"avx2", "fma"}, "not pre-packed for oneDNN: it has no bf16 dot products"),
        ("0", {"avx2", "avx512_bf16"}, "not pre-packed for oneDNN (PLINTH_CPU_ONEDNN_PACKED=0)"),
        ("1", {"avx2", "fma"}, "pre-packed for oneDNN (PLINTH_CPU_ONEDNN_PACKED=1)"),
        ("on", {"avx2"}, "PLINTH_CPU_ONEDNN_PACKED='on' is not one of auto, 1, 0"),
    ],
)
def test_backends_line_says_whether_bf16_weights_are_packed(
    monkeypatch: pytest.MonkeyPatch, mode: str, flags: set[str], says: str
) -> None:
    """``plinth backends`` carries the packing decision and its reason; a bad value is named there
    (the probe never raises)."""
    from plinth_cpu.backend import CpuBackend

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("PLINTH_CPU_ONEDNN_PACKED", mode)
    monkeypatch.setattr(gemm_mod, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(gemm_mod, "native_cpu_flags", lambda: flags)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    assert says in gemm_mod.onednn_packing_status()
    assert any(says in reason for reason in CpuBackend().probe().reasons)


def test_backends_line_says_whether_quantized_products_run_on_amx_int8_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """``plinth backends`` names PLINTH_CPU_AMX_INT8 only when it is set: taken where the AVX-512 build
    (here: its emulation) meets AMX-INT8, refused with the reason elsewhere, a bad value named."""
    from plinth_cpu import native as native_mod

    monkeypatch.delenv(native_mod.AMX_INT8_ENV, raising=False)
    monkeypatch.delenv(native_mod.AMX_ENV, raising=False)
    monkeypatch.delenv(native_mod.ISA_ENV, raising=False)
    assert gemm_mod.amx_int8_status() is None
    monkeypatch.setenv(native_mod.AMX_INT8_ENV, "1")
    monkeypatch.setattr(gemm_mod, "native_cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512f", "avx512bw"})
    assert gemm_mod.amx_int8_status() == (
        "q4_1/q8_0 models: PLINTH_CPU_AMX_INT8=1 asked for, but the VNNI kernel only (the CPU has no AMX-INT8)"
    )
    monkeypatch.setattr(gemm_mod, "native_cpu_flags", lambda: set(native_mod.EMULATED_CPU_FLAGS))
    monkeypatch.setattr(gemm_mod, "choose_variant", lambda: (native_mod.EMULATED_AVX512, "emulated"))
    assert gemm_mod.amx_int8_status() == (
        "q4_1/q8_0 models: products of 16 rows or more on AMX-INT8 tiles (PLINTH_CPU_AMX_INT8=1)"
    )
    monkeypatch.setenv(native_mod.AMX_ENV, "0")
    assert gemm_mod.amx_int8_status() == (
        "q4_1/q8_0 models: PLINTH_CPU_AMX_INT8=1 asked for, but the VNNI kernel only (PLINTH_CPU_AMX=0)"
    )
    monkeypatch.setattr(gemm_mod, "choose_variant", lambda: (native_mod.AVX2, "forced"))
    monkeypatch.delenv(native_mod.AMX_ENV)
    assert gemm_mod.amx_int8_status() == (
        "q4_1/q8_0 models: PLINTH_CPU_AMX_INT8=1 asked for, but the VNNI kernel only (the avx2 build is chosen)"
    )
    monkeypatch.setenv(native_mod.AMX_INT8_ENV, "yes")
    assert gemm_mod.amx_int8_status() == (
        "PLINTH_CPU_AMX_INT8='yes' is not one of 0, 1: the native kernels will not load"
    )


def test_backends_line_says_whether_fp32_products_run_as_bf16x3(monkeypatch: pytest.MonkeyPatch) -> None:
    """``plinth backends`` names PLINTH_CPU_FP32_BF16X3 only when it is set: taken where the AMX tile
    kernel is expected (here: the emulated build), refused with the reason elsewhere, a bad value named."""
    from plinth_cpu import native as native_mod

    monkeypatch.delenv(gemm_mod.BF16X3_ENV, raising=False)
    monkeypatch.delenv(native_mod.ISA_ENV, raising=False)
    assert gemm_mod.bf16x3_status() is None
    monkeypatch.setenv(gemm_mod.BF16X3_ENV, "16")
    monkeypatch.setenv(native_mod.EMULATE_ENV, "0")
    monkeypatch.setattr(gemm_mod, "native_cpu_flags", lambda: {"avx2", "fma", "f16c"})
    line = gemm_mod.bf16x3_status()
    assert line is not None and "PLINTH_CPU_FP32_BF16X3=16 asked for, but fp32 panels only (no AVX512-BF16" in line
    monkeypatch.setattr(gemm_mod, "native_cpu_flags", native_mod.native_cpu_flags)
    monkeypatch.setattr(gemm_mod, "choose_variant", lambda: (native_mod.EMULATED_AVX512, "emulated"))
    monkeypatch.setenv(native_mod.EMULATE_ENV, "1")
    assert gemm_mod.bf16x3_status() == (
        "fp32 models: products of 16 rows or more as three bf16 products on AMX tiles (PLINTH_CPU_FP32_BF16X3)"
    )
    monkeypatch.setenv(gemm_mod.BF16X3_ENV, "lots")
    assert gemm_mod.bf16x3_status() == "PLINTH_CPU_FP32_BF16X3='lots' is not a row count: an fp32 model will not start"
