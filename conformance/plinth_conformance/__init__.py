"""plinth-conformance: the suite that certifies a plinth backend.

It ships inside the ``plinth`` distribution as a pytest plugin (entry point ``pytest11``) whose
test modules live in :mod:`plinth_conformance.suite`. Hardware CI runs it through the command line::

    plinth conformance --backend acme --tier extended --report out/

which exits non-zero when a case fails and writes a JUnit report, a JSON certificate and a
Markdown summary. The oracle is an fp64 computation from the already-rounded inputs, with the
reference backend run in the same dtype as the yardstick for tolerances (see :mod:`.tolerance`).
"""

from __future__ import annotations

#: The suite's version: written into certificates, so a certificate names exactly which checks it passed.
SUITE_VERSION = "1.10.0"

#: The version every case's seed is drawn from (with the case id). It moved with SUITE_VERSION up to
#: 1.6.0, redrawing every case's data each release; a release that only adds cases keeps it (1.7.0
#: added the grouped collectives, 1.8.0 the scale-out declarations check, 1.9.0 the stored-dtype GEMM
#: check, 1.10.0 fp8 (e4m3fn) KV caches; all kept 1.6.0's seeds, so every other case draws what it drew).
SEED_VERSION = "1.6.0"

#: Tiers in the order they build on each other.
TIERS: tuple[str, ...] = ("core", "extended", "perf", "collectives")

__all__ = ["SEED_VERSION", "SUITE_VERSION", "TIERS"]
