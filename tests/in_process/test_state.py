import pickle

import pytest

from metrale_model_engine import SequenceState, check_u32


class KvState(SequenceState):
    __slots__ = ("kv_blocks",)

    def __init__(self, seq_id: int, kv_blocks: int) -> None:
        super().__init__(seq_id)
        self.kv_blocks = kv_blocks


def test_fields_and_growth() -> None:
    state = SequenceState(2, [5, 6])
    state.append(7)
    state.extend((8, 9))
    assert state.seq_id == 2
    assert list(state.tokens) == [5, 6, 7, 8, 9]
    assert repr(state) == "SequenceState(seq_id=2, tokens=[5, 6, 7, 8, 9])"


def test_equality_is_by_class_seq_id_and_tokens() -> None:
    assert SequenceState(1, [3]) == SequenceState(1, [3])
    assert SequenceState(1, [3]) != SequenceState(1, [4])
    assert SequenceState(1, [3]) != SequenceState(2, [3])
    assert SequenceState(1) != KvState(1, kv_blocks=0)


@pytest.mark.parametrize("seq_id", [True, 1.0, None])
def test_seq_id_type_checked(seq_id: object) -> None:
    with pytest.raises(TypeError, match="seq_id must be an int"):
        SequenceState(seq_id)  # type: ignore[arg-type]


def test_seq_id_range_checked() -> None:
    with pytest.raises(ValueError, match=r"seq_id=-1 is outside the u32 range"):
        SequenceState(-1)


def test_bad_token_names_its_index_and_records_nothing() -> None:
    state = SequenceState(0, [1])
    with pytest.raises(ValueError, match=r"tokens\[2\]=4294967296 is outside"):
        state.extend([2, 3, 2**32])
    with pytest.raises(TypeError, match=r"token must be an int.*got float 1.5"):
        state.append(1.5)  # type: ignore[arg-type]
    assert list(state.tokens) == [1]


def test_subclass_adds_device_state_and_stays_slotted() -> None:
    state = KvState(4, kv_blocks=3)
    state.append(11)
    assert (state.seq_id, list(state.tokens), state.kv_blocks) == (4, [11], 3)
    assert not hasattr(state, "__dict__")


def test_pickles() -> None:
    state = SequenceState(3, [1, 2])
    assert pickle.loads(pickle.dumps(state)) == state


def test_extend_checks_in_c_and_keeps_the_messages() -> None:
    import enum

    class Token(enum.IntEnum):
        A = 7

    state = SequenceState(0, [1])
    for bad, error, fragment in (
        ([2, True], TypeError, r"tokens\[1\] must be an int in 0 \.\.= 4294967295 .* got bool True"),
        ([2, 3, -1], ValueError, r"tokens\[2\]=-1 is outside the u32 range"),
        ((2, 2**32), ValueError, r"tokens\[1\]=4294967296 is outside"),
        ([2.0], TypeError, r"tokens\[0\] must be an int .* got float 2\.0"),
    ):
        with pytest.raises(error, match=fragment):
            state.extend(bad)  # type: ignore[arg-type]
    assert list(state.tokens) == [1]  # nothing recorded by a failed extend
    state.extend([Token.A, 8])
    state.extend(iter([9]))
    assert list(state.tokens) == [1, 7, 8, 9] and all(type(t) is int for t in state.tokens)


@pytest.mark.parametrize(
    "tokens",
    [
        [],
        [0, 1, 2**31 - 1],
        [2**31, 2**32 - 1, 5],  # past the marshal pass's 2**31: the array path
        [5] * 1000,
        [False, 1],
        [1, True, 2**31, 2**31, 3],  # a bool and big ints whose lengths would balance in marshal's output
        ["", 1],  # marshal writes '' in 5 bytes too
        [1, -(2**31)],
        [[1, 2]],
    ],
)
def test_the_fast_check_agrees_with_the_token_by_token_check(tokens: list[object]) -> None:
    def one_by_one() -> list[int] | str:
        try:
            return [check_u32(f"tokens[{i}]", t) for i, t in enumerate(tokens)]
        except (TypeError, ValueError) as error:
            return f"{type(error).__name__}: {error}"

    state = SequenceState(0)
    try:
        state.extend(tokens)  # type: ignore[arg-type]
        outcome: list[int] | str = list(state.tokens)
    except (TypeError, ValueError) as error:
        outcome = f"{type(error).__name__}: {error}"
    assert outcome == one_by_one()
