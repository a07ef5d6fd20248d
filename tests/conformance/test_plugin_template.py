"""The template tests itself: render a plugin, install it with ``pip install -e``, run its tests
(which run the conformance core tier through ``plinth conformance``).

The install goes into a throw-away virtual environment layered on this one (a ``.pth`` that adds
this environment's site-packages), so the shared environment other test runs use never sees the
rendered plugin, and teardown is deleting a directory.
"""

from __future__ import annotations

import site
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from plinth.cli import main
from plinth.hookspecs import PLUGIN_API_VERSION
from plinth_conformance.template import render_plugin


def _layered_venv(root: Path) -> Path:
    """A venv without pip whose interpreter also sees this environment's packages; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # addsitedir (not a bare path) so this environment's own .pth files (editable installs) run too
    lines = [f"import site; site.addsitedir({p!r})" for p in site.getsitepackages()]
    (Path(purelib) / "_plinth_parent_env.pth").write_text("\n".join(lines) + "\n")
    return python


def test_plugin_new_renders_a_complete_package(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugin", "new", "acme_npu", "--dest", str(tmp_path)]) == 0
    dest = tmp_path / "plinth-acme-npu"
    assert str(dest) in capsys.readouterr().out
    for path in (
        "pyproject.toml",
        "README.md",
        ".copier-answers.yml",
        ".github/workflows/conformance.yml",
        "plinth_acme_npu/plugin.py",
        "plinth_acme_npu/backend.py",
        "plinth_acme_npu/attention.py",
        "plinth_acme_npu/gemm.py",
        "tests/test_conformance.py",
    ):
        assert (dest / path).is_file(), path
    project = tomllib.loads((dest / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["plinth.backends"] == {"acme_npu": "plinth_acme_npu.plugin"}
    answers = (dest / ".copier-answers.yml").read_text()
    assert "backend_name: acme_npu" in answers and "_src_path:" in answers
    workflow = (dest / ".github/workflows/conformance.yml").read_text()
    assert "self-hosted" in workflow and "plinth conformance --backend acme_npu --tier all" in workflow
    assert "${{ github.sha }}" in workflow  # GitHub's own expressions survive the jinja rendering
    backend_py = (dest / "plinth_acme_npu/backend.py").read_text()
    assert "class AcmeNpuBackend(Backend)" in backend_py
    # the rendered plugin declares the API of the plinth that rendered it, taken from the contract
    major, minor = PLUGIN_API_VERSION
    assert f"    api_version = ({major}, {minor})\n" in backend_py
    assert f"plugin_api_version: '{major}.{minor}'" in answers
    with pytest.raises(ValueError, match="already exists"):
        render_plugin("acme_npu", tmp_path)
    with pytest.raises(ValueError, match="lowercase"):
        render_plugin("Acme-NPU", tmp_path)


@pytest.mark.slow
def test_rendered_plugin_installs_and_passes_the_core_tier(tmp_path: Path) -> None:
    dest = render_plugin("tmplcheck", tmp_path / "src")
    python = _layered_venv(tmp_path / "venv")
    pip = [
        sys.executable,
        "-m",
        "pip",
        "--python",
        str(python),
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-e",
        str(dest),
    ]
    subprocess.run(pip, check=True, capture_output=True, timeout=300)
    tests = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=dest,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert tests.returncode == 0, tests.stdout[-6000:] + tests.stderr[-3000:]
    assert "2 passed" in tests.stdout  # discovered by entry point with its hook, and the core tier passed


def test_the_static_shape_variant_declares_buckets_the_engine_accepts(tmp_path: Path) -> None:
    """``static_shapes=true`` renders a backend with ``step_buckets`` (API 1.5) covering the engine's maxima."""
    import importlib

    from plinth.platform.backend import StepBuckets

    dest = render_plugin("static_npu", tmp_path, data={"static_shapes": True})
    plain = render_plugin("plain_npu", tmp_path)
    assert "def step_buckets" not in (plain / "plinth_plain_npu/backend.py").read_text()
    sys.path.insert(0, str(dest))
    try:
        module = importlib.import_module("plinth_static_npu.backend")
        buckets = module.StaticNpuBackend().step_buckets(1024, 64, 128)
    finally:
        sys.path.remove(str(dest))
    assert isinstance(buckets, StepBuckets)
    assert buckets.largest()[:3] == (1024, 64, 128) and buckets.tokens[0] == 16 and buckets.blocks_per_seq == (128,)
    assert buckets.decode is None and not buckets.flat_blocks


def test_the_separate_phases_variant_declares_a_decode_set_and_unmixed_steps(tmp_path: Path) -> None:
    """``separate_phases=true`` (API 1.6) adds a decode set, flat block lists and ``mixed_batches=False``."""
    import importlib

    dest = render_plugin("phased_npu", tmp_path, data={"static_shapes": True, "separate_phases": True})
    sys.path.insert(0, str(dest))
    try:
        backend = importlib.import_module("plinth_phased_npu.backend").PhasedNpuBackend()
        buckets = backend.step_buckets(1024, 64, 128)
    finally:
        sys.path.remove(str(dest))
    assert not backend.capabilities().mixed_batches
    assert buckets.decode is not None and buckets.decode.tokens == buckets.decode.seqs == (1, 2, 4, 8, 16, 32, 64)
    assert buckets.flat_blocks[-1] >= 64 * 128 and buckets.largest()[:3] == (1024, 64, 128)
    assert all(s.tokens == s.seqs for s in buckets.shapes() if s.decode)
