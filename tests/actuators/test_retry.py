"""The outbound actuators' one retry loop, driven by scripted outcomes and a recorded sleep."""

from __future__ import annotations

import asyncio

import pytest

from kvguard.actuators.retry import Retried, backoff_delay, retry


class Script:
    """An attempt that returns ``outcomes`` in order, and a sleep that records its waits."""

    def __init__(self, *outcomes: str) -> None:
        self.outcomes = list(outcomes)
        self.calls = 0
        self.slept: list[float] = []
        self.log: list[str] = []  # attempts and sleeps, interleaved as they happened

    async def attempt(self) -> str:
        outcome = self.outcomes[self.calls]
        self.calls += 1
        self.log.append(f"attempt {self.calls}")
        return outcome

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.log.append(f"sleep {seconds:g}")


def busy(outcome: str) -> bool:
    """The scripts' one retryable outcome."""
    return outcome == "busy"


async def run(script: Script, attempts: int, backoff_s: float = 0.5) -> Retried[str]:
    """``retry`` over ``script``, retrying "busy"."""
    return await retry(
        script.attempt,
        attempts=attempts,
        backoff_s=backoff_s,
        retryable=busy,
        sleep=script.sleep,
    )


async def test_a_first_final_outcome_is_returned_without_sleeping():
    """Done (or failed for good) at once: one attempt, no wait."""
    script = Script("done")
    assert await run(script, attempts=3) == Retried("done", 1)
    assert script.slept == []


async def test_retryable_outcomes_are_retried_with_doubling_waits_between():
    """Waits of backoff, 2x, 4x between attempts; the first final outcome ends it."""
    script = Script("busy", "busy", "busy", "done")
    assert await run(script, attempts=5, backoff_s=0.5) == Retried("done", 4)
    assert script.log == [
        "attempt 1",
        "sleep 0.5",
        "attempt 2",
        "sleep 1",
        "attempt 3",
        "sleep 2",
        "attempt 4",
    ]


async def test_a_final_outcome_after_retries_stops_at_once():
    """An outcome that is not retryable ends the loop, whatever attempts are left."""
    script = Script("busy", "refused", "done")
    assert await run(script, attempts=5) == Retried("refused", 2)
    assert script.slept == [0.5]


async def test_attempts_is_the_total_and_no_wait_follows_the_last():
    """Exhausted: the last (retryable) outcome comes back, after ``attempts`` tries."""
    script = Script("busy", "busy", "busy", "busy")
    assert await run(script, attempts=3, backoff_s=1.0) == Retried("busy", 3)
    assert script.calls == 3
    assert script.slept == [1.0, 2.0]


async def test_one_attempt_means_no_retry():
    """``attempts=1``: a retryable outcome is returned as is, nothing slept."""
    script = Script("busy", "done")
    assert await run(script, attempts=1) == Retried("busy", 1)
    assert script.slept == []


async def test_zero_backoff_still_calls_sleep():
    """A zero backoff waits 0 s: the injected sleep still yields between attempts."""
    script = Script("busy", "busy", "done")
    assert await run(script, attempts=3, backoff_s=0.0) == Retried("done", 3)
    assert script.slept == [0.0, 0.0]


async def test_an_exception_from_an_attempt_propagates_without_retry():
    """Attempts report failures as outcomes; a raise is a bug and is not retried."""
    calls = 0

    async def broken() -> str:
        nonlocal calls
        calls += 1
        raise RuntimeError("bug")

    with pytest.raises(RuntimeError, match="bug"):
        await retry(broken, attempts=3, backoff_s=0.5, retryable=busy, sleep=asyncio.sleep)
    assert calls == 1


async def test_cancellation_during_a_wait_propagates():
    """A cancelled wait ends the loop: no further attempt is made."""
    script = Script("busy", "done")

    async def cancelled(_seconds: float) -> None:
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await retry(script.attempt, attempts=3, backoff_s=0.5, retryable=busy, sleep=cancelled)
    assert script.calls == 1


async def test_fewer_than_one_attempt_is_refused():
    """The callers validate their settings; the helper refuses a loop that never tries."""
    script = Script("done")
    with pytest.raises(ValueError, match="attempts"):
        await run(script, attempts=0)
    assert script.calls == 0


def test_backoff_delay_doubles_from_the_base():
    """The wait after attempt n is ``backoff_s * 2**(n-1)``."""
    assert [backoff_delay(0.25, n) for n in range(1, 6)] == [0.25, 0.5, 1.0, 2.0, 4.0]
    assert backoff_delay(0.0, 4) == 0.0
