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

Two scheduling policies, as vLLM's ``--scheduling-policy``: ``fcfs`` serves in
arrival order and preempts the most recently admitted; ``priority`` serves by
(priority, arrival) and preempts the running sequence with the largest
(priority, arrival): the lowest priority, latest arrival.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

SequenceState = Literal["waiting", "running", "finished"]
SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    """Pool and batch limits, named as vLLM's flags.

    ``num_gpu_blocks`` counts one reserved null block, as vLLM does, so
    ``num_gpu_blocks - 1`` blocks hold KV.

    ``oom_on_exhaust`` models engines that allocate KV dynamically per sequence and
    die when an allocation does not fit: a waiting sequence is admitted only if its
    first prompt chunk fits in the free blocks now (a free-memory check at
    admission, with nothing reserved for growth), otherwise it keeps waiting; a
    running sequence whose growth (its next prefill chunk or its next decoded
    token) needs blocks that are not free crashes the engine, and nothing is ever
    preempted.

    ``activation_limit_tokens`` crashes a step whose prefill tokens exceed it, like a
    large prefill burst outside the KV pool.

    ``scheduling_policy`` is vLLM's ``--scheduling-policy``: ``fcfs`` (arrival
    order) or ``priority`` (each sequence's ``priority``, lower first, then arrival).
    """

    num_gpu_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    oom_on_exhaust: bool = False
    activation_limit_tokens: int | None = None
    scheduling_policy: SchedulingPolicy = "fcfs"

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)},"
                f" got {self.scheduling_policy!r}"
            )

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
    """One request inside the engine.

    ``max_tokens`` is what the client asked for; ``stop_after``, when set, is the
    request's true output length: it ends there (``finish_reason`` "stop") if that
    comes before ``max_tokens`` (which ends it with "length"). ``priority`` orders it
    under the ``priority`` policy (lower first); ``arrival`` is its place in arrival
    order, set by :meth:`Scheduler.add`.
    """

    request_id: str
    prompt_tokens: int
    max_tokens: int
    stop_after: int | None = None
    priority: int = 0
    arrival: int = -1
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

    @property
    def rank(self) -> tuple[int, int]:
        """Its order under the ``priority`` policy: smaller is served first, preempted last."""
        return (self.priority, self.arrival)

    def due_finish_reason(self) -> str | None:
        """``length`` at ``max_tokens``, ``stop`` at a shorter true length, else None."""
        if self.generated >= self.max_tokens:
            return "length"
        if self.stop_after is not None and self.generated >= self.stop_after:
            return "stop"
        return None


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
    arrivals: int = 0

    def __post_init__(self) -> None:
        if self.free_blocks < 0:
            self.free_blocks = self.config.usable_blocks

    @property
    def by_priority(self) -> bool:
        """Whether the ``priority`` policy orders the queue and picks the victims."""
        return self.config.scheduling_policy == "priority"

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
        """Queue a new request (last in arrival order, or in its priority's place)."""
        seq.state = "waiting"
        seq.arrival = self.arrivals
        self.arrivals += 1
        if self.by_priority:
            self._insert_by_rank(seq)
        else:
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
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            tokens = min(seq.target - seq.computed, budget)
            need = self._blocks_for(seq.computed + tokens) - seq.blocks
            while need > self.free_blocks and seq.state == "running":
                if self.config.oom_on_exhaust:
                    # A dynamic allocator has no victim to take blocks from: the
                    # growth of a running sequence that does not fit kills it.
                    return StepPlan(crash=self._oom_message(need))
                victim, position = self._victim()
                if position < index:
                    # Under priority the victim may already be in this step (as in
                    # vLLM): its tokens go back to the budget, the loop shifts left.
                    budget += self._unschedule(scheduled, victim)
                    index -= 1
                self._preempt(victim)
                preempted.append(victim)
            if seq.state != "running":
                break  # it preempted itself: it ranked last among the running
            self._allocate(seq, need)
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
                # Both modes keep it waiting: the pool waits for blocks, and a
                # dynamic allocator checks free memory before starting a request.
                break
            self.waiting.popleft()
            seq.state = "running"
            self.running.append(seq)
            self._allocate(seq, need)
            scheduled.append((seq, tokens))
            budget -= tokens
        # Prefill tokens are counted once the batch is final, since a priority
        # victim can leave it after being scheduled.
        prefill = sum(n for s, n in scheduled if s.in_prefill)
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
            reason = seq.due_finish_reason()
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
            events.append(TokenEvent(seq, seq.generated == 1, reason is not None))
        return events

    def preempt_all(self) -> int:
        """Preempt every running sequence (a forced cache reset); returns how many."""
        count = len(self.running)
        while self.running:
            self._preempt(self.running[-1])
        return count

    def _victim(self) -> tuple[Sequence, int]:
        """The running sequence to preempt, and its place in the running list."""
        if self.by_priority:
            # vLLM: max(running, key=(priority, arrival_time)).
            victim = max(self.running, key=lambda s: s.rank)
            return victim, self.running.index(victim)
        return self.running[-1], len(self.running) - 1  # the most recently admitted

    @staticmethod
    def _unschedule(scheduled: list[tuple[Sequence, int]], seq: Sequence) -> int:
        """Take ``seq`` out of a step being planned; returns the tokens it had."""
        for i, (planned, tokens) in enumerate(scheduled):
            if planned is seq:
                del scheduled[i]
                return tokens
        return 0

    def _insert_by_rank(self, seq: Sequence) -> None:
        """Put ``seq`` in the queue after every sequence that ranks before it."""
        position = len(self.waiting)
        for i, queued in enumerate(self.waiting):
            if seq.rank < queued.rank:
                position = i
                break
        self.waiting.insert(position, seq)

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
        if self.by_priority:
            self._insert_by_rank(seq)  # back in its priority's place
        else:
            self.waiting.appendleft(seq)  # first to be readmitted, as in vLLM
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
