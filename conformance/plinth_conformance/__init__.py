"""plinth-conformance: the suite that certifies a plinth backend.

It ships inside the ``plinth`` distribution as a pytest plugin (entry point ``pytest11``) whose
test modules live in :mod:`plinth_conformance.suite`. Hardware CI runs it through the command line::

    plinth conformance --backend acme --tier extended --report out/

which exits non-zero when a case fails and writes a JUnit report, a JSON certificate and a
Markdown summary. The oracle is an fp64 computation from the already-rounded inputs, with the
reference backend run in the same dtype as the yardstick for tolerances (see :mod:`.tolerance`).
"""

from __future__ import annotations

#: The suite's version: it seeds every case (with the case id) and is written into certificates,
#: so a certificate names exactly which checks it passed.
SUITE_VERSION = "1.6.0"

#: Tiers in the order they build on each other.
TIERS: tuple[str, ...] = ("core", "extended", "perf", "collectives")

__all__ = ["SUITE_VERSION", "TIERS"]
