"""mypy --strict on small files of deliberate misuse: each expected error is reported.

Each case marks the lines where mypy must report an error with ``# E: <code>``;
the test asserts exactly those (line, code) pairs and nothing else.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

CASES = {
    "exact_types": """
from collections.abc import MutableSequence
from typing_extensions import assert_type
from metrale_model_engine import ModelEp, SequenceState, WorkerSummary, run_worker
from metrale_model_engine.testing import RecordingEp

class KvState(SequenceState):
    pass

class Plain(ModelEp):
    def ep_worker_step(self, slots: MutableSequence[SequenceState | None]) -> bool:
        return True

class Kv(ModelEp[KvState]):
    def is_ep(self) -> bool:
        return True
    def ep_worker_step(self, slots: MutableSequence[KvState | None]) -> bool:
        assert_type(slots[0], KvState | None)
        return False

kv_slots: list[KvState | None] = [None]
assert_type(run_worker(Kv(), kv_slots), WorkerSummary)
assert_type(Plain().ep_broadcast_tokens([1]), list[int])
assert_type(RecordingEp().events[0].args, tuple[int, ...])
""",
    "wrong_is_ep_return": """
from metrale_model_engine import ModelEp

class Broken(ModelEp):
    def is_ep(self) -> str:  # E: override
        return "yes"
""",
    "wrong_slot_element_type": """
from metrale_model_engine import ModelEp, SequenceState

class KvState(SequenceState):
    pass

class Kv(ModelEp[KvState]):
    pass

plain_slots: list[SequenceState | None] = [None]
Kv().ep_worker_step(plain_slots)  # E: arg-type
Kv().ep_worker_step([1, 2])  # E: list-item
""",
    "float_command_word": """
from metrale_model_engine import ModelEp

class M(ModelEp):
    pass

M().ep_broadcast_cmd(1.5)  # E: arg-type
M().ep_broadcast_cmd_for_seq(0, "7")  # E: arg-type
""",
    "slot_type_outside_bound": """
from metrale_model_engine import ModelEp

class M(ModelEp[int]):  # E: type-var
    pass
""",
}

if importlib.util.find_spec("numpy") is not None:
    # numpy's stubs declare the buffer protocol only from Python 3.12 on: the cases
    # are checked as Python 3.10 (see the fixture), where only ArrayInterface helps.
    CASES["numpy_token_arrays"] = """
import numpy
from metrale_model_engine import EpLink, as_u32_buffer
from metrale_model_engine.testing import RecordingTransport, ReplayTransport
from metrale_model_engine.toy import ToyModel, ToyState

tokens = numpy.array([1, 2], dtype=numpy.uint32)
head = EpLink(RecordingTransport(2), num_slots=2)
head.send_tokens(tokens)
head.send_command(0, 1, tokens, 3)
as_u32_buffer("tokens", tokens)
ToyModel(EpLink(RecordingTransport(2), num_slots=2)).prefill([ToyState(0), None], 0, tokens)
worker = EpLink(ReplayTransport(()), num_slots=2)
worker.recv_tokens_into(numpy.zeros(2, dtype=numpy.uint32))
head.send_tokens(1.5)  # E: arg-type
head.send_command(0, 1, 2.5)  # E: arg-type
"""

CASES["linked_models"] = """
from collections.abc import MutableSequence
from typing_extensions import assert_type
from metrale_model_engine import EpLink, LinkedEp, ModelEp, SequenceState
from metrale_model_engine.testing import RecordingTransport

class KvState(SequenceState):
    pass

class Model(LinkedEp[KvState]):
    __slots__ = ("ep_link",)
    def __init__(self, link: EpLink) -> None:
        self.ep_link = link
    def ep_run_command(self, seq_id: int, cmd: int, slots: MutableSequence[KvState | None]) -> None:
        assert_type(self.ep_link.recv_tokens(), list[int])

model = Model(EpLink(RecordingTransport(2), num_slots=2))
trait: ModelEp[KvState] = model
with model as entered:
    assert_type(entered, Model)
model.ep_link = "not a link"  # E: assignment
plain_slots: list[SequenceState | None] = [None]
model.ep_worker_step(plain_slots)  # E: arg-type
"""

if importlib.util.find_spec("torch") is not None:
    CASES["run_group_arguments"] = """
from metrale_model_engine.torch import open_transport, run_group

def rank_main(rank: int, world_size: int, name: str, count: int) -> None:
    pass

run_group(rank_main, 2, "a", 3)
run_group(rank_main, 2, "a", "3")  # E: arg-type
run_group(rank_main, 2, "a")  # E: arg-type
kind_from_configuration: str = "auto"
open_transport(kind_from_configuration)
open_transport(3)  # E: arg-type
"""

_ERROR = re.compile(r"^(?P<file>[^:]+\.py):(?P<line>\d+): error: .*\[(?P<code>[a-z-]+)\]$")


def expected_errors(source: str) -> set[tuple[int, str]]:
    marks = (re.search(r"# E: ([a-z-]+)", line) for line in source.splitlines())
    return {(number, mark.group(1)) for number, mark in enumerate(marks, start=1) if mark}


@pytest.fixture(scope="module")
def mypy_errors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[tuple[int, str]]]:
    folder = tmp_path_factory.mktemp("typing_cases")
    for name, source in CASES.items():
        (folder / f"{name}.py").write_text(source.lstrip("\n"))
    # Incremental, with a cache of its own beside mypy's usual one (ignored by git): the
    # standard library's stubs are checked once, not on every run (10 s -> about 2 s).
    cache = SRC.parent / ".mypy_cache" / "typing_cases"
    command = [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(cache), "--config-file", os.devnull]
    command += ["--python-version", "3.10"]  # the oldest Python the package supports
    command += ["--show-traceback", *sorted(str(p) for p in folder.glob("*.py"))]
    env = {**os.environ, "MYPYPATH": str(SRC)}
    for _ in range(2):  # a second run only after mypy's own crash (seen once in CI, its cache cold)
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, check=False)
        if "INTERNAL ERROR" not in result.stdout + result.stderr:
            break
    found: dict[str, set[tuple[int, str]]] = {name: set() for name in CASES}
    for line in result.stdout.splitlines():
        match = _ERROR.match(line)
        if match:
            found[Path(match["file"]).stem].add((int(match["line"]), match["code"]))
    assert result.returncode in (0, 1), result.stdout + result.stderr
    return found


@pytest.mark.parametrize("case", sorted(CASES))
def test_mypy_reports_exactly_the_marked_errors(case: str, mypy_errors: dict[str, set[tuple[int, str]]]) -> None:
    assert mypy_errors[case] == expected_errors(CASES[case].lstrip("\n"))


def test_every_misuse_case_expects_an_error() -> None:
    assert all(expected_errors(source) for name, source in CASES.items() if name != "exact_types")
