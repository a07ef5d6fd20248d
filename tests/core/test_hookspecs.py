"""The contract module lists the whole contract, and every version marker in it agrees with the
version history it keeps."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pluggy

from plinth import hookspecs
from plinth.platform import backend, values

_MARKER = re.compile(r"\.\. version(added|changed):: (\d+)\.(\d+)")


def _resolve(dotted: str) -> object:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _markers(text: str) -> list[tuple[str, tuple[int, int]]]:
    return [(kind, (int(major), int(minor))) for kind, major, minor in _MARKER.findall(text)]


def test_history_ends_at_the_current_version_without_gaps() -> None:
    versions = list(hookspecs.API_HISTORY)
    assert versions[-1] == hookspecs.PLUGIN_API_VERSION == max(versions)
    major = hookspecs.PLUGIN_API_VERSION[0]
    assert versions == [(major, minor) for minor in range(len(versions))]
    assert hookspecs.api_version_string() == "{}.{}".format(*hookspecs.PLUGIN_API_VERSION)
    for version in versions:  # the prose table says the same versions as the data
        assert re.search(rf"^{version[0]}\.{version[1]} ", hookspecs.__doc__ or "", re.M), version


def test_every_contract_object_exists_and_says_when_it_was_added() -> None:
    for dotted in hookspecs.CONTRACT:
        obj = _resolve(dotted)
        doc = inspect.getdoc(obj) or ""
        added = [v for kind, v in _markers(doc) if kind == "added"]
        assert added, f"{dotted}: no versionadded in its docstring"
        assert added[0] in hookspecs.API_HISTORY, dotted


def test_every_hook_is_listed_and_documents_each_argument() -> None:
    hooks = [name for name, obj in vars(hookspecs).items() if inspect.isfunction(obj) and name.startswith("plinth_")]
    assert hooks and all(f"plinth.hookspecs.{name}" in hookspecs.CONTRACT for name in hooks)
    marker = pluggy.HookspecMarker(hookspecs.PROJECT_NAME)
    for name in hooks:
        fn = getattr(hookspecs, name)
        assert getattr(fn, marker.project_name + "_spec", None) is not None, f"{name} is not a hookspec"
        doc = inspect.getdoc(fn) or ""
        for arg in inspect.signature(fn).parameters:
            assert f":param {arg}:" in doc, f"{name}: argument {arg} undocumented"
        assert ":return:" in doc, name


def test_members_named_in_a_version_carry_that_versions_marker() -> None:
    # members the history table says a later minor added: each must carry the marker itself
    later = {
        "plinth.platform.backend.GemmKernels.prepare_quantized": (1, 1),
        "plinth.platform.backend.SmallOps.add_rms_norm": (1, 1),
        "plinth.platform.backend.DeviceServices.begin_graph_capture": (1, 2),
        "plinth.platform.backend.StepGraph.replay_rows": (1, 3),
        "plinth.platform.backend.AttentionKernels.write_and_attend": (1, 5),
        "plinth.platform.backend.DeviceServices.compile_step": (1, 5),
        "plinth.platform.backend.Backend.step_buckets": (1, 5),
        "plinth.platform.backend.AttentionMetadata.describe": (1, 5),
        "plinth.platform.values.KVCacheLayout.block_bytes": (1, 5),
        "plinth.platform.values.KVCacheLayout.physical_head_size": (1, 5),
    }
    for dotted, version in later.items():
        owner, _, member = dotted.rpartition(".")
        assert ("added", version) in _markers(inspect.getdoc(getattr(_resolve(owner), member)) or ""), dotted
    # a field's marker sits in its `#:` comment
    source = inspect.getsource(values.Capabilities)
    assert re.search(r"#: \.\. versionadded:: 1\.1\n\s+quant_formats:", source)
    # the hook that gained an argument in 1.4 says so
    assert ("changed", (1, 4)) in _markers(inspect.getdoc(hookspecs.plinth_register_kernels) or "")


def test_no_marker_names_a_version_outside_the_history() -> None:
    for module in (hookspecs, values, backend):
        text = Path(inspect.getfile(module)).read_text()
        for _kind, version in _markers(text):
            assert version in hookspecs.API_HISTORY, f"{module.__name__}: marker for {version}"


def test_removed_dead_surface_stays_removed() -> None:
    # DeviceServices.compile was never called by the core (removed in 1.4): a vendor must not be
    # invited to implement it again
    assert not hasattr(backend.DeviceServices, "compile")


def test_a_plugin_of_an_older_minor_still_imports_the_quantized_types_from_plinth_quant() -> None:
    # 1.1-1.3 plugins (the cpu one among them) imported plinth.quant; 1.4 moved it to plinth.platform
    import plinth.platform.quant as new
    import plinth.quant as old

    assert old.QuantizedWeight is new.QuantizedWeight and old.dequantize is new.dequantize
