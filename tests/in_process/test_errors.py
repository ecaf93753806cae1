import pickle

import pytest

from metrale_model_engine import EpCommandFailed, EpLinkError, EpReceiveError, EpSendError, WorkerFailure
from metrale_model_engine._core.checks import disagreement, ranks_disagree
from metrale_model_engine.wire import Report


def test_carries_cause_as_attribute_and_dunder_cause() -> None:
    cause = KeyError("slot 3 is free")
    error = EpCommandFailed(cause)
    assert error.cause is cause and error.__cause__ is cause
    assert str(error) == "KeyError: 'slot 3 is free'"


def test_str_of_a_cause_without_message_is_its_type() -> None:
    assert str(EpCommandFailed(RuntimeError())) == "RuntimeError"


def test_survives_pickling_with_message_and_cause() -> None:
    error = EpCommandFailed(ValueError("unknown command word 99"))
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is EpCommandFailed
    assert str(copy) == "ValueError: unknown command word 99"
    assert isinstance(copy.cause, ValueError) and copy.__cause__ is copy.cause


def test_untagged_errors_are_never_taken_for_it() -> None:
    for error in (ValueError("x"), RuntimeError("x"), EpReceiveError("x"), EpSendError("x")):
        assert not isinstance(error, EpCommandFailed)
    assert not issubclass(EpLinkError, EpCommandFailed)
    assert issubclass(EpReceiveError, EpLinkError) and issubclass(EpSendError, EpLinkError)


def test_refuses_a_non_exception_cause() -> None:
    with pytest.raises(TypeError, match=r"EpCommandFailed\(cause\) needs an exception, got str 'oops'"):
        EpCommandFailed("oops")  # type: ignore[arg-type]


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("a __str__ that raises")


def test_an_error_whose_str_raises_is_shown_as_such_never_raised_again() -> None:
    assert str(EpCommandFailed(Unprintable())) == "Unprintable: <its str() raised RuntimeError>"


def test_a_worker_failure_is_made_from_the_report_it_came_in() -> None:
    report = Report(2**33 + 1, 3, 0xFFFFFFF0, "ValueError: bad", stopped=True, witness=True)
    assert WorkerFailure.from_report(2, report) == WorkerFailure(
        2, 2**33 + 1, 3, 0xFFFFFFF0, "ValueError: bad", stopped=True, witness=True
    )
    assert str(WorkerFailure.from_report(1, Report(1, 0, 7, "KeyError"))) == (
        "worker rank 1 failed command 1 (seq_id=0, cmd=7): KeyError"
    )


def test_one_wording_says_where_the_ranks_disagree_naming_every_value_that_differs() -> None:
    assert ranks_disagree({"chunk": [16, 16], "tokens": [4, 4]}) is None
    assert ranks_disagree({"chunk": [16, 32, 16], "tokens": [4, 4, 4], "the names": [1, 1, 2]}) == (
        "the ranks disagree on chunk (rank 0: 16, rank 1: 32, rank 2: 16); the names (rank 0: 1, rank 1: 1, rank 2: 2)"
    )
    assert disagreement(1, "protocol", [1, 2], "v{}".format) == (
        "rank 1: the ranks disagree on the protocol (rank 0: v1, rank 1: v2); every rank must use the same value"
    )
    assert disagreement(0, "slot count", [4, 4]) is None
