"""Reading one field of the mapping that holds an address from /proc/self/smaps (a test helper for
the huge-page and prefault tests; a uniquely named module, imported as ``from smaps import ...``)."""

from __future__ import annotations

from pathlib import Path


def mapping_field(address: int, field: str) -> str | None:
    """The value of ``field`` (``"Rss"``, ``"THPeligible"``, ...) for the mapping holding ``address``,
    as smaps writes it after the colon; None when smaps is unreadable or does not say."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    for i, line in enumerate(lines):
        head = line.split()[0] if line and not line.startswith((" ", "\t")) else ""
        if "-" not in head:
            continue
        try:
            lo, hi = (int(x, 16) for x in head.split("-"))
        except ValueError:
            continue
        if lo <= address < hi:
            for entry in lines[i + 1 :]:
                if entry.startswith(f"{field}:"):
                    return entry.split(":", 1)[1].strip()
            return None
    return None
