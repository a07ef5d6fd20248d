"""The plugin host: discovery by entry point, failures attributed, selection by score and name."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from plinth.hookspecs import hookimpl
from plinth.platform.backend import Probe
from plinth.platform.host import BackendError, PluginHost
from plinth.platform.reference import ReferenceBackend


def _fake_dist(root: Path, dist: str, entry_points: str, modules: dict[str, str] | None = None) -> None:
    info = root / f"{dist}-1.2.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    for name, source in (modules or {}).items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in list(sys.modules):
        if name.startswith("fakeplug_"):
            del sys.modules[name]


def test_reference_backend_is_found_by_entry_point() -> None:
    host = PluginHost()
    assert "reference" in host.names()
    ref = next(p for p in host.plugins if p.name == "reference")
    assert ref.dist_name == "plinth"
    assert ref.hooks == ["plinth_register_backends"]


def test_broken_import_is_reported_with_distribution_and_others_still_load(site: Path) -> None:
    _fake_dist(site, "acme-broken", "[plinth.backends]\nacme = fakeplug_missing_module\n")
    host = PluginHost()
    broken = next(p for p in host.plugins if p.name == "acme")
    assert broken.dist_name == "acme-broken"
    assert broken.error is not None and "fakeplug_missing_module" in broken.error
    assert "reference" in host.names()
    with pytest.raises(BackendError, match="acme-broken"):
        host.select("acme")


def test_misspelled_hook_fails_check_pending(site: Path) -> None:
    _fake_dist(
        site,
        "acme-typo",
        "[plinth.backends]\ntypo = fakeplug_typo\n",
        {
            "fakeplug_typo": """
            from plinth.hookspecs import hookimpl

            @hookimpl
            def plinth_register_backend():
                return []
            """
        },
    )
    host = PluginHost()
    typo = next(p for p in host.plugins if p.name == "typo")
    assert typo.error is not None and "plinth_register_backend" in typo.error
    assert "reference" in host.names()


class _Raising(ReferenceBackend):
    name = "raising"

    def probe(self) -> Probe:
        raise RuntimeError("driver exploded")


class _Better(ReferenceBackend):
    name = "better"

    def probe(self) -> Probe:
        return Probe(score=99, reasons=("fake, for the test",))


class _NewMajor(ReferenceBackend):
    name = "future"
    api_version = (2, 0)


class _Unusable(ReferenceBackend):
    name = "absent"

    def probe(self) -> Probe:
        return Probe(score=0, reasons=("no such device",))


class _Plugin:
    def __init__(self, *backends: object) -> None:
        self.backends = backends

    @hookimpl
    def plinth_register_backends(self) -> list:
        return list(self.backends)


def test_selection_by_score_name_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    host = PluginHost(plugins=(("fake", _Plugin(_Better(), _Raising(), _Unusable())),))
    monkeypatch.delenv("PLINTH_BACKEND", raising=False)
    ranked = host.statuses()
    assert ranked[0].name == "better"
    assert host.select().name == "better"
    assert host.select("reference").name == "reference"
    monkeypatch.setenv("PLINTH_BACKEND", "reference")
    assert host.select().name == "reference"


def test_probe_error_is_reported_not_swallowed() -> None:
    host = PluginHost(plugins=(("fake", _Plugin(_Raising())),))
    status = next(s for s in host.statuses() if s.name == "raising")
    assert status.score == 0
    assert "driver exploded" in status.reasons[0] and "fake" in status.reasons[0]
    with pytest.raises(BackendError, match="driver exploded"):
        host.select("raising")


def test_unusable_and_unknown_backends_raise_with_reasons() -> None:
    host = PluginHost(plugins=(("fake", _Plugin(_Unusable())),))
    with pytest.raises(BackendError, match="no such device"):
        host.select("absent")
    with pytest.raises(BackendError, match="unknown backend 'nope'.*reference"):
        host.select("nope")


def test_api_major_mismatch_is_refused_naming_the_plugin() -> None:
    host = PluginHost(plugins=(("fake-future", _Plugin(_NewMajor())),))
    assert "future" not in host.names()
    info = next(p for p in host.plugins if p.name == "fake-future")
    assert info.error is not None and "2.0" in info.error and "fake-future" in info.error


def test_duplicate_backend_name_is_refused() -> None:
    host = PluginHost(plugins=(("dup", _Plugin(ReferenceBackend())),))
    info = next(p for p in host.plugins if p.name == "dup")
    assert info.error is not None and "already registered" in info.error


# -- hooks are called through pluggy: an implementation of an older signature keeps working --------


def test_kernel_hook_of_the_1_0_signature_is_called_without_the_argument_added_in_1_4(site: Path) -> None:
    # Installed by entry point like a real plugin written against API 1.0, before
    # plinth_register_kernels gained `backend`: pluggy must prune the argument for it.
    _fake_dist(
        site,
        "acme-kernels",
        "[plinth.backends]\nacme_kernels = fakeplug_old_kernels\n",
        {
            "fakeplug_old_kernels": """
            from plinth.hookspecs import hookimpl
            from plinth.platform.backend import KernelProvider
            from plinth.platform.reference import ReferenceGemm
            import torch

            CALLS = []

            class OldProvider(KernelProvider):
                backend_name = "reference"
                name = "old"
                priority = 5

                def gemm_kernels(self, dtype):
                    return ReferenceGemm(torch.float32) if dtype == "float32" else None

            @hookimpl
            def plinth_register_kernels(backend_name):
                CALLS.append(backend_name)
                return [OldProvider()]
            """
        },
    )
    host = PluginHost()
    info = next(p for p in host.plugins if p.name == "acme_kernels")
    assert info.error is None and info.hooks == ["plinth_register_kernels"]
    providers = host.kernel_providers("reference")
    assert [p.name for p in providers] == ["old"]
    assert sys.modules["fakeplug_old_kernels"].CALLS == ["reference"]  # type: ignore[attr-defined]
    assert info.error is None


def test_the_1_4_signature_receives_the_selected_backend_object() -> None:
    seen: list[object] = []

    class _New:
        @hookimpl
        def plinth_register_kernels(self, backend: object, backend_name: str) -> list:  # any order
            seen.append((backend_name, backend))
            return []

    host = PluginHost(plugins=(("new", _New()),))
    assert host.kernel_providers("reference") == []
    assert seen == [("reference", host.select("reference").backend)]


def test_a_raising_kernel_hook_is_reported_and_the_other_plugins_still_contribute() -> None:
    class _Boom:
        @hookimpl
        def plinth_register_kernels(self, backend_name: str) -> list:
            raise RuntimeError("no kernels today")

    class _Empty:
        @hookimpl
        def plinth_register_kernels(self, backend_name: str) -> list:
            return []

    host = PluginHost(plugins=(("boom", _Boom()), ("empty", _Empty())))
    assert host.kernel_providers("reference") == []
    boom = next(p for p in host.plugins if p.name == "boom")
    assert boom.error is not None and "no kernels today" in boom.error and "plinth_register_kernels" in boom.error
    assert next(p for p in host.plugins if p.name == "empty").error is None
    with pytest.raises(BackendError, match="unknown backend 'nope'"):
        host.kernel_providers("nope")


def test_a_raising_register_backends_is_reported_with_the_plugin_and_others_still_load() -> None:
    class _Boom:
        @hookimpl
        def plinth_register_backends(self) -> list:
            raise RuntimeError("constructor touched the device")

    host = PluginHost(plugins=(("boom", _Boom()), ("fine", _Plugin(_Better()))))
    boom = next(p for p in host.plugins if p.name == "boom")
    assert boom.error is not None and "constructor touched the device" in boom.error
    assert {"better", "reference"} <= set(host.names())
    # each plugin's hook was called for that plugin alone: "fine" registered exactly its backend
    assert next(p for p in host.plugins if p.name == "fine").backends == ["better"]
