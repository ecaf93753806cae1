"""The re-form of a link over the ranks left, in one process: the epoch every rank agrees on."""

from __future__ import annotations

import pytest

from metrale_model_engine import EpLink, EpSetupError, ProtocolVersion
from metrale_model_engine._engine.settings import LinkSettings, agree_on_setup
from metrale_model_engine.wire import WIRE_VERSION

from helpers.fakes import FakeTransport


def settings(epoch: int) -> LinkSettings:
    checked = LinkSettings.checked(
        0, 3, num_slots=4, protocol=ProtocolVersion.V1, seq_id_on_wire=True, command_timeout=None
    )
    return LinkSettings(**{**vars(checked), "epoch": epoch})


def test_a_link_is_built_at_epoch_0() -> None:
    assert EpLink(FakeTransport(0, 2), num_slots=2).epoch == 0


def test_a_setup_of_an_older_epoch_is_refused_naming_the_ranks_that_missed_a_re_form() -> None:
    peers = [[WIRE_VERSION, 1, 1, 4, 1, 0, 0, 0], [WIRE_VERSION, 1, 1, 4, 2, 0, 0, 0]]
    with pytest.raises(EpSetupError) as refused:
        agree_on_setup(FakeTransport(0, 3, peers=peers), settings(2))
    assert str(refused.value) == (
        "rank 0: the ranks disagree on the epoch (rank 0: 2, rank 1: 1, rank 2: 2); every rank must use the same "
        "value; rank(s) [1] are of an epoch older than the head's: they missed a re-form of the link"
    )


def test_a_setup_of_a_later_epoch_than_the_heads_is_refused_too() -> None:
    peers = [[WIRE_VERSION, 1, 1, 4, 3, 0, 0, 0], [WIRE_VERSION, 1, 1, 4, 2, 0, 0, 0]]
    later = r"rank\(s\) \[1\] are of an epoch later than the head's: the link re-formed"
    with pytest.raises(EpSetupError, match=later):
        agree_on_setup(FakeTransport(0, 3, peers=peers), settings(2))
