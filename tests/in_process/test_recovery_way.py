"""ARCHITECTURE.md's account of a recovery of the served model, held against the code.

The section lists the recovery's steps in order, each a numbered item that begins with
``module:name`` (a path under ``src/metrale_model_engine``, then a function, a class or a
class's method).  Every ``module:name`` of the section names a definition that exists,
and in each list every step after the first is referred to (called, or passed on) by a
step before it, so a step renamed, moved or no longer reached fails here, naming it.
Parsed with ``ast``, never imported (no torch needed).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "src" / "metrale_model_engine"
DRAWING = ROOT / "ARCHITECTURE.md"
HEADING = "## A recovery of the served model, in order"
STEP = re.compile(r"`([\w/]+\.py):([\w.]+)`")


def section(text: str) -> str:
    """The section's text, up to the next heading of its level."""
    assert HEADING in text, f"ARCHITECTURE.md has no section {HEADING!r}"
    return text.split(HEADING, 1)[1].split("\n## ", 1)[0]


def lists(text: str) -> list[list[tuple[str, str]]]:
    """Each numbered list of ``text``: the ``module:name`` each of its items begins with."""
    found: list[list[tuple[str, str]]] = []
    current: list[tuple[str, str]] | None = None
    for line in text.splitlines():
        item = re.match(r"\d+\. (.*)", line)
        if item:
            step = STEP.match(item.group(1))
            assert step is not None, f"a step that does not begin with `module:name`: {line!r}"
            if current is None:
                current = []
                found.append(current)
            current.append((step.group(1), step.group(2)))
        elif not line.startswith(" "):  # neither an item nor its continuation: the list is over
            current = None
    return found


def definition(module: str, name: str) -> ast.AST:
    """The definition of ``name`` (``function``, ``Class``, ``Class.method``) in ``module``; AssertionError if none."""
    path = SOURCE / module
    assert path.is_file(), f"`{module}:{name}`: no module {module} under src/metrale_model_engine"
    scope: ast.AST = ast.parse(path.read_text(encoding="utf-8"))
    for part in name.split("."):
        defined = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        found = [node for node in ast.iter_child_nodes(scope) if isinstance(node, defined) and node.name == part]
        assert found, f"`{module}:{name}`: {module} defines no {name}"
        scope = found[0]
    return scope


def refers_to(node: ast.AST, name: str) -> bool:
    """Whether ``node``'s code names ``name`` (a plain name, or an attribute)."""
    return any(
        (isinstance(inner, ast.Name) and inner.id == name) or (isinstance(inner, ast.Attribute) and inner.attr == name)
        for inner in ast.walk(node)
    )


def unreached(steps: list[tuple[str, str]]) -> list[str]:
    """The steps after the first that no step before them refers to, as ``module:name``."""
    nodes = [definition(module, name) for module, name in steps]
    return [
        f"{module}:{name}"
        for index, (module, name) in enumerate(steps)
        if index and not any(refers_to(node, name.rsplit(".", 1)[-1]) for node in nodes[:index])
    ]


def test_every_step_of_a_recovery_is_defined_and_reached_from_a_step_before_it() -> None:
    text = section(DRAWING.read_text(encoding="utf-8"))
    for module, name in STEP.findall(text):  # the steps, and every module:name the prose names
        definition(module, name)
    head, worker = lists(text)
    assert len(head) >= 10 and len(worker) >= 4, (head, worker)
    assert head[0] == ("demo.py", "_drive") and worker[0] == ("_trait/worker_loop.py", "run_worker")
    for steps in (head, worker):
        assert unreached(steps) == [], "steps that no step before them refers to"


def test_a_step_no_step_before_it_reaches_is_named_and_a_name_not_defined_fails() -> None:
    """The check itself: a step out of order is found, and a name the module lacks is refused."""
    steps = [("_trait/reform.py", "reform_link"), ("reference/scheduler.py", "Server._recover")]
    assert unreached(steps) == ["reference/scheduler.py:Server._recover"]
    assert unreached(list(reversed(steps))) == []
    planted = "1. `demo.py:_drive` steps\n2. `reference/scheduler.py:Server.step`\n\nworker:\n\n1. `demo.py:serve`\n"
    assert lists(planted) == [
        [("demo.py", "_drive"), ("reference/scheduler.py", "Server.step")],
        [("demo.py", "serve")],
    ]
    with pytest.raises(
        AssertionError, match=r"^`reference/scheduler\.py:Server\.recover_now`: .* defines no Server\.re"
    ):
        definition("reference/scheduler.py", "Server.recover_now")
    with pytest.raises(AssertionError, match=r"^`reference/planted\.py:step`: no module reference/planted\.py under"):
        definition("reference/planted.py", "step")
