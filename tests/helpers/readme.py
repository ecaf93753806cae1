"""The README's python blocks, and the program its model blocks make: the model of ``examples/ep_model.py``,
quoted in parts, then the block that starts its ranks, which is the README's own (the example's start
parses options and runs under torchrun too)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MODEL_EXAMPLE = ROOT / "examples" / "ep_model.py"
START = 'if __name__ == "__main__":'
"""How the block that starts the README's model program begins: the one README block that is in no example."""


def python_blocks(document: Path) -> list[str]:
    """Every fenced python block of ``document``, in order, each with its last newline."""
    return re.findall(r"```python\n(.*?)```", document.read_text(), flags=re.DOTALL)


def model_program() -> tuple[str, str]:
    """The README's model program, and its start: the README's blocks quoted from ``examples/ep_model.py``,
    in the README's order, then its one block that begins with ``START``, which must come after them."""
    blocks = python_blocks(README)
    source = MODEL_EXAMPLE.read_text()
    quoted = [index for index, block in enumerate(blocks) if block in source]
    starts = [index for index, block in enumerate(blocks) if block.startswith(START)]
    assert quoted, "the README quotes nothing of examples/ep_model.py"
    assert len(starts) == 1, f"the README has {len(starts)} blocks that start a program, not 1"
    assert starts[0] > quoted[-1], "the README's model program starts its ranks before it has shown them all"
    start = blocks[starts[0]]
    return "\n\n".join([*(blocks[index] for index in quoted), start]), start
