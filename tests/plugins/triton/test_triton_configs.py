"""Launch-config tables: lookups by architecture (no triton needed)."""

from __future__ import annotations

import pytest
from plinth_triton.configs import ATTENTION_TABLE, attention_config, gemm_config


@pytest.mark.parametrize(
    "arch,entry",
    [
        ("sm80", "sm80"),
        ("sm86", "sm80"),
        ("sm89", "sm80"),
        ("sm90", "sm90"),
        ("sm120", "sm100"),
        ("sm75", "sm80"),
        ("gfx90a", "gfx90a"),
        ("gfx942", "gfx942"),
        ("gfx950", "gfx942"),
        ("gfx908", "gfx90a"),
        ("gfx1030", "gfx1100"),
    ],
)
def test_nearest_entry(arch: str, entry: str) -> None:
    """An architecture without its own row uses the nearest older one of its family."""
    assert attention_config(arch) is ATTENTION_TABLE[entry]


def test_gemm_m_classes() -> None:
    """Decode-sized M gets narrow M tiles, big batches wide ones; AMD rows carry waves_per_eu."""
    assert gemm_config("sm90", 1).block_m < gemm_config("sm90", 4096).block_m
    assert gemm_config("sm90", 16) is gemm_config("sm90", 1)
    assert "waves_per_eu" in gemm_config("gfx942", 32).extra
    assert not gemm_config("sm80", 32).extra


def test_tiles_fit_tensor_cores() -> None:
    """tl.dot needs every dimension >= 16 on hardware; AMD wavefronts are 64 wide (fewer warps)."""
    for arch, cfg in ATTENTION_TABLE.items():
        assert cfg.block_m >= 16 and cfg.tile_n >= 16 and cfg.decode_block_m >= 16, arch
    for m in (1, 64, 4096):
        for arch in ("sm80", "sm90", "gfx942", "interpreter"):
            cfg = gemm_config(arch, m)
            assert min(cfg.block_m, cfg.block_n, cfg.block_k) >= 16
    assert attention_config("gfx90a").num_warps <= attention_config("sm80").num_warps


def test_each_target_carries_its_mode() -> None:
    """The interpreter's differences live in InterpreterTarget, chosen once by the backend: no kernel
    asks which mode it runs in."""
    from plinth_triton.ops import InterpreterTarget, KernelTarget

    gpu, amd, interp = KernelTarget("sm90"), KernelTarget("gfx942", amd=True), InterpreterTarget()
    assert (gpu.upcast, gpu.write_kv_block_t, gpu.rows_per_program) == (False, 4, 1)
    assert (interp.upcast, interp.write_kv_block_t, interp.rows_per_program) == (True, 16, 16)
    assert gpu.launch(4, 2, {"waves_per_eu": 2}) == {"num_warps": 4, "num_stages": 2}
    assert amd.launch(4, 2, {"waves_per_eu": 2}) == {"num_warps": 4, "num_stages": 2, "waves_per_eu": 2}
    assert interp.launch(4, 2, {"waves_per_eu": 2}) == {}
    assert gpu.gemm_tiles(128, 64, 20, 40) == (128, 64)
    assert interp.gemm_tiles(128, 64, 20, 40) == (32, 64)  # never wider than the matrix
    assert interp.arch == "interpreter"
