"""ARCHITECTURE.md held against the code: the layers, what each may import, and the limits of size.

Every module under ``src/metrale_model_engine`` is parsed with ``ast``, never imported (so
this needs no torch): its imports, type-only ones under ``TYPE_CHECKING`` and the ones
inside functions included, relative ones resolved against its package.  Each module
belongs to a layer: the demo program's (``demo``, and its private parts in ``_demo/``), else its top
folder, or for a module at the root, the public fronts (``fronts``).  Every rule has a short name, and a broken
one fails with that name, the importing file and line, and what it imported:

* ``layer:<layer>``: a layer imports only the layers ARCHITECTURE.md's table lets it;
* ``outside:<layer>``: and, outside the standard library, only the packages it names;
* ``plain-errors``: the backends' modules (``_shm``, ``_torch``) build none of the package's
  errors (no import of ``_core.errors``), but the ring's launcher (:data:`ERRORS_IN_BACKENDS`);
* ``private-names``: no ``from x import _y`` across modules, but for :data:`PRIVATE_IMPORTS`;
* ``private-attributes``: no ``x._y`` on another object (``x`` not ``self`` or ``cls``) of a
  name the module does not define (assign, declare in ``__slots__``, or set on ``self``), but for
  :data:`PRIVATE_ATTRIBUTES`: a class's private state is read by its own module, which gives
  others a function;
* ``no-circle``: no circle of imports between modules, nor between layers;
* ``module-size`` and ``folder-size``: a module of at most 450 lines, a folder of at most
  12 modules besides its ``__init__``;
* ``thin-fronts``: a public front defines no function or class of its own, but for the
  fronts ARCHITECTURE.md names as holding code (:data:`FRONTS_WITH_CODE`);
* ``dynamic-imports``: no ``importlib.import_module(...)`` or ``__import__(...)`` that may reach
  the package's own modules (a name of the package, a relative one, or one computed at run
  time), which the rules above cannot read, but for :data:`DYNAMIC_IMPORTS`;
* ``drawing``: the table in ARCHITECTURE.md is :data:`MAY_IMPORT` and :data:`OUTSIDE`.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "metrale_model_engine"
SOURCE = ROOT / "src" / PACKAGE
DRAWING = ROOT / "ARCHITECTURE.md"

MODULE_LINES = 450
FOLDER_MODULES = 12

DEMO = frozenset({"demo", "_demo"})
"""The demo program: its root module and the folder of its private parts; every other root module is a public front."""

MAY_IMPORT: dict[str, frozenset[str]] = {
    "serve": frozenset({"demo", "reference", "fronts", "_core"}),
    "demo": frozenset({"reference", "fronts", "_core", "_host"}),
    "reference": frozenset({"fronts", "_tensors", "_core"}),
    "fronts": frozenset({"_launch", "_tensors", "_torch", "_trait", "_engine", "_shm", "_host", "_core"}),
    "_launch": frozenset({"_torch", "_engine", "_shm", "_host", "_core"}),
    "_tensors": frozenset({"_torch", "_engine", "_shm", "_host", "_core"}),
    "_torch": frozenset({"_shm", "_core"}),
    "_trait": frozenset({"_engine", "_core"}),
    "_engine": frozenset({"_host", "_core"}),
    "_shm": frozenset({"_host", "_core"}),
    "_host": frozenset({"_core"}),
    "_core": frozenset(),
}
"""Each layer, top down, and the other layers it may import (its own is always allowed)."""

OUTSIDE: dict[str, frozenset[str]] = {
    "serve": frozenset({"fastapi", "starlette", "pydantic", "uvicorn", "prometheus_client", "jinja2"}),
    "demo": frozenset({"torch"}),
    "reference": frozenset({"torch", "safetensors", "tokenizers"}),
    "fronts": frozenset({"typing_extensions", "torch", "numpy"}),
    "_launch": frozenset({"typing_extensions", "torch"}),
    "_tensors": frozenset({"typing_extensions", "torch"}),
    "_torch": frozenset({"typing_extensions", "torch"}),
    "_trait": frozenset({"typing_extensions"}),
    "_engine": frozenset({"typing_extensions"}),
    "_shm": frozenset({"typing_extensions"}),
    "_host": frozenset(),
    "_core": frozenset({"typing_extensions"}),
}
"""What each layer may import from outside the standard library (top-level package names)."""

BACKENDS = frozenset({"_shm", "_torch"})
ERRORS_IN_BACKENDS = frozenset({f"{PACKAGE}._shm.run"})
"""The backend modules that may raise the package's errors: ``run_ring`` raises the setup failure its ranks gathered."""

PRIVATE_IMPORTS: dict[str, tuple[str, str, str]] = {}
"""Allowed imports of a private name from another module: a short name for each, with
(importing module, imported module, name).  Empty: every name one module takes from
another is public in its module (a private folder keeps it inside the package)."""

PRIVATE_ATTRIBUTES: dict[str, tuple[str, str]] = {
    "torch's timeout of a group": ("_launch.choice", "_get_backend"),
    "torch's timeout of a group's backend": ("_launch.choice", "_timeout"),
    "torch's op overloads, which a dispatch mode is handed": ("_tensors.op_count", "_ops"),
    "os._exit: a process's exit without its cleanup": ("*", "_exit"),
    "torch's timeout of the default group, set past a re-formed group's rendezvous": (
        "_torch.regroup",
        "_set_pg_timeout",
    ),
}
"""Allowed reads of a private attribute of another object: a short name for each, with (the
module, below the package, or ``*`` for any; the attribute).  Only other libraries' names:
within the package, a class's private state stays in the module that defines it."""

FRONTS_WITH_CODE = frozenset({"batching", "testing", "toy"})
"""The public fronts that define functions or classes of their own (ARCHITECTURE.md says why)."""

FRONT_HOOKS = frozenset({"__getattr__", "__dir__"})
"""What a thin front may still define: the module hooks of PEP 562."""

DYNAMIC_IMPORTS: dict[str, tuple[str, str]] = {
    "the package's deprecated names, imported from their new home on first use": (PACKAGE, "__getattr__"),
}
"""Allowed imports by a name given at run time: a short name for each, with (the module, the function
the call is in).  The one shim: a renamed name's new home is a public front, whatever the table says."""


@dataclass(frozen=True)
class Import:
    """One import statement's target, as the importer wrote it and as it resolves."""

    importer: str
    path: Path
    line: int
    target: str  # the module it resolves to (a module of the package, or an outside top-level name)
    name: str | None  # the name taken from it with ``from``, when that name is not a module itself


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SOURCE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {module_name(path): path for path in sorted(SOURCE.rglob("*.py"))}


def layer_of(module: str) -> str:
    """The layer of a module of the package: ``demo`` for the demo's, else its top folder, else ``fronts``."""
    parts = module.split(".")
    if len(parts) == 1:
        return "fronts"
    if parts[1] in DEMO:
        return "demo"
    if (SOURCE / parts[1]).is_dir():
        return parts[1]
    return "fronts"


def owner(dotted: str) -> str:
    """The module of the package that ``dotted`` names, or that holds it."""
    while dotted not in MODULES:
        dotted = dotted.rpartition(".")[0]
    return dotted


def imports_of(module: str) -> Iterator[Import]:
    """Every import in ``module``'s file, wherever it stands (type-only and inside functions too)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, path, node.lineno, alias.name, None)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                whole = f"{source}.{alias.name}"
                if whole in MODULES:
                    yield Import(module, path, node.lineno, whole, None)
                else:
                    yield Import(module, path, node.lineno, source, alias.name)


ALL_IMPORTS: list[Import] = [found for module in MODULES for found in imports_of(module)]
INSIDE = [found for found in ALL_IMPORTS if found.target.split(".")[0] == PACKAGE]


def where(found: Import) -> str:
    return f"{found.path.relative_to(ROOT)}:{found.line}"


def test_every_layer_imports_only_the_layers_under_it() -> None:
    broken = []
    for found in INSIDE:
        mine, theirs = layer_of(found.importer), layer_of(owner(found.target))
        if theirs != mine and theirs not in MAY_IMPORT[mine]:
            allowed = ", ".join(sorted(MAY_IMPORT[mine])) or "no other layer"
            broken.append(f"[layer:{mine}] {where(found)} imports {owner(found.target)} ({mine} may import {allowed})")
    assert not broken, "\n".join(broken)


def test_outside_the_standard_library_each_layer_imports_only_what_it_names() -> None:
    broken = []
    for found in ALL_IMPORTS:
        top = found.target.split(".")[0]
        if top == PACKAGE or top in sys.stdlib_module_names or top == "__future__":
            continue
        mine = layer_of(found.importer)
        if top not in OUTSIDE[mine]:
            allowed = ", ".join(sorted(OUTSIDE[mine])) or "nothing"
            broken.append(f"[outside:{mine}] {where(found)} imports {found.target} ({mine} may import {allowed})")
    assert not broken, "\n".join(broken)


def test_a_backend_raises_plain_errors() -> None:
    broken = [
        f"[plain-errors] {where(found)} imports {found.name or found.target} from {owner(found.target)}"
        for found in INSIDE
        if layer_of(found.importer) in BACKENDS
        and found.importer not in ERRORS_IN_BACKENDS
        and owner(found.target) == f"{PACKAGE}._core.errors"
    ]
    assert not broken, "\n".join(broken)


def test_no_private_name_crosses_modules_but_the_allowed_ones() -> None:
    allowed = {(importer, source, name) for importer, source, name in PRIVATE_IMPORTS.values()}
    broken = []
    for found in INSIDE:
        name = found.name
        if name is None or not name.startswith("_") or name.startswith("__"):
            continue
        if (found.importer, owner(found.target), name) not in allowed:
            broken.append(f"[private-names] {where(found)} imports {name} from {owner(found.target)}")
    assert not broken, "\n".join(broken)


def own_names(tree: ast.Module) -> set[str]:
    """The names a module defines: its functions and classes, the names it assigns (a class's
    fields), the attributes it assigns on ``self`` or ``cls``, and the names in its ``__slots__``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for part in (part for target in targets for part in ast.walk(target)):
                if isinstance(part, ast.Name):
                    names.add(part.id)
                elif isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name):
                    names.update([part.attr] if part.value.id in ("self", "cls") else [])
            if any(isinstance(target, ast.Name) and target.id == "__slots__" for target in targets):
                value = node.value if node.value is not None else ast.Constant(None)
                names.update(
                    c.value for c in ast.walk(value) if isinstance(c, ast.Constant) and isinstance(c.value, str)
                )
    return names


def private_reads(tree: ast.Module) -> list[ast.Attribute]:
    """Every ``x._y`` on another object (``x`` not ``self`` or ``cls``) of a name the module does not define."""
    own = own_names(tree)
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        and node.attr not in own
    ]


def test_no_module_reaches_into_another_objects_private_state() -> None:
    allowed = set(PRIVATE_ATTRIBUTES.values())
    broken = []
    for module, path in MODULES.items():
        short = module.removeprefix(f"{PACKAGE}.")
        for node in private_reads(ast.parse(path.read_text(encoding="utf-8"))):
            if (short, node.attr) not in allowed and ("*", node.attr) not in allowed:
                where_ = f"{path.relative_to(ROOT)}:{node.lineno}"
                broken.append(f"[private-attributes] {where_} reads {ast.unparse(node)}, which {short} does not define")
    assert not broken, "\n".join(broken)


def test_a_read_of_another_modules_private_state_is_found() -> None:
    """What ``Collectives`` did before the transports named their waits: read them off the transport."""
    crossing = """
class Collectives:
    __slots__ = ("_link",)

    def __init__(self, transport, link):
        self._link = link
        self._waits = transport._blocking if hasattr(transport, "_world") else transport._world._blocking

    def same_class(self, other):
        return other._link
"""
    found = sorted({node.attr for node in private_reads(ast.parse(crossing))})
    assert found == ["_blocking", "_world"]


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(edges.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            part = [stack.pop()]
            while part[-1] != node:
                part.append(stack.pop())
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_circle_between_modules_nor_between_layers() -> None:
    modules: dict[str, set[str]] = defaultdict(set)
    layers: dict[str, set[str]] = defaultdict(set)
    for found in INSIDE:
        target = owner(found.target)
        if target != found.importer:
            modules[found.importer].add(target)
        if layer_of(target) != layer_of(found.importer):
            layers[layer_of(found.importer)].add(layer_of(target))
    assert not circles(modules), f"[no-circle] these modules import each other in a circle: {circles(modules)}"
    assert not circles(layers), f"[no-circle] these layers import each other in a circle: {circles(layers)}"


def test_the_circle_finder_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_is_over_its_size(module: str) -> None:
    lines = len(MODULES[module].read_text(encoding="utf-8").splitlines())
    assert lines <= MODULE_LINES, f"[module-size] {MODULES[module].relative_to(ROOT)} has {lines} lines"


def test_no_folder_holds_more_than_its_modules() -> None:
    counts: dict[Path, int] = defaultdict(int)
    for path in MODULES.values():
        if path.name != "__init__.py":
            counts[path.parent] += 1
    crowded = [f"{folder.relative_to(ROOT)}: {n}" for folder, n in sorted(counts.items()) if n > FOLDER_MODULES]
    assert not crowded, f"[folder-size] over {FOLDER_MODULES} modules: {crowded}"


def test_the_public_fronts_stay_thin_but_the_named_ones() -> None:
    broken = []
    for module, path in MODULES.items():
        if layer_of(module) != "fronts" or module.rpartition(".")[2] in FRONTS_WITH_CODE:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name not in FRONT_HOOKS:
                broken.append(f"[thin-fronts] {path.relative_to(ROOT)}:{node.lineno} defines {node.name}")
    assert not broken, "\n".join(broken)


def dynamic_imports(module: str, path: Path, source: str) -> list[str]:
    """Every ``importlib.import_module(...)``/``__import__(...)`` in ``source`` that may reach the package's own
    modules (a literal name of the package or a relative one, or a name computed at run time), but the allowed."""
    allowed = set(DYNAMIC_IMPORTS.values())
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inside = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
            if isinstance(child, ast.Call) and (module, function) not in allowed:
                call = ast.unparse(child.func)
                if call in ("importlib.import_module", "import_module", "__import__", "importlib.__import__"):
                    target = child.args[0] if child.args else None
                    named = target.value if isinstance(target, ast.Constant) else None
                    if not isinstance(named, str):
                        what = "a name computed at run time"
                    elif named.startswith(".") or named.split(".")[0] == PACKAGE:
                        what = repr(named)
                    else:
                        what = None  # another package's module, by name
                    if what is not None:
                        found.append(
                            f"[dynamic-imports] {path.relative_to(ROOT)}:{child.lineno} imports {what} with {call}: "
                            "write an import statement, which the layers' rules read"
                        )
            visit(child, inside)

    visit(ast.parse(source), "")
    return found


def test_no_module_imports_the_packages_own_modules_by_a_name_given_at_run_time() -> None:
    broken = [line for module, path in MODULES.items() for line in dynamic_imports(module, path, path.read_text())]
    assert not broken, "\n".join(broken)


def test_an_import_by_name_of_the_packages_own_modules_is_found_but_the_shim() -> None:
    planted = f"""
import importlib
from importlib import import_module


def reach(name):
    import_module("{PACKAGE}.reference")
    __import__("{PACKAGE}._core.words")
    importlib.import_module(".words", package="{PACKAGE}._core")
    importlib.import_module("json")  # another package's: the outside rule's business, not this one's


def __getattr__(name):
    return importlib.import_module(name)
"""
    in_core = dynamic_imports(f"{PACKAGE}._core.planted", SOURCE / "_core" / "planted.py", planted)
    assert [line.split(" imports ")[1].split(" with ")[0] for line in in_core] == [
        f"'{PACKAGE}.reference'",
        f"'{PACKAGE}._core.words'",
        "'.words'",
        "a name computed at run time",
    ]
    assert in_core[0] == (
        f"[dynamic-imports] src/{PACKAGE}/_core/planted.py:7 imports '{PACKAGE}.reference' with import_module: "
        "write an import statement, which the layers' rules read"
    )
    assert len(dynamic_imports(PACKAGE, SOURCE / "__init__.py", planted)) == 3  # the shim's own call is allowed


def drawn_table() -> dict[str, tuple[frozenset[str], frozenset[str]]]:
    """ARCHITECTURE.md's layer table: each layer, the layers it may import, the outside packages."""
    header = "| layer | what it is | may import | outside the standard library |"
    text = DRAWING.read_text(encoding="utf-8")
    assert header in text, f"[drawing] ARCHITECTURE.md has no table headed {header!r}"
    rows = text.split(header, 1)[1].splitlines()[2:]
    drawn = {}
    for row in rows:
        if not row.startswith("|"):
            break
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        layer = cells[0].strip("`/")
        named = [name.strip("/") for name in re.findall(r"`([^`]+)`", cells[2])]
        drawn[layer] = (frozenset(named), frozenset(re.findall(r"`([^`]+)`", cells[3])))
    return drawn


def test_architecture_md_draws_the_layers_this_test_holds() -> None:
    drawn = drawn_table()
    held = {layer: (MAY_IMPORT[layer], OUTSIDE[layer]) for layer in MAY_IMPORT}
    assert drawn == held, "[drawing] ARCHITECTURE.md's layer table differs from MAY_IMPORT and OUTSIDE"
    assert list(drawn) == list(MAY_IMPORT), "[drawing] the table lists the layers top down, as MAY_IMPORT does"
    assert {layer_of(module) for module in MODULES} == set(MAY_IMPORT), "[drawing] a layer is missing"


def test_architecture_md_names_the_fronts_that_hold_code_and_its_check() -> None:
    text = DRAWING.read_text(encoding="utf-8")
    for front in FRONTS_WITH_CODE:
        assert f"`{front}`" in text, f"[drawing] ARCHITECTURE.md does not say why {front} holds code"
    assert "tests/in_process/test_architecture.py" in text, "[drawing] ARCHITECTURE.md names no check"
