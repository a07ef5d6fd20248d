"""resolve_kernels: provider priority, providers only where the backend cannot, per-op reference
fallback with a warning, strict mode, and the KV-layout rule that refuses the reference fallback.
The last tests take the providers from plugins through the real plugin host."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from plinth.hookspecs import hookimpl
from plinth.platform.backend import (
    AttentionKernels,
    AttentionSpec,
    Backend,
    Capabilities,
    GemmKernels,
    KernelProvider,
    KVCacheLayout,
    NotSupported,
)
from plinth.platform.host import PluginHost
from plinth.platform.kernels import resolve_kernels
from plinth.platform.reference import ReferenceAttention, ReferenceBackend, ReferenceGemm

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64, block_size=16)


class _ProviderGemm(ReferenceGemm):
    """The reference GEMM, labelled with the provider that made it."""

    def __init__(self, dtype: torch.dtype, by: str) -> None:
        super().__init__(dtype)
        self.by = by


class _ProviderAttention(ReferenceAttention):
    """The reference attention, labelled with the provider that made it."""

    def __init__(self, spec: AttentionSpec, layout: KVCacheLayout, by: str) -> None:
        super().__init__(spec, layout)
        self.by = by


class _Provider(KernelProvider):
    """Covers float32 GEMM and head size 64 attention, for whichever backend the subclass names."""

    backend_name = "reference"

    def gemm_kernels(self, dtype: str) -> GemmKernels | None:
        return _ProviderGemm(torch.float32, self.name) if dtype == "float32" else None

    def attention_kernels(self, spec: AttentionSpec, layout: KVCacheLayout) -> AttentionKernels | None:
        return _ProviderAttention(spec, layout, self.name) if spec.head_size == 64 else None


class _Fast(_Provider):
    name = "fast"
    priority = 10


class _Faster(_Provider):
    name = "faster"
    priority = 20


class _Spare(_Provider):
    """Priority 0: asked only where the backend itself cannot."""

    name = "spare"
    priority = 0


class _Fp64Only(ReferenceBackend):
    """A backend that runs nothing in float32: every float32 op must come from elsewhere."""

    name = "fp64only"

    def __init__(self, layout: KVCacheLayout | None = None) -> None:
        super().__init__()
        self._caps = Capabilities(
            dtypes=frozenset({"float64"}),
            kv_cache_dtypes=frozenset({"float64"}),
            head_sizes=frozenset(range(1, 513)),
            block_sizes=(16,),
            kv_cache_layout=layout or KVCacheLayout(),
        )


#: A layout the reference kernels cannot read: heads before tokens.
_HEADS_FIRST = KVCacheLayout(dims=("kv", "num_blocks", "num_kv_heads", "block_size", "head_size"))


def _by(kernels: object) -> str:
    return getattr(kernels, "by", "backend")


def test_higher_priority_provider_wins_over_the_backend_and_a_lower_one() -> None:
    # given in the wrong order on purpose: the priority decides, not the order
    ks = resolve_kernels(ReferenceBackend(), [_Fast(), _Faster()], "float32")
    assert _by(ks.gemm) == "faster"
    assert _by(ks.attention(SPEC)) == "faster"
    assert ks.fallbacks == []


def test_a_case_the_top_provider_does_not_cover_goes_to_the_next_then_the_backend() -> None:
    class _GemmOnly(_Faster):
        name = "gemm-only"

        def attention_kernels(self, spec: AttentionSpec, layout: KVCacheLayout) -> AttentionKernels | None:
            return None

    ks = resolve_kernels(ReferenceBackend(), [_GemmOnly(), _Fast()], "float32")
    assert _by(ks.gemm) == "gemm-only"
    assert _by(ks.attention(SPEC)) == "fast"
    head_128 = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=128, block_size=16)
    kernels = ks.attention(head_128)  # no provider covers head size 128: the backend's own
    assert _by(kernels) == "backend" and type(kernels) is ReferenceAttention


def test_priority_zero_provider_is_used_only_where_the_backend_raises_not_supported() -> None:
    supported = resolve_kernels(ReferenceBackend(), [_Spare()], "float32")
    assert _by(supported.gemm) == "backend" and _by(supported.attention(SPEC)) == "backend"
    unsupported = resolve_kernels(_Fp64Only(), [_Spare()], "float32")
    assert _by(unsupported.gemm) == "spare" and _by(unsupported.attention(SPEC)) == "spare"
    assert unsupported.fallbacks == []


def test_unsupported_ops_fall_back_to_the_reference_with_a_warning_recorded_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="plinth.platform.kernels"):
        ks = resolve_kernels(_Fp64Only(), [], "float32")
        layers = [ks.attention(SPEC) for _ in range(3)]  # three layers, one spec
    assert type(ks.gemm) is ReferenceGemm
    assert all(type(k) is ReferenceAttention for k in layers)
    assert len(ks.fallbacks) == 2, ks.fallbacks
    gemm_note, attention_note = ks.fallbacks
    assert gemm_note.startswith("GEMM:") and "fp64only" in gemm_note and "reference kernel" in gemm_note
    assert attention_note.startswith("attention:") and "dtype float32" in attention_note
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ks.fallbacks


def test_strict_mode_raises_not_supported_instead_of_falling_back() -> None:
    with pytest.raises(NotSupported, match="fp64only.*GEMM in float32"):
        resolve_kernels(_Fp64Only(), [], "float32", strict=True)

    class _GemmProvider(_Spare):
        def attention_kernels(self, spec: AttentionSpec, layout: KVCacheLayout) -> AttentionKernels | None:
            return None

    ks = resolve_kernels(_Fp64Only(), [_GemmProvider()], "float32", strict=True)
    assert _by(ks.gemm) == "spare"  # a provider is no fallback: strict mode accepts it
    with pytest.raises(NotSupported, match="dtype float32") as err:
        ks.attention(SPEC)
    assert err.value.backend == "fp64only" and err.value.what == "attention"
    assert ks.fallbacks == []


def test_a_kv_layout_the_reference_cannot_read_refuses_the_attention_fallback() -> None:
    ks = resolve_kernels(_Fp64Only(layout=_HEADS_FIRST), [], "float32")  # not strict
    with pytest.raises(NotSupported, match="KV layout rules out the reference fallback") as err:
        ks.attention(SPEC)
    assert "dtype float32" in str(err.value)  # the backend's own reason is kept
    assert not any(note.startswith("attention") for note in ks.fallbacks)
    # a provider is handed the backend's layout and may cover the case
    kernels = resolve_kernels(_Fp64Only(layout=_HEADS_FIRST), [_Spare()], "float32").attention(SPEC)
    assert _by(kernels) == "spare" and kernels.layout == _HEADS_FIRST


# -- providers contributed by plugins, through the plugin host -------------------------------------


class _KernelPlugin:
    """A kernel plugin of API 1.4: it reads the backend it is handed."""

    def __init__(self, *providers: KernelProvider) -> None:
        self.providers = providers
        self.seen: list[Backend] = []

    @hookimpl
    def plinth_register_kernels(self, backend_name: str, backend: Backend) -> Sequence[KernelProvider]:
        self.seen.append(backend)
        return [p for p in self.providers if p.backend_name == backend_name]


class _OtherBackendProvider(_Faster):
    backend_name = "cpu"
    name = "for-cpu"
    priority = 99


def test_providers_from_plugins_are_selected_through_the_host_by_priority() -> None:
    plugin = _KernelPlugin(_Fast(), _OtherBackendProvider())
    spare = _KernelPlugin(_Spare(), _Faster())
    host = PluginHost(plugins=(("fast-kernels", plugin), ("spare-kernels", spare)))
    providers = host.kernel_providers("reference")
    assert [p.name for p in providers] == ["faster", "fast", "spare"]  # for-cpu dropped
    reference = host.select("reference").backend
    assert plugin.seen == [reference] and spare.seen == [reference]
    ks = resolve_kernels(reference, providers, "float32")
    assert _by(ks.gemm) == "faster" and _by(ks.attention(SPEC)) == "faster"
    info = next(p for p in host.plugins if p.name == "fast-kernels")
    assert info.hooks == ["plinth_register_kernels"] and info.backends == []


class _Fp64Plugin:
    @hookimpl
    def plinth_register_backends(self) -> Sequence[Backend]:
        return [_Fp64Only()]


def test_an_engine_reports_its_fallbacks_once_each_and_strict_refuses_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sys.path.insert(0, str(Path(__file__).parents[1] / "runtime" / "engine"))
    from engine_helpers import save_tiny_folder

    from plinth import LLM, SamplingParams
    from plinth.cli import _report

    save_tiny_folder("llama", tmp_path)  # two layers, one attention spec
    host = PluginHost(plugins=(("fp64", _Fp64Plugin()),))
    llm = LLM(model=str(tmp_path), backend="fp64only", host=host, dtype="float32", num_kv_blocks=16)
    fallbacks = llm.engine.kernels.fallbacks
    assert [note.split(":")[0] for note in fallbacks] == ["GEMM", "attention"], fallbacks
    [out] = llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 2  # the reference kernels do run the model
    _report(llm, out)
    err = capsys.readouterr().err
    assert err.count("[reference fallback: ") == 2 and "GEMM: backend 'fp64only'" in err
    with pytest.raises(NotSupported, match="fp64only"):
        LLM(model=str(tmp_path), backend="fp64only", host=host, dtype="float32", num_kv_blocks=16, strict=True)
