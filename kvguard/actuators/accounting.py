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


@dataclass(eq=False)
class InflightRequest:
    """One request passing through the proxy to the engine."""

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
    # The byte-based estimate of the prompt it was admitted with (None: counted), and
    # whether the engine's count replaced it since (usage, or /tokenize).
    prompt_estimate: int | None = None
    prompt_exact: bool = False

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


class Inflight:
    """The registry of in-flight requests and the size histograms."""

    def __init__(self) -> None:
        # Keyed by the request itself: ids come from clients (X-Request-Id) and may repeat.
        self._requests: dict[InflightRequest, InflightRequest] = {}
        self.version = 0  # changes whenever a request is added or done
        self.kv_tokens = Histogram(TOKEN_BUCKETS)  # footprint at the end of each request
        self.prompt_tokens = Histogram(TOKEN_BUCKETS)

    def __iter__(self) -> Iterator[InflightRequest]:
        return iter(list(self._requests.values()))

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request: object) -> bool:
        """Whether ``request`` is in flight (admitted and not yet done)."""
        return request in self._requests

    def add(self, request: InflightRequest) -> None:
        """Start accounting a request."""
        self._requests[request] = request
        self.version += 1

    def done(self, request: InflightRequest) -> None:
        """Stop accounting a request and record its final sizes.

        The prompt is observed here, not at the start: its count may have been an
        estimate then, corrected by the engine's while the request ran.
        """
        if self._requests.pop(request, None) is not None:
            self.version += 1
            self.kv_tokens.observe(request.footprint_tokens)
            self.prompt_tokens.observe(request.prompt_tokens)

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
        sum (:func:`kvguard.core.admission.pooled_reservation`).
        """
        each = expected = 0
        variance = 0.0
        for r in self._requests.values():
            each += whole_blocks(r.projected_tokens, block_size)
            if quantile < 1.0:
                expected += whole_blocks(r.expected_tokens, block_size)
                variance += r.output_variance
        if quantile >= 1.0:
            return each
        return pooled_reservation(each, expected, variance, quantile)

    @property
    def total_tokens(self) -> int:
        """Tokens all in-flight requests hold now."""
        return sum(r.footprint_tokens for r in self._requests.values())

    def largest(self, *, spare: str = "critical") -> InflightRequest | None:
        """The request with the largest footprint, ``spare`` priority excluded."""
        candidates = [r for r in self._requests.values() if r.priority != spare and not r.cancelled]
        return max(candidates, key=lambda r: r.footprint_tokens, default=None)

    def top(self, n: int = 10) -> list[InflightRequest]:
        """The ``n`` largest in-flight requests by footprint."""
        return sorted(self._requests.values(), key=lambda r: r.footprint_tokens, reverse=True)[:n]
