"""Rank programs for the multi-process tests: each runs in a spawned process.

Every program writes what it saw to ``<out>/rank<N>.pkl`` (a dict) so that the
test in the parent process can assert on every rank.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import threading
import time
from array import array
from collections.abc import MutableSequence
from pathlib import Path

import torch
import torch.distributed as dist

from metrale_model_engine import EpCommandFailed, EpLink, EpWorkerFailed, LinkedEp, ProtocolVersion, run_worker
from metrale_model_engine.torch import TorchTransport, open_link, tensor_tokens
from metrale_model_engine.toy import ToyCommand, ToyModel, ToyState, slots_digest

from helpers.faulty_toy import CMD_CHECK, CMD_DIE, CMD_PLACEHOLDER, FaultyToy
from helpers.rank_results import save, wait_for_result, wait_until_dead
from helpers.shm_programs import serve_until_error, stall_inside_a_command

SLOTS = 4
FROZEN_AT_IMPORT = gc.get_freeze_count()
"""How many objects were frozen out of the garbage collector as this module was imported: in a rank forked from
the start server (the tests' ranks), the server's, since a rank imports its target's module first."""


def summary_fields(slots: list[ToyState | None]) -> dict[str, object]:
    return {"slots": slots, "digest": slots_digest(slots)}


def full_session(rank: int, world_size: int, protocol_name: str, out: str) -> None:
    """Alloc, prefill, interleaved decodes over several slots, free, shutdown."""
    full_session_on(rank, world_size, protocol_name, None, out)


def full_session_on(rank: int, world_size: int, protocol_name: str, device: str | None, out: str) -> None:
    """:func:`full_session` with the collective tensors on ``device`` (default: the backend's)."""
    import torch

    transport = TorchTransport(device=None if device is None else torch.device(device))
    model = ToyModel(EpLink(transport, num_slots=SLOTS, protocol=ProtocolVersion(protocol_name), command_timeout=20))
    slots: list[ToyState | None] = [None] * SLOTS
    if rank == 0:
        for seq_id in (0, 1, 3):
            model.alloc(slots, seq_id)
            model.prefill(slots, seq_id, [seq_id + 1] * (seq_id + 2))
        for _ in range(4):
            for seq_id in (3, 0, 1):
                model.decode(slots, seq_id)
        model.free(slots, 1)
        model.ep_link.shutdown_workers()
        save(out, rank, **summary_fields(slots))
    else:
        summary = run_worker(model, slots)
        save(out, rank, summary=summary, **summary_fields(slots))


def faults_session(rank: int, world_size: int, out: str) -> None:
    """A worker-only failure, an unknown command, an out-of-range seq_id and a bad
    token on the head, each followed by commands that must still be served."""
    model = FaultyToy(EpLink(TorchTransport(), num_slots=SLOTS, protocol=ProtocolVersion.V2, command_timeout=20))
    slots: list[ToyState | None] = [None] * SLOTS
    if rank != 0:
        summary = run_worker(model, slots)
        save(out, rank, summary=summary, **summary_fields(slots))
        return
    seen: dict[str, object] = {}
    model.alloc(slots, 0)
    model.ep_broadcast_cmd_for_seq(0, CMD_CHECK)  # fails on worker 1 only
    model.ep_broadcast_cmd(1)
    model.prefill(slots, 0, [9, 8, 7])
    model.ep_broadcast_cmd_for_seq(2, 999)  # unknown on every worker
    model.decode(slots, 0)
    try:
        model.ep_broadcast_cmd_for_seq(SLOTS, ToyCommand.FREE)
    except ValueError as error:
        seen["head_seq_id_error"] = str(error)
    try:
        model.prefill(slots, 0, [1, 2, -5])
    except ValueError as error:
        seen["head_token_error"] = str(error)
    model.decode(slots, 0)
    seen["reported"] = shut_down_hearing_failures(model)
    save(out, rank, seen=seen, **summary_fields(slots))


def shut_down_hearing_failures(model: ToyModel) -> dict[int, list[tuple[int, str]]]:
    """Shut the workers down; return what they reported failing, by rank: (command, error)."""
    try:
        model.ep_link.shutdown_workers()
    except EpWorkerFailed as error:
        heard: dict[int, list[tuple[int, str]]] = {}
        for failure in error.failures:
            heard.setdefault(failure.rank, []).append((failure.command, failure.error))
        return heard
    return {}


def setup_mismatch(rank: int, world_size: int, what: str, out: str) -> None:
    protocol = ProtocolVersion.V2 if what == "protocol" and rank == 1 else ProtocolVersion.V1
    num_slots = SLOTS + 1 if what == "slots" and rank == world_size - 1 else SLOTS
    try:
        ToyModel(EpLink(TorchTransport(), num_slots=num_slots, protocol=protocol))
    except Exception as error:
        save(out, rank, error_type=type(error).__name__, error=str(error))
        return
    save(out, rank, error_type=None, error=None)


def head_dies(rank: int, world_size: int, out: str) -> None:
    """The head kills itself mid-session: between commands for worker 1, in the
    middle of a command (after the header) for the others' view of it."""
    model = ToyModel(EpLink(TorchTransport(), num_slots=SLOTS, protocol=ProtocolVersion.V2, command_timeout=60))
    slots: list[ToyState | None] = [None] * SLOTS
    if rank == 0:
        model.alloc(slots, 0)
        model.prefill(slots, 0, [1, 2, 3])
        model.ep_broadcast_cmd_for_seq(0, ToyCommand.DECODE)  # the token never follows
        with open(Path(out) / "head_died_at", "w") as file:
            file.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        run_worker(model, slots)
    except Exception as error:
        save(out, rank, error_type=type(error).__name__, error=str(error), at=time.time(), slots=slots)
        return  # a normal exit, group teardown included, even with the head gone
    save(out, rank, error_type=None, error=None, at=time.time(), slots=slots)


def worker_dies(rank: int, world_size: int, out: str) -> None:
    import torch.distributed as dist

    pids: list[object] = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    model = FaultyToy(EpLink(TorchTransport(), num_slots=SLOTS, protocol=ProtocolVersion.V2, command_timeout=20))
    slots: list[ToyState | None] = [None] * SLOTS
    if rank != 0:
        run_worker(model, slots)
        return
    model.alloc(slots, 0)
    model.ep_broadcast_cmd_for_seq(0, CMD_DIE)
    model.ep_broadcast_cmd(1)
    wait_until_dead(int(str(pids[1])), timeout=30.0)
    started = time.time()
    try:
        for _ in range(3):  # the first send after the death may still be buffered by the OS
            model.decode(slots, 0)
    except Exception as error:
        save(out, rank, error_type=type(error).__name__, error=str(error), seconds=time.time() - started)
        os._exit(3)
    save(out, rank, error_type=None, error=None, seconds=time.time() - started)
    os._exit(0)


def idle_worker(rank: int, world_size: int, idle_seconds: float, out: str) -> None:
    """The head is silent longer than the command timeout between two commands."""
    model = ToyModel(EpLink(TorchTransport(), num_slots=SLOTS, protocol=ProtocolVersion.V1, command_timeout=1.0))
    slots: list[ToyState | None] = [None] * SLOTS
    if rank == 0:
        model.alloc(slots, 2)
        time.sleep(idle_seconds)
        model.prefill(slots, 2, [4, 4])
        model.ep_link.shutdown_workers()
        save(out, rank, **summary_fields(slots))
    else:
        summary = run_worker(model, slots)
        save(out, rank, summary=summary, **summary_fields(slots))


class TensorTokens(LinkedEp[ToyState]):
    """A model that receives one token array per command into slot ``seq_id``."""

    __slots__ = ("ep_link",)

    def __init__(self) -> None:
        self.ep_link = open_link(num_slots=2, protocol=ProtocolVersion.V2)

    def ep_run_command(self, seq_id: int, cmd: int, slots: MutableSequence[ToyState | None]) -> None:
        import numpy

        count = self.ep_link.recv_word()
        if cmd == 2:  # buffer to buffer
            received = numpy.zeros(count, dtype=numpy.uint32)
            self.ep_link.recv_tokens_into(received)
            tokens = [int(t) for t in received]
        else:
            tokens = self.ep_broadcast_tokens(range(count))
        state = slots[seq_id] or ToyState(seq_id)
        state.consume(tokens)
        slots[seq_id] = state


def tensor_tokens_session(rank: int, world_size: int, out: str) -> None:
    import numpy
    import torch

    model = TensorTokens()
    slots: list[ToyState | None] = [None, None]
    if rank != 0:
        summary = run_worker(model, slots)
        save(out, rank, summary=summary, slots=slots)
        return
    inputs: list[object] = [
        tensor_tokens(torch.tensor([1, 2, 4_294_967_295], dtype=torch.int64)),
        numpy.array([5, 6], dtype=numpy.uint32),
        numpy.array([7], dtype=numpy.int64),
    ]
    errors: list[str] = []
    for bad in (torch.tensor([1, -1]), torch.tensor([1.5]), torch.zeros(2, 2, dtype=torch.int64)):
        try:
            tensor_tokens(bad)
        except (TypeError, ValueError) as error:
            errors.append(str(error))
    state = ToyState(1)
    for tokens in inputs:
        count = len(tokens)  # type: ignore[arg-type]
        model.ep_broadcast_cmd_for_seq(1, 1)
        model.ep_broadcast_cmd(count)
        state.consume(model.ep_broadcast_tokens(tokens))  # type: ignore[arg-type]
    into = array("I", [11, 4_294_967_294])
    model.ep_link.send_command(1, 2, len(into), into)
    state.consume(into)
    model.ep_link.shutdown_workers()
    save(out, rank, slots=[None, state], errors=errors)


def follow_up_timeout(rank: int, world_size: int, stall: float, out: str) -> None:
    """The head stalls inside a command longer than the workers' command timeout."""
    model = FaultyToy(EpLink(TorchTransport(), num_slots=SLOTS, protocol=ProtocolVersion.V2, command_timeout=1.0))
    slots: list[ToyState | None] = [None] * SLOTS
    if rank != 0:
        serve_until_error(model, slots, out)
    else:
        stall_inside_a_command(model, slots, CMD_CHECK, stall, out)


LONG_PROMPT = list(range(1000, 1040))
"""Longer than a frame holds: travels as frame + bulk."""


def wire_faults(rank: int, world_size: int, out: str) -> None:
    """Commands that fail on the workers with follow-ups still on the wire."""
    import numpy

    model = FaultyToy(EpLink(TorchTransport(), num_slots=SLOTS, protocol=ProtocolVersion.V2, command_timeout=20))
    if rank != 0:
        slots: list[ToyState | None] = [None] * 2  # shorter than the head's: seq_id 3 is out of range here
        failures: list[str] = []
        run = 0
        while True:
            try:
                if not model.ep_worker_step(slots):
                    break
                run += 1
            except EpCommandFailed as error:
                failures.append(str(error))
        save(out, rank, run=run, failures=failures, slots=slots)
        return
    slots = [None] * SLOTS
    model.alloc(slots, 3)
    model.prefill(slots, 3, LONG_PROMPT)
    model.decode(slots, 3)
    model.alloc(slots, 1)
    model.prefill(slots, 1, numpy.array([5, 6, 70_000], dtype=">u4"))  # foreign byte order, converted once
    for sent in ([7, 8, 9], LONG_PROMPT):
        for placeholder in (len(sent) - 1, len(sent) + 1):
            model.ep_broadcast_cmd_for_seq(1, CMD_PLACEHOLDER)
            model.ep_broadcast_cmd(placeholder)
            model.ep_broadcast_tokens(sent)
    model.decode(slots, 1)
    save(out, rank, slots=slots, reported=shut_down_hearing_failures(model))


def soak_session(rank: int, world_size: int, kind: str, commands: int, seed: int, out: str) -> None:
    """The shared-memory soak's random command stream, over the transport ``kind`` picks."""
    from metrale_model_engine.torch import open_transport

    from helpers.shm_programs import SLOTS as SOAK_SLOTS
    from helpers.shm_programs import drive_random

    transport = open_transport(kind)
    model = ToyModel(EpLink(transport, num_slots=SOAK_SLOTS, protocol=ProtocolVersion.V2, command_timeout=60))
    slots: list[ToyState | None] = [None] * SOAK_SLOTS
    if rank == 0:
        drive_random(model, slots, commands, seed)
    else:
        run_worker(model, slots)
    save(out, rank, digest=slots_digest(slots), transport=type(transport).__name__)


def transport_mismatch(rank: int, world_size: int, out: str) -> None:
    """Rank 1 asks for shared memory, the others for the default."""
    from metrale_model_engine.torch import open_transport

    try:
        open_transport("shm" if rank == 1 else "auto")
    except Exception as error:
        save(out, rank, error_type=type(error).__name__, error=str(error))
        return
    save(out, rank, error_type=None)


def module_models(rank: int, world_size: int, kind: str, out: str) -> None:
    """An nn.Module model and one whose other base uses the engine's old names, over a real transport."""
    import torch

    from metrale_model_engine import SequenceState

    class TinyModule(torch.nn.Module, LinkedEp[SequenceState]):
        def __init__(self, link: EpLink) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.register_buffer("scale", torch.ones(4))
            self.ep_link = link

        def ep_run_command(self, seq_id: int, cmd: int, slots: MutableSequence[SequenceState | None]) -> None:
            slots[seq_id] = SequenceState(seq_id, self.ep_link.recv_tokens())

    class UsersBase:
        def __init__(self) -> None:
            self.rank, self.world_size, self.num_slots = "the user's rank", 99, -1
            self.transport, self.protocol, self._apply = "pigeons", "http", "the user's _apply"

    class Colliding(UsersBase, LinkedEp[SequenceState]):
        def __init__(self, link: EpLink) -> None:
            super().__init__()
            self.ep_link = link

        def ep_run_command(self, seq_id: int, cmd: int, slots: MutableSequence[SequenceState | None]) -> None:
            slots[seq_id] = SequenceState(seq_id, [self.ep_link.recv_word()])

    module = TinyModule(open_link(kind, num_slots=2, protocol=ProtocolVersion.V2))
    module.to(torch.float64).eval()
    state = module.state_dict()
    module.load_state_dict(state)
    facts = {
        "dtype": str(module.proj.weight.dtype),
        "training": module.training,
        "state": sorted(state),
        "modules": [name for name, _ in module.named_modules()],
        "parameters": [name for name, _ in module.named_parameters()],
    }
    colliding = Colliding(open_link(kind, num_slots=2, protocol=ProtocolVersion.V2))
    users: list[object] = [colliding.rank, colliding.world_size, colliding.transport, colliding.protocol]
    facts["users"] = [*users, colliding.num_slots, colliding._apply]
    slots: list[SequenceState | None] = [None, None]
    # One link after the other: two links over one process group share its stream of collectives.
    with module:
        if rank == 0:
            module.ep_link.send_command(1, 7, [10, 11, 12])
            slots[1] = SequenceState(1, [10, 11, 12])
            module.ep_link.shutdown_workers()
        else:
            run_worker(module, slots)
    with colliding:
        if rank == 0:
            colliding.ep_link.send_command(0, 7, 42)
            slots[0] = SequenceState(0, [42])
            colliding.ep_link.shutdown_workers()
        else:
            run_worker(colliding, slots)
    facts["transports"] = [type(module.ep_link.transport).__name__, type(colliding.ep_link.transport).__name__]
    save(out, rank, slots=slots, facts=facts, closed=[module.ep_link.closed, colliding.ep_link.closed])


def head_leaves_its_with_block(rank: int, world_size: int, kind: str, out: str) -> None:
    """The head sends one command and leaves its ``with`` block without shutting the workers down."""
    with ToyModel(open_link(kind, num_slots=SLOTS, protocol=ProtocolVersion.V2)) as model:
        slots: list[ToyState | None] = [None] * SLOTS
        if rank == 0:
            model.alloc(slots, 0)
            save(out, rank, left_at=time.time())
            return
        try:
            run_worker(model, slots)
        except Exception as error:
            save(out, rank, error_type=type(error).__name__, error=str(error), at=time.time(), slots=slots)
            return
        save(out, rank, error_type=None, at=time.time(), slots=slots)


def disagree_on_slots(rank: int, world_size: int) -> None:
    """Each rank asks for a different slot count: the link's setup raises ``EpSetupError`` on every rank."""
    EpLink(TorchTransport(), num_slots=SLOTS + rank)


def leaves_its_group_itself(rank: int, world_size: int) -> None:
    """A target that follows the README's advice: it destroys the group when it is done."""
    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()


def last_words(rank: int, world_size: int, out: str) -> None:
    """A worker leaves answers in the group's store three times; the head looks after each (``TorchTransport``)."""
    transport = TorchTransport(heartbeat=None)
    transport.gather([0])  # the setup: last words of an earlier transport are cleared here
    looks: list[list[tuple[int, bytes]]] = []
    for words in ([b"one."], [b"two.", b"three"], []):
        if rank == 1:
            transport.leave_answers(1, words)
        transport.gather([1])  # left before the head looks
        if rank == 0:  # the head looks at most every 10 ms: it looks until every word left is read, then once more
            found: list[tuple[int, bytes]] = []
            deadline = time.monotonic() + 5.0
            while len(found) < len(words) and time.monotonic() < deadline:
                time.sleep(0.02)
                found += transport.poll_answers()
            time.sleep(0.02)
            looks.append(found + transport.poll_answers())  # a word read twice would show here
        transport.gather([2])  # looked before the worker leaves more
    save(out, rank, looks=looks)
    transport.close()


def last_words_right_after_setup(rank: int, world_size: int, out: str) -> None:
    """A worker leaves answers at once after the setup, while the head is slow to clear an earlier link's: the
    head must read them (it clears before any rank may leave new ones)."""
    transport = TorchTransport(heartbeat=None)
    if rank == 0:
        clear = transport._forget_last_words

        def slowly() -> None:
            time.sleep(0.3)  # the worker is past the setup's collective by now
            clear()

        transport._forget_last_words = slowly  # type: ignore[method-assign]
    transport.gather([0])
    if rank == 1:
        transport.leave_answers(1, [b"early"])
    transport.gather([1])  # left before the head looks
    if rank == 0:
        found: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + 5.0
        while not found and time.monotonic() < deadline:
            time.sleep(0.02)
            found += transport.poll_answers()
        save(out, rank, found=found)
    transport.close()


def severed_wait(rank: int, world_size: int, out: str) -> None:
    """Rank 0 waits in an all-reduce that rank 1 never joins; a thread severs gloo's connections after 0.5 s.

    Rank 0 holds a TCP connection of its own too (to a listener of its own), which
    must stay: it saves how long its wait took, what ended it, and whether its own
    connection still carries a byte.
    """
    from metrale_model_engine._torch.heartbeat import tcp_store
    from metrale_model_engine._torch.severing import sever_group_connections

    if rank == 1:  # in no all-reduce, and alive (its exit would close its end): only the severing ends the wait
        wait_for_result(out, 0, timeout=8.0)
        return
    store = tcp_store(dist.group.WORLD.get_group_store() if dist.group.WORLD is not None else None)
    assert store is not None
    with socket.create_server(("127.0.0.1", 0)) as listener:
        own = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        severed: list[int] = []
        severing = threading.Timer(0.5, lambda: severed.append(sever_group_connections(store)))
        severing.start()
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1))
            ended = "it completed"
        except RuntimeError as error:
            ended = str(error)
        seconds = time.monotonic() - started
        # The first shutdown ends the wait while the severing still looks at the process's other
        # descriptors: its count is in once its thread has ended (unjoined, a loaded machine read []).
        severing.join()
        own.sendall(b"x")
        save(out, 0, seconds=seconds, ended=ended, severed=severed, own=accepted.recv(1))
        own.close()
        accepted.close()
    os._exit(0)  # rank 1 still sleeps; the group cannot be torn down


SYNC_TIMEOUT = 1.0
"""The link's command timeout in :func:`stopped_at_a_sync_point`: what the head's sync point waits."""


def stopped_at_a_sync_point(rank: int, world_size: int, kind: str, out: str) -> None:
    """The head stops worker rank 1 (SIGSTOP), then shuts the workers down: it saves what raised, and when."""
    model = ToyModel(open_link(kind, num_slots=2, protocol=ProtocolVersion.V2, command_timeout=SYNC_TIMEOUT))
    pids = model.ep_link.gather_u32(os.getpid())
    slots: list[ToyState | None] = [None, None]
    if rank != 0:
        serve_until_error(model, slots, out)
        return
    model.alloc(slots, 0)
    os.kill(pids[1], signal.SIGSTOP)
    started = time.monotonic()
    try:
        model.ep_link.shutdown_workers()
        outcome = "shut down"
    except Exception as error:
        outcome = f"{type(error).__name__}: {error}"
    save(out, 0, outcome=outcome, seconds=time.monotonic() - started)
    os.kill(pids[1], signal.SIGKILL)
    os._exit(0)  # a rank is gone: the group cannot be torn down


def frozen_at_import(rank: int, world_size: int, out: str) -> None:
    save(out, rank, frozen=FROZEN_AT_IMPORT)
