"""Failures inside a forward, for any model: real processes, both transports, every rank ends within a bound.

The model (``forward_sessions.Summing``) is the smallest a user writes from the
README: one collective command whose forward sums a tensor over the ranks through
``Collectives``.  One fault is planted on one worker; every rank must end with a
:class:`RunStopped` (the victim an :class:`EpCommandRefused` when it refused) within
:data:`BOUND` seconds of the fault, the head's naming the worker, the command and,
where it can be known, the worker's error; and every process must exit non-zero.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")

from metrale_model_engine.torch import run_group

from helpers import forward_sessions as sessions
from helpers.rank_results import load, read_note

pytestmark = pytest.mark.torch

BOUND = 10.0
"""Seconds from the fault to the error on every rank (measured: well under one; see the README)."""
RUN_LIMIT = 120.0
COMMAND = f"command {sessions.FAULTY_STEP} (seq_id=0, cmd={sessions.FORWARD})"


def run(
    kind: str, fault: str, world_size: int, tmp_path: Path, victim: int = 1
) -> tuple[list[int], dict[int, dict[str, object]], float]:
    codes = run_group(sessions.forward_fault, world_size, kind, fault, victim, str(tmp_path), timeout=RUN_LIMIT)
    return codes, load(tmp_path, world_size), float(read_note(tmp_path, "struck")["at"])  # type: ignore[arg-type]


def assert_bounded(results: dict[int, dict[str, object]], struck: float, bound: float = BOUND) -> None:
    for rank, result in results.items():
        took = float(result["at"]) - struck  # type: ignore[arg-type]
        assert 0 <= took < bound, (rank, took, result)


@pytest.mark.parametrize(("kind", "world_size"), [("shm", 3), ("torch", 2)])
def test_a_plain_exception_before_the_collective_stops_every_rank_and_the_head_names_it(
    kind: str, world_size: int, tmp_path: Path
) -> None:
    codes, results, struck = run(kind, "before", world_size, tmp_path)
    assert codes == [1] * world_size
    head, victim = results[0], results[1]
    assert head["kind"] == "RunStopped", head
    expected = f"head: the run stopped in {COMMAND}: worker rank 1 failed {COMMAND}: KeyError: 'slot 0 is free on"
    assert str(head["message"]).startswith(expected), head["message"]
    assert victim["kind"] == "EpCommandRefused" and "which runs collectives, failed here" in str(victim["message"])
    for rank in range(2, world_size):  # in the all-reduce with the head when the victim left
        assert results[rank]["kind"] == "RunStopped", results[rank]
        assert f"the run stopped in {COMMAND}: an all-reduce failed" in str(results[rank]["message"])
    assert_bounded(results, struck)


@pytest.mark.parametrize("kind", ["shm", "torch"])
def test_an_error_inside_the_collective_stops_every_rank(kind: str, tmp_path: Path) -> None:
    codes, results, struck = run(kind, "inside", 2, tmp_path)
    assert codes == [1, 1]
    head, victim = results[0], results[1]
    assert victim["kind"] == "RunStopped" and "an all-reduce failed" in str(victim["message"]), victim
    assert head["kind"] == "RunStopped", head
    assert f"worker rank 1 failed {COMMAND}: an all-reduce failed here: TypeError" in str(head["message"])
    assert_bounded(results, struck)


@pytest.mark.parametrize("kind", ["shm", "torch"])
def test_a_plain_exception_after_the_collective_stops_the_run_at_the_heads_next_command(
    kind: str, tmp_path: Path
) -> None:
    codes, results, struck = run(kind, "after", 2, tmp_path)
    assert codes == [1, 1]
    head, victim = results[0], results[1]
    assert victim["kind"] == "EpCommandRefused" and "ValueError: a bug after the all-reduce" in str(victim["message"])
    assert head["kind"] == "RunStopped", head
    assert f"worker rank 1 failed {COMMAND}: ValueError: a bug after the all-reduce" in str(head["message"])
    assert_bounded(results, struck)


@pytest.mark.parametrize("kind", ["shm", "torch"])
def test_a_worker_that_reads_past_the_end_of_a_command_fails_at_once(kind: str, tmp_path: Path) -> None:
    codes, results, struck = run(kind, "over-read", 2, tmp_path)
    assert codes == [1, 1]
    head = results[0]
    assert head["kind"] == "RunStopped", head
    assert f"worker rank 1 failed {COMMAND}: EpMismatchError: worker rank 1 expected a follow-up word, but" in str(
        head["message"]
    )
    assert "came whole, as one message" in str(head["message"])
    assert_bounded(results, struck, 5.0)  # at once: not the 30 s command timeout


@pytest.mark.light  # 2 s of a collective's timeout, 0.2 s of CPU
@pytest.mark.parametrize("kind", ["shm", "torch"])
def test_a_worker_stopped_inside_its_forward_stops_the_run_after_the_collective_timeout(
    kind: str, tmp_path: Path
) -> None:
    codes, results, struck = run(kind, "stop", 2, tmp_path)
    assert codes[0] == 1 and codes[1] == -9  # the head ended the stopped worker, as an operator would
    head = results[0]
    assert head["kind"] == "RunStopped", head
    assert f"head: the run stopped in {COMMAND}: an all-reduce failed" in str(head["message"])
    assert "worker rank(s) [1] are stopped (a signal, a debugger)" in str(head["message"])
    took = float(head["at"]) - struck  # type: ignore[arg-type]
    # The head's all-reduce began a moment before the worker stopped itself: its timeout counts from then.
    assert sessions.COLLECTIVE_TIMEOUT - 0.5 <= took < sessions.COLLECTIVE_TIMEOUT + BOUND, took


@pytest.mark.parametrize("kind", ["shm", "torch"])
def test_a_worker_killed_inside_its_forward_stops_the_head_with_its_rank(kind: str, tmp_path: Path) -> None:
    codes, results, struck = run(kind, "kill", 2, tmp_path)
    assert codes == [1, -9]
    head = results[0]
    assert head["kind"] == "RunStopped", head
    assert f"head: the run stopped in {COMMAND}: worker rank(s) [1] exited" in str(head["message"])
    assert_bounded({0: head}, struck)


@pytest.mark.light  # 2 s of a collective's timeout, 0.2-0.3 s of CPU
@pytest.mark.parametrize("kind", ["shm", "torch"])
def test_a_worker_hung_in_its_forward_is_the_one_the_head_names_after_the_collective_timeout(
    kind: str, tmp_path: Path
) -> None:
    codes, results, struck = run(kind, "hang", 3, tmp_path)
    assert codes[0] == 1 and codes[2] == 1
    message = str(results[0]["message"])
    # Rank 2 waited in the all-reduce with the head: a witness, not the cause; rank 1 said nothing.
    assert f"worker rank 2 failed {COMMAND}: an all-reduce failed here" in message, message
    assert "rank(s) [1] said nothing (they stall, skipped their forward, or left)" in message, message
    assert results[2]["kind"] == "RunStopped"
    took = float(results[0]["at"]) - struck  # type: ignore[arg-type]
    assert sessions.COLLECTIVE_TIMEOUT - 0.5 <= took < sessions.COLLECTIVE_TIMEOUT + BOUND, took


FIRST = f"command 1 (seq_id=0, cmd={sessions.FORWARD})"
WRONG = {
    "skip": (
        3,
        f"head: the run stopped in {COMMAND}: worker rank 1 failed {COMMAND}: it ran no collective: cmd 7 is in",
    ),
    "forgot": (
        2,
        f"head: the run stopped in {FIRST}: worker rank 1 failed {FIRST}: an all-reduce ran in cmd 7, which "
        "ep_collective_commands does not declare: add 7 to the model's ep_collective_commands (a failure there must "
        "stop every rank, not leave them in the collective)",
    ),
    "direct": (2, f"head: the run stopped in {FIRST}: it ran no collective: its forward inside"),
    # the head's own collective fails as the worker leaves: it names the worker, not "Connection closed by peer"
    "closed-socket": (2, f"head: the run stopped in {COMMAND}: worker rank 1 failed {COMMAND}: KeyError: 'slot 0 is"),
}
"""The pattern slightly wrong (``forward_sessions.Summing``), and what the head's line says: world size, its start."""


@pytest.mark.parametrize("fault", WRONG)
@pytest.mark.parametrize("kind", ["shm", "torch"])
def test_the_pattern_slightly_wrong_stops_every_rank_at_once_named(kind: str, fault: str, tmp_path: Path) -> None:
    world_size, expected = WRONG[fault]
    codes, results, struck = run(kind, fault, world_size, tmp_path)
    assert codes == [1] * world_size
    assert str(results[0]["message"]).startswith(expected), results[0]["message"]
    assert results[1]["kind"] == "EpCommandRefused", results[1]
    assert all(results[rank]["kind"] == "RunStopped" for rank in range(2, world_size))
    assert_bounded(results, struck)  # milliseconds: not the collective timeout, not for ever


@pytest.mark.light  # 3 s of head_lost_after, 0.1 s of CPU
def test_a_worker_stopped_past_head_lost_after_in_its_forward_is_lost_and_the_run_stops_then(tmp_path: Path) -> None:
    codes, results, struck = run("torch", "lost", 2, tmp_path)  # heartbeats: the group's own transport
    assert codes == [1, -9]  # the head ended the stopped worker, as an operator would
    message = str(results[0]["message"])
    assert message.startswith(f"head: the run stopped in {COMMAND}: an all-reduce failed: worker rank(s) [1] are lost")
    assert "past head_lost_after" in message, message
    took = float(results[0]["at"]) - struck  # type: ignore[arg-type]
    # Its bound, not the all-reduce's 30 s: a beat of the worker may have come just before it stopped.
    assert sessions.HEAD_LOST_AFTER - 0.5 <= took < sessions.HEAD_LOST_AFTER + BOUND, took


@pytest.mark.parametrize("kind", ["shm", "torch"])
@pytest.mark.serial  # a pause that must stay under its bound
def test_a_worker_paused_inside_its_forward_for_less_than_head_lost_after_loses_nothing(
    kind: str, tmp_path: Path
) -> None:
    codes, results, _ = run(kind, "pause", 2, tmp_path)
    assert codes == [0, 0], results
    assert results[0]["sums"] == [3.0] * sessions.STEPS  # every forward summed both ranks


LAST = f"command {sessions.STEPS} (seq_id=0, cmd={sessions.FORWARD})"
SKIPPED = (
    "the head {doing} without running its forward: the forward of cmd 7 runs collectives (ep_collective_commands "
    "declares it), which the workers wait in; run the head's forward of every cmd 7 inside `with link.collective():`"
)


@pytest.mark.parametrize(("fault", "where", "doing"), [
    ("head-skip", COMMAND, "sent the next command"),
    ("head-skip-last", LAST, "reached a sync point"),
])  # fmt: skip
@pytest.mark.parametrize("kind", ["shm", "torch"])
@pytest.mark.serial  # within 1 s
def test_a_head_that_skips_its_forward_is_stopped_at_its_next_send_or_sync_point_named(
    kind: str, fault: str, where: str, doing: str, tmp_path: Path
) -> None:
    codes, results, struck = run(kind, fault, 2, tmp_path, victim=0)
    assert codes == [1, 1]
    head, worker = results[0], results[1]
    assert head["kind"] == "RunStopped", head
    expected = f"head: the run stopped in {where}: " + SKIPPED.format(doing=doing)
    assert str(head["message"]).startswith(expected), head["message"]
    # The worker waited in that forward's all-reduce, which fails as the head's process ends.
    assert worker["kind"] == "RunStopped" and "an all-reduce failed" in str(worker["message"]), worker
    assert float(head["at"]) - struck < 1.0  # type: ignore[arg-type]  # at the next send: not a 30 s sync point
    assert_bounded(results, struck)
