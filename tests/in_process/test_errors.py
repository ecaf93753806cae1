import pickle

import pytest

from metrale_model_engine import EpCommandFailed, EpLinkError, EpReceiveError, EpSendError


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
