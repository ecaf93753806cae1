"""The README and the docs: every python block is part of a program under examples/ (run by
``tests/programs/test_examples.py``, as is the README's model program), every relative link resolves,
the README stays short; the sources: every name and heading a docstring, a message or a comment
points to exists."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import io
import re
import textwrap
import tokenize
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.readme import model_program, python_blocks

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


DOCUMENTS = sorted([ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "CONTRIBUTING.md", *ROOT.glob("docs/*.md")])


def test_every_python_block_of_the_readme_and_the_docs_is_part_of_an_example() -> None:
    """But the start of the README's model program, which ``tests/programs/test_examples.py`` runs with the rest."""
    sources = [path.read_text() for path in EXAMPLES.glob("*.py")]
    assert python_blocks(ROOT / "README.md"), "the README has no python blocks"
    _, start = model_program()
    for document in DOCUMENTS:
        for block in python_blocks(document):
            if document.name == "README.md" and block == start:
                continue
            included = re.fullmatch(r'--8<-- "(examples/\w+\.py)"\n', block)  # a whole example (pymdownx.snippets)
            if included:
                assert (ROOT / included.group(1)).is_file(), f"{document.name}: includes a missing {included.group(1)}"
                continue
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
            slugs = {re.sub(r"[^a-z0-9_ -]", "", heading.lower()).replace(" ", "-") for heading in headings}
            assert anchor in slugs, f"{document.name}: no heading {anchor!r} in {linked.name}"


README_LINES = 275
"""The README's budget: 250 until it showed its model program whole, ranks started and link made (#44)."""


def test_the_readme_stays_a_front_door() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_LINES


# Pointers in the sources: every name a docstring, a message or a comment gives (an autorefs link's
# identifier, a dotted name of this package, a private module named bare) resolves, and every "see the
# README, 'Heading'" names a heading that exists.  No reST role (``:class:`Name```): mkdocstrings reads
# Markdown, where a role is shown as written; a docstring links a name as ``[`Name`][metrale_model_engine.x.Name]``.

PACKAGE = "metrale_model_engine"
SOURCES = sorted((ROOT / "src" / PACKAGE).rglob("*.py"))
ROLE = re.compile(r":(mod|func|class|meth|attr|data|exc|obj|const):`([^`]+)`")
AUTOREF = re.compile(r"\[([^\[\]]+)\]\[([\w.]*)\]")
DOTTED = re.compile(rf"\b{PACKAGE}(?:\.[A-Za-z_]\w*)+")
DOCUMENT = r"(README|ARCHITECTURE|CONTRIBUTING|docs/\w+\.md)(?:\.md)?"
# "see the README, 'Heading'", "(docs/errors.md, 'Heading')", "the README's 'Heading'"
QUOTED_HEADING = re.compile(DOCUMENT + r"(?:'s)?,? '([^']+)'")
# "the README's Install section"
NAMED_SECTION = re.compile(r"the " + DOCUMENT + r"'s ([A-Z][\w ,-]*?) section")
DOCS_PATH = re.compile(r"\bdocs/[\w-]+\.md(?:#[\w-]+)?")
# A private name in double backticks, dotted or not ("``_shm.ring``'s docstring", "``_core.words``"): unless
# the module's own code uses that name (a function, an attribute, a constant of its own), it points to a module
# of the package, written from the package's root or from the module's own folder, and must resolve so.
BARE_PRIVATE = re.compile(r"``(_(?!_)[A-Za-z]\w*(?:\.[A-Za-z_]\w*)*)``")
# Where a package that a module imports is not installed (torch on most interpreters), its names are not checked.
OPTIONAL = {
    "torch",
    "numpy",
    "safetensors",
    "tokenizers",
    "transformers",
    "fastapi",
    "uvicorn",
    "prometheus_client",
    "jinja2",
    "starlette",
    "pydantic",
}
# Dotted names that are not names of the code: a logger's, and one whose message says it is gone.
LOGGER = re.compile(rf"getLogger\(f?\"{PACKAGE}[\w.]*")
GONE = {f"{PACKAGE}.torch.TorchEp"}


@dataclass(frozen=True)
class Text:
    """A string of the sources (a docstring, a message) or a comment, and where it is."""

    path: Path
    line: int
    text: str

    def where(self, offset: int = 0) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line + self.text.count(chr(10), 0, offset)}"


def _texts() -> list[Text]:
    texts: list[Text] = []
    for path in SOURCES:
        source = path.read_text()

        def visit(node: ast.AST, path: Path = path) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.Call) and getattr(child.func, "attr", None) == "getLogger":
                    continue  # a logger's name is not a name of the code
                if isinstance(child, ast.Constant) and isinstance(child.value, str):
                    texts.append(Text(path, child.lineno, child.value))
                else:
                    visit(child)

        visit(ast.parse(source))
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                texts.append(Text(path, token.start[0], token.string))
    return texts


TEXTS = _texts()


def _instance_attributes(cls: type) -> set[str]:
    """The names a class's methods assign on ``self`` (``self.name = ...``)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return set()
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
        if isinstance(node.value, ast.Name) and node.value.id == "self"
    }


def _member(owner: object, name: str) -> tuple[bool, object]:
    """Whether ``owner`` has ``name`` (as an attribute, an annotated field or an instance attribute), and it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return True, getattr(owner, name)
        except AttributeError:
            pass
    if isinstance(owner, type):
        for cls in owner.__mro__:
            if name in vars(cls).get("__annotations__", {}) or name in _instance_attributes(cls):
                return True, None
    if isinstance(owner, types.ModuleType):  # a name imported for the type checker only
        imported = _type_checking_imports(owner).get(name)
        if imported is not None:
            found = _lookup(imported)
            return found is not False, None
    return False, None


@functools.cache
def _type_checking_imports(module: types.ModuleType) -> dict[str, str]:
    """The names that ``from X import Y`` binds anywhere at a module's top (under ``TYPE_CHECKING`` too)."""
    if module.__file__ is None:
        return {}
    names: dict[str, str] = {}
    package = module.__name__ if module.__file__.endswith("__init__.py") else module.__name__.rpartition(".")[0]
    for node in ast.walk(ast.parse(Path(module.__file__).read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *filter(None, [base])])
            for alias in node.names:
                names[alias.asname or alias.name] = f"{base}.{alias.name}"
    return names


def _lookup(dotted: str) -> bool | None:
    """Whether a dotted name of this package names something; None where an optional package it needs is missing."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError as error:  # metrale_model_engine.torch raises its own, from the missing module's
            missing = error.name or getattr(error.__cause__, "name", None)
            if missing is not None and missing.split(".")[0] in OPTIONAL:
                return None
            continue
        for name in parts[cut:]:
            if found is None:  # an attribute known only from an annotation: its members are not checked
                return True
            ok, found = _member(found, name)
            if not ok:
                return False
        return True
    return False


@functools.cache
def _code_names(path: Path) -> frozenset[str]:
    """Every name a source file's code uses: names, attributes, definitions, arguments, imports, and strings
    that are identifiers (``getattr(x, "_stop")``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.arg | ast.keyword) and node.arg is not None:
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.update([*node.name.split("."), *([node.asname] if node.asname else [])])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            names.add(node.value)
    return frozenset(names)


def _bare_module_resolves(path: Path, name: str) -> bool:
    """Whether ``name`` (``_shm.ring``, ``_words``) is a module of the package, or in one, from the package's
    root or from the folder of the module at ``path``; true too where an optional package it needs is missing."""
    folder = path.parent.relative_to(ROOT / "src").as_posix().replace("/", ".")
    return any(_lookup(f"{base}.{name}") is not False for base in dict.fromkeys([PACKAGE, folder]))


def _headings(document: str) -> set[str]:
    """A document's headings, outside fenced code, backticks removed: whole, and up to a colon or a comma."""
    path = ROOT / (document if document.endswith(".md") else f"{document}.md")
    if not path.exists():
        return set()
    prose = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.DOTALL | re.MULTILINE)
    headings = {heading.replace("`", "").strip() for heading in re.findall(r"^#+ (.*)$", prose, flags=re.MULTILINE)}
    return headings | {re.split(r"[:,]", heading)[0] for heading in headings}


def _stale_pointers(text: Text) -> list[str]:
    stale: list[str] = []
    for match in ROLE.finditer(text.text):
        stale.append(f"{text.where(match.start())}: {match.group()} is a reST role: write [`Name`][{PACKAGE}.x.Name]")
    linked = {match.end() for match in LOGGER.finditer(text.text)}
    for match in AUTOREF.finditer(text.text):
        identifier = match.group(2) or match.group(1).strip("`")
        linked.add(match.end(2))
        if identifier.startswith(PACKAGE) and _lookup(identifier) is False:
            stale.append(f"{text.where(match.start())}: {match.group()} names nothing")
    for match in DOTTED.finditer(text.text):
        if match.end() in linked or match.group() in GONE:
            continue
        if _lookup(match.group()) is False:
            stale.append(f"{text.where(match.start())}: {match.group()} names nothing")
    for match in QUOTED_HEADING.finditer(text.text):
        if match.group(2) not in _headings(match.group(1)):
            stale.append(f"{text.where(match.start())}: {match.group()}: no such heading in {match.group(1)}")
    for match in NAMED_SECTION.finditer(text.text):
        if match.group(2) not in _headings(match.group(1)):
            stale.append(f"{text.where(match.start())}: {match.group()}: no such heading in {match.group(1)}")
    for match in BARE_PRIVATE.finditer(text.text):
        name = match.group(1)
        if name.split(".")[0] not in _code_names(text.path) and not _bare_module_resolves(text.path, name):
            stale.append(
                f"{text.where(match.start())}: ``{name}`` names no module of the package "
                "(write a module from the package's root, as ``_shm.ring``, or link a name)"
            )
    for match in DOCS_PATH.finditer(text.text):
        path, _, anchor = match.group().partition("#")
        slugs = {re.sub(r"[^a-z0-9_ -]", "", heading.lower()).replace(" ", "-") for heading in _headings(path)}
        if not (ROOT / path).exists() or (anchor and anchor not in slugs):
            stale.append(f"{text.where(match.start())}: {match.group()} is not in docs/")
    return stale


def test_every_name_and_heading_that_the_sources_point_to_exists() -> None:
    """Autorefs links, dotted names of the package and "see the README, 'Heading'"; and no reST role."""
    stale = [pointer for text in TEXTS for pointer in _stale_pointers(text)]
    assert not stale, f"{len(stale)} reST roles, or pointers to what does not exist:\n" + "\n".join(stale)


@pytest.mark.parametrize(
    "written",
    [
        "see the README, 'A heading that is not there'",
        "the README's Nowhere section",
        "docs/errors.md#no-such-anchor",
        "docs/nothing.md",
        f"{PACKAGE}.no_such_module",
        f"[`EpLink`][{PACKAGE}.EpLink.no_such_method]",
        ":class:`EpLink`",
        "how the ring works is in ``_ring``'s docstring",
        "the policy is in ``_core.no_such_module``",
    ],
)
def test_a_stale_pointer_or_a_role_is_named_with_its_place(written: str) -> None:
    """The check itself: each kind of pointer it reads fails once, at its file and line."""
    (message,) = _stale_pointers(Text(ROOT / "src" / PACKAGE / "__init__.py", 7, f"A docstring.\n{written}"))
    assert message.startswith(f"src/{PACKAGE}/__init__.py:8: "), message


def test_a_bare_private_name_that_resolves_or_is_the_modules_own_is_not_stale() -> None:
    """From the package's root or the module's folder, a module or a name in one; or a name the module's code uses."""
    launch = ROOT / "src" / PACKAGE / "_host" / "launch.py"
    written = "``_shm.ring``'s docstring, ``_core.words.check_u32``, ``liveness``, the tracker's ``_stop``"
    assert _stale_pointers(Text(launch, 1, written)) == []
    assert len(_stale_pointers(Text(launch, 1, "``_liveness``, ``_shm.ring.no_such_name``"))) == 2
