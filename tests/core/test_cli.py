"""The plinth command line: backends table, generate, chat, and errors that name the culprit."""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import plinth
from plinth.cli import build_parser, main

# the tiny-model helpers live beside the engine's tests
ENGINE_TESTS = str(Path(__file__).parent / "runtime" / "engine")


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
    assert "plinth_register_backends" in out and "API 1.11" in out  # the reference and cpu plugins


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
    sys.path.insert(0, ENGINE_TESTS)
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
    sys.path.insert(0, ENGINE_TESTS)
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
    sys.path.insert(0, ENGINE_TESTS)
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


def test_version_and_python_dash_m(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc_info:
        main(["--version"])
    assert exc_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"plinth {plinth.__version__}"
    proc = subprocess.run([sys.executable, "-m", "plinth", "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"plinth {plinth.__version__}", proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "plinth", "bench", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "usage: plinth bench" in proc.stdout


def _parsers(parser: argparse.ArgumentParser, path: str = "plinth") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def test_every_option_has_help_and_shows_its_default() -> None:
    checked = 0
    for path, parser in _parsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            checked += 1
            name = f"{path} {action.option_strings[-1]}"
            assert action.help and action.help.strip(), f"{name} has no help"
            if action.default not in (None, False, [], argparse.SUPPRESS) and not isinstance(
                action, argparse._VersionAction | argparse._HelpAction
            ):
                assert "default" in str(formatter._get_help_string(action)), f"{name} does not show its default"
        if path not in ("plinth bench", "plinth conformance", "plinth plugin", "plinth plugin new"):
            assert "--verbose" in parser.format_help(), f"{path} has no -v/--verbose"
    assert checked > 80


def test_verbose_logs_and_shows_the_traceback_of_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", "/no/such/model", "hi"]) == 2
    err = capsys.readouterr().err
    assert "/no/such/model" in err and "Traceback" not in err
    for argv in (
        ["-v", "generate", "--model", "/no/such/model", "hi"],
        ["generate", "-v", "--model", "/no/such/model", "hi"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err and err.rstrip().splitlines()[-1].startswith("plinth: error:")
    args = build_parser().parse_args(["-vv", "backends"])
    assert args.verbose_log == 2  # -vv: DEBUG; the subcommand's own -v did not reset the count
    assert build_parser().parse_args(["backends", "--verbose"]).verbose_log == 1


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


def test_building_the_parser_imports_neither_the_server_nor_torch() -> None:
    # every command builds the whole parser: `plinth generate`'s cold start must not pay for fastapi,
    # the server's state or torch there (a module-level import in server/launch.py cost ~0.85 s)
    code = (
        "import sys\nfrom plinth.cli import build_parser\nbuild_parser()\n"
        "print([m for m in ('torch', 'fastapi', 'plinth.server.state', 'plinth.runtime.engine') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
