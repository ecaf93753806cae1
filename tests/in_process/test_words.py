import enum

import pytest

from metrale_model_engine import CMD_SHUTDOWN, U32_MAX, check_u32
from metrale_model_engine.wire import U32_MIN


class Cmd(enum.IntEnum):
    ALLOC = 1


def test_bounds_and_shutdown_word() -> None:
    assert (U32_MIN, U32_MAX, CMD_SHUTDOWN) == (0, 2**32 - 1, 0xFFFFFFFF)


@pytest.mark.parametrize("value", [0, 1, 12345, 2**31, U32_MAX])
def test_accepts_u32_ints(value: int) -> None:
    assert check_u32("cmd", value) == value


def test_accepts_int_enum_as_plain_int() -> None:
    checked = check_u32("cmd", Cmd.ALLOC)
    assert checked == 1 and type(checked) is int


@pytest.mark.parametrize("value", [True, False, 1.0, "1", None, b"\x01"])
def test_rejects_non_ints_with_type_error(value: object) -> None:
    with pytest.raises(TypeError) as info:
        check_u32("seq_id", value)
    message = str(info.value)
    assert "seq_id" in message and repr(value) in message and "0xFFFFFFFF" in message


@pytest.mark.parametrize("value", [-1, 2**32, 2**64, -(2**40)])
def test_rejects_out_of_range_with_value_error(value: int) -> None:
    with pytest.raises(ValueError, match=rf"cmd={value} is outside the u32 range 0 \.\.= 4294967295"):
        check_u32("cmd", value)
