"""The collectives tier: the backend's communicator on 2 ranks, every collective in every declared
dtype, contiguous and not (see :mod:`plinth_conformance.collectives`)."""

from __future__ import annotations

import pytest

from plinth.platform.backend import Backend
from plinth_conformance.collectives import SKIPPED, CollectiveCase, run_collectives


@pytest.fixture(scope="session")
def collective_results(request: pytest.FixtureRequest) -> dict[str, str | None]:
    """One 2-rank run for the whole tier (started by the first case that asks)."""
    backend = request.config.getoption("plinth_backend")
    return run_collectives(str(backend))


def test_collective(
    plinth_backend: Backend, collective_case: CollectiveCase, collective_results: dict[str, str | None]
) -> None:
    """Both ranks got the reference result (and wrote nothing outside a strided view)."""
    assert "*" not in collective_results, collective_results["*"]
    assert collective_case.id in collective_results, f"[{collective_case.id}] was not run by the ranks"
    error = collective_results[collective_case.id]
    if error is not None and error.startswith(SKIPPED):
        pytest.skip(error.removeprefix(SKIPPED))
    assert error is None, f"[{collective_case.id}] {error}"
