"""The HTTP server's ends, as a user's signals give them, on the shipped model: a drain that runs out of
``--drain-timeout``, a second SIGTERM that ends every rank at once, and rank 0 serving under ``torchrun``."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")
pytest.importorskip("fastapi", reason="the serve extra is not installed")

import openai

from metrale_model_engine.torch import free_port

from helpers.openai_server import RemoteServer
from helpers.serial import Alone

pytestmark = pytest.mark.torch
MODEL = "tiny_moe"


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_drain_that_runs_out_ends_the_running_streams_with_an_error_and_exits_0() -> None:
    server = RemoteServer("--slots", "4", "--drain-timeout", "0")
    try:
        with server.client() as client:
            stream = client.completions.create(model=MODEL, prompt="Licensed", max_tokens=240, temperature=0, n=4,
                                               stream=True)  # fmt: skip
            chunks = iter(stream)
            next(chunks)
            server.terminate()
            with pytest.raises(openai.APIError) as ended:
                list(chunks)
        assert ended.value.message == "the server shut down before the request finished"
        assert server.wait(30) == 0, server.output()
    finally:
        server.kill()


@pytest.mark.parametrize(
    ("signals", "code"),
    [((signal.SIGTERM, signal.SIGTERM), 128 + signal.SIGTERM), ((signal.SIGINT,), 130)],
    ids=["a-second-sigterm", "ctrl-c"],
)
def test_a_second_sigterm_or_ctrl_c_ends_every_rank_at_once(signals: tuple[int, ...], code: int, alone: Alone) -> None:
    """The first SIGTERM starts a drain of up to 30 s, the second ends it; Ctrl-C to the launcher interrupts its
    ranks (the stream and the signals alone: the ranks gone within 5 s)."""
    server = RemoteServer("--world-size", "2", "--slots", "2")
    try:
        with alone(), server.client() as client:
            stream = client.completions.create(model=MODEL, prompt="Licensed", max_tokens=240, temperature=0,
                                               stream=True)  # fmt: skip
            next(iter(stream))
            for signum in signals:
                told = time.monotonic()
                server.process.send_signal(signum)
                time.sleep(0.05)
            ended = server.wait(30)
            took = time.monotonic() - told
        assert ended == code, server.output()
        assert all(gone(pid) for pid in server.pids), server.pids
        assert took < 5.0, f"the ranks took {took:.2f} s to end after the last signal"
    finally:
        server.kill()


def test_under_torchrun_rank_0_serves_and_the_others_run_its_commands() -> None:
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(free_port()), "-m", "metrale_model_engine.serve")  # fmt: skip
    server = RemoteServer("--slots", "2", program=torchrun)
    try:
        assert "2 ranks over" in server.lines[0] and len(server.pids) == 2
        assert server.process.pid not in server.pids  # torchrun's agent serves nothing: its rank 0 does
        with server.client() as client:
            streamed = client.completions.create(model=MODEL, prompt="Licensed under the", max_tokens=24,
                                                 temperature=0, stream=True)  # fmt: skip
            text = "".join(choice.text for chunk in streamed for choice in chunk.choices)
        assert text == " Apache License, Version"  # the shipped model's 24 greedy tokens, as at one rank
        server.terminate()  # torchrun passes it to every rank: the head drains, the workers ignore it
        server.wait(60)
        assert all(gone(pid) for pid in server.pids), server.output()
        assert "[worker 1] served" in server.output()  # the head shut its worker down
    finally:
        server.kill()
