"""A worker whose errors carry any text (``os.fsdecode``'s surrogates, NUL, other scripts, megabytes, a
``__str__`` that raises), in ordinary commands and in one that stops the run: each reaches the head.

:func:`texts` runs in a process of ``torch.run_group``, over the transport it names
(``way_back_sessions.open_link_of``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableSequence

from metrale_model_engine import EpLink, EpWorkerFailed, LinkedEp, RunStopped, SequenceState, run_worker

from helpers.rank_results import save
from helpers.way_back_sessions import open_link_of

FAIL, STOP = 1, 2
FILE_NAME = os.fsdecode(b"/data/\xff.bin")
"""A file name that is not UTF-8, as ``os.fsdecode`` gives it: with a lone surrogate."""
QUIET = logging.getLogger("tests.error_text.quiet")
QUIET.setLevel(logging.CRITICAL)


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("a __str__ that raises")


def errors() -> list[BaseException]:
    """The errors the worker raises, by the follow-up word of FAIL."""
    return [
        ValueError("no such file: " + FILE_NAME),
        KeyError("nul\0inside"),
        RuntimeError("ошибка 错误 エラー ❌"),
        MemoryError("x" * (4 << 20)),
        Unprintable(),
    ]


class Texts(LinkedEp[SequenceState]):
    """FAIL raises ``errors()[word]`` (an ordinary failure); STOP, which runs collectives, the file name's."""

    __slots__ = ("ep_link",)
    ep_collective_commands = frozenset({STOP})

    def __init__(self, link: EpLink) -> None:
        self.ep_link = link

    def ep_run_command(self, seq_id: int, cmd: int, slots: MutableSequence[SequenceState | None]) -> None:
        if cmd == FAIL:
            raise errors()[self.ep_link.recv_word()]
        if cmd == STOP:
            raise ValueError("no such file: " + FILE_NAME)
        super().ep_run_command(seq_id, cmd, slots)


def texts(rank: int, world_size: int, kind: str, out: str) -> None:
    """Every error of :func:`errors` as an ordinary failure, then STOP; the head saves the texts it read."""
    model = Texts(open_link_of(kind, command_timeout=30))
    link = model.ep_link
    if rank != 0:
        slots: list[SequenceState | None] = [None, None, None, None]
        try:
            run_worker(model, slots, logger=QUIET)
        except RunStopped as refused:  # STOP: it refused, having told the head
            save(out, rank, failed=link.commands, stopped=str(refused))
        link.close()
        return
    read: list[str] = []
    for word in range(len(errors())):
        try:
            link.send_command(0, FAIL, word)
        except EpWorkerFailed as failed:  # over shared memory, at the next command: then it is sent again
            read += [failure.error for failure in failed.failures]
            link.send_command(0, FAIL, word)
    try:
        link.sync()
    except EpWorkerFailed as failed:
        read += [failure.error for failure in failed.failures]
    link.send_command(0, STOP)
    with link.collective():  # the head's forward of it, as the safe pattern runs one: empty here, it has no
        link.empty_forward()  # collective (the head owes it all the same: else the sync point refuses the skip)
    try:
        link.sync()
        stopped = "nothing stopped the run"
    except RunStopped as error:
        stopped = str(error)
    save(out, 0, read=read, stopped=stopped, transport=type(link.transport).__name__)
    link.close()
