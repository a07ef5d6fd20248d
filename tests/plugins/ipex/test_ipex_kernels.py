"""IPEX's kernels under plinth-ipex against the reference, and the provider's per-op offer.

Skipped where intel_extension_for_pytorch is not importable (the main .venv: IPEX 2.8 pins torch
2.8): run in the ipex lane's venv, ``make test-ipex``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("intel_extension_for_pytorch", reason="IPEX is installed only in the ipex lane (make test-ipex)")

from plinth_ipex import plugin  # noqa: E402
from plinth_ipex.attention import IpexAttention  # noqa: E402
from plinth_ipex.choice import OpChoice, choose  # noqa: E402
from plinth_ipex.gemm import IpexGemm, cannot_pack  # noqa: E402
from plinth_ipex.provider import IpexProvider, isa_level  # noqa: E402
from test_cpu_attention import MIXED, PAD_TOKENS, SCALE, make_batch  # noqa: E402

from plinth.platform.backend import AttentionMetadata, AttentionSpec, KVCacheLayout  # noqa: E402
from plinth.platform.kernels import resolve_kernels  # noqa: E402
from plinth.platform.quant import quantize_q8_0  # noqa: E402
from plinth.platform.reference import ReferenceAttention, ReferenceGemm  # noqa: E402
from plinth_cpu.attention import CPU_KV_LAYOUT  # noqa: E402
from plinth_cpu.backend import CpuBackend  # noqa: E402


def check_attention(cases: list[tuple[int, int]], atol: float = 1e-5, **kw: Any) -> None:
    """IPEX's output on a hostile batch (NaN pages, garbage table entries, NaN padding queries) is
    finite, equals the reference's, and leaves padding tokens' rows zero."""
    batch = make_batch(cases, **kw)
    out = IpexAttention(batch.spec, CPU_KV_LAYOUT).forward(batch.query, batch.kv_cache, batch.meta, SCALE)
    want = ReferenceAttention(batch.spec, KVCacheLayout()).forward(
        batch.query, batch.reference_cache, batch.meta, SCALE
    )
    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    assert torch.isfinite(out).all(), "NaN/inf leaked from stale pages or padding"
    torch.testing.assert_close(out.float(), want.float(), atol=atol, rtol=0)
    assert (out[-PAD_TOKENS:] == 0).all()


@pytest.mark.parametrize(
    "cases",
    [
        [(1, 1), (1, 17), (1, 100)],  # decodes only: the decode kernel
        [(23, 23), (64, 64)],  # fresh prefills: the varlen kernel
        [(1, 31), (20, 20), (7, 50), (1, 3)],  # decode-first mixed: both, a chunk after context
        MIXED,  # not decode-first, with a sequence of no query tokens: all through varlen
    ],
    ids=["decodes", "prefills", "mixed", "ragged"],
)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (8, 2), (9, 3), (8, 1)])
def test_attention_matches_the_reference(cases: list[tuple[int, int]], num_heads: int, num_kv_heads: int) -> None:
    check_attention(cases, num_heads=num_heads, num_kv_heads=num_kv_heads)


@pytest.mark.parametrize("head_size", [16, 80, 128, 256])
@pytest.mark.parametrize("block_size", [8, 64])
def test_attention_head_and_block_sizes(head_size: int, block_size: int) -> None:
    check_attention([(1, 33), (12, 12), (3, 47)], head_size=head_size, block_size=block_size)


def test_attention_sliding_window_and_soft_cap() -> None:
    # the window's off-by-one differs between IPEX's two kernels: both paths are exercised
    check_attention([(1, 70), (1, 9), (40, 40), (9, 61)], sliding_window=8)
    check_attention([(1, 70), (25, 25), (6, 38)], logits_soft_cap=0.5)


def test_attention_bf16() -> None:
    check_attention([(1, 33), (12, 12), (3, 47)], atol=2e-2, dtype=torch.bfloat16)


def test_what_ipex_cannot_run_is_declared() -> None:
    both = AttentionSpec(8, 2, 64, 16, sliding_window=8, logits_soft_cap=30.0)
    assert "soft cap" in (IpexAttention.covers(both) or "")
    assert "float16" in (IpexAttention.covers(AttentionSpec(8, 2, 64, 16, "float16", "float16")) or "")
    assert "differs" in (IpexAttention.covers(AttentionSpec(8, 2, 64, 16, "float32", "bfloat16")) or "")
    assert "window of 1" in (IpexAttention.covers(AttentionSpec(8, 2, 64, 16, sliding_window=1)) or "")
    assert IpexAttention.covers(AttentionSpec(9, 3, 64, 16, sliding_window=2)) is None


def test_write_kv_skips_padding_slots_and_reads_strided_values() -> None:
    spec = AttentionSpec(4, 2, 64, 16)
    cache = torch.zeros(2, 6, 2, 16, 64)  # [2, NB, Hkv, bs, D]
    qkv = torch.randn(5, 3, 2, 64)  # a fused projection: K and V are strided views of it
    slots = torch.tensor([17, -1, 3, 95, -1])
    IpexAttention(spec, CPU_KV_LAYOUT).write_kv(qkv[:, 1], qkv[:, 2], cache, slots)
    want = torch.zeros_like(cache)
    ReferenceAttention(spec, KVCacheLayout()).write_kv(qkv[:, 1], qkv[:, 2], want.transpose(2, 3), slots)
    torch.testing.assert_close(cache, want, atol=0, rtol=0)


def test_write_then_attend_round_trip() -> None:
    """The fused entry the model calls: write the step's K/V, then attend over them."""
    spec = AttentionSpec(6, 2, 64, 16)
    gen = torch.Generator().manual_seed(3)
    meta = AttentionMetadata.from_lengths([1, 20], [9, 20], [[4, 0], [2, 5]], block_size=16)
    q, k, v = (torch.randn(21, h, 64, generator=gen) for h in (6, 2, 2))
    prior = torch.randn(2, 8, 2, 64, generator=gen)  # the decode's first 8 tokens, already cached
    ours, ref = torch.zeros(2, 6, 2, 16, 64), torch.zeros(2, 6, 16, 2, 64)
    ours[:, 4, :, :8] = prior.transpose(1, 2)
    ref[:, 4, :8] = prior
    got, cache = IpexAttention(spec, CPU_KV_LAYOUT).write_and_attend(q, k, v, ours, meta, SCALE)
    want, _ = ReferenceAttention(spec, KVCacheLayout()).write_and_attend(q, k, v, ref, meta, SCALE)
    assert cache is ours
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", ["mkl", "onednn", "tpp"])
@pytest.mark.parametrize("m", [1, 7, 70])
@pytest.mark.parametrize("n,k", [(96, 128), (513, 255)])  # the second is outside TPP's 16 x 64 tiles
def test_gemm_fp32_matches_the_reference(variant: str, m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    x = torch.randn(m, 2 * k, generator=gen)[:, ::2]  # strided, as a view into a fused projection
    ref = ReferenceGemm(torch.float32)
    want = ref.linear(x, ref.prepare(w, b))
    mine = IpexGemm(torch.float32, variant)
    prepared = mine.prepare(w, b)
    assert prepared.format == f"ipex_{variant}" and prepared.weight is None
    got = mine.linear(x, prepared)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_quantized_weights_stay_with_the_cpu_backend() -> None:
    """A GGUF block weight is the cpu backend's (its native q8_0 kernel), not dequantized for IPEX."""
    own = CpuBackend().gemm_kernels("float32")
    mine = IpexGemm(torch.float32, "mkl", own)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=gen)
    quantized = quantize_q8_0(w)
    prepared = mine.prepare_quantized(quantized, None)
    assert prepared.format == own.prepare_quantized(quantized, None).format
    x = torch.randn(3, 64, generator=gen)
    torch.testing.assert_close(mine.linear(x, prepared), own.linear(x, prepared), atol=0, rtol=0)


def test_bf16_packing_follows_the_isa() -> None:
    """IPEX refuses bf16 weight packing without avx_ne_convert or AVX-512 (this lane's Zen 3 hosts)."""
    why = cannot_pack(torch.bfloat16, "onednn")
    if isa_level() == "AVX2":
        assert why is not None and "avx512bw" in why
    assert cannot_pack(torch.float32, "mkl") is None


def _provider(chosen: set[str]) -> IpexProvider:
    verdicts = {k: OpChoice(k, k in chosen, v.variant, "test") for k, v in choose("AVX2", {"hosts": {}}).items()}
    return IpexProvider(verdicts, backend=CpuBackend())


def test_resolution_keeps_the_cpu_kernels_for_ops_not_chosen() -> None:
    """Through the core's resolution: a chosen op is IPEX's, one measured slower stays the cpu backend's."""
    backend = CpuBackend()
    spec = AttentionSpec(9, 3, 64, 16)
    only_attention = resolve_kernels(backend, [_provider({"attention/float32"})], "float32", strict=True)
    assert isinstance(only_attention.attention(spec), IpexAttention)
    assert type(only_attention.gemm) is type(backend.gemm_kernels("float32"))
    only_gemm = resolve_kernels(backend, [_provider({"gemm/float32"})], "float32", strict=True)
    assert isinstance(only_gemm.gemm, IpexGemm)
    assert type(only_gemm.attention(spec)) is type(backend.attention_kernels(spec))
    # chosen, but a case IPEX does not cover: the cpu backend's kernel for that layer
    capped = AttentionSpec(9, 3, 64, 16, sliding_window=4, logits_soft_cap=30.0)
    assert type(only_attention.attention(capped)) is type(backend.attention_kernels(capped))


def test_the_provider_offers_nothing_it_cannot_run() -> None:
    provider = _provider({"gemm/bfloat16", "attention/float32"})
    assert provider.attention_kernels(AttentionSpec(9, 3, 64, 16), KVCacheLayout()) is None  # not the cpu layout
    if cannot_pack(torch.bfloat16, "onednn") is not None:
        assert provider.gemm_kernels("bfloat16") is None
    assert provider.gemm_kernels("float64") is None


def test_the_hook_contributes_to_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLINTH_IPEX_OPS", "gemm/float32")
    assert plugin.plinth_register_kernels("reference", CpuBackend()) == []
    [provider] = plugin.plinth_register_kernels("cpu", CpuBackend())
    assert isinstance(provider, IpexProvider) and provider.priority > 0 and provider.backend_name == "cpu"
    assert provider.chosen() == ["gemm/float32"]
