import abc
from array import array
from collections.abc import MutableSequence
from dataclasses import dataclass

import pytest
from typing_extensions import assert_type

from metrale_model_engine import ModelEp, SequenceState


class SingleGpu(ModelEp):
    """A model that inherits every default."""


class ToyState(SequenceState):
    __slots__ = ("position",)

    def __init__(self, seq_id: int) -> None:
        super().__init__(seq_id)
        self.position = 0


class TypedEp(ModelEp[ToyState]):
    def ep_worker_step(self, slots: MutableSequence[ToyState | None]) -> bool:
        state = slots[0]
        assert_type(state, ToyState | None)
        return state is not None


class Layer:
    def __init__(self, width: int) -> None:
        self.width = width


class LayeredModel(Layer, ModelEp):
    def __init__(self) -> None:
        super().__init__(width=4)


class Slotted:
    __slots__ = ("weight",)
    weight: float


class SlottedModel(Slotted, ModelEp):
    __slots__ = ("name",)
    name: str


@dataclass
class DataModel(ModelEp):
    layers: int = 2


def test_defaults_are_the_traits() -> None:
    model = SingleGpu()
    slots: list[SequenceState | None] = [None, SequenceState(1)]
    assert model.ep_worker_step(slots) is True
    assert model.is_ep() is False
    assert model.ep_protocol_v2() is False
    assert model.ep_broadcast_cmd(7) is None  # type: ignore[func-returns-value]
    assert model.ep_broadcast_cmd_for_seq(0, 7) is None  # type: ignore[func-returns-value]
    assert slots == [None, SequenceState(1)]


def test_default_tokens_is_a_new_empty_list_every_call() -> None:
    model = SingleGpu()
    first = model.ep_broadcast_tokens([1, 2, 3])
    second = model.ep_broadcast_tokens(array("I", [4]))
    assert first == [] and second == [] and first is not second
    first.append(1)
    assert model.ep_broadcast_tokens([]) == []


@pytest.mark.parametrize("word", [0, 1, 0xFFFFFFFF])
def test_defaults_accept_every_u32(word: int) -> None:
    SingleGpu().ep_broadcast_cmd(word)
    SingleGpu().ep_broadcast_cmd_for_seq(word, word)


@pytest.mark.parametrize("bad", [True, 2.0, "3", None])
def test_defaults_refuse_non_int_words(bad: object) -> None:
    model = SingleGpu()
    with pytest.raises(TypeError, match=rf"cmd must be an int .* got {type(bad).__name__}"):
        model.ep_broadcast_cmd(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"seq_id must be an int"):
        model.ep_broadcast_cmd_for_seq(bad, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"cmd must be an int"):
        model.ep_broadcast_cmd_for_seq(1, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_defaults_refuse_out_of_range_words(bad: int) -> None:
    model = SingleGpu()
    with pytest.raises(ValueError, match=rf"cmd={bad} is outside the u32 range"):
        model.ep_broadcast_cmd(bad)
    with pytest.raises(ValueError, match=rf"seq_id={bad} is outside the u32 range"):
        model.ep_broadcast_cmd_for_seq(bad, 0)
    with pytest.raises(ValueError, match=rf"cmd={bad} is outside the u32 range"):
        model.ep_broadcast_cmd_for_seq(0, bad)


def test_is_an_abc_mixin_without_state() -> None:
    assert isinstance(ModelEp, abc.ABCMeta)
    assert ModelEp.__slots__ == ()
    assert "__init__" not in vars(ModelEp)


def test_composes_with_another_base() -> None:
    model = LayeredModel()
    assert model.width == 4 and model.is_ep() is False
    assert [cls.__name__ for cls in LayeredModel.__mro__[:3]] == ["LayeredModel", "Layer", "ModelEp"]


def test_keeps_slotted_classes_slotted() -> None:
    model = SlottedModel()
    model.name = "toy"
    model.weight = 1.0
    assert not hasattr(model, "__dict__")
    with pytest.raises(AttributeError):
        model.other = 1  # type: ignore[attr-defined]


def test_composes_with_dataclasses() -> None:
    assert DataModel(layers=3) == DataModel(layers=3)
    assert DataModel().ep_broadcast_tokens([1]) == []


def test_generic_slot_type() -> None:
    model = TypedEp()
    slots: list[ToyState | None] = [ToyState(0)]
    assert model.ep_worker_step(slots) is True
    assert model.ep_worker_step([None]) is False
    assert_type(SingleGpu().ep_broadcast_tokens([1]), list[int])
