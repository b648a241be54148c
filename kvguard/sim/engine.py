"""The simulated engine's clockwork: steps of the scheduler in real time.

:class:`SimEngine` runs one asyncio task that plans a step, waits for the step's
duration (fixed cost + per-token cost, with seeded jitter), applies it, and hands
each generated token to the request's stream. Requests are submitted and aborted
from HTTP handlers; pause modes and the crash of a simulated CUDA OOM are here too.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from kvguard.sim.scheduler import Scheduler, SchedulerConfig, Sequence, StepPlan
from kvguard.sim.stats import SimStats
from kvguard.sim.tokenizer import FillerText

PauseMode = Literal["abort", "wait", "keep"]


class EngineUnavailableError(Exception):
    """The engine cannot take the request now: paused, or dead after a crash."""


@dataclass(frozen=True)
class TimeModel:
    """How long a step takes: ``step_fixed_s + per_token_s * tokens``, +/- ``jitter``."""

    step_fixed_s: float = 0.004
    per_token_s: float = 0.00004
    jitter: float = 0.05

    def duration(self, tokens: int, rng: random.Random) -> float:
        """Seconds one step of ``tokens`` tokens takes."""
        base = self.step_fixed_s + self.per_token_s * tokens
        return base * (1 + rng.uniform(-self.jitter, self.jitter))


@dataclass(eq=False)
class RequestHandle:
    """A submitted request: its sequence, its token stream, and its timings."""

    seq: Sequence
    text: FillerText
    submitted_at: float
    tokens: asyncio.Queue[str | None] = field(default_factory=asyncio.Queue)
    first_token_at: float | None = None
    last_token_at: float | None = None
    scheduled_at: float | None = None
    finished_at: float | None = None
    error: str | None = None

    @property
    def finish_reason(self) -> str | None:
        """``length``, ``stop`` or ``abort`` once finished."""
        return self.seq.finish_reason


class SimEngine:
    """A paged-KV engine that runs in real time on the event loop."""

    def __init__(
        self,
        config: SchedulerConfig,
        time_model: TimeModel | None = None,
        *,
        seed: int = 0,
        on_crash: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.config = config
        self.scheduler = Scheduler(config)
        self.time_model = time_model or TimeModel()
        self.stats = SimStats()
        self.dead_reason: str | None = None
        self.pause_mode: PauseMode | None = None
        self._rng = random.Random(seed)
        self._seed = seed
        self._ids = itertools.count()
        self._handles: dict[str, RequestHandle] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._on_crash = on_crash
        self._clock = clock
        self._sleep = sleep

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the step loop on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        """Stop the step loop and fail whatever is still in flight."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for handle in list(self._handles.values()):
            self._fail(handle, "engine stopped")

    @property
    def alive(self) -> bool:
        """False once a simulated OOM has killed the engine."""
        return self.dead_reason is None

    # ------------------------------------------------------------------ requests
    def submit(
        self,
        prompt_tokens: int,
        max_tokens: int,
        request_id: str | None = None,
        *,
        output_tokens: int | None = None,
        priority: int = 0,
    ) -> RequestHandle:
        """Queue a request; raises :class:`EngineUnavailableError` when dead or paused.

        ``output_tokens`` is the request's true length (it stops there if that is
        before ``max_tokens``); ``priority`` orders it under the ``priority`` policy.
        """
        if self.dead_reason is not None:
            raise EngineUnavailableError(f"engine is dead: {self.dead_reason}")
        if self.pause_mode in ("abort", "wait"):
            raise EngineUnavailableError("engine is paused")
        number = next(self._ids)
        rid = request_id or f"req-{number}"
        seq = Sequence(rid, prompt_tokens, max_tokens, stop_after=output_tokens, priority=priority)
        handle = RequestHandle(seq, FillerText(self._seed * 1_000_003 + number), self._clock())
        self._handles[rid] = handle
        self.scheduler.add(seq)
        # The client's max_tokens, not the true length: it is what an engine is asked.
        self.stats.request_arrived(max_tokens)
        self._wakeup.set()
        return handle

    def abort(self, request_id: str) -> bool:
        """Abort a request (client disconnect or admin); frees its blocks at once."""
        handle = self._handles.get(request_id)
        if handle is None or handle.seq.state == "finished":
            return False
        self.scheduler.abort(handle.seq)
        self._close(handle)
        return True

    def request_ids(self) -> list[str]:
        """Ids of requests waiting or running."""
        return list(self._handles)

    # ------------------------------------------------------------------ admin
    def pause(self, mode: PauseMode) -> None:
        """Pause like vLLM's /pause.

        ``abort`` drops in-flight work, ``wait`` lets it drain, ``keep`` freezes it;
        the first two refuse new requests until :meth:`resume`.
        """
        self.pause_mode = mode
        if mode == "abort":
            for rid in list(self._handles):
                self.abort(rid)

    def resume(self) -> None:
        """Resume like vLLM's /resume: admit and step again."""
        self.pause_mode = None
        self._wakeup.set()

    def reset_cache(self, reset_running: bool = False) -> bool:
        """Reset like vLLM's /reset_prefix_cache: refused while requests hold blocks, unless forced.

        Forcing preempts every running request (they recompute), which is how the
        real engine frees blocks held by running requests.
        """
        if self.scheduler.used_blocks == 0:
            return True
        if not reset_running:
            return False
        self.stats.preempted(self.scheduler.preempt_all())
        self._wakeup.set()
        return True

    # ------------------------------------------------------------------ the loop
    async def _run(self) -> None:
        while self.dead_reason is None:
            if self.pause_mode == "keep" or not self.scheduler.has_work:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            plan = self.scheduler.schedule()
            if plan.crash is not None:
                self._crash(plan.crash)
                return
            if not plan.scheduled:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            self.stats.preempted(len(plan.preempted))
            now = self._clock()
            for seq, _ in plan.scheduled:
                handle = self._handles.get(seq.request_id)
                if handle is not None and handle.scheduled_at is None:
                    handle.scheduled_at = now
            duration = self.time_model.duration(plan.total_tokens, self._rng)
            await self._sleep(duration)
            self._apply(plan, duration)

    def _apply(self, plan: StepPlan, duration: float) -> None:
        now = self._clock()
        events = self.scheduler.complete(plan)
        self.stats.step_done(len(events), duration)
        for event in events:
            handle = self._handles.get(event.sequence.request_id)
            if handle is None:
                continue
            self.stats.token_generated(handle, now)
            if event.first:
                handle.first_token_at = now
            handle.last_token_at = now
            handle.tokens.put_nowait(handle.text.next_token())
            if event.finished:
                handle.finished_at = now
                self.stats.request_finished(handle)
                self._close(handle)

    def _close(self, handle: RequestHandle) -> None:
        if handle.seq.finish_reason == "abort":
            handle.finished_at = self._clock()
            self.stats.request_finished(handle)
        self._handles.pop(handle.seq.request_id, None)
        handle.tokens.put_nowait(None)

    def _fail(self, handle: RequestHandle, reason: str) -> None:
        handle.error = reason
        self._handles.pop(handle.seq.request_id, None)
        handle.tokens.put_nowait(None)

    def _crash(self, reason: str) -> None:
        self.dead_reason = reason
        lost = len(self._handles)
        for handle in list(self._handles.values()):
            self._fail(handle, reason)
        if self._on_crash is not None:
            self._on_crash(f"{reason}; {lost} in-flight requests lost")
