"""The CPU backend object: plugin registration, probe, capabilities, GEMM and device services."""

from __future__ import annotations

import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pluggy
import pytest
import torch
from smaps import mapping_field

from plinth import hookspecs
from plinth.platform.backend import AttentionSpec, NotSupported, SmallOps
from plinth.platform.reference import REFERENCE_SCORE, ReferenceBackend, ReferenceGemm
from plinth_cpu import CpuBackend, __version__, backend, plugin
from plinth_cpu.attention import CPU_KV_LAYOUT, CpuAttention
from plinth_cpu.gemm import CpuGemm, NativeGemm
from plinth_cpu.native import native

PYPROJECT = Path(__file__).parents[3] / "plugins" / "cpu" / "pyproject.toml"

X86_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp
CPU implementer\t: 0x41
"""


def test_pyproject_declares_the_entry_point() -> None:
    """``plinth.backends`` -> ``cpu = plinth_cpu.plugin``, the module the host loads."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert project["entry-points"]["plinth.backends"] == {"cpu": "plinth_cpu.plugin"}


def test_plugin_module_registers_through_pluggy() -> None:
    """The entry-point module passes ``check_pending`` and its hook returns one CPU backend."""
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    pm.register(plugin, name="cpu")
    pm.check_pending()
    (backends,) = pm.hook.plinth_register_backends()
    assert [type(b) for b in backends] == [CpuBackend]
    assert backends[0].name == "cpu"
    assert backends[0].api_version[0] == hookspecs.PLUGIN_API_VERSION[0]


def test_installed_entry_point_loads_when_installed() -> None:
    """Where plinth-cpu is installed, its entry point resolves to the plugin module."""
    found = [ep for ep in entry_points(group=hookspecs.PROJECT_NAME) if ep.name == "cpu"]
    if not found:
        pytest.skip("plinth-cpu is not installed in this environment")
    assert found[0].load() is plugin


def test_version_comes_from_package_metadata() -> None:
    """Installed: the distribution's version; from a bare source tree: 0.1.0."""
    assert CpuBackend.version == __version__
    assert __version__.count(".") >= 2


def test_probe_scores_above_reference_and_explains(monkeypatch: pytest.MonkeyPatch) -> None:
    """On this host: a usable score above the oracle's, with model, ISA and threads in the reasons."""
    monkeypatch.delenv("PLINTH_CPU_EMULATE", raising=False)
    probe = CpuBackend().probe()
    assert probe.score > REFERENCE_SCORE
    assert probe.score > ReferenceBackend().probe().score
    text = " | ".join(probe.reasons)
    assert "CPU:" in text and "ISA features:" in text
    assert f"{torch.get_num_threads()} threads" in text
    assert probe.device_name and not probe.emulation


def test_probe_says_emulation_where_the_avx512_build_is_emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    """PLINTH_CPU_EMULATE=1 where the native kernels can be built: the probe's emulation flag is set, so a
    certificate made so says "emulation", never hardware; a bad value leaves it unset (its line names it)."""
    from plinth_cpu import native as native_mod
    from plinth_cpu.preflight import build_check

    monkeypatch.setenv("PLINTH_CPU_EMULATE", "1")
    assert CpuBackend().probe().emulation == (build_check()[0] is not None)
    monkeypatch.setenv("PLINTH_CPU_EMULATE", "maybe")
    monkeypatch.setattr(native_mod, "native_loaded", lambda: False)  # the line a fresh process's probe gives
    probe = CpuBackend().probe()
    assert not probe.emulation and any("PLINTH_CPU_EMULATE='maybe'" in r for r in probe.reasons)


def test_probe_reads_x86_and_arm_features(monkeypatch: pytest.MonkeyPatch) -> None:
    """avx2 / avx512f (VNNI, BF16, FP16) / amx (bf16, int8) from x86 "flags", neon from Arm "Features"
    (asimd): what torch's oneDNN and the native builds dispatch on."""
    assert backend.cpu_model(X86_CPUINFO) == "Intel(R) Xeon(R) Platinum 8480+"
    x86 = ["avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8"]
    assert backend.isa_features(X86_CPUINFO) == x86
    assert backend.isa_features(ARM_CPUINFO) == ["neon"]
    monkeypatch.setattr(backend, "_read_cpuinfo", lambda: X86_CPUINFO)
    probe = CpuBackend().probe()
    assert probe.score == backend.SIMD_SCORE
    assert probe.device_name == "Intel(R) Xeon(R) Platinum 8480+"
    assert any(", ".join(x86) in r for r in probe.reasons)


def test_probe_without_cpuinfo_or_simd_still_works(monkeypatch: pytest.MonkeyPatch) -> None:
    """No /proc/cpuinfo and a scalar torch build: a lower score, still above the reference."""
    monkeypatch.setattr(backend, "_read_cpuinfo", lambda: "")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    probe = CpuBackend().probe()
    assert REFERENCE_SCORE < probe.score < backend.SIMD_SCORE
    assert any("no SIMD" in r for r in probe.reasons)
    assert probe.device_name  # platform.processor()/machine() fallback


def test_read_cpuinfo_missing_file_is_empty(tmp_path: Path) -> None:
    """A host without /proc: no exception, just no details."""
    assert backend._read_cpuinfo(str(tmp_path / "nope")) == ""


def test_capabilities() -> None:
    """The declared envelope: dtypes (and fp8 KV caches), head/block sizes, features, head-major layout."""
    caps = CpuBackend().capabilities()
    assert {"float32", "bfloat16", "float16"} <= caps.dtypes
    assert caps.kv_cache_dtypes == caps.dtypes | {"float8_e4m3fn"}  # fp8: a KV-cache dtype only
    assert {32, 64, 80, 96, 112, 128, 160, 192, 256} <= caps.head_sizes
    assert caps.block_sizes == (8, 16, 32, 64, 128)
    assert caps.max_gqa_ratio is None
    assert caps.features == {"sliding_window", "logits_soft_cap"}
    assert caps.kv_cache_layout == CPU_KV_LAYOUT


@pytest.mark.parametrize(
    "spec,needle",
    [
        (AttentionSpec(8, 2, 100, 16), "head size 100"),
        (AttentionSpec(8, 2, 64, 12), "block size 12"),
        (AttentionSpec(8, 3, 64, 16), "not a multiple"),
    ],
)
def test_attention_kernels_refuse_undeclared_cases(spec: AttentionSpec, needle: str) -> None:
    """An undeclared case raises NotSupported naming the backend and the reason."""
    with pytest.raises(NotSupported, match=needle) as info:
        CpuBackend().attention_kernels(spec)
    assert info.value.backend == "cpu"


def test_attention_kernels_for_declared_cases() -> None:
    """Every declared feature combination builds kernels on the declared layout."""
    spec = AttentionSpec(32, 8, 128, 16, "bfloat16", "bfloat16", sliding_window=4096, logits_soft_cap=50.0)
    kernels = CpuBackend().attention_kernels(spec)
    assert isinstance(kernels, CpuAttention)
    assert kernels.layout == CPU_KV_LAYOUT


def test_allocate_kv_cache_follows_the_layout() -> None:
    """[2, num_blocks, Hkv, block_size, D] in the kv-cache dtype, on the CPU."""
    cache = CpuBackend().allocate_kv_cache(AttentionSpec(8, 2, 64, 16, kv_cache_dtype="bfloat16"), 10)
    assert cache.shape == (2, 10, 2, 16, 64)
    assert cache.dtype == torch.bfloat16 and cache.device.type == "cpu"


def _resident_bytes(t: torch.Tensor) -> int | None:
    """Bytes of ``t``'s mapping resident in memory (``Rss`` in /proc/self/smaps); None if unknown."""
    rss = mapping_field(t.data_ptr(), "Rss")  # "1234 kB"
    return None if rss is None else int(rss.split()[0]) * 1024


def test_allocate_kv_cache_prefault_backs_every_page() -> None:
    """Lazily mapped by default (a first touch fills a page); ``prefault=True`` (API 1.4) faults the
    whole 64 MiB in before returning, still all zeros."""
    spec = AttentionSpec(8, 4, 64, 16)
    size = 2 * 1024 * 4 * 16 * 64 * 4  # 64 MiB: 1024 blocks of fp32
    lazy = CpuBackend().allocate_kv_cache(spec, 1024)
    if (resident := _resident_bytes(lazy)) is None:
        pytest.skip("/proc/self/smaps does not show the mapping's resident size")
    assert resident < size // 8
    eager = CpuBackend().allocate_kv_cache(spec, 1024, prefault=True)
    assert (_resident_bytes(eager) or 0) >= size
    assert not bool(eager.any()) and eager.shape == lazy.shape


def test_services_set_the_thread_count_of_torch_and_the_pool() -> None:
    """``set_num_threads`` (API 1.4) reaches torch and the native kernels' pool, loaded or not yet."""
    services = CpuBackend().device_services()
    before = torch.get_num_threads()
    try:
        services.set_num_threads(1)
        assert torch.get_num_threads() == 1
        if (kernels := native()) is not None:
            assert kernels.num_threads() == 1
            services.set_num_threads(2)
            assert kernels.num_threads() == 2 and torch.get_num_threads() == 2
    finally:
        services.set_num_threads(before)


def test_read_probes_stream_the_buffer() -> None:
    """torch's sum, plus the native GEMV's streaming loop where the kernels load (API 1.4): each
    reads the whole buffer (the sum of ones is its length)."""
    probes = CpuBackend().device_services().read_probes()
    assert set(probes) == ({"torch_sum", "avx2_stream"} if native() is not None else {"torch_sum"})
    x = torch.ones(16 * 4096)
    for name, probe in probes.items():
        assert float(probe(x)) == x.numel(), name  # type: ignore[arg-type]


def test_gemm_refuses_undeclared_dtype() -> None:
    """An unknown compute dtype is a NotSupported, not a KeyError."""
    with pytest.raises(NotSupported, match="GEMM in int8"):
        CpuBackend().gemm_kernels("int8")


@pytest.mark.parametrize("with_bias", [True, False])
def test_gemm_float32_matches_reference(with_bias: bool) -> None:
    """prepare lays the weight out in 8-row panels (native kernels) or keeps [N, K] contiguous;
    linear equals x @ w.T + b either way."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 80, generator=gen)
    b = torch.randn(48, generator=gen) if with_bias else None
    x = torch.randn(5, 80, generator=gen)
    gemm = CpuBackend().gemm_kernels("float32")
    assert isinstance(gemm, CpuGemm)
    prepared = gemm.prepare(w.t().contiguous().t(), b)  # a strided weight comes out contiguous
    if isinstance(gemm, NativeGemm):
        assert prepared.format == "f32_panels" and prepared.weight is None
        assert prepared.data["panels"].shape == (6, 80, 8)
    else:
        assert prepared.weight is not None and prepared.weight.is_contiguous()
    assert (prepared.out_features, prepared.in_features) == (48, 80)
    ref = ReferenceGemm(torch.float32)
    torch.testing.assert_close(gemm.linear(x, prepared), ref.linear(x, ref.prepare(w, b)))


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("keep", ["1", "0"], ids=["kept", "cast"])
def test_gemm_float32_keeps_a_16bit_checkpoint_weight(
    stored: torch.dtype, keep: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An fp32 model's weight stored in 16 bits stays in 16-bit panels with the native kernels (half
    the bytes; PLINTH_CPU_KEEP_16BIT=0 casts it to fp32 panels), and the product is the fp32 one of its
    values bit for bit, with fp32 activations and bias; without native kernels it is cast to fp32."""
    monkeypatch.setenv("PLINTH_CPU_KEEP_16BIT", keep)
    gen = torch.Generator().manual_seed(2)
    w, b = torch.randn(45, 96, generator=gen).to(stored), torch.randn(45, generator=gen).to(stored)
    x = torch.randn(7, 96, generator=gen)
    gemm = CpuBackend().gemm_kernels("float32")
    prepared = gemm.prepare(w, b)
    assert prepared.bias is not None and prepared.bias.dtype == torch.float32
    if isinstance(gemm, NativeGemm):
        fmt, dtype = ("w16_panels", stored) if keep == "1" else ("f32_panels", torch.float32)
        assert prepared.format == fmt and prepared.data["panels"].dtype == dtype
        assert prepared.data["panels"].shape == (6, 96, 8)
        fp32 = gemm.prepare(w.float(), b.float())
        assert torch.equal(gemm.linear(x, prepared), gemm.linear(x, fp32))
    else:
        assert prepared.weight is not None and prepared.weight.dtype == torch.float32
    ref = ReferenceGemm(torch.float32)
    torch.testing.assert_close(gemm.linear(x, prepared), ref.linear(x, ref.prepare(w.float(), b.float())))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gemm_half_precision_is_close_to_fp32(dtype: str) -> None:
    """A half-precision GEMM keeps the weight in that dtype (dense, or in bf16 pair panels on a CPU with
    AVX512-BF16) and stays near the fp32 result."""
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(32, 64, generator=gen), torch.randn(32, generator=gen)
    x = torch.randn(4, 64, generator=gen)
    gemm = CpuBackend().gemm_kernels(dtype)
    prepared = gemm.prepare(w, b)
    half = getattr(torch, dtype)
    kept = prepared.weight if prepared.weight is not None else prepared.data["pairs"]
    assert kept.dtype == half
    out = gemm.linear(x.to(half), prepared)
    assert out.dtype == half
    torch.testing.assert_close(out.float(), x @ w.t() + b, rtol=3e-2, atol=1e-1)


def test_linear_without_dense_weight_is_a_clear_error() -> None:
    """A weight in a format this GEMM did not prepare is named in the error."""
    prepared = CpuGemm(torch.float32).prepare(torch.ones(2, 2), None)
    prepared.weight, prepared.format = None, "q4_1"
    with pytest.raises(ValueError, match="q4_1"):
        CpuGemm(torch.float32).linear(torch.ones(1, 2), prepared)


def test_device_services_and_small_ops() -> None:
    """Host CPU services; the small ops are CpuOps where the native kernels load, torch's otherwise
    (chosen once, not checked in every op)."""
    be = CpuBackend()
    services = be.device_services()
    assert services.device == torch.device("cpu")
    free, total = services.memory_info()
    assert 0 < free <= total
    assert isinstance(be.small_ops(), SmallOps)
    assert type(be.small_ops()).__name__ == ("CpuOps" if native() is not None else "TorchOps")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("k", [255, 256])  # 255: fp32 stays dense [N, K] for F.linear; 256: fp32 panels
def test_gemm_never_hands_torch_a_strided_half_precision_x(monkeypatch: pytest.MonkeyPatch, dtype: str, k: int) -> None:
    """Issue 23: torch's bf16 F.linear (oneDNN, AMX hosts) reads outside a strided view of ``x`` at
    M = 33. bf16/fp16 get a contiguous copy; fp32 keeps its view (read correctly, no copy to pay);
    the native kernels read the view's rows (a 16-bit one widened by a native call) or a copy. NaN
    beside the view never leaks in."""
    from plinth_cpu import gemm as gemm_module

    seen: list[bool] = []
    real_linear = gemm_module.F.linear

    def spy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        seen.append(x.is_contiguous())
        return real_linear(x, w, b)

    monkeypatch.setattr(gemm_module.F, "linear", spy)
    gen = torch.Generator().manual_seed(5)
    torch_dtype = getattr(torch, dtype)
    w, b = torch.randn(513, k, generator=gen), torch.randn(513, generator=gen)
    wide = torch.full((33, 2 * k), float("nan"), dtype=torch_dtype)
    wide[:, :k] = torch.randn(33, k, generator=gen).to(torch_dtype)
    x = wide[:, :k]  # [33, k] with row stride 2k: NaN between the rows
    gemm = CpuBackend().gemm_kernels(dtype)
    lw = gemm.prepare(w, b)
    out = gemm.linear(x, lw)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), x.float() @ w.t() + b, rtol=3e-2, atol=2e-1)
    native_rows = dtype != "float32" and k % 8 == 0 and getattr(gemm, "rows16_max_rows", 0) >= 33
    if lw.format != "dense" or native_rows or "onednn" in lw.data:
        assert seen == []  # native panels (fp32), an fp16 model's native row tiles, or pre-packed bf16 weights
    elif dtype != "float32":
        assert seen == [True]  # torch's 16-bit GEMM: a contiguous copy
    else:
        assert seen == [False]  # the fp32 view as given
