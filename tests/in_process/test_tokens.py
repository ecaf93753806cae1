import sys
from array import array

import pytest

from metrale_model_engine import U32_MAX, EpLink, as_u32_buffer
from metrale_model_engine.testing import ReplayTransport
from metrale_model_engine.wire import U32_TYPECODE


def test_u32_array_is_returned_as_is() -> None:
    tokens = array(U32_TYPECODE, [1, 2, 3])
    assert as_u32_buffer("tokens", tokens) is tokens


def test_u32_memoryview_is_not_copied() -> None:
    backing = array(U32_TYPECODE, [4, 5])
    view = as_u32_buffer("tokens", memoryview(backing))
    backing[0] = 9
    assert memoryview(view).tolist() == [9, 5]


@pytest.mark.parametrize("tokens", [[1, 2, U32_MAX], (0, 7), range(3), array("q", [1, 2])])
def test_sequences_and_other_int_buffers_convert(tokens: object) -> None:
    converted = as_u32_buffer("tokens", tokens)  # type: ignore[arg-type]
    assert memoryview(converted).format in ("I", "L") and memoryview(converted).itemsize == 4
    assert memoryview(converted).tolist() == list(tokens)  # type: ignore[call-overload]


def test_read_only_buffer_is_copied_once() -> None:
    data = bytes(array(U32_TYPECODE, [3, 4]))
    converted = as_u32_buffer("tokens", memoryview(data).cast("I"))
    assert not memoryview(converted).readonly and memoryview(converted).tolist() == [3, 4]


def test_out_of_range_names_the_element() -> None:
    with pytest.raises(ValueError, match=r"tokens\[1\]=-1 is outside the u32 range"):
        as_u32_buffer("tokens", [0, -1])
    with pytest.raises(ValueError, match=r"tokens\[0\]=4294967296 is outside"):
        as_u32_buffer("tokens", array("q", [2**32]))


def test_non_int_element_names_the_element() -> None:
    with pytest.raises(TypeError, match=r"tokens\[2\] must be an int .* got float 2.5"):
        as_u32_buffer("tokens", [0, 1, 2.5])  # type: ignore[list-item]


def test_float_and_multidimensional_buffers_are_refused() -> None:
    with pytest.raises(TypeError, match=r"tokens must hold integers, got a buffer of format 'd'"):
        as_u32_buffer("tokens", array("d", [1.0]))
    square = memoryview(bytes(16)).cast("I", (2, 2))
    with pytest.raises(ValueError, match=r"tokens must be a 1-D token array, got a 2-D buffer"):
        as_u32_buffer("tokens", square)


@pytest.mark.parametrize("tokens", [[True, False], (1, True), [7, True], [2**31, False]])
def test_a_bool_is_not_a_token_anywhere(tokens: list[int]) -> None:
    from metrale_model_engine import SequenceState

    bad = next(i for i, token in enumerate(tokens) if isinstance(token, bool))
    for check in (lambda: as_u32_buffer("tokens", tokens), lambda: SequenceState(0, tokens)):
        with pytest.raises(TypeError, match=rf"tokens\[{bad}\] must be an int .* got bool"):
            check()


FOREIGN = ">" if sys.byteorder == "little" else "<"


def test_foreign_byte_order_is_converted_once() -> None:
    numpy = pytest.importorskip("numpy", reason="numpy makes foreign-order buffers; the standard library does not")
    values = [1, 2, 70_000, U32_MAX]
    assert memoryview(as_u32_buffer("tokens", numpy.array(values, dtype=f"{FOREIGN}u4"))).tolist() == values
    assert memoryview(as_u32_buffer("tokens", numpy.array([3, 258], dtype=f"{FOREIGN}i2"))).tolist() == [3, 258]
    with pytest.raises(ValueError, match=r"tokens\[1\]=-1 is outside the u32 range"):
        as_u32_buffer("tokens", numpy.array([3, -1], dtype=f"{FOREIGN}i2"))


def test_receive_into_a_foreign_byte_order_buffer_is_a_type_error() -> None:
    numpy = pytest.importorskip("numpy")
    worker = EpLink(ReplayTransport(()), num_slots=1)
    with pytest.raises(
        TypeError, match=rf"buffer must hold u32 items in this machine's byte order .* \(byte order '{FOREIGN}'\)"
    ):
        worker.recv_tokens_into(numpy.zeros(2, dtype=f"{FOREIGN}u4"))
