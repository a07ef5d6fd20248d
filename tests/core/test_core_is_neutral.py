"""The hardware-neutral core names no backend, no device and no plugin or vendor package.

Read from the AST of every module under ``core/plinth``: string constants (whole strings, and the
literal parts of f-strings) that are a backend or device name (``"cpu"``, ``"cuda:0"``, ``"nccl"``)
or a plugin/vendor module (``importlib.import_module("triton")``), attributes that reach a device
API (``torch.cuda``, ``x.cuda()``), and imports of plugins (``plinth_cpu``, ...) or vendor
packages. A backend's knowledge belongs in its plugin, offered to the core through the contract
(``plinth.platform.backend``); messages that merely mention a backend are longer strings and pass.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

CORE = Path(__file__).parents[2] / "core" / "plinth"

#: Backends, torch device types and collective libraries a core might be tempted to special-case.
BACKEND_NAMES = (
    *("cpu", "cuda", "rocm", "hip", "tpu", "gaudi", "hpu", "habana", "metal", "mps", "mlx"),
    *("xla", "xpu", "npu", "ipu", "vulkan", "nccl", "rccl", "gloo", "hccl", "oneccl", "mpi"),
)
#: Vendor packages the core must never import (STYLE rule 3).
VENDOR_PACKAGES = frozenset(
    {"triton", "jax", "jaxlib", "torch_xla", "intel_extension_for_pytorch", "habana_frameworks", "mlx", "libtpu"}
)
#: ``plinth_*`` packages that are not plugins: the conformance suite ships in the core's distribution.
CORE_DISTRIBUTION = frozenset({"plinth_conformance"})
#: Attribute names that reach one device's API (``torch.cuda.synchronize()``, ``t.cuda()``).
DEVICE_ATTRIBUTES = frozenset({"cpu", "cuda", "mps", "xpu", "hpu", "xla", "mtia"})

_DEVICE_STRING = re.compile(rf"^(?:{'|'.join(BACKEND_NAMES)})(?::\d*)?$", re.IGNORECASE)
#: A plugin's module named in a string (``import_module("plinth_cpu")``); hook names
#: (``"plinth_register_backends"``) share the prefix, so only backend-named packages count.
_PLUGIN_STRING = re.compile(rf"^plinth_(?:{'|'.join(BACKEND_NAMES)}|triton|ipex)(?:\.[\w.]+)?$")

#: (path under core/plinth, what was found, why it stays). Each entry is one known, justified hit.
ALLOWED: dict[tuple[str, str], str] = {
    # torch's name for host memory, defined once; every other core module uses HOST.
    ("platform/devices.py", "string 'cpu'"): "host memory, not the cpu backend",
    ("platform/devices.py", "string 'gloo'"): "torch.distributed's host-memory collectives (the control group)",
    ("parallel/ray_executor.py", "string 'CPU'"): "Ray's resource name for a node's cores (a bundle's size)",
}


@dataclass(frozen=True, slots=True)
class Finding:
    """One place core code names a backend, a device, a plugin or a vendor package."""

    path: str  # relative to core/plinth
    line: int
    what: str  # "string 'cuda'", "import plinth_cpu.native", "attribute .cuda"

    def __str__(self) -> str:
        return f"core/plinth/{self.path}:{self.line}: {self.what}"


def _is_forbidden_module(name: str) -> bool:
    top = name.split(".")[0]
    return top in VENDOR_PACKAGES or (top.startswith("plinth_") and top not in CORE_DISTRIBUTION)


def scan(source: str, path: str) -> list[Finding]:
    """Every :class:`Finding` in one module's source."""
    found = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value.strip()
            if _DEVICE_STRING.match(text):
                found.append(Finding(path, node.lineno, f"string {node.value!r}"))
            elif _PLUGIN_STRING.match(text) or text.split(".")[0] in VENDOR_PACKAGES:
                found.append(Finding(path, node.lineno, f"module name {node.value!r}"))
        elif isinstance(node, ast.Import):
            bad = [a.name for a in node.names if _is_forbidden_module(a.name)]
            found += [Finding(path, node.lineno, f"import {name}") for name in bad]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if _is_forbidden_module(node.module):
                found.append(Finding(path, node.lineno, f"import {node.module}"))
        elif isinstance(node, ast.Attribute) and node.attr in DEVICE_ATTRIBUTES:
            found.append(Finding(path, node.lineno, f"attribute .{node.attr}"))
    return found


def core_findings() -> list[Finding]:
    """Findings in every module of the core, allow-listed ones left out."""
    found = []
    for file in sorted(CORE.rglob("*.py")):
        rel = file.relative_to(CORE).as_posix()
        found += [f for f in scan(file.read_text(encoding="utf-8"), rel) if (f.path, f.what) not in ALLOWED]
    return found


def test_core_names_no_backend_device_plugin_or_vendor() -> None:
    """The whole core is clean; the message lists every hit, one per line, with file and line."""
    found = core_findings()
    assert not found, "core code names a backend, device, plugin or vendor package:\n" + "\n".join(map(str, found))


def test_every_allow_list_entry_is_still_needed() -> None:
    """An allow-list entry whose hit is gone is dropped, so the list never grows stale."""
    hits = set()
    for file in sorted(CORE.rglob("*.py")):
        rel = file.relative_to(CORE).as_posix()
        hits |= {(f.path, f.what) for f in scan(file.read_text(encoding="utf-8"), rel)}
    assert set(ALLOWED) <= hits, f"stale allow-list entries: {sorted(set(ALLOWED) - hits)}"


@pytest.mark.parametrize(
    ("source", "what"),
    [
        ('if device.type != "cpu":\n    pass', "string 'cpu'"),
        ('x = torch.empty(3, device="cuda:0")', "string 'cuda:0'"),
        ('dev = f"cuda:{rank}"', "string 'cuda:'"),
        ('backend = "nccl"', "string 'nccl'"),
        ("import triton", "import triton"),
        ("import triton.language as tl", "import triton.language"),
        ("from plinth_cpu.native import native", "import plinth_cpu.native"),
        ("import plinth_rocm", "import plinth_rocm"),
        ("from torch_xla.core import xla_model", "import torch_xla.core"),
        ('mod = importlib.import_module("intel_extension_for_pytorch")', "module name 'intel_extension_for_pytorch'"),
        ('spec = importlib.util.find_spec("plinth_cpu.native")', "module name 'plinth_cpu.native'"),
        ("torch.cuda.synchronize()", "attribute .cuda"),
        ("y = x.cpu()", "attribute .cpu"),
    ],
)
def test_scan_finds_each_kind(source: str, what: str) -> None:
    """Each kind of hit is found, and named the way the failure message shows it."""
    assert [f.what for f in scan(source, "m.py")] == [what]


def test_scan_passes_what_is_only_data() -> None:
    """Messages and help text that mention a backend, the core's own packages, relative imports and
    the reference backend's name are not findings."""
    source = '''
"""Docstring about the cpu backend and CUDA graphs."""
from . import sibling
from plinth.platform.devices import HOST
import plinth_conformance.cli
help_text = "backend to use (e.g. cpu, cuda)"
name = "reference"
hooks = [c for c in callers if c.startswith("plinth_")] + ["plinth_register_backends"]
message = f"backend {name!r} on cuda failed"
'''
    assert scan(source, "m.py") == []
