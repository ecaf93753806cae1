from array import array

import pytest

from metrale_model_engine import U32_MAX, U32_TYPECODE, as_u32_buffer


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


def test_bools_count_as_ints_like_array_does() -> None:
    assert memoryview(as_u32_buffer("tokens", [True, False])).tolist() == [1, 0]
