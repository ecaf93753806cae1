"""The room of a parallel run (``helpers.serial``): who may run beside a test apart, beside a test alone, and beside
two loads."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from helpers.serial import Need, Room

WAIT = 0.3
"""Seconds a blocked entry is given to show that it waits."""


@pytest.fixture
def room(tmp_path: Path) -> Iterator[Callable[[], Room]]:
    """``room()``: one more worker's way into a room of its own, closed after the test."""
    made: list[Room] = []

    def one() -> Room:
        made.append(Room(tmp_path))
        return made[-1]

    yield one
    for each in made:
        each.close()


def enters(room: Room, need: Need) -> threading.Event:
    """Start entering ``room`` as ``need`` says, in a thread; the event is set once it has entered."""
    entered = threading.Event()

    def enter() -> None:
        room.enter(need)
        entered.set()

    threading.Thread(target=enter, daemon=True).start()
    return entered


def test_beside_a_test_apart_an_in_process_test_runs_and_tests_that_start_processes_wait(
    room: Callable[[], Room],
) -> None:
    serial, other = room(), room()
    serial.enter(Need.APART)
    assert enters(other, Need.QUIET).wait(5)
    other.leave()
    busy = enters(other, Need.BUSY)
    assert not busy.wait(WAIT)
    serial.leave()
    assert busy.wait(5)


def test_beside_a_test_apart_one_in_process_test_runs_and_light_tests_too(room: Callable[[], Room]) -> None:
    serial, first, second, light = room(), room(), room(), room()
    serial.enter(Need.APART)
    assert enters(first, Need.QUIET).wait(5)
    assert enters(light, Need.LIGHT).wait(5)
    quiet = enters(second, Need.QUIET)  # the other load slot is the serial test's
    assert not quiet.wait(WAIT)
    first.leave()
    assert quiet.wait(5)


def test_two_loads_at_most_and_light_tests_beside_them(room: Callable[[], Room]) -> None:
    first, second, third, light = room(), room(), room(), room()
    first.enter(Need.BUSY)
    second.enter(Need.QUIET)
    busy = enters(third, Need.BUSY)
    assert not busy.wait(WAIT)
    second.leave()
    assert busy.wait(5)
    assert enters(light, Need.LIGHT).wait(5)
    light.leave()
    apart = enters(light, Need.APART)  # the busy room by itself: once both tests that start processes have left
    first.leave()
    assert not apart.wait(WAIT)
    third.leave()
    assert apart.wait(5)


def test_beside_a_test_alone_nothing_runs(room: Callable[[], Room]) -> None:
    serial, other = room(), room()
    serial.enter(Need.ALONE)
    quiet = enters(other, Need.QUIET)
    assert not quiet.wait(WAIT)
    serial.enter(Need.APART)  # the next serial test, apart: the in-process test goes in
    assert quiet.wait(5)


def test_a_test_waiting_apart_keeps_new_tests_out_until_it_has_run(room: Callable[[], Room]) -> None:
    running, serial, newcomer = room(), room(), room()
    running.enter(Need.BUSY)
    apart = enters(serial, Need.APART)
    assert not apart.wait(WAIT)
    late = enters(newcomer, Need.BUSY)  # behind the serial test at the turnstile, not beside the running one
    assert not late.wait(WAIT)
    running.leave()
    assert apart.wait(5)
    assert not late.wait(WAIT)
    serial.leave()
    assert late.wait(5)


def test_an_alone_block_runs_apart_then_gives_back_what_the_test_held(room: Callable[[], Room]) -> None:
    test, other = room(), room()
    test.enter(Need.BUSY)
    with test.alone():
        assert enters(other, Need.QUIET).wait(5)
        other.leave()
        busy = enters(other, Need.BUSY)
        assert not busy.wait(WAIT)
    assert busy.wait(5)  # the test holds its share again, beside the other
    other.leave()
    test.leave()
    with test.alone():  # a test that held nothing: the block apart, then nothing held
        alone = enters(other, Need.ALONE)
        assert not alone.wait(WAIT)
    assert alone.wait(5)


def test_a_test_waiting_for_the_busy_room_keeps_no_light_or_in_process_test_out(room: Callable[[], Room]) -> None:
    serial, waiting, light, quiet = room(), room(), room(), room()
    serial.enter(Need.APART)
    busy = enters(waiting, Need.BUSY)
    assert not busy.wait(WAIT)
    assert enters(light, Need.LIGHT).wait(5)  # past the waiting test: it stands outside, holding nothing
    assert enters(quiet, Need.QUIET).wait(5)
    serial.leave()
    assert busy.wait(5)


def test_from_apart_to_alone_no_test_that_starts_processes_slips_in(room: Callable[[], Room]) -> None:
    serial, waiting, light = room(), room(), room()
    serial.enter(Need.APART)
    light.enter(Need.LIGHT)
    busy = enters(waiting, Need.BUSY)
    alone = enters(serial, Need.ALONE)
    assert not alone.wait(WAIT)  # the light test still runs
    light.leave()
    assert alone.wait(5)
    assert not busy.wait(WAIT)  # the busy room was kept throughout
    newcomer = enters(light, Need.LIGHT)
    assert not newcomer.wait(WAIT)  # nothing beside a test alone
    serial.leave()
    assert busy.wait(5) and newcomer.wait(5)
