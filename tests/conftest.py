"""What every test module shares: rank processes start from one server that imported torch once;
the shipped model's checkpoint, opened once per module (``shipped``), and what one rank computes that
several must equal (``greedy_one_rank``, ``served_one_rank``); torch on one thread (``one_thread``); the tiers.

Tiers, one folder each: ``in_process/`` (no process of its own beyond a short helper),
``ranks/`` (rank processes from the start server) and ``programs/`` (the demo, the
server, the examples and torchrun run as a user runs them, as processes of their own:
the slow tier).  The folder gives each test its tier's marker, ``ranks`` or
``programs``; a ``programs`` test is a ``ranks`` test too, so ``--quick``
(``-m "not ranks"``) runs ``in_process/`` alone.  The run ends with each tier's time.

In a parallel run (pytest-xdist's ``-n``, as ``scripts/test.sh`` runs it, with 3 workers): the
tests of a module that uses a module-scoped fixture stay on one worker (the fixture made once),
the tests marked ``serial`` go first, together, on one worker, each apart from the tests that
start processes (or alone, if it is an in-process test itself: ``helpers.serial``), while the
tests marked ``light`` and the in-process tests run beside them, each kind together on a worker
of its own; then the tests that start processes, the slowest tier first.  At most two tests that
load the machine run at once, however many workers there are: a light test takes no load.

``run_group`` and ``run_ring`` spawn a fresh interpreter per rank by default, and each
imports torch (about a second on this project's 2-core machine).  In this process the
test suite has them fork from a start server instead (``start_ranks_from_a_server``):
about 0.05 s a group.  Programs the tests run as a user runs them (the demo, the
server, the examples) fork from a program server that imported torch once, their
ranks forks of them (``helpers.programs``), but where only a fresh start shows what
a test checks.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import shutil
import sys
import tempfile
from collections import defaultdict
from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from metrale_model_engine._host.launch import start_ranks_from_a_server

from helpers.serial import Alone, Need, Room

if TYPE_CHECKING:
    from _pytest.terminal import TerminalReporter

    from metrale_model_engine.reference import Checkpoint

    from helpers.greedy import Greedy
    from helpers.serving_sessions import Served

# Each connection to a group's store makes torch look up its peer's name (``getnameinfo`` of ``::ffff:127.0.0.1``,
# which ``/etc/hosts`` seldom lists); where the machine's resolver drops a query now and then, glibc waits its
# default 5 s before asking again: about 1 store connection in 25 to 50 on this project's machine, a test 5 s
# longer each time.  Every process of the run (set before any starts) asks once, for a second at most.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

start_ranks_from_a_server(
    ["metrale_model_engine.torch"] if importlib.util.find_spec("torch") is not None else ["metrale_model_engine.shm"]
)


SERIAL = "serial"
"""The marker of a test that runs apart or alone in a parallel run, and the xdist group of every such test."""
LIGHT = "light"
"""The marker of a test that starts processes but mostly waits, and the xdist group of every such test of the ranks
tier: it runs beside the serial tests, and takes none of the run's loads (``helpers.serial``)."""
LIGHT_LATE = "light-late"
"""The xdist group of the light tests of the programs tier: they run beside the tests that load the machine."""
ROOM = pytest.StashKey[Room]()
"""A worker's way into the room of a parallel run (``helpers.serial``)."""


@pytest.fixture
def alone(request: pytest.FixtureRequest) -> Alone:
    """``with alone():``, in a parallel run: the block runs once every other test that starts processes has ended,
    and no other starts meanwhile (one in-process test and light tests may run); the rest of the test runs beside
    the others.  For a time bound measured after a start that need not be apart (a program's, a server's); a test
    whose whole run is timed is marked ``serial`` instead."""
    room = request.config.stash.get(ROOM, None)
    return contextlib.nullcontext if room is None else room.alone


@pytest.fixture(scope="module")
def shipped() -> Checkpoint:
    """The shipped model's checkpoint, opened (needs torch)."""
    from metrale_model_engine.reference import Checkpoint

    return Checkpoint.open()


@pytest.fixture
def one_thread() -> None:
    """Torch's CPU ops on one thread, as in a rank process (needs torch): ``usefixtures("one_thread")``."""
    from helpers.greedy import on_one_thread

    on_one_thread()


@pytest.fixture(scope="module")
def greedy_one_rank(shipped: Checkpoint) -> Greedy:
    """The shipped model's greedy session on one rank, in this process: what a sharded run must equal (needs torch)."""
    from helpers.greedy import one_rank_greedy

    return one_rank_greedy(shipped)


@pytest.fixture(scope="module")
def served_one_rank() -> Served:
    """The serving workload on one rank, in this process: its tokens, logits and final digest (needs torch)."""
    from helpers.serving_sessions import one_rank_reference

    return one_rank_reference()


TIERS = ("in_process", "ranks", "programs")
"""The tiers, fastest first: one folder of ``tests/`` each."""
HERE = Path(__file__).parent


def _tier(path: Path) -> str:
    """The tier of the test module at ``path``: its folder under ``tests/``."""
    tier = path.relative_to(HERE).parts[0]
    if tier not in TIERS:
        raise pytest.UsageError(f"{path}: a test module belongs in one of the tiers' folders, {', '.join(TIERS)}")
    return tier


def _serial(item: pytest.Item) -> bool:
    return item.get_closest_marker(SERIAL) is not None


def _light(item: pytest.Item) -> bool:
    return item.get_closest_marker(LIGHT) is not None and not _serial(item)


def _shares_a_module_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` uses a fixture made once per module (or package): made once if its module runs on one worker."""
    info = getattr(item, "_fixtureinfo", None)
    definitions = info.name2fixturedefs.values() if info is not None else ()
    return any(defs and defs[-1].scope in ("module", "package") for defs in definitions)


def _need(item: pytest.Item) -> Need:
    """What ``item`` needs of the room of a parallel run: an in-process test (one core at most) runs beside any test
    but one alone, a test that starts processes beside any but one apart or alone, a light one beside any but one
    alone; a serial test runs apart from the tests that start processes, or alone if it is an in-process test
    itself."""
    quiet = _tier(item.path) == "in_process"
    if _serial(item):
        return Need.ALONE if quiet else Need.APART
    if _light(item):
        return Need.LIGHT
    return Need.QUIET if quiet else Need.BUSY


def _parallel_order(item: pytest.Item) -> int:
    """A parallel run's order: the serial tests first (together, on one worker; those alone last among them), beside
    them the light tests (together, on a second worker) and the in-process tests (together, on a third); then the
    tests that start processes, the slowest tier first so that short tests fill the end, the light tests of the
    programs tier (together) among that tier's tests.

    The serial tests first, because a worker that takes them while the others still hold tests that start processes
    (pytest-xdist sends a worker up to 3 tests ahead) would keep it waiting for them all; those alone last, because
    a light test already running (seconds) would keep them waiting.  The light tests wait more than they compute:
    beside the serial tests, which wait too, they fill the cores, where later each would hold a worker that a test
    loading the machine could use.  The in-process tests on one worker: beside a test apart only one may run (one
    load slot is left), and two workers taking turns at it would each stand idle half the time.  The light tests of
    the programs tier (a cut cable's, 4-6 s each) later: beside the serial tests they would outlast the tests apart
    and keep the tests alone waiting; among the tests that load the machine, two of which hold the two load slots,
    they take the third worker, which would otherwise wait for a slot.
    """
    if _serial(item):
        return 1 if _tier(item.path) == "in_process" else 0
    if _light(item):
        return 2 if _tier(item.path) != "programs" else 4
    return {"in_process": 3, "programs": 4, "ranks": 5}[_tier(item.path)]


@pytest.hookimpl(tryfirst=True)  # before -m selects by these markers, and before xdist reads its groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = _tier(item.path)
        if tier != "in_process":
            item.add_marker(pytest.mark.ranks)
        if tier == "programs":
            item.add_marker(pytest.mark.programs)
        if _serial(item):
            item.add_marker(pytest.mark.xdist_group(SERIAL))
        elif _light(item):
            item.add_marker(pytest.mark.xdist_group(LIGHT if tier != "programs" else LIGHT_LATE))
        elif tier == "in_process":
            item.add_marker(pytest.mark.xdist_group(tier))
        elif _shares_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
    if hasattr(config, "workerinput"):  # a worker of a parallel run (pytest-xdist)
        items.sort(key=_parallel_order)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Once every test module is imported: what was made so far frozen out of the garbage collector, and torch
    (if imported) on one thread.

    The imports (torch's, transformers') are most of this process's objects; frozen
    (``gc.freeze``), they are no longer walked by each full collection of the run.  Torch
    on one thread computes as each rank does; a second thread on this 2-core machine, shared
    with the other workers and the ranks, mostly spins in OpenMP's wait.
    """
    gc.freeze()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        config.stash[ROOM] = Room(Path(tempfile.gettempdir(), f"metrale-tests-{workerinput['testrunuid']}"))


def pytest_unconfigure(config: pytest.Config) -> None:
    room = config.stash.get(ROOM, None)
    if room is not None:
        room.close()
        shutil.rmtree(room.folder, ignore_errors=True)  # its locks held open by the workers still running


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    """In a parallel run: a test waits for what it needs of the room (``_need``); a serial test keeps it for the
    next serial test."""
    room = item.config.stash.get(ROOM, None)
    if room is None:
        return (yield)
    room.enter(_need(item))
    try:
        return (yield)
    finally:
        if not (_serial(item) and nextitem is not None and _serial(nextitem)):
            room.leave()


def pytest_terminal_summary(terminalreporter: TerminalReporter) -> None:
    """Each tier's time (setup, call and teardown of its tests) and count, after the run."""
    seconds: defaultdict[str, float] = defaultdict(float)
    tests: defaultdict[str, set[str]] = defaultdict(set)
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                tier = _tier(terminalreporter.config.rootpath / report.location[0])
                seconds[tier] += report.duration
                tests[tier].add(report.nodeid)
    if tests:
        parts = [f"{tier} {seconds[tier]:.1f} s ({len(tests[tier])} tests)" for tier in TIERS if tier in tests]
        terminalreporter.write_line("tiers: " + ", ".join(parts))
