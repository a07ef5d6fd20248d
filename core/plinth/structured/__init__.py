"""Structured output: constraints compiled to grammars, and the per-step token masks they give."""
