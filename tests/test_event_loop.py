"""Which event loop `kvguard run` picks (KVGUARD_EVENT_LOOP), and what it says when it cannot."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from kvguard.errors import InvalidInputError
from kvguard.runtime import event_loop
from kvguard.runtime.event_loop import EVENT_LOOP_ENV, choose_loop, run


def test_auto_picks_uvloop_when_it_is_installed():
    """Unset or auto: uvloop (the test install has the `fast` extra), else asyncio."""
    assert importlib.util.find_spec("uvloop") is not None, "install with .[fast]"
    assert choose_loop({}) == choose_loop({EVENT_LOOP_ENV: "auto"}) == "uvloop"
    assert choose_loop({EVENT_LOOP_ENV: " UVLOOP "}) == "uvloop"
    assert choose_loop({EVENT_LOOP_ENV: "asyncio"}) == "asyncio"


def test_without_uvloop_auto_falls_back_and_uvloop_says_how_to_install(monkeypatch):
    """Without uvloop: auto runs asyncio, and asking for uvloop is an error naming the extra."""
    monkeypatch.setattr(event_loop.importlib.util, "find_spec", lambda name: None)
    assert choose_loop({}) == "asyncio"
    with pytest.raises(InvalidInputError, match=r"kvguard\[fast\]"):
        choose_loop({EVENT_LOOP_ENV: "uvloop"})


def test_a_bad_choice_names_the_variable_and_the_choices():
    """A typo is refused with the variable, the value and what is allowed."""
    with pytest.raises(InvalidInputError, match=r"KVGUARD_EVENT_LOOP.*auto, uvloop, asyncio"):
        choose_loop({EVENT_LOOP_ENV: "trio"})


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_run_runs_the_coroutine_on_that_loop(loop):
    """The coroutine's result comes back, and it ran on the loop asked for."""

    async def main() -> str:
        await asyncio.sleep(0)
        return type(asyncio.get_running_loop()).__module__

    module = run(main(), loop)
    assert module.startswith("uvloop") == (loop == "uvloop")
