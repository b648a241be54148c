"""Counters and histograms the simulated engine keeps for its /metrics.

Engine-neutral: :mod:`kvguard.sim.metrics` names them as vLLM, SGLang or
llama.cpp would. Histogram buckets are vLLM's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvguard.core.histogram import TOKEN_BUCKETS, Histogram

if TYPE_CHECKING:
    from kvguard.sim.engine import RequestHandle

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


@dataclass
class SimStats:
    """Everything the engine counts since start."""

    requests_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    preemptions_total: int = 0
    steps_total: int = 0
    finished: Counter[str] = field(default_factory=Counter)
    last_step_tokens_per_s: float = 0.0
    prompt_tokens: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    generation_tokens: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    max_tokens_param: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    inter_token: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))

    def request_arrived(self, max_tokens: int) -> None:
        """A request was accepted; ``max_tokens`` is the client's, whatever its true length."""
        self.requests_total += 1
        self.max_tokens_param.observe(max_tokens)

    def preempted(self, count: int) -> None:
        """``count`` running requests lost their cache."""
        self.preemptions_total += count

    def step_done(self, tokens_generated: int, duration_s: float) -> None:
        """A step finished, generating ``tokens_generated`` tokens in ``duration_s``."""
        self.steps_total += 1
        self.last_step_tokens_per_s = tokens_generated / duration_s if duration_s > 0 else 0.0

    def token_generated(self, handle: RequestHandle, now: float) -> None:
        """A request produced a token at ``now``."""
        self.generation_tokens_total += 1
        if handle.first_token_at is None:  # its first: the prompt was processed
            self.prompt_tokens_total += handle.seq.prompt_tokens
            self.ttft.observe(now - handle.submitted_at)
            if handle.scheduled_at is not None:
                self.queue_time.observe(handle.scheduled_at - handle.submitted_at)
        elif handle.last_token_at is not None:
            self.inter_token.observe(now - handle.last_token_at)

    def request_finished(self, handle: RequestHandle) -> None:
        """A request ended (``stop``, ``length`` or ``abort``)."""
        reason = handle.seq.finish_reason or "abort"
        self.finished[reason] += 1
        self.prompt_tokens.observe(handle.seq.prompt_tokens)
        self.generation_tokens.observe(handle.seq.generated)
        if handle.finished_at is not None:
            self.e2e.observe(handle.finished_at - handle.submitted_at)
