"""Every "DESIGN section N" cited in code, tests and scripts is a section of the repo's own docs/DESIGN.md."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CITE = re.compile(r"DESIGN(?:\.md)?\s+(?:section\s+)?(\d+)")


def test_cited_design_sections_exist():
    sections = set(re.findall(r"^## (\d+)\. ", (REPO / "docs" / "DESIGN.md").read_text(), flags=re.M))
    cited = {}
    for folder in ("python", "kernel", "test", "scripts"):
        for py in (REPO / folder).rglob("*.py"):
            for n in CITE.findall(py.read_text()):
                cited.setdefault(n, py.relative_to(REPO).as_posix())
    assert cited, "no DESIGN citations found: is the pattern stale?"
    missing = {n: where for n, where in cited.items() if n not in sections}
    assert not missing, f"cited but not in docs/DESIGN.md: {missing}"
