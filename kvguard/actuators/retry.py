"""Retrying an outbound call: a fixed number of attempts, doubling waits between them.

Both outbound actuators retry through :func:`retry`: the engine admin calls
(:mod:`kvguard.actuators.engine_admin`) and webhook deliveries
(:mod:`kvguard.actuators.webhook`). An attempt reports its outcome as a value, never
by raising: the caller's ``retryable`` says which outcomes are worth another try,
and the caller turns the last outcome into its result, its log line and its counts.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Retried(Generic[T]):
    """The outcome of the last attempt made, and how many attempts were made (>= 1)."""

    outcome: T
    attempts: int


def backoff_delay(backoff_s: float, attempt: int) -> float:
    """The wait after failed attempt number ``attempt`` (from 1): ``backoff_s * 2**(attempt-1)``."""
    doubling: int = 2 ** (attempt - 1)  # attempt >= 1: an int (typeshed says Any)
    return backoff_s * doubling


async def retry(
    attempt: Callable[[], Awaitable[T]],
    *,
    attempts: int,
    backoff_s: float,
    retryable: Callable[[T], bool],
    sleep: Callable[[float], Awaitable[object]],
) -> Retried[T]:
    """Await ``attempt()`` until an outcome is not ``retryable`` or ``attempts`` were made.

    ``attempts`` counts every try, the first included (at least 1). After a
    retryable outcome that is not the last attempt's, ``sleep`` waits
    ``backoff_s``, then twice that, and so on (:func:`backoff_delay`); nothing is
    slept after the last attempt or after a final outcome. An exception from
    ``attempt`` or ``sleep`` (cancellation included) propagates at once, without
    further attempts.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    number = 1
    while True:
        outcome = await attempt()
        if number == attempts or not retryable(outcome):
            return Retried(outcome, number)
        await sleep(backoff_delay(backoff_s, number))
        number += 1
