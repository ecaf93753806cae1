"""What every test module shares: rank processes start from one server that imported torch once;
the shipped model's checkpoint, opened once per module (``shipped``), and what one rank computes that
several must equal (``greedy_one_rank``, ``served_one_rank``); torch on one thread (``one_thread``); the tiers.

Tiers, one folder each: ``in_process/`` (no process of its own beyond a short helper),
``ranks/`` (rank processes from the start server) and ``programs/`` (the demo, the
examples and torchrun run as a user runs them: fresh interpreters that import torch,
the slow tier).  The folder gives each test its tier's marker, ``ranks`` or
``programs``; a ``programs`` test is a ``ranks`` test too, so ``--quick``
(``-m "not ranks"``) runs ``in_process/`` alone.  The run ends with each tier's time.

``run_group`` and ``run_ring`` spawn a fresh interpreter per rank by default, and each
imports torch (about a second on this project's 2-core machine).  In this process the
test suite has them fork from a start server instead (``start_ranks_from_a_server``):
about 0.05 s a group.  Programs the tests run as a user runs them (the demo, the
examples) are other processes and keep the default.
"""

from __future__ import annotations

import importlib.util
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from metrale_model_engine._host.launch import start_ranks_from_a_server

if TYPE_CHECKING:
    from _pytest.terminal import TerminalReporter

    from metrale_model_engine.reference import Checkpoint

    from helpers.greedy import Greedy
    from helpers.serving_sessions import Served

start_ranks_from_a_server(
    ["metrale_model_engine.torch"] if importlib.util.find_spec("torch") is not None else ["metrale_model_engine.shm"]
)


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


@pytest.hookimpl(tryfirst=True)  # before -m selects by these markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = _tier(item.path)
        if tier != "in_process":
            item.add_marker(pytest.mark.ranks)
        if tier == "programs":
            item.add_marker(pytest.mark.programs)


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
