"""Recorded traffic traces: read a trace file, then replay it as request specs.

Pure apart from reading the file: no network, no clock. :func:`load_trace` reads and
validates a whole file before anything is sent (a malformed file is one
:class:`TraceFileError` naming the file and line); :func:`replay` turns its requests
into :class:`~kvguard.sim.traffic.RequestSpec` at the recorded arrival offsets,
compressed by ``speed``, scaled and capped like the synthetic patterns.

Two formats, told apart by their header:

``azure``
    The Azure LLM inference trace 2023 (``TIMESTAMP,ContextTokens,GeneratedTokens``;
    timestamps like ``2023-11-16 18:17:03.9799600``, read as one clock, no time
    zone). Published in Azure/AzurePublicDataset under CC-BY 4.0. Attribution, as
    the publishers ask: Pratyush Patel, Esha Choukse, Chaojie Zhang, Aashaka Shah,
    Íñigo Goiri, Saeed Maleki, Ricardo Bianchini, "Splitwise: Efficient generative
    LLM inference using phase splitting", ISCA 2024.
``burstgpt``
    BurstGPT (HPMLL/BurstGPT: ``Timestamp,Model,Request tokens,Response tokens,
    Total tokens,Log Type``; ``Timestamp`` in seconds from the trace's start). Its
    failed requests have ``Response tokens`` 0; they are replayed with a true length
    of 1, as every size is at least one token.

Offsets are relative to the first request's timestamp; timestamps must not go back.
"""

from __future__ import annotations

import csv
import datetime as dt
import math
import random
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from kvguard.errors import InvalidInputError
from kvguard.sim.traffic import RequestSpec, TrafficParams, cap_to_context

TRACE_FLAG = "--trace"

# The columns of each format, in file order; the header must name exactly these.
TRACE_HEADERS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
        "burstgpt": (
            "Timestamp",
            "Model",
            "Request tokens",
            "Response tokens",
            "Total tokens",
            "Log Type",
        ),
    }
)
# Which columns hold (arrival time, prompt tokens, true output tokens).
_COLUMNS: Mapping[str, tuple[str, str, str]] = MappingProxyType(
    {
        "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
        "burstgpt": ("Timestamp", "Request tokens", "Response tokens"),
    }
)
# Up to 9 fractional digits: Azure writes 7, more than datetime.fromisoformat takes on 3.11.
_AZURE_TIME = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?")
_NS_PER_S = 1_000_000_000


class TraceFileError(InvalidInputError):
    """A trace file that cannot be replayed; ``path`` and ``line`` (0: the file as a whole).

    An :class:`InvalidInputError` of the ``--trace`` flag, so the command line prints it
    as one line and exits 2.
    """

    def __init__(self, path: str, line: int, problem: str, value: object = None) -> None:
        self.path = path
        self.line = line
        where = f"{path} line {line}" if line else path
        super().__init__(TRACE_FLAG, value if value is not None else path, f"{where}: {problem}")


@dataclass(frozen=True)
class TraceRequest:
    """One recorded request: its arrival offset (s), prompt and true output length (tokens).

    Sizes are as recorded (before any scale); ``line`` is its line in the file.
    """

    offset_s: float
    prompt_tokens: int
    output_tokens: int
    line: int


@dataclass(frozen=True)
class Trace:
    """A whole trace file, validated: its format and its requests in arrival order."""

    path: str
    trace_format: str
    requests: tuple[TraceRequest, ...]

    @property
    def name(self) -> str:
        """The file's name without its directory (what reports show)."""
        return Path(self.path).name

    @property
    def span_s(self) -> float:
        """Recorded seconds from the first request to the last."""
        return self.requests[-1].offset_s if self.requests else 0.0


def detect_format(header: list[str]) -> str | None:
    """The format whose header ``header`` is (spaces around names ignored), or None."""
    names = tuple(name.strip() for name in header)
    return next((fmt for fmt, columns in TRACE_HEADERS.items() if names == columns), None)


def load_trace(path: str | Path, trace_format: str | None = None) -> Trace:
    """Read and validate the whole trace at ``path``; ``trace_format`` None: from the header.

    Raises :class:`TraceFileError` (an :class:`InvalidInputError` of ``--trace``) for an
    unreadable or empty file, a header of neither format (or not of ``trace_format``),
    a header with no requests, a row with the wrong number of fields, a timestamp or
    size that is not a number, a negative size, or a timestamp earlier than the row
    before it. The message names the file and the line.
    """
    if trace_format is not None and trace_format not in TRACE_HEADERS:
        raise InvalidInputError(
            "--trace-format", trace_format, f"must be one of {', '.join(TRACE_HEADERS)}"
        )
    source = str(path)
    try:
        with Path(path).open("rb") as file:
            return parse_trace(file, source, trace_format)
    except OSError as exc:
        raise TraceFileError(source, 0, f"cannot be read ({exc.strerror or exc})") from exc


def parse_trace(lines: Iterable[bytes], source: str, trace_format: str | None = None) -> Trace:
    """Parse the raw lines of a trace file, named ``source`` in errors (see :func:`load_trace`)."""
    header: list[str] | None = None
    fmt = trace_format
    requests: list[TraceRequest] = []
    first_ns: int | None = None
    first_s: float | None = None
    last = -math.inf
    number = 0
    for number, raw in enumerate(lines, start=1):
        text = _decode(raw, source, number)
        if not text.strip():
            continue  # blank lines (a trailing newline, an editor's last line) carry nothing
        fields = next(csv.reader([text]))
        if header is None:
            header, fmt = fields, _format_of(fields, source, number, trace_format)
            continue
        row = _row(fields, header, fmt or "", source, number)
        # Offsets from the first request, kept exact for Azure's 100 ns clock: an absolute
        # time of day as a float would lose the last digits.
        if fmt == "azure":
            stamp_ns = _azure_ns(row["TIMESTAMP"], source, number)
            first_ns = stamp_ns if first_ns is None else first_ns
            offset = (stamp_ns - first_ns) / _NS_PER_S
        else:
            stamp = _seconds(row["Timestamp"], "Timestamp", source, number)
            first_s = stamp if first_s is None else first_s
            offset = stamp - first_s
        if offset < last:
            raise TraceFileError(
                source,
                number,
                "timestamps must not go back (rows are in arrival order)",
                row[_COLUMNS[fmt or ""][0]],
            )
        last = offset
        _, prompt_col, output_col = _COLUMNS[fmt or ""]
        prompt = _size(row[prompt_col], prompt_col, source, number)
        output = _size(row[output_col], output_col, source, number)
        requests.append(TraceRequest(offset, prompt, output, number))
    if header is None:
        raise TraceFileError(source, 1, "the file is empty; a trace starts with its header")
    if not requests or fmt is None:
        raise TraceFileError(source, number + 1, "the header is followed by no requests")
    return Trace(source, fmt, tuple(requests))


def _decode(raw: bytes, source: str, number: int) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TraceFileError(source, number, "is not UTF-8 text", raw[:40]) from None
    # A byte-order mark that spreadsheet exports put before the header.
    return text.removeprefix("\ufeff") if number == 1 else text


def _format_of(header: list[str], source: str, number: int, wanted: str | None) -> str:
    found = detect_format(header)
    if wanted is not None and found != wanted:
        expected = ",".join(TRACE_HEADERS[wanted])
        raise TraceFileError(
            source, number, f"a {wanted} trace starts with the header {expected}", ",".join(header)
        )
    if found is None:
        expected = " or ".join(f"{','.join(cols)} ({fmt})" for fmt, cols in TRACE_HEADERS.items())
        raise TraceFileError(source, number, f"the header must be {expected}", ",".join(header))
    return found


def _row(
    fields: list[str], header: list[str], fmt: str, source: str, number: int
) -> dict[str, str]:
    if len(fields) != len(header):
        raise TraceFileError(
            source,
            number,
            f"a row has {len(header)} comma-separated fields (as the header), this has"
            f" {len(fields)}",
            ",".join(fields),
        )
    return {name: value.strip() for name, value in zip(TRACE_HEADERS[fmt], fields, strict=True)}


def _azure_ns(text: str, source: str, number: int) -> int:
    match = _AZURE_TIME.fullmatch(text)
    if match is None:
        raise TraceFileError(
            source, number, "TIMESTAMP must look like 2023-11-16 18:17:03.9799600", text
        )
    year, month, day, hour, minute, second = (int(part) for part in match.groups()[:6])
    fraction = match.group(7) or ""
    try:
        # The proleptic day number, so a trace may cross midnight or a month's end.
        days = dt.date(year, month, day).toordinal()
    except ValueError:
        raise TraceFileError(source, number, "TIMESTAMP is not a real date", text) from None
    if hour > 23 or minute > 59 or second > 60:
        raise TraceFileError(source, number, "TIMESTAMP is not a real time of day", text)
    seconds = ((days * 24 + hour) * 60 + minute) * 60 + second
    return seconds * _NS_PER_S + int(fraction.ljust(9, "0") or 0)


def _seconds(text: str, column: str, source: str, number: int) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise TraceFileError(source, number, f"{column} must be a number of seconds", text)
    return value


def _size(text: str, column: str, source: str, number: int) -> int:
    try:
        value = int(text)
    except ValueError:
        # Tolerate "12.0", as tables written from a dataframe have; "12.5" is no size.
        try:
            as_float = float(text)
        except ValueError:
            as_float = math.nan
        if not (math.isfinite(as_float) and as_float.is_integer()):
            raise TraceFileError(
                source, number, f"{column} must be a whole number of tokens", text
            ) from None
        value = int(as_float)
    if value < 0:
        raise TraceFileError(source, number, f"{column} must be a number of tokens >= 0", text)
    return value


def replay(
    trace: Trace,
    params: TrafficParams,
    *,
    seed: int,
    speed: float = 1.0,
    start_s: float = 0.0,
) -> Iterator[RequestSpec]:
    """The trace's requests as specs, from ``start_s`` recorded seconds on, ``speed`` times faster.

    A request recorded at offset ``t >= start_s`` is sent at ``(t - start_s) / speed``
    seconds into the run; the stream ends before ``params.duration_s``. Sizes are
    multiplied by ``params.scale`` (at least 1 token each) and capped at
    ``params.max_context`` (the prompt gives way first). Each request's priority class
    is drawn from ``params.shares`` with ``random.Random(seed)``: the same seed gives
    the same classes.
    """
    if not (math.isfinite(speed) and speed > 0):
        raise InvalidInputError("speed", speed, "must be a number > 0")
    if not (math.isfinite(start_s) and start_s >= 0):
        raise InvalidInputError("start_s", start_s, "must be a number of seconds >= 0")
    rng = random.Random(seed)
    for request in trace.requests:
        if request.offset_s < start_s:
            continue
        at_s = (request.offset_s - start_s) / speed
        if at_s >= params.duration_s:
            return
        prompt, output = cap_to_context(
            params.scaled(request.prompt_tokens),
            params.scaled(request.output_tokens),
            params.max_context,
        )
        yield RequestSpec(at_s, prompt, output, params.shares.draw(rng))
