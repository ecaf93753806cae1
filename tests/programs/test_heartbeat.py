"""A worker that cannot reach the group's store ends its process, within its bound, and says why.

A program (``helpers.programs``) beats in a ``TCPStore`` this test serves; the test then stops
serving, as a head's host that is gone or cut off does.  (Across real namespaces:
``test_hosts.py``.)
"""

from __future__ import annotations

import datetime
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed (pip install torch==2.13.0 first)")

from torch._C._distributed_c10d import TCPStore

from metrale_model_engine.torch import HEAD_LOST_EXIT_CODE, free_port

from helpers import programs
from helpers.serial import Alone

pytestmark = pytest.mark.torch

LOST_AFTER = 1.0
LOST_SLACK = 3.0
"""Seconds allowed past ``LOST_AFTER``: two beats of the watch after a pause, a loaded 2-core machine."""
WORKER = """
import sys, time
from torch._C._distributed_c10d import TCPStore
from metrale_model_engine._torch.heartbeat import Heartbeat
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, wait_for_workers=False)
assert Heartbeat.start("g", store, 3, 0.05, float(sys.argv[2])) is not None
print("beating", flush=True)
time.sleep(60)
"""


def test_a_worker_that_loses_the_store_ends_its_process_with_the_reason(
    alone: Alone,
) -> None:
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)
    worker = programs.Popen(
        [sys.executable, "-c", WORKER, str(port), str(LOST_AFTER)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout is not None
        assert worker.stdout.readline() == "beating\n"
        key = "metrale_model_engine/heartbeat/g/3"
        first = store.add(key, 0)
        deadline = time.monotonic() + 10
        while store.add(key, 0) == first:  # it beats
            assert time.monotonic() < deadline, "no beat arrived"
            time.sleep(0.01)
        assert worker.poll() is None
        with alone():  # a loss found within its bound and 3 s (the worker beats for a minute)
            del store  # the store stops serving: the head's host is gone
            gone = time.monotonic()
            _, stderr = worker.communicate(timeout=30)
            took = time.monotonic() - gone
    finally:
        worker.kill()
        worker.communicate()
    assert worker.returncode == HEAD_LOST_EXIT_CODE, stderr
    assert LOST_AFTER - 0.1 <= took < LOST_AFTER + LOST_SLACK, took  # from its last beat, a beat before
    assert f"worker rank 3: the head is lost: no answer from the group's store at 127.0.0.1:{port} for 1." in stderr
    assert f"ending this process with status {HEAD_LOST_EXIT_CODE}" in stderr
