import logging
from collections.abc import Iterator, MutableSequence

import pytest

from metrale_model_engine import (
    EpCommandFailed,
    EpCommandRefused,
    EpReceiveError,
    ModelEp,
    RunStopped,
    SequenceState,
    WorkerSummary,
    run_worker,
)

from helpers.fakes import no_slots

Step = bool | BaseException


class ScriptedWorker(ModelEp):
    """A worker whose steps return or raise what the script says, in order."""

    def __init__(self, *steps: Step) -> None:
        self._steps: Iterator[Step] = iter(steps)
        self.calls = 0

    def is_ep(self) -> bool:
        return True

    def ep_worker_step(self, slots: MutableSequence[SequenceState | None]) -> bool:
        self.calls += 1
        step = next(self._steps)
        if isinstance(step, BaseException):
            raise step
        return step


def test_runs_until_shutdown_and_counts() -> None:
    model = ScriptedWorker(True, True, True, False)
    assert run_worker(model, no_slots(1)) == WorkerSummary(commands_run=3, commands_failed=0)
    assert model.calls == 4


def test_command_failure_is_logged_and_the_loop_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    failure = EpCommandFailed(KeyError("slot 1 is free"))
    model = ScriptedWorker(True, failure, True, False)
    with caplog.at_level(logging.ERROR, logger="metrale_model_engine.worker"):
        summary = run_worker(model, no_slots(1))
    assert summary == WorkerSummary(commands_run=2, commands_failed=1)
    (record,) = caplog.records
    assert record.levelno == logging.ERROR
    assert "KeyError: 'slot 1 is free'" in record.getMessage()
    assert record.exc_info is not None and record.exc_info[1] is failure


@pytest.mark.parametrize(
    ("error", "label"),
    [
        (EpReceiveError("head gone"), "worker receive failed, leaving the loop after 1 commands"),
        (RunStopped("the run stopped"), "the run stopped, leaving the loop after 1 commands"),
        (EpCommandRefused("rank 1 refuses it"), "the run stopped, leaving the loop after 1 commands"),
        (RuntimeError("link reset"), "worker step failed, leaving the loop after 1 commands"),
        (ValueError("x"), "worker step failed, leaving the loop after 1 commands"),
    ],
)
def test_other_errors_are_logged_by_what_they_mean_and_re_raised(
    error: Exception, label: str, caplog: pytest.LogCaptureFixture
) -> None:
    model = ScriptedWorker(True, error, True)
    with caplog.at_level(logging.ERROR, logger="metrale_model_engine.worker"), pytest.raises(type(error)) as info:
        run_worker(model, no_slots(1))
    assert info.value is error
    assert model.calls == 2
    (record,) = caplog.records
    assert record.getMessage() == label and record.exc_info is not None


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt(), SystemExit(3)])
def test_interrupts_propagate_untouched(interrupt: BaseException, caplog: pytest.LogCaptureFixture) -> None:
    model = ScriptedWorker(True, interrupt)
    with pytest.raises(type(interrupt)) as info:
        run_worker(model, no_slots(1))
    assert info.value is interrupt
    assert caplog.records == []


def test_uses_the_given_logger(caplog: pytest.LogCaptureFixture) -> None:
    mine = logging.getLogger("tests.my_worker")
    model = ScriptedWorker(EpCommandFailed(ValueError("bad")), False)
    with caplog.at_level(logging.ERROR, logger="tests.my_worker"):
        run_worker(model, no_slots(1), logger=mine)
    assert [r.name for r in caplog.records] == ["tests.my_worker"]


def test_refuses_a_single_gpu_model() -> None:
    class SingleGpu(ModelEp):
        pass

    with pytest.raises(ValueError, match=r"SingleGpu.is_ep\(\) is False"):
        run_worker(SingleGpu(), no_slots(1))
