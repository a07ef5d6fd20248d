"""The contract's value objects and the plugin host import without torch (discovery is torch-free)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from plinth.platform import backend, values


def test_values_host_and_hookspecs_import_and_work_without_torch() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError

        from plinth import hookspecs
        from plinth.platform import Capabilities, AttentionSpec, NotSupported, Probe
        from plinth.platform.host import PluginHost

        caps = Capabilities(frozenset({"float32"}), frozenset({"float32"}), frozenset({64}), (16,))
        spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=128, block_size=16)
        assert caps.unsupported(spec) == ["head size 128 (supported: [64])"], caps.unsupported(spec)
        try:
            caps.require_attention("acme", spec)
        except NotSupported as err:
            assert err.backend == "acme"
        else:
            raise AssertionError("require_attention accepted an undeclared head size")
        assert Probe(score=0, reasons=("absent",)).score == 0

        class KernelsOnly:
            @hookspecs.hookimpl
            def plinth_register_kernels(self, backend_name):
                return []

        host = PluginHost(group="plinth.no-such-group", plugins=(("k", KernelsOnly()),))
        assert host.plugins[0].hooks == ["plinth_register_kernels"] and host.plugins[0].error is None
        try:
            from plinth.platform import Backend  # the tensor half is loaded only when asked for
        except ImportError as exc:
            assert "torch" in str(exc), exc  # it failed for torch, the one thing blocked
        else:
            raise AssertionError("plinth.platform.Backend imported without torch")
        print("torch-free")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "torch-free"


def test_backend_module_re_exports_the_value_objects_unchanged() -> None:
    for name in ("AttentionSpec", "Capabilities", "KVCacheLayout", "NotSupported", "Probe"):
        assert getattr(backend, name) is getattr(values, name), name
        assert name in backend.__all__
