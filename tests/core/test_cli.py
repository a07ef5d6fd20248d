"""The plinth command line: backends table, generate, chat, and errors that name the culprit."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from plinth.cli import main


@pytest.fixture(autouse=True)
def _thaw_gc() -> Iterator[None]:
    """``main(["generate", ...])`` freezes start-up's objects out of the cyclic GC, as a process should
    that lives as long as its engine; the test session goes on collecting them."""
    yield
    gc.enable()
    gc.unfreeze()


def test_backends_table_shows_reference_and_cpu_with_scores_and_reasons(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PLINTH_BACKEND", raising=False)
    assert main(["backends", "--verbose"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = lines[0].split()
    assert header[:3] == ["backend", "score", "plugin"]
    rows = {line.split()[1] if line.startswith("*") else line.split()[0]: line for line in lines[1:3]}
    assert set(rows) == {"cpu", "reference"}
    assert rows["cpu"].startswith("*")  # the cpu backend outranks the reference one
    assert "correctness oracle" in rows["reference"]
    assert "selected: cpu (highest score)" in out
    assert "plinth_register_backends" in out and "API 1.1" in out


def test_unknown_backend_is_an_error_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--backend", "warp-drive", "hi"]) == 2
    err = capsys.readouterr().err
    assert "unknown backend 'warp-drive'" in err and "reference" in err


def test_missing_model_path_is_an_error_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", "/no/such/model", "hi"]) == 2
    assert "/no/such/model" in capsys.readouterr().err


def test_invalid_sampling_option_names_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--temperature", "-1", "hi"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_generate_on_a_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(Path(__file__).parent / "engine"))
    from engine_helpers import save_tiny_folder

    save_tiny_folder("llama", tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--max-tokens", "8", "--ignore-eos", "hello"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert "8 generated tokens" in captured.err and "tokens/s" in captured.err
    assert main(["chat", "--model", str(tmp_path), "--max-tokens", "4", "--ignore-eos", "hi there"]) == 0
    assert "4 generated tokens" in capsys.readouterr().err


def test_generate_pauses_the_gc_for_start_up_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sys.path.insert(0, str(Path(__file__).parent / "engine"))
    from engine_helpers import save_tiny_folder

    import plinth.llm

    save_tiny_folder("llama", tmp_path)
    real_llm, enabled_while_building = plinth.llm.LLM, []

    def spy(*args: object, **kwargs: object) -> plinth.llm.LLM:
        enabled_while_building.append(gc.isenabled())
        return real_llm(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(plinth.llm, "LLM", spy)
    frozen = gc.get_freeze_count()
    assert main(["generate", "--model", str(tmp_path), "--max-tokens", "2", "hi"]) == 0
    assert enabled_while_building == [False]  # paused while the engine was built
    assert gc.isenabled() and gc.get_freeze_count() > frozen  # on again, start-up's objects frozen
    assert main(["generate", "--backend", "warp-drive", "hi"]) == 2  # start-up failed
    assert gc.isenabled()
    capsys.readouterr()


def test_generate_writes_start_up_timings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(Path(__file__).parent / "engine"))
    from engine_helpers import save_tiny_folder

    save_tiny_folder("llama", tmp_path)
    path = tmp_path / "timings.json"
    assert main(["generate", "--model", str(tmp_path), "--max-tokens", "2", "--timings-json", str(path), "hi"]) == 0
    report = json.loads(path.read_text())
    marks = report["marks"]
    assert list(marks) == ["python", "imports", "engine", "first_token"]
    assert marks["python"] <= marks["imports"] <= marks["engine"] <= marks["first_token"]
    assert set(report["engine_phases"]) == {"backend", "weights", "tokenizer", "kv_cache"}
    assert all(v >= 0 for v in report["engine_phases"].values())
    assert "--timings-json" not in capsys.readouterr().out  # a hidden option: nothing else changes


@pytest.mark.slow
def test_readme_generate_on_the_default_model() -> None:
    plinth = Path(sys.executable).parent / "plinth"
    proc = subprocess.run(
        [str(plinth), "generate", "--chat", "--max-tokens", "32", "What is the capital of France?"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "tokens/s" in proc.stderr and "cpu backend" in proc.stderr
