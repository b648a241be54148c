"""The admission of generation requests: shed, refuse, clamp, hold or let through.

:class:`Admission` applies the mitigations in force to one generation request: it
refuses everything while the engine is drained for a restart, sheds the classes
the policy sheds (holding each for room first, within a bound), refuses or clamps
requests over the window caps, and with ``admission = "projected"`` waits until the
request fits the engine's pool. The arithmetic of each rule is
:mod:`kvguard.core.admission` (pure, tested with plain numbers); what is here is the
glue around it: reading the body, awaiting counts and room, the counters, the log
and the 4xx/5xx answers. Kept apart from forwarding because it decides and waits,
but never talks to the engine except through :class:`PromptCounter`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import structlog
from aiohttp import web

from kvguard.actuators.accounting import ESTIMATE_BYTES_PER_TOKEN, Inflight, InflightRequest
from kvguard.actuators.mitigations import PRIORITIES, Mitigations, rank, request_priority
from kvguard.actuators.proxy import shapes
from kvguard.actuators.proxy.answers import _error
from kvguard.actuators.proxy.counting import (
    PromptCount,
    PromptCounter,
    _answer_has_usage,
    measure_prompt,
)
from kvguard.actuators.proxy.screen import _malformed_generation, beside_the_loop, read_json
from kvguard.actuators.proxy.settings import ProxyCounters, ProxySettings
from kvguard.core import admission as rules
from kvguard.core.lengths import LengthTable, ObservedLengths

log = structlog.get_logger("kvguard.proxy")
CRITICAL_RANK = rank("critical")
# A prompt that may hold more than this share of the pool (at one token a byte) is
# counted by the engine before it is admitted: a few such prompts, each admitted at
# an estimate that can be 3x low, fill the pool in their prefill.
COUNT_SHARE_OF_POOL = 0.125


class Admission:
    """The admission of generation requests, and the requests waiting for room.

    ``waiting`` counts the requests waiting for room in the pool (held or projected
    admission); ``held_tokens`` sums the projections of shed-class requests held.
    """

    def __init__(
        self,
        settings: ProxySettings,
        mitigations: Mitigations,
        inflight: Inflight,
        counters: ProxyCounters,
        counter: PromptCounter,
        *,
        lengths: ObservedLengths | None = None,
    ) -> None:
        self.settings = settings
        self.lengths = lengths if lengths is not None else ObservedLengths()
        self.mitigations = mitigations
        self._inflight = inflight
        self._counters = counters
        self._counter = counter
        # Set (and replaced) whenever a request finishes: waiters re-check for room.
        # No Condition: on 3.11, wait_for() timing out a Condition.wait can leave the
        # lock released under `async with`, which then raises.
        self._room_freed = asyncio.Event()
        self.held_tokens = 0  # projections of shed-class requests held for room
        self.waiting = 0
        # Requests waiting for admission: class rank (mitigations.rank) -> their
        # tickets (arrival order) -> their own projections; and the next ticket.
        self._waiting_ranks: dict[int, dict[int, InflightRequest]] = {}
        self._tickets = 0
        # Since when requests have waited in make_room without a break (loop time; None
        # while none waits): a queue older than admission_wait_s is overload, and then a
        # request waits overload_wait_s at most.
        self._queue_since: float | None = None
        # The engine's count of what it held at the previous tick: its growth.
        self._last_used: int | None = None
        # What each answer in flight had written per sequence at the previous tick (by
        # id, with the request itself: an id is reused once its request is gone).
        self._written: dict[int, tuple[InflightRequest, int]] = {}
        self._last_read_at: float | None = None  # when that count was read (monotonic)
        # Each kind's estimated lengths, as last read (each tick, and at each request's
        # reservation): what the spread bound reads where answers will likely end.
        self._tables: dict[tuple[str, str, str], LengthTable | None] = {}
        # The last projection and what it was read from: a wake-up re-checks every
        # request waiting, and each would otherwise read the same state again.
        self._projection: tuple[tuple[object, ...], Projection] | None = None
        self._revision = 0  # reservations or learned lengths changed

    def queue_age_s(self) -> float | None:
        """How long requests have waited for room without a break (None: none waits now)."""
        if self._queue_since is None:
            return None
        return asyncio.get_running_loop().time() - self._queue_since

    def wake(self) -> None:
        """Make requests waiting for room re-check now (one ended, or the mitigations changed)."""
        self._room_freed.set()
        self._room_freed = asyncio.Event()

    def priority_of(self, headers: Mapping[str, str]) -> str:
        """The request's class: from the API-key map, else the header, else the default."""
        settings = self.settings
        return request_priority(
            headers,
            settings.priority_header,
            settings.api_key_priorities,
            settings.default_priority,
            trust_header=settings.trust_priority_header,
        )

    async def admit(  # noqa: PLR0915 - one decision, step by step, as the docs tell it
        self,
        request: web.Request,
        body: bytes,
        request_id: str,
        shape: str = "completions",
        *,
        parsed: Callable[[], None] | None = None,
    ) -> web.StreamResponse | tuple[bytes, InflightRequest | None]:
        """Decide on one generation request: an answer in the engine's stead, or go on.

        ``shape`` is how the route's body reads (:mod:`.shapes`). Going on is the body
        to forward (its answer's length clamped when a cap says so) and the request to
        account while it runs (None for an empty body, or an ``/invocations`` body
        that is no generation request). ``parsed`` is called once the body is parsed
        and checked, before it waits for room: it gives the body's memory share back
        (:class:`.bodies.BodyGate`), so a request held for up to ``read_timeout_s``
        does not hold the budget other bodies are read under.
        """
        priority = self.priority_of(request.headers)
        if self.draining():
            return self.refuse_draining(priority)
        shed_class = self.mitigations.sheds(priority)
        # Cheap, before anything is parsed, so a flood of shed requests stays cheap: no
        # pool to measure against, or already HELD_POOLS pools' worth of requests held.
        if shed_class and not self.may_hold():
            return self.shed(priority, request_id, self.not_held_reason())
        payload = await read_json(body, self.settings.max_body_values) if body else None
        chat = _reads_as_chat(shape, payload)
        malformed = _malformed_generation(payload, body, chat=chat)
        generation: shapes.Generation | None = None
        if malformed is None and isinstance(payload, dict):
            try:
                generation = shapes.read_generation(shape, payload)
            except shapes.ShapeError as exc:
                malformed = str(exc)
            else:
                if generation is None:
                    return body, None  # not a generation request (a pooling /invocations)
        if malformed is not None:
            self._counters.rejected["invalid_body"] += 1
            return _error(400, malformed, "invalid_request_error", code="invalid_body")
        if generation is None or not isinstance(payload, dict):
            return body, None  # an empty body: nothing to project or change
        chat = generation.chat
        single = generation.sequences == 1
        prompt_cap, completion_cap = self.window_for(priority)
        # The engine's exact count is waited for only when it decides something now (a
        # window cap, a hold for room, projected admission). Otherwise the request goes
        # on with an estimate, corrected when the engine's count comes (see below): the
        # /tokenize round trip was most of the latency the proxy adds.
        subject = generation.prompts[0]
        # A batch's prompts are estimated (or counted from their token ids) one by one:
        # one /tokenize for each would be a burst of requests on the engine. Measured
        # beside the loop for a large body (hashing many messages takes milliseconds).
        measured = await beside_the_loop(len(body), _measure_all, payload, generation)
        known = self._counter.recall(measured[0])
        # Admission alone does not wait for the engine's count: the estimate errs high,
        # so a request that fits with it fits; only one that does not is counted (below).
        decides = rules.needs_exact_count(prompt_cap, completion_cap, shed_class=shed_class)
        counts = [known.count] + [self._counter.recall(m).count for m in measured[1:]]
        # An estimate errs high; scaled by what the engine counted for this model's
        # recent prompts, it is close to what the prompt really holds.
        model = payload.get("model")
        scale = self.lengths.prompt_scale(model[:128] if isinstance(model, str) else "")
        estimate = None if known.exact else known.count
        if scale is not None and estimate is not None:
            counts[0] = max(1, math.ceil(estimate * scale))
        if not known.exact and decides and len(counts) == 1:
            counts[0] = await self._counter.exact(payload, known, chat=chat, subject=subject)
            estimate = None  # counted (or, when /tokenize failed, the estimate unscaled)
            # What is in force now, not before the wait (up to TOKENIZE_TIMEOUT_S).
            prompt_cap, completion_cap = self.window_for(priority)
        # The window caps hold each sequence's context: the longest prompt's.
        prompt = max(counts)
        window = rules.apply_window(
            prompt,
            generation.requested,
            prompt_cap,
            completion_cap,
            self.settings.min_completion_tokens,
        )
        if window.refusal == "prompt_over_window":
            self._counters.rejected["prompt_over_window"] += 1
            return _error(
                400,
                f"prompt of {prompt} tokens is over kvguard's current limit of {prompt_cap}"
                " tokens (the KV cache is under pressure); shorten it or retry later",
                "invalid_request_error",
                code="kv_window_exceeded",
            )
        if window.refusal == "no_room_for_completion":
            self._counters.rejected["no_room_for_completion"] += 1
            return _error(
                400,
                f"prompt of {prompt} tokens leaves less than"
                f" {self.settings.min_completion_tokens} tokens under kvguard's current"
                f" limit of {completion_cap} tokens (the KV cache is under pressure);"
                " shorten it or retry later",
                "invalid_request_error",
                code="kv_window_exceeded",
            )
        if window.clamped and window.max_tokens is not None:
            shapes.clamp(payload, generation, window.max_tokens)
            self._counters.clamped += 1
            body = json.dumps(payload).encode()
        # Every sequence holds its prompt and its answer: n per prompt, in all.
        prompt_total, max_total = rules.sequence_totals(
            counts, generation.samples, window.max_tokens
        )
        tracked = InflightRequest(request_id, priority, prompt_total, max_total)
        tracked.sequences = generation.sequences
        tracked.streamed = payload.get("stream") is True
        tracked.clamped = window.clamped
        tracked.answer_limit = window.max_tokens
        if single and estimate is not None:
            tracked.prompt_estimate = estimate  # the engine's count, when it comes, teaches
        tracked.kind = _kind_of(payload, request.path, priority)
        if self.settings.admission == "observed":
            self._reserve(tracked, window.max_tokens, prompt)
        else:  # reserved at max_tokens (own() assumes UNKNOWN_MAX_TOKENS without one)
            asked = window.max_tokens
            tracked.reserved_from = (
                f"{asked} output tokens (max_tokens)"
                if asked is not None
                else f"{rules.UNKNOWN_MAX_TOKENS} output tokens (default)"
            )
        if (
            not known.exact
            and not decides
            and single
            and self._worth_counting(tracked, measured[0], generation.samples)
        ):
            # The estimate may be what decides: it errs high on plain text but low on
            # text dense in tokens (digits, code, other scripts), so a prompt is counted
            # unless it fits even at one token a byte, and is small beside the pool.
            counted = await self._counter.exact(payload, known, chat=chat, subject=subject)
            tracked.prompt_tokens = counted * generation.samples
            tracked.prompt_estimate = None  # maybe the estimate again, if /tokenize failed
            if self.settings.admission == "observed":
                self._reserve(tracked, window.max_tokens, counted)
            decides = True
        if not known.exact and not decides and single:
            tracked.prompt_key = known.key
            # While calm, a whole answer or a stream asked to end with `usage` brings the
            # engine's own count at its end: no /tokenize (a second request to the
            # engine's API server). Once pressure builds, or admission has half the
            # pool reserved, what is in flight must be known while it runs: /tokenize
            # alongside, the count in milliseconds (the estimate errs high, by up to
            # 2x on plain English: that much of the pool would stay idle).
            if (
                self.mitigations.level != "ok"
                or not _answer_has_usage(payload)
                or self.half_reserved()
            ):
                self._counter.count_later(tracked, payload, known.key, chat=chat, subject=subject)
        if parsed is not None:
            parsed()  # parsing is over: waiting for room must not pin the body budget
        if shed_class and not await self.hold_for_room(tracked):
            return (
                self.refuse_draining(priority)
                if self.draining()
                else self.shed(priority, request_id, self.hold_failed_reason(tracked))
            )
        if not await self.make_room(tracked) and not self.draining():
            why = self.pool_full_reason(tracked)
            self._counters.note_shed(priority, "kv_pool_full", why)
            # One line per shed request would flood the log in a burst: debug level; the
            # `requests_shed` summary (at most one line each SHED_LOG_EVERY_S) tells it.
            log.debug(
                "request_shed",
                request_id=request_id,
                priority=priority,
                reason="kv_pool_full",
                detail=why,
            )
            return _error(
                503,
                f"kvguard shed this {priority} request: {why};"
                f" retry after {self.mitigations.retry_after_s} s",
                "server_overloaded",
                # Its own code: the pool had no room for it, whatever the level (a client
                # can tell it from the ladder's shed, kv_cache_pressure).
                code="kv_pool_full",
                headers={"Retry-After": str(self.mitigations.retry_after_s)},
            )
        if self.draining():
            # A drain began while this one waited for a token count or for room: the
            # engine is about to restart, so it must not be forwarded now.
            return self.refuse_draining(priority)
        return body, tracked

    def _reserve(self, tracked: InflightRequest, max_tokens: int | None, prompt: int) -> None:
        """Reserve ``tracked``'s answers at what answers of its kind really use.

        Per sequence: under ``max_tokens`` (else the room the engine's context leaves
        the longest prompt), the learned quantile once enough answers were seen.
        """
        context = self.mitigations.context_tokens
        room = context - prompt if context is not None else None
        sequences = max(tracked.sequences, 1)
        # The answers still being written count too: early in a burst the short ones
        # end first, and the long ones of the same kind must not go unseen.
        running = self._inflight.running_answers() if tracked.kind is not None else []
        # One estimate of the kind's lengths gives both its quantile and its moments.
        table = self.lengths.table(tracked.kind, running) if tracked.kind else None
        if tracked.kind is not None:
            self._tables[tracked.kind] = table
            self._revision += 1
        learned = table.quantile(self.settings.reserve_quantile) if table is not None else None
        per_sequence, source = rules.reserved_answer(
            max_tokens, learned.tokens if learned is not None else None, room
        )
        tracked.reserved_output = per_sequence * sequences
        ceiling, ceiling_source = rules.reserved_answer(max_tokens, None, room)
        if source == "observed":
            # What it may really write, should it outrun the estimate (see accounting).
            tracked.output_ceiling = ceiling * sequences
        if table is not None:
            if ceiling_source == "default" and table.lengths:
                # 512 is a guess, not a limit: an answer may be as long as any seen.
                ceiling = max(ceiling, table.lengths[-1])
            tracked.expected_ceiling = ceiling
            mean, variance = table.moments(0, ceiling)
            tracked.expected_output = mean * sequences
            tracked.output_variance = variance * sequences
        tracked.reserved_from = (
            learned.describe(self.settings.reserve_quantile)
            if source == "observed" and learned is not None
            else f"{per_sequence} output tokens ({source})"
        )

    def review_outrunners(self) -> None:
        """Re-read where each answer will likely end; re-reserve each that ran past its length.

        Called every tick. Each answer's expected length and its variance (what the
        answers in flight are reserved at together) are read again given what it has
        written. Such an answer is longer than most of its kind, and the
        long ones are what a pool runs out on: it is reserved again at the
        ``reserve_quantile`` of the answers of its kind known to be longer than what
        it has written (running and cut ones counted), else — fewer than
        ``1 / (1 - reserve_quantile)`` of them known, or the quantile past every one
        that ended — at its ceiling. Between ticks its projection is twice what it
        has written.
        """
        running: list[tuple[tuple[str, str, str], int]] | None = None
        tables: dict[tuple[str, str, str], LengthTable | None] = {}
        self._revision += 1
        # The totals admission reads are kept as requests change; once a tick they are
        # computed again from every request, so no drift could outlast a tick.
        self._inflight.recount(self.mitigations.block_size)
        for tracked in self._inflight:
            if tracked.expected_ceiling is not None and tracked.kind is not None:
                # Where it will likely end, given what it has written by now.
                if running is None:
                    running = self._inflight.running_answers()
                if tracked.kind not in tables:
                    tables[tracked.kind] = self.lengths.table(tracked.kind, running)
                    self._tables[tracked.kind] = tables[tracked.kind]
                table = tables[tracked.kind]
                if table is not None:
                    sequences = max(tracked.sequences, 1)
                    mean, variance = table.moments(
                        tracked.output_per_sequence, tracked.expected_ceiling
                    )
                    tracked.expected_output = mean * sequences
                    tracked.output_variance = variance * sequences
            reserved, ceiling = tracked.reserved_output, tracked.output_ceiling
            if reserved is None or ceiling is None or tracked.kind is None:
                continue
            if tracked.generated <= reserved:
                continue
            tracked.outran = True
            if running is None:
                running = self._inflight.running_answers()
            sequences = max(tracked.sequences, 1)
            written = tracked.output_per_sequence
            learned = self.lengths.estimate(tracked.kind, running, beyond=written)
            per_sequence = ceiling // sequences if learned is None else learned.tokens
            tracked.reserved_output = max(min(per_sequence * sequences, ceiling), tracked.generated)
            quantile = f"p{self.settings.reserve_quantile * 100:g}"
            tracked.reserved_from = (
                f"{tracked.reserved_output // sequences} output tokens (its ceiling: at"
                f" {written} it is longer than all but a few answers of its kind seen)"
                if learned is None
                else f"{quantile} output {learned.tokens} tokens of the answers of its kind"
                f" longer than {written}"
            )

    def uncertain(
        self, tracked: InflightRequest, grid: list[int]
    ) -> tuple[rules.Growth, list[float] | None]:
        """``tracked``'s growth to its ceiling and its chance of still being written ahead.

        At each interval start of ``grid``, from its kind's estimated lengths given what
        it has written. Without one (nothing learned, several sequences, or an answer in
        flight that does not stream): its growth to its reservation, written for sure;
        longer than every answer seen to end: to its ceiling, for sure.
        """
        table = self._tables.get(tracked.kind) if tracked.kind is not None else None
        ceiling = tracked.expected_ceiling
        unseen = not tracked.streamed and tracked in self._inflight
        if table is None or ceiling is None or tracked.sequences != 1 or unseen:
            return self.growth(tracked), None
        written = tracked.output_per_sequence
        block = self.mitigations.block_size
        to_ceiling = rules.growth(
            tracked.footprint_tokens,
            rules.whole_blocks(tracked.prompt_tokens + max(ceiling, written), block),
            1,
            block,
        )
        chances = table.still_writing(written, ceiling, [written + s for s in grid[:-1]])
        if chances is None:
            return to_ceiling, None
        return to_ceiling, chances

    def spread_z(self) -> float | None:
        """The spread bound's ``z`` (from ``reserve_quantile``), None where it is not used."""
        quantile = self._pooling_quantile()
        return NormalDist().inv_cdf(quantile) if 0.5 < quantile < 1.0 else None

    def overrunning(self, now: float, ahead_s: float | None = None) -> list[InflightRequest]:
        """The answers to cancel now, so the engine's pool lasts.

        Called every tick, at ``now`` (monotonic seconds), with the engine's fresh
        count. Learned reservations are a quantile, and the answers in flight are
        reserved together at a quantile of their total: a few answers run past their
        own, and now and then the set runs past its — when several long ones run at
        once they can fill the pool on their own, which an engine that allocates per
        sequence does not survive, and one that preempts pays for in recompute.

        When the engine's count plus what the answers write in ``ahead_s`` (the
        daemon passes :data:`~kvguard.core.admission.OVERRUN_READINGS_AHEAD` of its
        shortest poll intervals: the next reading can come late; None: that many
        intervals like the last) would pass the pool, and what is in flight, each
        reserved at what it may still reach, does not fit it (else the growth was
        prompts admitted into reserved room), answers go until it would not: first
        those past their reservation, lowest class first and within a class the
        newest (the least work lost); then, if that is not enough, the others that
        hold the pool, lowest class first and within a class the largest (the fewest
        clients cut). A critical answer only when cutting every other one would not
        be enough and cutting critical ones too would, and the answers in flight run
        to their caps would not end within the pool (:meth:`_peak_at_ceilings`): the
        engine would fail, and lose every critical answer in flight.
        Only while admission is enforced (not in dry-run), and only for an engine that
        fails when its pool runs out (``Mitigations.kv_exhaustion``): one that
        preempts resumes the answer later.
        """
        used, pool = self.mitigations.engine_used_tokens, self.mitigations.pool_tokens
        if used is None:
            return []  # a failed read: the last good one stays the reference
        last, self._last_used = self._last_used, used
        last_at, self._last_read_at = self._last_read_at, now
        requests = list(self._inflight)
        written = self._answer_growth(requests, None if last is None else used - last)
        if pool is None or written is None or last_at is None or not self.admission_enforced():
            return []
        if self.mitigations.kv_exhaustion == "preempt":
            # The engine preempts the newest answer and resumes it once room frees:
            # a stall for one client, where a cancel would lose its answer.
            return []
        growth, writing = written
        elapsed = now - last_at
        if ahead_s is None:
            growth *= rules.OVERRUN_READINGS_AHEAD
        elif elapsed > 0:
            growth *= ahead_s / elapsed
        if used + growth <= pool:
            return []
        block = self.mitigations.block_size
        reserved = sum(rules.whole_blocks(r.reachable_tokens, block) for r in requests)
        if reserved <= pool and used <= reserved:
            # What is in flight, each reserved at what it may still reach, fits: the
            # growth was prompts just admitted into reserved room, not answers outgrowing.
            # Not so where the engine holds more than all of it: answers that do not
            # stream ran past their reservations unseen (their progress shows only in
            # the engine's count), or traffic that bypasses kvguard fills the pool.
            return []
        held = self._holdings(requests, used)
        order = {id(r): i for i, r in enumerate(requests)}
        cancellable = [r for r in requests if not r.cancelled and r.cancel is not None]

        def in_order(critical: bool) -> list[InflightRequest]:
            ours = [r for r in cancellable if (r.priority == "critical") is critical]
            past = sorted(
                (r for r in ours if r.outran), key=lambda r: (rank(r.priority), -order[id(r)])
            )
            # Within their reservations but holding the pool: the set ran past its quantile.
            holding = sorted(
                (r for r in ours if not r.outran and held[id(r)] > 0),
                key=lambda r: (rank(r.priority), -held[id(r)], -order[id(r)]),
            )
            return past + holding

        others = in_order(critical=False)
        plan = others
        if any(r.priority == "critical" for r in cancellable):
            # Critical answers last, and only where cutting every other one would not
            # keep the engine alive but cutting some of them too would: an engine that
            # dies loses every critical answer in flight.
            sizes = [rules.whole_blocks(held[id(r)], block) for r in others]
            n = rules.overrun_cancels(used, growth, pool, sizes, writing)
            # The growth ahead is read as linear; answers that end at their caps meanwhile
            # free all they hold. Where every answer in flight would end within the pool
            # (their peak step by step, each written to its cap), no critical one is cut.
            if not rules.pool_lasts(used, growth, pool, sizes, writing, cancels=n) and (
                (peak := self._peak_at_ceilings(requests, held, used)) is None or peak > pool
            ):
                everyone = others + in_order(critical=True)
                sizes = [rules.whole_blocks(held[id(r)], block) for r in everyone]
                m = rules.overrun_cancels(used, growth, pool, sizes, writing)
                if rules.pool_lasts(used, growth, pool, sizes, writing, cancels=m):
                    plan = everyone
        footprints = [rules.whole_blocks(held[id(r)], block) for r in plan]
        return plan[: rules.overrun_cancels(used, growth, pool, footprints, writing)]

    def _peak_at_ceilings(
        self, requests: list[InflightRequest], held: dict[int, int], used: int
    ) -> int | None:
        """The most the pool will hold if every answer in flight runs to its cap; None: uncapped.

        Each holds what it holds now (``held``, from :meth:`_holdings`) and writes a
        token per sequence per step until it reaches its cap (``max_tokens``, else the
        room its context leaves), then frees all it holds; what the engine holds
        beyond them stays. The peak step by step (:class:`~kvguard.core.admission.Envelope`).
        """
        block = self.mitigations.block_size
        growths = []
        for tracked in requests:
            cap = tracked.output_ceiling
            if cap is None:
                cap = tracked.max_tokens
            if cap is None:
                return None
            final = rules.whole_blocks(tracked.prompt_tokens + max(cap, tracked.generated), block)
            holds = held[id(tracked)]
            growths.append(rules.growth(holds, max(final, holds), tracked.sequences, block))
        beyond = max(used - sum(held.values()), 0)
        return rules.Envelope(growths).peak + beyond

    def _holdings(self, requests: list[InflightRequest], used: int) -> dict[int, int]:
        """What each request in flight holds in the engine now (by ``id``), as best known.

        A streamed answer's is its prompt and what it wrote. One that does not stream
        is seen only at its end: what the engine holds beyond everything kvguard sees
        is shared equally among such answers (each has written one token a step since
        it began, as the others have), so cancelling one is known to free its part.
        """
        held = {id(r): r.footprint_tokens for r in requests}
        unseen = [r for r in requests if r.progress_unseen]
        beyond = used - sum(held.values())
        if unseen and beyond > 0:
            for tracked in unseen:
                held[id(tracked)] += beyond // len(unseen)
        return held

    def _answer_growth(
        self, requests: list[InflightRequest], engine_growth: int | None
    ) -> tuple[float, int] | None:
        """What the answers in flight wrote since the last tick; the sequences writing.

        Not the engine's own growth since its last reading: that also counts the
        prompts it just took in, once, into room admission reserved for them — read
        as growth to come, it cancels the requests just admitted, and the room they
        leave admits the next ones (a churn). Answers write one token per sequence
        per step for as long as they run, so: the engine's steps since the last
        tick — at least the most any streamed answer wrote per sequence since then
        (all it wrote, for one that came since) — times the sequences writing (those
        that have written, and any that does not stream: kvguard cannot see its
        progress). With no streamed answer in flight: the engine's growth less the
        prompts of the requests that came since. None before the engine's second
        reading.
        """
        previous, self._written = (
            self._written,
            {id(r): (r, r.output_per_sequence) for r in requests},
        )
        if engine_growth is None:
            return None
        steps: int | None = None
        prompts = 0
        for key, (tracked, written) in self._written.items():
            before = previous.get(key)
            since = 0  # what it had written at the last tick: nothing, if it came since
            if before is not None and before[0] is tracked:
                since = before[1]
            else:
                prompts += tracked.prompt_tokens
            if tracked.streamed:
                steps = max(steps or 0, written - since)
        writing = sum(max(r.sequences, 1) for r in requests if r.generated > 0 or not r.streamed)
        if steps is None:
            return float(max(engine_growth - prompts, 0)), writing
        return float(steps * writing), writing

    def half_reserved(self) -> bool:
        """Whether admission is enforced and half the pool or more is reserved."""
        pool = self.mitigations.pool_tokens
        if not self.admission_enforced() or pool is None:
            return False
        projection = self.projection()
        # The sum bounds what is in flight from above: below half, no peak is needed.
        return projection.summed * 2 >= pool and projection.in_flight * 2 >= pool

    def admits_now(self, tracked: InflightRequest) -> bool:
        """Whether admission would let ``tracked`` in at once (True when it is not enforced)."""
        if not self.admission_enforced():
            return True
        critical = tracked.priority == "critical"
        projection = self.projection()
        return rules.admits(
            projection.summed,  # whether anything is in flight (Projection.in_flight)
            self.own(tracked),
            self.mitigations.pool_tokens,
            self._terms(critical=critical).ratio,
            critical=critical,
            with_it=projection.with_it(tracked, self._limit(critical=critical)),
        )

    def _worth_counting(
        self, tracked: InflightRequest, measured: PromptCount, samples: int
    ) -> bool:
        """Whether ``tracked``'s prompt, at the most it can be, must be counted before it goes in.

        When it would not fit now, or when it may hold more than
        :data:`COUNT_SHARE_OF_POOL` of the pool: several such prompts admitted at their
        estimates at once could fill it in their prefill, before any count comes back.
        ``tracked`` (not in flight yet) is measured at that most (:func:`_most_prompt`,
        from its text as ``measured``, ``samples`` sequences) and left as it was.
        """
        if not self.admission_enforced():
            return False  # nothing is decided from its size
        most = _most_prompt(tracked, measured, samples)
        pool = self.mitigations.pool_tokens
        if pool is not None and most > pool * COUNT_SHARE_OF_POOL:
            return True
        prompt, max_tokens = tracked.prompt_tokens, tracked.max_tokens
        tracked.prompt_tokens = most
        try:
            return not self.admits_now(tracked)
        finally:
            # own() fills a missing max_tokens: the request goes on as it came.
            tracked.prompt_tokens, tracked.max_tokens = prompt, max_tokens

    def _limit(self, *, critical: bool) -> float | None:
        """What a request of the class may fill: ``ratio`` of the pool (None: unknown)."""
        pool = self.mitigations.pool_tokens
        return None if pool is None else pool * self._terms(critical=critical).ratio

    def inflight_requests(self) -> list[InflightRequest]:
        """The requests in flight now."""
        return list(self._inflight)

    def _terms(self, *, critical: bool) -> rules.AdmissionTerms:
        """The share of the pool a request may fill, and how long it may wait for it."""
        settings = self.settings
        return rules.admission_terms(
            critical=critical,
            admission_ratio=settings.admission_ratio,
            admission_wait_s=settings.admission_wait_s,
            read_timeout_s=settings.read_timeout_s,
        )

    def pool_full_reason(self, tracked: InflightRequest) -> str:
        """Why ``tracked`` found no room, in numbers a person can check.

        ``projected 11,920 of the 11,440 KV tokens admission fills (0.95 of the
        12,042-token pool) with it, after waiting 5 s; its answer reserved at p95
        output 310 tokens (of 240 answers)``.
        """
        pool = self.mitigations.pool_tokens or 0
        ratio = self.settings.admission_ratio
        limit = math.floor(pool * ratio)
        own = self.own(tracked)
        reserved = self.reserved()
        projection = self.projection()
        in_flight, with_it = projection.in_flight, projection.with_it(tracked)
        of = f"the {limit:,} KV tokens admission fills ({ratio:g} of the {pool:,}-token pool)"
        sized = f"; its answer reserved at {tracked.reserved_from}" if tracked.reserved_from else ""
        quantile = self._pooling_quantile()
        if tracked.expected_output is not None and quantile < 1.0:
            # Reserved together: what a person checks against the figures above.
            sized += (
                f", expected to write {math.ceil(tracked.expected_output):,};"
                f" the in-flight answers reserved together at the p{quantile * 100:g}"
                " of their total"
            )
        if own > limit:
            return f"it alone reserves {own:,} tokens, more than {of}{sized}"
        why = f"projected {with_it:,} of {of} with it"
        if tracked.passed_over_for is not None:
            return (
                f"{why}, and {tracked.passed_over_for} requests are waiting for room ahead of"
                f" it (room goes to the higher class first), so it was not held{sized}"
            )
        if with_it < projection.summed + own:
            why += (
                f" (at its peak, step by step: the {projection.summed + own:,} reserved in"
                " all are never held at once)"
            )
        elif in_flight > reserved:
            why += f" (in flight per the engine's own count: {in_flight:,})"
        if with_it <= limit:
            why = f"the room that freed went to higher classes or newer requests waiting ({why})"
        return f"{why}, {self._waited(tracked)}{sized}"

    def _waited(self, tracked: InflightRequest) -> str:
        """How long ``tracked`` waited for room, and why no longer (overload), in words."""
        settings = self.settings
        waited = tracked.waited_s
        if waited is None:  # not held at all (it could never fit)
            return f"after waiting {settings.admission_wait_s:g} s"
        overloaded = (tracked.queue_age_s or 0.0) + waited > settings.admission_wait_s
        if overloaded and waited < settings.admission_wait_s - 1e-3:
            return (
                f"after waiting {waited:.2g} s (requests had waited for room without a"
                f" break for {(tracked.queue_age_s or 0.0) + waited:.1f} s, longer than"
                f" admission_wait_s {settings.admission_wait_s:g} s: overload, so a request"
                f" waits overload_wait_s {settings.overload_wait_s:g} s at most)"
            )
        return f"after waiting {waited:.2g} s"

    def window_for(self, priority: str) -> tuple[int | None, int | None]:
        """The (prompt, completion) caps in force for ``priority`` now (none for critical)."""
        return rules.caps_for(priority, self.mitigations.window)

    def draining(self) -> bool:
        """Whether every generation request is refused now: the engine is drained to restart."""
        return self.mitigations.draining and self.mitigations.enforcing

    def admission_enforced(self) -> bool:
        """Whether projected admission checks each request against the pool now."""
        mitigations = self.mitigations
        return rules.admission_enforced(
            self.settings.admission, enforcing=mitigations.enforcing, pool=mitigations.pool_tokens
        )

    def refuse_draining(self, priority: str) -> web.StreamResponse:
        """The 503 for every class (critical too) while the engine is drained for a restart."""
        retry_after = self.mitigations.drain_retry_after_s
        self._counters.note_shed(
            priority, "draining", "kvguard is restarting the engine to change its KV cache"
        )
        return _error(
            503,
            f"kvguard is restarting the engine to change its KV cache; retry after {retry_after} s",
            "server_overloaded",
            code="kv_cache_reconfigure",
            headers={"Retry-After": str(retry_after)},
        )

    def not_held_reason(self) -> str:
        """Why a request of a shed class was not even held for room, in checkable figures."""
        pool, ratio = self.mitigations.pool_tokens, self.settings.shed_ratio
        if pool is None:
            return "the engine's pool is not known yet, so none is held for room"
        if ratio <= 0:
            return "shed_ratio is 0: the whole class is shed"
        bound = math.floor(pool * ratio * rules.HELD_POOLS)
        return (
            f"{self.held_tokens:,} KV tokens of requests are held for room already, the most"
            f" kvguard holds ({rules.HELD_POOLS} x shed_ratio {ratio:g} of the {pool:,}-token"
            f" pool: {bound:,})"
        )

    def hold_failed_reason(self, tracked: InflightRequest) -> str:
        """Why a held request of a shed class found no room, in figures a person can check."""
        pool, ratio = self.mitigations.pool_tokens, self.settings.shed_ratio
        if pool is None or ratio <= 0:
            return self.not_held_reason()
        own, limit = self.own(tracked), math.floor(pool * ratio)
        of = (
            f"the {limit:,} KV tokens a shed class may fill"
            f" (shed_ratio {ratio:g} of the {pool:,}-token pool)"
        )
        if own > limit:
            return f"it alone reserves {own:,} tokens, more than {of}"
        with_it = self.projection().with_it(tracked)
        if not self.may_hold(own) and with_it > limit:
            return self.not_held_reason()
        return (
            f"projected {with_it:,} of {of} with it, after holding it up to"
            f" {self.settings.shed_wait_s:g} s"
        )

    def shed(self, priority: str, request_id: str, why: str = "") -> web.StreamResponse:
        """The 503 for a request of a class the policy sheds now (``why``: the figures)."""
        self._counters.note_shed(
            priority,
            "kv_cache_pressure",
            f"the ladder sheds classes up to {self.mitigations.shed_floor or priority}"
            f" (pressure level {self.mitigations.level})" + (f"; {why}" if why else ""),
        )
        # One line per shed request would flood the log in a burst: debug level; the
        # `requests_shed` summary (at most one line each SHED_LOG_EVERY_S) tells the story.
        log.debug(
            "request_shed",
            request_id=request_id,
            priority=priority,
            pressure_level=self.mitigations.level,
        )
        return _error(
            503,
            f"kvguard is shedding {priority} traffic: the KV cache is under pressure"
            f" ({self.mitigations.level}){'; ' + why if why else ''};"
            f" retry after {self.mitigations.retry_after_s} s",
            "server_overloaded",
            code="kv_cache_pressure",
            headers={"Retry-After": str(self.mitigations.retry_after_s)},
        )

    def own(self, tracked: InflightRequest) -> int:
        """``tracked``'s projection in whole blocks (no ``max_tokens``: assume a long answer).

        Where its expected length is known, what it adds to the in-flight set's
        reservation at most: its expected tokens plus ``z`` of its own standard
        deviation (the pooled margin grows by less), never more than its projection.
        """
        if tracked.max_tokens is None:
            tracked.max_tokens = rules.UNKNOWN_MAX_TOKENS  # the engine picks; assume a long answer
        block = self.mitigations.block_size
        alone = rules.whole_blocks(tracked.projected_tokens, block)
        quantile = self._pooling_quantile()
        if tracked.expected_output is None or quantile >= 1.0:
            return alone
        return rules.pooled_reservation(
            alone,
            rules.whole_blocks(tracked.expected_tokens, block),
            tracked.output_variance,
            quantile,
        )

    def _pooling_quantile(self) -> float:
        """The quantile of the in-flight total reserved: 1 (each alone) unless ``observed``."""
        return self.settings.reserve_quantile if self.settings.admission == "observed" else 1.0

    def reserved(self) -> int:
        """What the in-flight requests are reserved at together (before the engine's floor).

        Their projections summed (or pooled: :meth:`own`), what they hold at their
        peak step by step (:class:`~kvguard.core.admission.Envelope`), or its spread
        bound (:class:`~kvguard.core.admission.SpreadProfile`): the least.
        """
        envelope = self.envelope()
        least = min(self._summed(), envelope.peak)
        profile = Projection(least, 0, self, envelope).profile()
        return least if profile is None else min(least, profile.peak_with())

    def _summed(self) -> int:
        return self._inflight.projected_tokens(
            self.mitigations.block_size, self._pooling_quantile()
        )

    def envelope(self) -> rules.Envelope:
        """The in-flight requests' peak step by step (:class:`~kvguard.core.admission.Envelope`)."""
        return rules.Envelope(self.growth(r) for r in self._inflight)

    def growth(self, tracked: InflightRequest) -> rules.Growth:
        """How ``tracked``'s hold on the pool grows step by step to its projection.

        An answer in flight that does not stream is seen only at its end: it may have
        written nearly all of it already, or have just begun, so it holds its whole
        projection until the latest it can end (as the sum reserves it).
        """
        block = self.mitigations.block_size
        if not tracked.streamed and tracked in self._inflight:
            final = rules.whole_blocks(tracked.projected_tokens, block)
            sequences = max(tracked.sequences, 1)
            return rules.Growth(final, 0, -(-(final - tracked.prompt_tokens) // sequences))
        return rules.growth(
            tracked.footprint_tokens,
            rules.whole_blocks(tracked.projected_tokens, block),
            tracked.sequences,
            block,
        )

    def projection(self) -> Projection:
        """What is in flight now, and with one more request: one reading for many checks."""
        mitigations = self.mitigations
        used, held = mitigations.engine_used_tokens, self._inflight.total_tokens
        key = (
            self._inflight.version,
            held,
            used,
            mitigations.block_size,
            self._revision,
            self.settings.admission,
            self.settings.reserve_quantile,
        )
        cached = self._projection
        if cached is not None and cached[0] == key:
            return cached[1]
        summed = rules.in_flight_tokens(self._summed(), used)
        # The engine's count above what the proxy's requests hold: traffic that
        # bypasses the proxy. It holds on for as long as anything can tell.
        unseen = 0 if used is None else max(used - held, 0)
        projection = Projection(summed, unseen, self)
        self._projection = (key, projection)
        return projection

    def room_under(self, ratio: float, tracked: InflightRequest) -> bool:
        """Whether in-flight projections with ``tracked`` stay within ``ratio`` of the pool."""
        pool = self.mitigations.pool_tokens
        if pool is None:
            return False  # no room to show; and no need to sum what is in flight
        return self.projection().with_it(tracked, pool * ratio) <= pool * ratio

    def in_flight(self) -> int:
        """Tokens in flight: the requests' projections, never under the engine's own count."""
        return self.projection().in_flight

    def may_hold(self, own: int = 0) -> bool:
        """Whether a request of a shed class (``own`` tokens, 0 while not yet known) may be held."""
        return rules.may_hold(
            self.held_tokens, self.mitigations.pool_tokens, self.settings.shed_ratio, own
        )

    async def hold_for_room(self, tracked: InflightRequest) -> bool:
        """Hold a request of a shed class until it fits ``shed_ratio`` of the pool.

        Shedding a whole class empties the pool between bursts (and the level holds
        for ``hold_s``); holding each request for at most ``shed_wait_s`` until the
        in-flight projections plus its own fit ``shed_ratio`` of the pool sheds only
        the excess. The held requests are bounded: at most ``HELD_POOLS`` pools' worth.
        """
        own = self.own(tracked)
        # Checked again here, with nothing awaited between the check and the add: in a
        # burst, many requests pass admit's early check together while their prompts
        # are tokenized, and would all be held past the bound.
        if not self.room_under(self.settings.shed_ratio, tracked) and not self.may_hold(own):
            return False
        self.held_tokens += own
        try:
            return (
                await self.wait_until(
                    # A release (the ladder's or an operator's) lets it in at once.
                    lambda: (
                        not self.mitigations.sheds(tracked.priority)
                        or self.room_under(self.settings.shed_ratio, tracked)
                    ),
                    self.settings.shed_wait_s,
                )
                and not self.draining()
            )
        finally:
            self.held_tokens -= own

    async def wait_until(
        self, fits: Callable[[], bool], wait_s: float, *, until: float | None = None
    ) -> bool:
        """Wait up to ``wait_s`` (or until loop time ``until``) for ``fits()``.

        ``fits()`` is re-checked as requests finish.
        """
        if fits():
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s if until is None else until
        self.waiting += 1
        try:
            while not fits():
                if self.draining():
                    return False  # the caller refuses it: the engine is about to restart
                left = deadline - loop.time()
                if left <= 0:
                    return False
                with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                    await asyncio.wait_for(self._room_freed.wait(), left)
            return True
        finally:
            self.waiting -= 1

    async def make_room(self, tracked: InflightRequest) -> bool:
        """With ``admission = "projected"``, wait until the request fits the pool.

        A request fits when every in-flight request's projection (prompt +
        ``max_tokens``, in whole blocks) plus its own stays within
        ``admission_ratio`` of the engine's usable pool. It waits up to
        ``admission_wait_s`` for others to finish (``overload_wait_s`` once the queue
        is older than that: :func:`~kvguard.core.admission.admission_deadline`), then
        is shed. Critical requests
        are never shed: they may use the whole pool (not just ``admission_ratio``)
        and wait for room as long as ``read_timeout_s`` — letting one in regardless
        is what would crash an engine that allocates per sequence. An unknown pool
        and dry-run admit everything. No poll interval stands between a burst and
        this check: it is what keeps an engine that crashes on exhaustion alive.
        """
        if not self.admission_enforced():
            return True
        mitigations = self.mitigations
        critical = tracked.priority == "critical"
        terms = self._terms(critical=critical)
        own = self.own(tracked)
        own_rank = rank(tracked.priority)

        self._tickets += 1
        ticket = self._tickets

        def fits() -> bool:
            # Room that frees goes to the highest class waiting for it first: a lower
            # class waits while a higher one does (it would take the room first).
            if any(waiting for r, waiting in self._waiting_ranks.items() if r > own_rank):
                return False
            # Re-read at each check: the pool may become unknown while waiting.
            projection, pool = self.projection(), mitigations.pool_tokens
            in_flight = projection.summed  # whether anything is in flight (Projection.in_flight)
            # Within a class, the newest that fits first ("adaptive LIFO", Facebook's
            # "Fail at Scale"): a queue only forms under overload, and then the request
            # that just came can still be answered in time, while the one that waited
            # longest is the likeliest to have given up; it gets its 503 at its wait's
            # end. A newer one too large for the room now does not block it.
            same = self._waiting_ranks.get(own_rank, {})
            if any(
                other > ticket
                and rules.admits(
                    in_flight,
                    self.own(newer),
                    pool,
                    terms.ratio,
                    critical=critical,
                    with_it=projection.with_it(newer, self._limit(critical=critical)),
                )
                for other, newer in same.items()
            ):
                return False
            return rules.admits(
                in_flight,
                own,
                pool,
                terms.ratio,
                critical=critical,
                with_it=projection.with_it(tracked, self._limit(critical=critical)),
            )

        if fits():
            return True
        pool = mitigations.pool_tokens
        if not critical and pool is not None and own > pool * terms.ratio:
            return False  # it could never fit: waiting would only block the others
        # Room that frees goes to the higher class first: a request the pool has no room
        # for now could go in only once that queue is gone, the likeliest moment for the
        # next burst. Held, it would get its 503 after the wait (its client's retry later
        # still) and, admitted that late, take room from fresher requests for an answer
        # its client may no longer want. Its 503 now lets the client retry or go
        # elsewhere while that is still worth it. Not while its kind's lengths are
        # unknown: reserved at max_tokens (a guess that errs high), the pool looks full
        # long before it is, and the queue ahead clears as soon as a few answers end (a
        # 503 then would be a false alarm on traffic that fits, at every start).
        # (Under "projected" nothing is learned: every request is reserved at max_tokens.)
        learned = tracked.expected_output is not None
        tracked.passed_over_for = (
            self.higher_class_waiting(own_rank) if learned and not critical else None
        )
        if tracked.passed_over_for is not None and (
            self._someone_fits() or self._fits_room_left(tracked, own)
        ):
            # The higher class is about to go in (woken, not yet resumed), or the pool
            # has room for this one now and it waits only for the order: what holds it
            # is not the pool, and the queue ahead goes as soon as room frees for it (a
            # 503 at once shed such requests on mixed traffic, where a large critical
            # one waits while small ones would still fit).
            tracked.passed_over_for = None
        if tracked.passed_over_for is not None:
            return False
        waiting = self._waiting_ranks.setdefault(own_rank, {})
        waiting[ticket] = tracked
        now = asyncio.get_running_loop().time()
        if self._queue_since is None:
            self._queue_since = now
        until = (
            None  # a critical request is never shed: it waits read_timeout_s
            if critical
            else rules.admission_deadline(
                now, self._queue_since, terms.wait_s, self.settings.overload_wait_s
            )
        )
        tracked.queue_age_s = now - self._queue_since
        admitted = False
        try:
            admitted = await self.wait_until(fits, terms.wait_s, until=until)
            return admitted
        finally:
            waiting.pop(ticket, None)
            if not any(self._waiting_ranks.values()):
                self._queue_since = None
            if not admitted:
                tracked.waited_s = asyncio.get_running_loop().time() - now
            # Not admitted, it leaves room it blocked others from. Admitted, it took some
            # room, and the rest may still fit others: in a wake-up only one request of
            # a class goes (the newest that fits; the older ones re-wait behind it), so
            # without this the others would wait for the next request to end, and the
            # oldest run out their wait with room to spare.
            if not admitted or self._someone_fits():
                self.wake()

    def _fits_room_left(self, tracked: InflightRequest, own: int) -> bool:
        """Whether a request that is not critical fits the room left now, queues aside."""
        return self._fits(self.projection(), tracked, own, critical=False)

    def _fits(
        self, projection: Projection, tracked: InflightRequest, own: int, *, critical: bool
    ) -> bool:
        """Whether ``tracked`` (reserving ``own``) fits beside ``projection``, queues aside."""
        return rules.admits(
            projection.summed,  # whether anything is in flight (Projection.in_flight)
            own,
            self.mitigations.pool_tokens,
            self._terms(critical=critical).ratio,
            critical=critical,
            with_it=projection.with_it(tracked, self._limit(critical=critical)),
        )

    def higher_class_waiting(self, own_rank: int) -> str | None:
        """The highest class above ``own_rank`` with requests waiting for room, or None."""
        above = [r for r, waiting in self._waiting_ranks.items() if r > own_rank and waiting]
        return None if not above else PRIORITIES[max(above)]

    def _someone_fits(self) -> bool:
        """Whether a request waiting for room would fit it now (the highest class waiting)."""
        projection = self.projection()
        for own_rank in sorted(self._waiting_ranks, reverse=True):
            waiting = self._waiting_ranks[own_rank]
            if not waiting:
                continue
            critical = own_rank == CRITICAL_RANK
            # A lower class waits while this one does: only this class can go now.
            return any(
                self._fits(projection, waiter, self.own(waiter), critical=critical)
                for waiter in waiting.values()
            )
        return False


@dataclass
class Projection:
    """What the in-flight requests project, read once for several admission checks.

    Bounds of what they will hold at once, the least taken: their projections summed
    (pooled under ``observed``), never under the engine's count; their peak step by
    step (:class:`~kvguard.core.admission.Envelope`) plus what the engine holds
    beyond them; and, where lengths are learned and the others refuse, the spread
    bound of that peak (:class:`~kvguard.core.admission.SpreadProfile`).

    The sum is kept as requests change (O(1) to read); the peak step by step needs
    every request in flight, sorted, so it is built only when the sum does not settle
    the question (most requests, on a pool that is not nearly full, never need it).
    """

    summed: int
    unseen: int
    admission: Admission
    _envelope: rules.Envelope | None = None
    _profile: rules.SpreadProfile | None = None
    _horizon: int = 0

    @property
    def envelope(self) -> rules.Envelope:
        """The in-flight requests' peak step by step (built on first use)."""
        if self._envelope is None:
            self._envelope = self.admission.envelope()
        return self._envelope

    @property
    def in_flight(self) -> int:
        """Tokens in flight now: the lesser bound.

        0 exactly when :attr:`summed` is (every request in flight holds or will write
        something, so its peak is above 0 whenever its projection is): where only
        whether anything is in flight matters (:func:`~kvguard.core.admission.admits`
        given ``with_it``), :attr:`summed` answers it without the peak.
        """
        if not self.summed:
            return 0  # nothing reserved, nothing counted by the engine: no peak to find
        return min(self.summed, self.envelope.peak + self.unseen)

    def with_it(self, tracked: InflightRequest, limit: float | None = None) -> int:
        """Tokens in flight with ``tracked`` admitted too: the least bound.

        With ``limit`` (what it is compared with), a bound that is within it is
        returned as soon as one is found: the sum first (O(1)), then the peak step by
        step, then the spread bound, the costliest. Without ``limit``, the least.
        """
        admission = self.admission
        own = admission.own(tracked)  # first: it sets a missing max_tokens
        summed = self.summed + own
        if limit is not None and summed <= limit:
            return summed
        peak = self.envelope.peak_with(admission.growth(tracked)) + self.unseen
        cheap = min(summed, peak)
        if limit is not None and cheap <= limit:
            return cheap
        profile = self.profile()
        if profile is None:
            return cheap
        grows, chances = admission.uncertain(tracked, profile.grid)
        sizes, odds = rules.spread_terms(grows, profile.grid, chances)
        spread = profile.peak_with(sizes, odds)
        if grows.steps > self._horizon:
            # Past every answer in flight's ceiling only it may be left, all of it.
            spread = max(spread, grows.held + grows.per_step * grows.steps)
        return min(cheap, spread + self.unseen)

    def profile(self) -> rules.SpreadProfile | None:
        """The in-flight requests' spread bound (built once), None where it is not used."""
        z = self.admission.spread_z()
        if z is None or not len(self.envelope):
            return None
        if self._profile is None:
            admission = self.admission
            requests = list(admission.inflight_requests())
            horizon = 0
            for tracked in requests:
                grows, _ = admission.uncertain(tracked, [0, 1])
                horizon = max(horizon, grows.steps)
            grid = rules.step_grid(horizon)
            terms = []
            for tracked in requests:
                grows, chances = admission.uncertain(tracked, grid)
                terms.append(rules.spread_terms(grows, grid, chances))
            self._profile = rules.SpreadProfile(grid, terms, z)
            self._horizon = horizon
        return self._profile


def _reads_as_chat(shape: str, payload: object) -> bool:
    """Whether the body's prompt is ``messages`` (what the OpenAI checks look at)."""
    if shape in ("chat", "messages", "ollama_chat"):
        return True
    # Every engine's /invocations shape (vllm_invocations, sglang_invocations, ...).
    invocations = shape.endswith("invocations")
    return invocations and isinstance(payload, dict) and "messages" in payload


def _measure_all(payload: dict[str, Any], generation: shapes.Generation) -> list[PromptCount]:
    """Each prompt of ``generation`` measured (:func:`.counting.measure_prompt`): pure."""
    return [
        measure_prompt(payload, chat=generation.chat, subject=prompt)
        for prompt in generation.prompts
    ]


def _most_prompt(tracked: InflightRequest, measured: PromptCount, samples: int) -> int:
    """The most ``tracked``'s prompt can hold: one token a byte of its text.

    The byte-based estimate (``ESTIMATE_BYTES_PER_TOKEN`` bytes a token, then scaled by
    what the engine counted for recent prompts) errs high on plain English and low on
    text dense in tokens: a CSV of digits is about one token a byte, three times the
    estimate (found by an adversarial client run: three such prompts, admitted at
    their estimates, filled a small pool in their prefill). No tokenizer of the
    engines kvguard guards writes more tokens than bytes (byte-level BPE and byte
    fallback cover one byte a token at least).
    """
    return max(measured.count * ESTIMATE_BYTES_PER_TOKEN * max(samples, 1), tracked.prompt_tokens)


def _kind_of(payload: Mapping[str, Any], path: str, priority: str) -> tuple[str, str, str]:
    """(model, route, priority): the kind of request whose answer lengths are learned together.

    Bounded strings: a client chooses the model's name (the number of kinds kept is
    bounded by :class:`~kvguard.core.lengths.LengthTerms`).
    """
    model = payload.get("model")
    return (model[:128] if isinstance(model, str) else "", path[:128], priority)
