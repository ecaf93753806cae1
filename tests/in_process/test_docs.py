"""The README and the docs: every python block is part of a program under examples/ (run by
``tests/programs/test_examples.py``), every relative link resolves, the README stays short."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


DOCUMENTS = sorted([ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "CONTRIBUTING.md", *ROOT.glob("docs/*.md")])


def test_every_python_block_of_the_readme_and_the_docs_is_part_of_an_example() -> None:
    sources = [path.read_text() for path in EXAMPLES.glob("*.py")]
    readme_blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.DOTALL)
    assert readme_blocks, "the README has no python blocks"
    for document in DOCUMENTS:
        for block in re.findall(r"```python\n(.*?)```", document.read_text(), flags=re.DOTALL):
            assert any(block in source for source in sources), f"{document.name}: block not in examples/:\n{block}"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_every_relative_link_of_the_readme_and_the_docs_resolves(document: Path) -> None:
    """A moved or renamed file, or a heading that changed, fails here (a link to a heading is checked too)."""
    text = document.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        linked = (document.parent / path).resolve() if path else document
        assert linked.exists(), f"{document.name}: the link {target!r} names a missing file"
        if anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", linked.read_text(), flags=re.MULTILINE)
            slugs = {re.sub(r"[^a-z0-9 -]", "", heading.lower()).replace(" ", "-") for heading in headings}
            assert anchor in slugs, f"{document.name}: no heading {anchor!r} in {linked.name}"


def test_the_readme_stays_a_front_door() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
