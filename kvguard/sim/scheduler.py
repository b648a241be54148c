"""A paged KV cache and a continuous-batching scheduler, modelled on vLLM v1.

Pure and synchronous: :meth:`Scheduler.schedule` decides one step (which
sequences run how many tokens, who is preempted, whether the step would crash) and
allocates blocks; :meth:`Scheduler.complete` applies the step once its time has
passed. The asyncio driver in :mod:`kvguard.sim.engine` owns time.

Like vLLM v1, prefill and decode are one mechanism: a sequence has ``target``
tokens (prompt + generated so far) and ``computed`` tokens with KV in the cache; a
step computes up to ``target - computed`` of them (a decode is the case of one),
and a sequence that reaches its target emits its next token. A preempted
sequence loses its blocks and recomputes everything when readmitted.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

SequenceState = Literal["waiting", "running", "finished"]


@dataclass(frozen=True)
class SchedulerConfig:
    """Pool and batch limits, named as vLLM's flags.

    ``num_gpu_blocks`` counts one reserved null block, as vLLM does, so
    ``num_gpu_blocks - 1`` blocks hold KV. ``oom_on_exhaust`` models engines that
    allocate per sequence without a pool check: exceeding the pool crashes instead
    of preempting. ``activation_limit_tokens`` crashes a step whose prefill tokens
    exceed it, like a large prefill burst outside the KV pool.
    """

    num_gpu_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    oom_on_exhaust: bool = False
    activation_limit_tokens: int | None = None

    @property
    def usable_blocks(self) -> int:
        """Blocks that can hold KV (all but the null block)."""
        return self.num_gpu_blocks - 1

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool holds."""
        return self.usable_blocks * self.block_size


@dataclass(eq=False)
class Sequence:
    """One request inside the engine."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    generated: int = 0
    computed: int = 0
    blocks: int = 0
    state: SequenceState = "waiting"
    preemptions: int = 0
    finish_reason: str | None = None

    @property
    def target(self) -> int:
        """Tokens whose KV must be computed before the next token can be sampled."""
        return self.prompt_tokens + self.generated

    @property
    def in_prefill(self) -> bool:
        """Whether the next step for this sequence processes more than one token."""
        return self.target - self.computed > 1


@dataclass(frozen=True)
class StepPlan:
    """What one step does: tokens per sequence, who was preempted, or a crash."""

    scheduled: tuple[tuple[Sequence, int], ...] = ()
    preempted: tuple[Sequence, ...] = ()
    prefill_tokens: int = 0
    crash: str | None = None

    @property
    def total_tokens(self) -> int:
        """Tokens computed by the step (sizes its duration)."""
        return sum(n for _, n in self.scheduled)


@dataclass(frozen=True)
class TokenEvent:
    """A sequence produced a token; ``finished`` when it was its last."""

    sequence: Sequence
    first: bool
    finished: bool


@dataclass
class Scheduler:
    """The engine's queue, running batch and block pool."""

    config: SchedulerConfig
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)
    free_blocks: int = -1
    preemptions_total: int = 0

    def __post_init__(self) -> None:
        if self.free_blocks < 0:
            self.free_blocks = self.config.usable_blocks

    @property
    def used_blocks(self) -> int:
        """Blocks holding KV now."""
        return self.config.usable_blocks - self.free_blocks

    @property
    def usage(self) -> float:
        """Share of usable blocks in use, as ``vllm:kv_cache_usage_perc``."""
        usable = self.config.usable_blocks
        return self.used_blocks / usable if usable else 1.0

    @property
    def has_work(self) -> bool:
        """Whether a step would do anything (running sequences or admissible waiting ones)."""
        return bool(self.running or self.waiting)

    def add(self, seq: Sequence) -> None:
        """Queue a new request."""
        seq.state = "waiting"
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is and free its blocks (a client went away)."""
        if seq.state == "running":
            self.running.remove(seq)
        elif seq.state == "waiting":
            self.waiting.remove(seq)
        self._finish(seq, "abort")

    def schedule(self, admit: bool = True) -> StepPlan:
        """Plan one step and allocate its blocks; ``admit`` false holds the queue."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []
        prefill = 0
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            tokens = min(seq.target - seq.computed, budget)
            need = self._blocks_for(seq.computed + tokens) - seq.blocks
            while need > self.free_blocks and seq.state == "running":
                if self.config.oom_on_exhaust:
                    return StepPlan(crash=self._oom_message(need))
                victim = self.running[-1]  # the most recently admitted goes first
                self._preempt(victim)
                preempted.append(victim)
            if seq.state != "running":
                break  # it preempted itself: nothing after it is running either
            self._allocate(seq, need)
            prefill += tokens if seq.in_prefill else 0
            scheduled.append((seq, tokens))
            budget -= tokens
            index += 1
        # vLLM admits no new request in a step that had to preempt.
        while admit and not preempted and self.waiting and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            seq = self.waiting[0]
            tokens = min(seq.target - seq.computed, budget)
            need = self._blocks_for(tokens)
            if need > self.free_blocks:
                if self.config.oom_on_exhaust:
                    return StepPlan(crash=self._oom_message(need))
                break
            self.waiting.popleft()
            seq.state = "running"
            self.running.append(seq)
            self._allocate(seq, need)
            prefill += tokens if seq.in_prefill else 0
            scheduled.append((seq, tokens))
            budget -= tokens
        limit = self.config.activation_limit_tokens
        if limit is not None and prefill > limit:
            return StepPlan(
                crash=f"simulated CUDA out of memory: a step of {prefill} prefill tokens"
                f" exceeds the activation limit of {limit} tokens"
            )
        return StepPlan(tuple(scheduled), tuple(preempted), prefill)

    def complete(self, plan: StepPlan) -> list[TokenEvent]:
        """Apply a step: advance computed tokens, sample tokens, finish sequences."""
        events: list[TokenEvent] = []
        for seq, tokens in plan.scheduled:
            if seq.state != "running":  # aborted while the step ran
                continue
            seq.computed += tokens
            if seq.computed < seq.target:
                continue  # a chunk of a longer prefill
            seq.generated += 1
            finished = seq.generated >= seq.max_tokens
            if finished:
                self.running.remove(seq)
                self._finish(seq, "length")
            events.append(TokenEvent(seq, seq.generated == 1, finished))
        return events

    def preempt_all(self) -> int:
        """Preempt every running sequence (a forced cache reset); returns how many."""
        count = len(self.running)
        while self.running:
            self._preempt(self.running[-1])
        return count

    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.config.block_size)

    def _allocate(self, seq: Sequence, blocks: int) -> None:
        if blocks > 0:
            self.free_blocks -= blocks
            seq.blocks += blocks

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.free_blocks += seq.blocks
        seq.blocks = 0
        seq.computed = 0
        seq.preemptions += 1
        seq.state = "waiting"
        self.waiting.appendleft(seq)
        self.preemptions_total += 1

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.free_blocks += seq.blocks
        seq.blocks = 0
        seq.state = "finished"
        seq.finish_reason = reason

    def _oom_message(self, need: int) -> str:
        size = self.config.block_size
        return (
            f"simulated CUDA out of memory: tried to allocate {need} KV blocks"
            f" ({need * size} tokens) with {self.free_blocks} of"
            f" {self.config.usable_blocks} free"
        )
