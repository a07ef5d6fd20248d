"""scripts/amx-decisions.sh: the timings left for an AMX host, in one run. Its timings cannot run on a
host without AMX; what runs anywhere is its refusal there and its dry run, whose commands must name
benchmarks, options and peers rows that exist (they drift as the benchmarks change)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "amx-decisions.sh"


def _has_amx() -> bool:
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def _dry_run() -> list[str]:
    out = subprocess.run([str(SCRIPT), "--dry-run"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_the_dry_run_names_benchmarks_and_peers_rows_that_exist() -> None:
    lines = _dry_run()
    commands = [line.split(": ", 1)[1].split() for line in lines if line.startswith("== ") and ": " in line]
    names = [line.split(":")[0][3:] for line in lines if line.startswith("== ")]
    assert names[:3] == ["attention-bf16-cache", "attention-fp8-cache", "attention-bf16-cache-again"]
    assert names[-2:] == ["plinth-rows", "conformance"]
    assert lines[-1].endswith("steps (dry run: nothing ran)")
    for cmd in commands:
        for arg in cmd:
            if arg.endswith(".py"):
                assert (REPO / arg).is_file(), f"{arg} is not in the repository"
    spec = importlib.util.spec_from_file_location("peers_run", REPO / "benchmarks" / "peers" / "run.py")
    assert spec and spec.loader
    run = importlib.util.module_from_spec(spec)
    sys.modules["peers_run"] = run
    spec.loader.exec_module(run)
    tags = {tag for _, tag, _ in run.PLINTH_VARIANTS}
    rows = next(cmd[cmd.index("--plinth-rows") + 1] for cmd in commands if "--plinth-rows" in cmd)
    assert set(rows.split(",")) <= tags, f"peers rows {rows} not all in run.py's {sorted(tags)}"
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=REPO, capture_output=True, text=True)
    gemm = [cmd for cmd in commands if "benchmarks/onednn_packed.py" in cmd]
    assert len(gemm) == 3  # the fp32 few-row tiles, the blocked tiles, the pairs' prefetch: each against its commit
    assert {cmd[cmd.index("--dtype") + 1] for cmd in gemm} == {"float32", "bfloat16"}
    for cmd in commands:
        script = next((a for a in cmd if a.startswith("benchmarks/") and a.endswith(".py")), None)
        if script is None or "peers" in script:
            continue
        text = (REPO / script).read_text()
        for opt in (a for a in cmd if a.startswith("--")):
            assert f'"{opt}"' in text, f"{script} has no option {opt}"
        if "--against" in cmd and not cmd[cmd.index("--against") + 1].startswith("wip/"):
            before = cmd[cmd.index("--against") + 1]  # a commit of this history (a shallow clone may lack it)
            if shallow.stdout.strip() == "false":
                found = subprocess.run(["git", "cat-file", "-e", f"{before}^{{commit}}"], cwd=REPO, capture_output=True)
                assert found.returncode == 0, f"--against {before} is not a commit of this repository"
        if script == "benchmarks/attention.py":
            dtype = cmd[cmd.index("--cache-dtype") + 1]
            assert re.search(rf'"{dtype}"', text), f"benchmarks/attention.py takes no cache dtype {dtype}"
    assert any("benchmarks/w16.py" in cmd for cmd in commands)


def test_it_refuses_a_host_without_amx_and_names_why() -> None:
    if _has_amx():
        pytest.skip("this CPU has AMX-BF16: the script would run its timings (30 min)")
    out = subprocess.run([str(SCRIPT)], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 2
    assert "no AMX-BF16" in out.stderr and "--dry-run" in out.stderr
    bad = subprocess.run([str(SCRIPT), "--fast"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert bad.returncode == 2 and "unknown argument --fast" in bad.stderr
