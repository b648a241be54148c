"""Per-request KV accounting: what each in-flight request holds in the cache.

Engines do not say which request holds how much cache; the proxy does: the prompt's
tokens (the engine's count — its ``/tokenize``, or its answer's ``usage`` — else a
conservative estimate), plus the tokens generated so far. A request's *footprint* is
prompt + generated tokens; its *projection* is prompt + ``max_tokens``. Bytes are
tokens x the budget's KV bytes per token per GPU, when a budget is configured.

The estimates and the cache key read a prompt's parsed values as they are: a prompt
is never written out again to be measured or hashed, which would cost one more copy
of a body of up to ``[proxy] max_body_bytes`` (and far more for one of many small
values), and they never raise on text the client sent (a lone surrogate included).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

from kvguard.core.admission import pooled_reservation, whole_blocks
from kvguard.core.histogram import TOKEN_BUCKETS, Histogram

# Real tokenizers average ~4 bytes of English per token; 3 overestimates the prompt,
# which is the safe side when the question is "will it fit".
ESTIMATE_BYTES_PER_TOKEN = 3
CHAT_TOKENS_PER_MESSAGE = 8  # role markers and separators of a chat template, generously


# Non-ASCII text is measured this many characters at a time: a slice's UTF-8 copy (4
# bytes a character at most) is all that measuring a long prompt holds at once.
MEASURE_CHARS = 64 * 1024


def utf8_length(text: str) -> int:
    """The length of ``text`` in UTF-8, without encoding it whole.

    ASCII text (most prompts) is its length. A lone surrogate counts 3 bytes, as
    ``surrogatepass`` writes it: measuring the client's text must never raise.
    """
    if text.isascii():
        return len(text)
    return sum(
        len(text[i : i + MEASURE_CHARS].encode("utf-8", "surrogatepass"))
        for i in range(0, len(text), MEASURE_CHARS)
    )


def value_bytes(value: object) -> int:
    """About the length of a JSON value written out, computed without writing it.

    Strings' UTF-8 bytes and their quotes, scalars' text, one separator per element
    and key: what an estimate from the value's JSON text would count, less the escapes.
    """
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += utf8_length(item) + 2
        elif isinstance(item, dict):
            total += 2 + 2 * len(item)  # braces; a colon and a comma per entry
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            total += 2 + len(item)  # brackets; a comma per element
            stack.extend(item)
        else:
            total += len(str(item))  # a number, true, false or null: a short text
    return total


def estimate_tokens(text: str) -> int:
    """A conservative token count for ``text`` when the engine cannot tokenize it."""
    return max(1, math.ceil(utf8_length(text) / ESTIMATE_BYTES_PER_TOKEN))


def estimate_value_tokens(value: object) -> int:
    """A conservative token count for a prompt that is no text: a batch, parts, a mix."""
    return max(1, math.ceil(value_bytes(value) / ESTIMATE_BYTES_PER_TOKEN))


def estimate_chat_tokens(messages: list[object]) -> int:
    """A conservative token count for chat messages, template included."""
    total = 0
    for message in messages:
        total += CHAT_TOKENS_PER_MESSAGE
        content = message.get("content") if isinstance(message, dict) else None
        if not content:
            continue
        if isinstance(content, str):
            total += estimate_tokens(content)
            continue
        if isinstance(content, list):
            # OpenAI content parts: the text ones count, as if joined by spaces.
            texts = [p.get("text", "") for p in content if isinstance(p, dict)]
            size = sum(_text_bytes(t) for t in texts) + max(len(texts) - 1, 0)
        else:
            size = value_bytes(content)  # an object or a scalar where text belongs
        if size:
            total += max(1, math.ceil(size / ESTIMATE_BYTES_PER_TOKEN))
    return total + CHAT_TOKENS_PER_MESSAGE


def _text_bytes(text: object) -> int:
    """A content part's text in bytes (its JSON text's, when it is no string)."""
    return utf8_length(text) if isinstance(text, str) else value_bytes(text)


def digest(value: object) -> int:
    """A hash of a JSON value, computed without writing it out.

    Equal values (objects in any key order) hash equal; others almost never, but
    for scalars Python hashes alike (1, 1.0 and true), whose prompts count the same.
    It is the count cache's key: a 64-bit hash, as the cache's keys always were.
    Objects and arrays of scalars (a message, token ids) are hashed in C as tuples;
    the rest is walked, with no recursion however deep the value.
    """
    folded = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            try:
                folded = hash((folded, "{", tuple(sorted(item.items()))))
                continue
            except TypeError:  # a value that is an array or an object: walk it
                pass
            folded = hash((folded, "{", len(item)))
            for key in sorted(item, key=str, reverse=True):  # popped in sorted order
                stack.append(item[key])
                stack.append(str(key))
        elif isinstance(item, (list, tuple)):
            try:
                folded = hash((folded, "[", tuple(item)))
                continue
            except TypeError:
                pass
            folded = hash((folded, "[", len(item)))
            stack.extend(reversed(item))
        else:
            folded = hash((folded, type(item).__name__, item))
    return folded


class TokenCache:
    """A small LRU cache of prompt → token count (by hash; prompts are never kept)."""

    def __init__(self, size: int = 2048) -> None:
        self._items: OrderedDict[int, int] = OrderedDict()
        self._size = size

    def get(self, key: int) -> int | None:
        """The cached count, refreshed as most recent."""
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        return None

    def put(self, key: int, count: int) -> None:
        """Remember a count, dropping the oldest beyond the size."""
        self._items[key] = count
        self._items.move_to_end(key)
        while len(self._items) > self._size:
            self._items.popitem(last=False)


# The fields a request's share of the in-flight totals is computed from: a change to
# one of them while it is in flight updates its registry's totals (see Inflight).
SHARE_FIELDS = frozenset(
    {
        "prompt_tokens",
        "generated",
        "max_tokens",
        "reserved_output",
        "output_ceiling",
        "expected_output",
        "output_variance",
    }
)


@dataclass(eq=False)
class InflightRequest:
    """One request passing through the proxy to the engine.

    While it is in flight (between :meth:`Inflight.add` and :meth:`Inflight.done`) a
    change to any of :data:`SHARE_FIELDS` updates the registry's totals at once, so
    that what is in flight is read in O(1) per admission, not summed over every
    request.
    """

    request_id: str
    priority: str
    prompt_tokens: int
    max_tokens: int | None
    generated: int = 0
    cancel: Callable[[], None] | None = field(default=None, repr=False)
    cancelled: bool = False
    cancel_reason: str | None = None  # largest, overrun, drain
    # While prompt_tokens is an estimate: the prompt's key in the count cache, so the
    # engine's count (from its answer's usage or /tokenize) is remembered when it comes.
    prompt_key: int | None = None
    prompt_counted: bool = False  # prompt_tokens came from the answer's usage
    # Admission "observed": the answer tokens reserved (all sequences), below
    # max_tokens when answers of this kind use less; None: max_tokens is the reservation.
    reserved_output: int | None = None
    # The most its answers may hold (max_tokens, else the context's room): the bound
    # of its reservation once it outruns the learned estimate.
    output_ceiling: int | None = None
    outran: bool = False  # its answer ran past the reservation it was admitted with
    # Admission "observed", once answers of its kind are known: where its answers (all
    # sequences) are expected to end given what they have written, and the variance
    # of that (re-read every tick); the in-flight set is reserved at a quantile of its
    # total from these (kvguard.core.admission.pooled_reservation). None: unknown,
    # its reservation above stands alone.
    expected_output: float | None = None
    output_variance: float = 0.0
    expected_ceiling: int | None = None  # per sequence: where the unknown tail is put
    sequences: int = 1  # prompts x samples (n, best_of): answers the engine writes
    # Its answer streams (the body asked for it): what it has written is seen as it
    # comes. A whole answer is seen only at its end: until then it may be anywhere.
    streamed: bool = False
    # (model, route, priority): whose answer lengths this one's is learned with.
    kind: tuple[str, str, str] | None = None
    completed: bool = False  # the engine's whole answer arrived with a 200
    clamped: bool = False  # kvguard lowered its max_tokens (a window cap): not its length
    # Per sequence: the answer length its client allowed (max_tokens; None: the engine's
    # default). An answer that reached it says only that it would have run at least that.
    answer_limit: int | None = None
    reserved_from: str = ""  # how the reservation was sized, in words (for reasons)
    # The higher class waiting for room that it was not held behind (its 503 said so).
    passed_over_for: str | None = None
    # How long it waited for room before its 503, and for how long before it requests
    # had waited without a break when it came (None: admitted, or never waited).
    waited_s: float | None = None
    queue_age_s: float | None = None
    # The byte-based estimate of the prompt it was admitted with (None: counted), and
    # whether the engine's count replaced it since (usage, or /tokenize).
    prompt_estimate: int | None = None
    prompt_exact: bool = False

    # Class-level defaults, not fields: set by the registry that holds the request.
    _registry: ClassVar[Inflight | None] = None
    _share: ClassVar[Share | None] = None

    def __setattr__(self, name: str, value: object) -> None:
        """Set a field; one that shapes its share of the totals updates its registry's."""
        registry = self._registry
        if registry is None or name not in SHARE_FIELDS:
            object.__setattr__(self, name, value)
            return
        share = self._share
        if name == "generated" and share is not None:
            # The hot path (every streamed chunk): what it holds changes; its
            # reservation only once the answer passes what was reserved for it.
            before, now = self.generated, int(value)  # type: ignore[call-overload]
            if now <= share.flat_until and before <= share.flat_until:
                object.__setattr__(self, name, now)
                registry.wrote(now - before)
                return
        registry.changing(self)
        object.__setattr__(self, name, value)
        registry.changed(self)

    @property
    def footprint_tokens(self) -> int:
        """Tokens this request holds in the cache now."""
        return self.prompt_tokens + self.generated

    @property
    def projected_tokens(self) -> int:
        """Tokens it will hold at the end: prompt + the answer reserved (or max_tokens).

        Never less than what it holds now; an answer that streams past its learned
        reservation is reserved at twice what it has written (at most its ceiling).
        """
        reserved = self.reserved_output if self.reserved_output is not None else self.max_tokens
        if (
            self.reserved_output is not None
            and self.output_ceiling is not None
            and self.generated > self.reserved_output
        ):
            # Past its learned length, this answer is of another kind than its peers (the
            # traffic changed): reserved at twice what it holds, up to its ceiling, so
            # it stays ahead as it grows without claiming a whole context at once.
            reserved = min(self.output_ceiling, 2 * self.generated)
        return self.prompt_tokens + max(reserved or 0, self.generated)

    @property
    def progress_unseen(self) -> bool:
        """Whether its answer is seen only at its end (it does not stream, and has not ended)."""
        return not self.streamed and self.generated == 0

    @property
    def reachable_tokens(self) -> int:
        """Tokens it may hold before kvguard can tell: its projection, or prompt + ceiling.

        The ceiling where its progress is unseen: it may be anywhere up to it by now.
        """
        if self.progress_unseen and self.output_ceiling is not None:
            return self.prompt_tokens + self.output_ceiling
        return self.projected_tokens

    @property
    def expected_tokens(self) -> int:
        """Tokens it is expected to hold at the end; its projection while that is unknown.

        Never less than what it holds now.
        """
        if self.expected_output is None:
            return self.projected_tokens
        return self.prompt_tokens + max(math.ceil(self.expected_output), self.generated)

    @property
    def output_per_sequence(self) -> int:
        """The answer's tokens per sequence (``n`` answers share the count)."""
        return -(-self.generated // max(self.sequences, 1))


class Share(NamedTuple):
    """One request's part of the in-flight totals, in whole blocks of the registry's size."""

    footprint: int  # tokens it holds now
    each: int  # its projection
    expected: int  # where it is expected to end (its projection while that is unknown)
    # Of its answers' length, in whole tokens squared (rounded up): integers add and
    # subtract exactly, where floats kept as a running total would drift.
    variance: int
    # Its projection and expectation stay as they are while it has written no more
    # than this: what it writes until then changes only what it holds.
    flat_until: float


def share_of(request: InflightRequest, block_size: int) -> Share:
    """``request``'s part of the in-flight totals (:class:`Share`)."""
    reserved = (
        request.reserved_output if request.reserved_output is not None else request.max_tokens
    )
    flat_until: float = reserved or 0
    if request.expected_output is not None:
        flat_until = min(flat_until, math.ceil(request.expected_output))
    return Share(
        request.footprint_tokens,
        whole_blocks(request.projected_tokens, block_size),
        whole_blocks(request.expected_tokens, block_size),
        math.ceil(request.output_variance),
        flat_until,
    )


class Inflight:
    """The registry of in-flight requests, their totals and the size histograms.

    The totals (what all hold now, their projections, expectations and variance) are
    kept up to date as each request changes (:class:`InflightRequest` tells its
    registry), so reading them costs the same with 5 or 500 requests in flight.
    """

    def __init__(self) -> None:
        # Keyed by the request itself: ids come from clients (X-Request-Id) and may repeat.
        self._requests: dict[InflightRequest, InflightRequest] = {}
        self.version = 0  # changes whenever a request is added or done
        self.kv_tokens = Histogram(TOKEN_BUCKETS)  # footprint at the end of each request
        self.prompt_tokens = Histogram(TOKEN_BUCKETS)
        self._block_size = 1  # the block size the projection totals are kept in
        self._held = 0
        self._each = 0
        self._expected = 0
        self._variance = 0

    def __iter__(self) -> Iterator[InflightRequest]:
        return iter(list(self._requests.values()))

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request: object) -> bool:
        """Whether ``request`` is in flight (admitted and not yet done)."""
        return request in self._requests

    def add(self, request: InflightRequest) -> None:
        """Start accounting a request."""
        if request in self._requests:
            return
        self._requests[request] = request
        self.version += 1
        object.__setattr__(request, "_registry", self)
        self._count(request, share_of(request, self._block_size))

    def done(self, request: InflightRequest) -> None:
        """Stop accounting a request and record its final sizes.

        The prompt is observed here, not at the start: its count may have been an
        estimate then, corrected by the engine's while the request ran.
        """
        if self._requests.pop(request, None) is not None:
            self.version += 1
            self._uncount(request)
            object.__setattr__(request, "_registry", None)
            self.kv_tokens.observe(request.footprint_tokens)
            self.prompt_tokens.observe(request.prompt_tokens)

    def wrote(self, tokens: int) -> None:
        """A request in flight wrote ``tokens`` more, within what was reserved for it."""
        self._held += tokens

    def changing(self, request: InflightRequest) -> None:
        """``request`` is about to change: its part is taken out of the totals."""
        if request in self._requests:
            self._uncount(request)

    def changed(self, request: InflightRequest) -> None:
        """``request`` changed: its part of the totals is computed again."""
        if request in self._requests:
            self._count(request, share_of(request, self._block_size))

    def _count(self, request: InflightRequest, share: Share) -> None:
        object.__setattr__(request, "_share", share)
        self._held += share.footprint
        self._each += share.each
        self._expected += share.expected
        self._variance += share.variance

    def _uncount(self, request: InflightRequest) -> None:
        share = request._share
        if share is None:
            return
        object.__setattr__(request, "_share", None)
        # What it holds now, not what its share said: chunks within its reservation
        # were added to the total as they came (wrote), not to its share.
        self._held -= request.footprint_tokens
        self._each -= share.each
        self._expected -= share.expected
        self._variance -= share.variance

    def recount(self, block_size: int | None = None) -> None:
        """Compute every total again from the requests (``block_size``: in these blocks).

        Called every tick, so a change that did not reach the totals (there should be
        none) lasts one tick at most; and when the engine's block size changes.
        """
        if block_size is not None:
            self._block_size = max(block_size, 1)
        self._held = self._each = self._expected = self._variance = 0
        for request in self._requests.values():
            self._count(request, share_of(request, self._block_size))

    def running_answers(self) -> list[tuple[tuple[str, str, str], int]]:
        """(kind, tokens per sequence written so far) of each answer being written.

        What the learned lengths count as answers at least that long (see
        :meth:`kvguard.core.lengths.ObservedLengths.estimate`); answers with nothing
        written yet tell nothing and are left out.
        """
        return [
            (r.kind, r.output_per_sequence)
            for r in self._requests.values()
            if r.kind is not None and r.generated > 0
        ]

    def projected_tokens(self, block_size: int, quantile: float = 1.0) -> int:
        """Tokens reserved for all in-flight requests, each rounded up to whole blocks.

        At ``quantile`` 1, the sum of each one's projection; below it, a ``quantile``
        of their total where their expected lengths are known, never more than that
        sum (:func:`kvguard.core.admission.pooled_reservation`). O(1): the totals are
        kept as requests change (recounted once when ``block_size`` changes).
        """
        if max(block_size, 1) != self._block_size:
            self.recount(block_size)
        if quantile >= 1.0:
            return self._each
        return pooled_reservation(self._each, self._expected, self._variance, quantile)

    @property
    def total_tokens(self) -> int:
        """Tokens all in-flight requests hold now."""
        return self._held

    def largest(self, *, spare: str = "critical") -> InflightRequest | None:
        """The request with the largest footprint, ``spare`` priority excluded."""
        candidates = [r for r in self._requests.values() if r.priority != spare and not r.cancelled]
        return max(candidates, key=lambda r: r.footprint_tokens, default=None)

    def top(self, n: int = 10) -> list[InflightRequest]:
        """The ``n`` largest in-flight requests by footprint."""
        return sorted(self._requests.values(), key=lambda r: r.footprint_tokens, reverse=True)[:n]
