"""Benchmarks (``plinth bench ...``), one module each: ``serve`` load-tests a running server."""
