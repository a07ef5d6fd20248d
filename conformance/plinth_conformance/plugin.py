"""The pytest plugin (entry point ``pytest11``): options, case generation, tiers, reports.

It stays inert unless ``--plinth-backend NAME`` is given, so installing plinth does not change any
other project's test run. With it, the suite's modules (:mod:`plinth_conformance.suite`) run
against that backend::

    pytest --pyargs plinth_conformance.suite --plinth-backend cpu --plinth-tier core

(what ``plinth conformance --backend cpu --tier core`` does). A failing case's report carries its
seed and the command that re-runs it alone.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from plinth_conformance import SEED_VERSION, SUITE_VERSION, TIERS
from plinth_conformance.collectives import collective_cases

#: ``--plinth-tier`` choices and the tiers each runs.
TIER_SELECTION: dict[str, tuple[str, ...]] = {
    "core": ("core",),
    "extended": ("core", "extended"),
    "perf": ("perf",),
    "collectives": ("collectives",),
    "all": TIERS,
}


@dataclass(slots=True)
class SuiteState:
    """What one conformance session knows: the backend, the selected tiers and every result."""

    backend_name: str | None
    tier_choice: str
    report_dir: Path | None
    note: str | None = None  # --note: carried by the certificate (e.g. why a tier was not run)
    host: Any = None  # plinth.platform.host.PluginHost
    status: Any = None  # plinth.platform.host.BackendStatus
    error: str | None = None
    started: float = field(default_factory=time.time)
    tier_of: dict[str, str] = field(default_factory=dict)  # nodeid -> tier
    counts: dict[str, dict[str, int]] = field(default_factory=dict)  # tier -> outcome -> n
    seconds: dict[str, float] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)
    tolerances: list[dict[str, Any]] = field(default_factory=list)
    perf: list[dict[str, Any]] = field(default_factory=list)
    quantized: list[dict[str, Any]] = field(default_factory=list)  # prepared-weight sizes per case
    roofline: dict[str, float] = field(default_factory=dict)
    covered: list[Any] = field(default_factory=list)  # the case objects of passed tests (certificate)
    exitstatus: int = 0

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tiers this session runs."""
        return TIER_SELECTION[self.tier_choice]

    @property
    def active(self) -> bool:
        """True when a backend was named: the plugin does nothing otherwise."""
        return self.backend_name is not None


STATE_KEY = pytest.StashKey[SuiteState]()


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--plinth-backend``, ``--plinth-tier`` and ``--plinth-report``."""
    group = parser.getgroup("plinth-conformance", "plinth backend conformance suite")
    group.addoption("--plinth-backend", default=None, metavar="NAME", help="backend to certify (enables the suite)")
    group.addoption(
        "--plinth-tier",
        default="extended",
        choices=sorted(TIER_SELECTION),
        help="core; extended (= core + extended); perf; all (default: extended)",
    )
    group.addoption("--plinth-report", default=None, metavar="DIR", help="write certificate.json and summary.md")
    group.addoption("--plinth-note", default=None, metavar="TEXT", help="a sentence the certificate carries")


def pytest_configure(config: pytest.Config) -> None:
    """Register the tier marker and, when a backend is named, select it through a fresh host."""
    config.addinivalue_line(
        "markers", "plinth_tier(name): conformance tier of a test (core, extended, perf, collectives)"
    )
    report = config.getoption("plinth_report")
    state = SuiteState(
        backend_name=config.getoption("plinth_backend"),
        tier_choice=config.getoption("plinth_tier"),
        report_dir=Path(report) if report else None,
        note=config.getoption("plinth_note"),
    )
    config.stash[STATE_KEY] = state
    if not state.active:
        return
    config.pluginmanager.register(_Tally(state), "plinth-conformance-tally")
    from plinth.platform.host import BackendError, PluginHost

    # A fresh host, not the process-wide one: it sees plugins put on sys.path after start-up.
    state.host = PluginHost()
    try:
        state.status = state.host.select(state.backend_name)
    except BackendError as exc:
        state.error = str(exc)


def state_of(config: pytest.Config) -> SuiteState:
    """The session's :class:`SuiteState`."""
    return config.stash[STATE_KEY]


def _generators() -> dict[str, Callable[..., list[Any]]]:
    from plinth_conformance import cases, coverage, moe_cases

    return {
        "attention_case": coverage.all_attention_cases,
        "head_sweep_case": coverage.head_sweep_cases,
        "kv_write_case": coverage.all_kv_write_cases,
        "copy_blocks_case": coverage.copy_blocks_cases,
        "gemm_case": coverage.all_gemm_cases,
        "quant_case": coverage.all_quant_cases,
        "ops_case": coverage.all_ops_cases,
        "undeclared_case": cases.undeclared_cases,
        "moe_case": moe_cases.moe_cases,
        "moe_undeclared_case": moe_cases.moe_undeclared_cases,
        "engine_case": cases.engine_cases,
        "perf_case": cases.perf_cases,
        "collective_case": lambda caps, _dtype: collective_cases(caps.dtypes),
    }


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize the suite's ``*_case`` arguments from the backend's declared capabilities."""
    if not metafunc.module.__name__.startswith("plinth_conformance."):
        return  # another project's test that happens to take an argument named like ours
    generators = _generators()
    names = [n for n in metafunc.fixturenames if n in generators]
    if not names:
        return
    state = state_of(metafunc.config)
    for name in names:
        if state.status is None:  # no backend (or a broken one): one placeholder that says why
            why = state.error or "run with --plinth-backend NAME"
            metafunc.parametrize(name, [pytest.param(None, id="no-backend", marks=pytest.mark.skip(reason=why))])
            continue
        backend = state.status.backend
        found = generators[name](backend.capabilities(), backend.device_services().default_dtype())
        metafunc.parametrize(name, [pytest.param(c, id=c.id, marks=pytest.mark.plinth_tier(c.tier)) for c in found])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the tests of tiers not asked for; remember each test's tier."""
    state = state_of(config)
    if not state.active:
        return
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        marker = item.get_closest_marker("plinth_tier")
        tier = str(marker.args[0]) if marker else "core"
        state.tier_of[item.nodeid] = tier
        (keep if tier in state.tiers else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _case(item: pytest.Item) -> Any:
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    return next((v for k, v in callspec.params.items() if k.endswith("_case") and hasattr(v, "seed")), None)


def rerun_commands(state: SuiteState, item: pytest.Item, case_id: str | None) -> list[str]:
    """Commands that re-run ``item`` alone: by case id through the CLI, by node id through pytest."""
    backend = shlex.quote(state.backend_name or "NAME")
    tier = state.tier_of.get(item.nodeid, "all")
    tier = "extended" if tier == "core" else tier
    out = []
    if case_id:
        out.append(f"plinth conformance --backend {backend} --tier {tier} -k {shlex.quote('[' + case_id + ']')}")
    node = item.nodeid.split("::", 1)[-1]
    module = getattr(item, "module", None)
    mod = module.__name__ if module is not None else "plinth_conformance.suite"
    out.append(f"pytest --pyargs {mod} --plinth-backend {backend} --plinth-tier {tier} -k {shlex.quote(node)}")
    return out


def _first_line(call: pytest.CallInfo[None], report: pytest.TestReport) -> str:
    """The exception's first line (``AssertionError: [case] ...``), at most 500 characters."""
    text = call.excinfo.exconly() if call.excinfo is not None else report.longreprtext
    return (text.strip().splitlines() or [""])[0][:500]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    """Attach the case id, its seed and the re-run commands to every failure."""
    report = yield
    state = state_of(item.config)
    if state.active and report.when == "call" and report.passed and (case := _case(item)) is not None:
        state.covered.append(case)
    if state.active and report.failed:
        case = _case(item)
        case_id = getattr(case, "id", None)
        lines = [f"case: {case_id or item.name}"]
        if case is not None:
            lines.append(f"seed: {case.seed} (sha256 of seed version {SEED_VERSION} and the case id)")
        lines += ["re-run alone:"] + [f"  {c}" for c in rerun_commands(state, item, case_id)]
        report.sections.append(("plinth conformance case", "\n".join(lines)))
        state.failures.append(
            {
                "nodeid": item.nodeid,
                "case": case_id or item.name,
                "tier": state.tier_of.get(item.nodeid, "core"),
                "seed": getattr(case, "seed", None),
                "message": _first_line(call, report),
                "rerun": rerun_commands(state, item, case_id)[0],
            }
        )
    return report


class _Tally:
    """Counts outcomes and time per tier; registered per session (``pytest_runtest_logreport``
    gets no config, so the hook lives on an object that holds the state)."""

    def __init__(self, state: SuiteState) -> None:
        self.state = state

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """A test counts once: its call, or a failed or skipped setup, or a failed teardown."""
        state = self.state
        tier = state.tier_of.get(report.nodeid)
        if tier is None:
            return
        state.seconds[tier] = state.seconds.get(tier, 0.0) + report.duration
        counts = state.counts.setdefault(tier, {"passed": 0, "failed": 0, "skipped": 0})
        if report.when == "call":
            counts["failed" if report.failed else "skipped" if report.skipped else "passed"] += 1
        elif report.when == "setup" and not report.passed:
            counts["failed" if report.failed else "skipped"] += 1
        elif report.when == "teardown" and report.failed:
            counts["failed"] += 1


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write the certificate and the Markdown summary when ``--plinth-report`` is given."""
    state = state_of(session.config)
    if not state.active:
        return
    state.exitstatus = int(exitstatus)
    if state.report_dir is not None:
        from plinth_conformance.certificate import write_reports

        write_reports(state, session.config)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """A per-tier table at the end of the run."""
    state = state_of(config)
    if not state.active:
        return
    from plinth_conformance.certificate import tier_table

    terminalreporter.section(f"plinth conformance {SUITE_VERSION}: backend {state.backend_name}")
    if state.error:
        terminalreporter.write_line(f"backend not usable: {state.error}")
    for line in tier_table(state):
        terminalreporter.write_line(line)
    for f in state.failures:
        terminalreporter.write_line(f"FAILED {f['case']} (seed {f['seed']}): {f['message']}")
    if state.report_dir is not None:
        terminalreporter.write_line(f"reports: {state.report_dir}/certificate.json, {state.report_dir}/summary.md")


# -- fixtures ----------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def plinth_state(request: pytest.FixtureRequest) -> SuiteState:
    """The session's conformance state (backend, host, results)."""
    return state_of(request.config)


@pytest.fixture(scope="session")
def plinth_backend(plinth_state: SuiteState) -> Any:
    """The backend under test; skips without ``--plinth-backend``, fails when it cannot be selected."""
    if not plinth_state.active:
        pytest.skip("the conformance suite runs with --plinth-backend NAME")
    if plinth_state.status is None:
        pytest.fail(f"backend {plinth_state.backend_name!r} cannot be selected: {plinth_state.error}")
    return plinth_state.status.backend


@pytest.fixture
def record_tolerance(plinth_state: SuiteState, request: pytest.FixtureRequest) -> Callable[..., None]:
    """``record_tolerance(case_id, dtype, verdict)``: keep the thresholds a case used (for the certificate)."""

    def record(case_id: str, dtype: str, verdict: Any) -> None:
        plinth_state.tolerances.append({"case": case_id, "dtype": dtype, **verdict.metrics})

    return record


@pytest.fixture
def record_quantized(plinth_state: SuiteState) -> Callable[..., None]:
    """``record_quantized(**fields)``: what a prepared quantized weight holds, for the certificate."""

    def record(**fields: Any) -> None:
        plinth_state.quantized.append(fields)

    return record


@pytest.fixture
def record_perf(plinth_state: SuiteState) -> Callable[..., None]:
    """``record_perf(**fields)``: one perf-tier measurement for the certificate and summary."""

    def record(**fields: Any) -> None:
        plinth_state.perf.append(fields)

    return record
