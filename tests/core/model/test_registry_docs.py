"""The README's and docs/models.md's architecture tables are the registry's, not written by hand."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from plinth.model.registry import markdown_table, supported_architectures

ROOT = Path(__file__).resolve().parents[3]
_TABLE = re.compile(r"<!-- architectures:begin -->\n(.*?)\n<!-- architectures:end -->", re.S)


@pytest.mark.parametrize("doc", ["README.md", "docs/models.md"])
def test_architecture_table_is_the_registrys(doc: str) -> None:
    match = _TABLE.search((ROOT / doc).read_text())
    assert match is not None, f"{doc} has no architectures:begin/end markers"
    assert match.group(1) == markdown_table(), f"regenerate {doc}'s table from plinth.model.registry.markdown_table()"


def test_table_names_every_architecture() -> None:
    table = markdown_table()
    assert all(f"`{name}`" in table for name in supported_architectures())
    assert len(table.splitlines()) == 2 + len(supported_architectures())
