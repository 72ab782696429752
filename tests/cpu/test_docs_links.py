"""Every relative link of the README and the docs points at a file of the checkout."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [
    ROOT / "README.md",
    ROOT / "benchmarks" / "results" / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    targets = [m.group(1) for m in LINK.finditer(page.read_text())]
    missing = [t for t in targets if "://" not in t and not (page.parent / t).exists()]
    assert not missing, missing
