"""The conformance suite's test modules (shipped with the package; run with ``--plinth-backend``)."""
