"""Rank programs for the way back: each runs in a process of ``torch.run_group``, over the transport it names.

Every program writes what it saw with :func:`rank_results.save`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import time
from collections.abc import MutableSequence, Sequence

from metrale_model_engine import (
    EpDivergenceError,
    EpLink,
    EpWorkerFailed,
    LinkedEp,
    ProtocolVersion,
    SequenceState,
    WorkerFailure,
    WorkerSummary,
    run_worker,
)
from metrale_model_engine.torch import open_link

from helpers.rank_results import save, wait_until_dead

SLOTS = 4
APPLY, FEWER, MORE, KIND, SKIP, FAIL, DIE, RESET = 1, 2, 3, 4, 5, 6, 7, 8
Slots = MutableSequence[SequenceState | None]
QUIET = logging.getLogger("tests.way_back.quiet")
QUIET.setLevel(logging.CRITICAL)


def digest(slots: Sequence[SequenceState | None]) -> int:
    """The slots' state as a u64."""
    text = repr([None if s is None else list(s.tokens) for s in slots]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


class Buggy(LinkedEp[SequenceState]):
    """APPLY reads a word and a token array and applies them; the other commands are the bugs under test."""

    __slots__ = ("ep_link",)

    def __init__(self, link: EpLink) -> None:
        self.ep_link = link
        link.state_digest = digest

    def ep_run_command(self, seq_id: int, cmd: int, slots: Slots) -> None:
        link = self.ep_link
        if cmd in (APPLY, SKIP):
            word, tokens = link.recv_word(), link.recv_tokens()
            if cmd == APPLY:  # SKIP: a worker that forgets to apply what it read, which no frame can see
                apply(slots, seq_id, [word, *tokens])
        elif cmd == FEWER:
            apply(slots, seq_id, [link.recv_word()])  # the head sent a word and a token array
        elif cmd == MORE:
            apply(slots, seq_id, [link.recv_word(), link.recv_word()])  # the head sent one word
        elif cmd == KIND:
            apply(slots, seq_id, [link.recv_word()])  # the head sent a token array
        elif cmd == FAIL:
            raise KeyError(f"slot {seq_id} is not served here")
        elif cmd == RESET:
            slots[seq_id] = None
        elif cmd == DIE:
            if link.recv_word() == link.rank:
                os.kill(os.getpid(), signal.SIGKILL)
        else:
            super().ep_run_command(seq_id, cmd, slots)


def apply(slots: Slots, seq_id: int, tokens: list[int]) -> None:
    state = slots[seq_id] or SequenceState(seq_id)
    state.extend(tokens)
    slots[seq_id] = state


def open_link_of(kind: str, *, command_timeout: float) -> EpLink:
    """``open_link(kind)`` with this module's slots and protocol v2.

    ``"hosts"``: ``auto``'s choice where the lower half of the ranks (the head's
    host) and the upper half stand for two hosts, so that it picks a
    ``HostsTransport`` over this one machine: [0] and [1, 2] for 3 ranks, [0, 1] and
    [2, 3] for 4; ``"hosts-odd-even"``: the even ranks and the odd ones, [0, 2] and
    [1, 3] for 4 (ring ranks then differ from ranks on both hosts).  Only the choice
    is told so (each rank's host words); the rings, the leaders' group and the way
    back through them are the real ones.
    """
    if kind in ("hosts", "hosts-odd-even"):
        import torch.distributed as dist

        from metrale_model_engine._launch import choice

        rank, world_size = dist.get_rank(), dist.get_world_size()
        host = rank % 2 if kind == "hosts-odd-even" else int(rank >= world_size // 2)
        choice._host_words = lambda: [1, 0x4D45, host]  # the one test seam
        kind = "auto"
    return open_link(kind, num_slots=SLOTS, protocol=ProtocolVersion.V2, command_timeout=command_timeout)


def failures_of(error: EpWorkerFailed) -> list[tuple[int, int, int, int, str]]:
    return [(f.rank, f.command, f.seq_id, f.cmd, f.error) for f in error.failures]


def contract(rank: int, world_size: int, kind: str, out: str) -> None:
    """The three ordinary bugs, a failure only the workers see, and a worker that skips applying a command."""
    model = Buggy(open_link_of(kind, command_timeout=30))
    slots: Slots = [None] * SLOTS
    if rank != 0:
        summary = run_worker(model, slots, logger=QUIET)
        save(out, rank, summary=summary, digest=digest(slots))
        model.ep_link.close()
        return
    link = model.ep_link
    seen: dict[str, object] = {}
    steps: list[tuple[str, int, tuple[int | list[int], ...]]] = [
        ("fewer", FEWER, (5, [1, 2, 3])),
        ("more", MORE, (6,)),
        ("kind", KIND, ([7, 8, 9],)),
        ("worker only", FAIL, ()),
    ]
    for name, cmd, follow_ups in steps:
        link.send_command(0, APPLY, 1, [2])  # a good command first: the slot states match
        apply(slots, 0, [1, 2])
        link.send_command(1, cmd, *follow_ups)
        try:
            link.sync(slots)
            seen[name] = "no error"
        except EpWorkerFailed as error:
            seen[name] = failures_of(error)
        if name != "worker only":  # reset the slot on every rank, as a scheduler does after a failure
            link.send_command(1, RESET)
            slots[1] = None
    try:
        link.sync(slots)
        seen["after the resets"] = "agree"
    except (EpWorkerFailed, EpDivergenceError) as error:
        seen["after the resets"] = f"{type(error).__name__}: {error}"
    link.send_command(2, SKIP, 4, [5])  # the workers read it all and apply nothing
    apply(slots, 2, [4, 5])
    try:
        link.sync(slots)
        seen["skip"] = "no error"
    except EpDivergenceError as error:
        seen["skip"] = (str(error), list(error.ranks))
    try:
        link.shutdown_workers(slots)  # a sync point: the divergence still stands, and is said again
        seen["shutdown"] = "clean"
    except (EpWorkerFailed, EpDivergenceError) as error:
        seen["shutdown"] = f"{type(error).__name__}: {error}"
    save(out, rank, seen=seen, commands=link.commands, transport=type(link.transport).__name__)
    link.close()


def check_contract(results: dict[int, dict[str, object]], world_size: int) -> None:
    """Assert what :func:`contract`'s ranks saw (``results``, by rank): every bug named, with its rank, once."""
    seen = results[0]["seen"]
    assert isinstance(seen, dict)
    workers = range(1, world_size)
    # Each step sends a good command, the buggy one, then a reset: the buggy ones are commands 2, 5, 8, 11.
    # (The last step resets nothing: the workers failed without changing the slot.)
    expected = {
        "fewer": (2, 2, "left a token array of 3 tokens unread; it was skipped"),
        "more": (5, 3, "expected a follow-up word, but command 5 (seq_id=1, cmd=3) came whole, as one message"),
        "kind": (8, 4, "expected a follow-up word, but the head sent a token array of 3 tokens"),
        "worker only": (11, 6, "KeyError: 'slot 1 is not served here'"),
    }
    for name, (command, cmd, text) in expected.items():
        failures = seen[name]
        assert isinstance(failures, list) and [f[0] for f in failures] == list(workers), (name, failures)
        for rank, failed_command, seq_id, failed_cmd, error in failures:
            assert (failed_command, seq_id, failed_cmd) == (command, 1, cmd), (name, failures)
            assert text in error and (name == "worker only" or f"worker rank {rank}" in error), error
    assert seen["after the resets"] == "agree"  # a scheduler that resets the slot is back in step
    skip = seen["skip"]
    assert isinstance(skip, tuple) and skip[1] == list(workers)
    assert "its state digest is" in skip[0] and "they diverged within commands 12 ..= 12" in skip[0], skip[0]
    assert str(seen["shutdown"]).startswith("EpDivergenceError"), seen["shutdown"]  # still differ: said again
    for rank in workers:
        # 12 commands (4 good, 4 buggy, 3 resets, the skip): the 4 buggy ones failed (a command that left a
        # follow-up unread fails itself, at once: it came as one message), the other 8 ran
        assert results[rank]["summary"] == WorkerSummary(commands_run=8, commands_failed=4)


def worker_dies_during_a_sync(rank: int, world_size: int, kind: str, out: str, victim: int = 1) -> None:
    """Worker ``victim`` kills itself inside a command; the head's sync point must fail within its bound."""
    model = Buggy(open_link_of(kind, command_timeout=10))
    pids = model.ep_link.gather_u32(os.getpid())
    slots: Slots = [None] * SLOTS
    if rank != 0:
        try:
            run_worker(model, slots, logger=QUIET)
        except Exception as error:
            save(out, rank, error_type=type(error).__name__, error=str(error))
            return
        save(out, rank, error_type=None)
        return
    link = model.ep_link
    link.send_command(0, DIE, victim)
    wait_until_dead(pids[victim], timeout=30.0)
    started = time.monotonic()
    try:
        link.sync()
        outcome: tuple[str, str] = ("no error", "")
    except Exception as error:
        outcome = (type(error).__name__, str(error))
    save(out, rank, outcome=outcome, seconds=time.monotonic() - started, transport=type(link.transport).__name__)
    os._exit(0)  # the group has a dead member: leave without tearing it down


def burst(rank: int, world_size: int, kind: str, commands: int, out: str) -> None:
    """``commands`` commands that all fail on every worker; the head must hear of each one, once."""
    model = Buggy(open_link_of(kind, command_timeout=60))
    slots: Slots = [None] * SLOTS
    if rank != 0:
        summary = run_worker(model, slots, logger=QUIET)
        save(out, rank, summary=summary)
        model.ep_link.close()
        return
    link = model.ep_link
    heard: list[WorkerFailure] = []
    raised = 0
    sent = 0
    while sent < commands:
        try:
            link.send_command(sent % SLOTS, FAIL)
            sent += 1
        except EpWorkerFailed as error:  # nothing of that command was sent: send it again
            heard += error.failures
            raised += 1
    try:
        link.shutdown_workers()
    except EpWorkerFailed as error:
        heard += error.failures
    by_rank = {r: sorted(f.command for f in heard if f.rank == r) for r in range(1, world_size)}
    save(
        out,
        rank,
        by_rank=by_rank,
        raised=raised,
        texts={f.error for f in heard},
        transport=type(link.transport).__name__,
    )
    link.close()


def group_timeouts(rank: int, world_size: int, out: str) -> None:
    """What ``_timeout_of`` reads: the world's timeout, the leaders' group's (over "hosts"), a subgroup's own."""
    import datetime

    import torch
    import torch.distributed as dist

    from metrale_model_engine._launch.choice import _timeout_of

    cpu = torch.device("cpu")
    subgroup = dist.new_group(list(range(world_size)), timeout=datetime.timedelta(seconds=4321))
    link = open_link_of("hosts", command_timeout=10)
    leaders = getattr(link.transport, "_leaders_group", None)
    save(
        out,
        rank,
        world=_timeout_of(dist.group.WORLD, cpu).total_seconds(),  # type: ignore[arg-type]  # initialised
        leaders=None if leaders is None else _timeout_of(leaders, cpu).total_seconds(),
        subgroup=_timeout_of(subgroup, cpu).total_seconds(),
    )
    link.close()
