"""mypy --strict on small files of deliberate misuse: each expected error is reported.

Each case marks the lines where mypy must report an error with ``# E: <code>``;
the test asserts exactly those (line, code) pairs and nothing else.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

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

_ERROR = re.compile(r"^(?P<file>[^:]+\.py):(?P<line>\d+): error: .*\[(?P<code>[a-z-]+)\]$")


def expected_errors(source: str) -> set[tuple[int, str]]:
    marks = (re.search(r"# E: ([a-z-]+)", line) for line in source.splitlines())
    return {(number, mark.group(1)) for number, mark in enumerate(marks, start=1) if mark}


@pytest.fixture(scope="module")
def mypy_errors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[tuple[int, str]]]:
    folder = tmp_path_factory.mktemp("typing_cases")
    for name, source in CASES.items():
        (folder / f"{name}.py").write_text(source.lstrip("\n"))
    command = [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--config-file", os.devnull]
    result = subprocess.run(
        [*command, *sorted(str(p) for p in folder.glob("*.py"))],
        capture_output=True,
        text=True,
        env={**os.environ, "MYPYPATH": str(SRC)},
        timeout=300,
        check=False,
    )
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
