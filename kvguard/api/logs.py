"""kvguard's logs: structlog to stderr, with the standard library's logging routed in.

:func:`configure_logging` sets up structlog: JSON lines when stderr is not a
terminal, a readable console otherwise; the standard library's logging (aiohttp's
and asyncio's) goes through it too, one line per cause per minute at most
(:class:`StdlibBridge`).
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
import traceback
from collections.abc import Callable, MutableMapping
from typing import Any

import structlog
from aiohttp.http_exceptions import HttpProcessingError


def configure_logging(level: str = "info", fmt: str = "auto") -> None:
    """Send structlog events to stderr: JSON lines, or a console renderer on a terminal.

    The standard library's log records (aiohttp, asyncio) are routed into the same
    stream by one :class:`StdlibBridge` on the root logger, at the same ``level``.
    Called again (a reload), it updates that bridge and keeps its rate limits.
    """
    console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    renderer: structlog.types.Processor = (
        structlog.dev.ConsoleRenderer()
        if console
        else structlog.processors.JSONRenderer(serializer=strict_json)
    )
    min_level = logging.getLevelName(level.upper())
    structlog.configure(
        processors=log_processors(renderer),
        wrapper_class=structlog.make_filtering_bound_logger(min_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    root = logging.getLogger()
    bridges = [handler for handler in root.handlers if isinstance(handler, StdlibBridge)]
    if bridges:
        bridges[0].min_level = min_level
    else:
        root.addHandler(StdlibBridge(min_level))
    # The root's level gates what reaches the bridge. aiohttp logs a malformed request
    # at ERROR, which passes any level: the bridge demotes it to debug itself.
    root.setLevel(min_level)


def log_processors(renderer: structlog.types.Processor) -> list[structlog.types.Processor]:
    """The chain of one log event: context, finite numbers, severity, time, ``renderer``.

    Strict JSON lines with ``structlog.processors.JSONRenderer(serializer=strict_json)``.
    """
    return [
        structlog.contextvars.merge_contextvars,
        finite_numbers,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        renderer,
    ]


def finite_numbers(
    _logger: object, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """Write non-finite numbers as null: ``Infinity`` and ``NaN`` are not JSON.

    Log shippers parse strictly (Loki, Vector, Elasticsearch): one
    ``"time_to_exhaustion_s": Infinity`` and the line is lost. A time that never comes is
    null, its unit stays in the key's name.
    """
    for key, value in event_dict.items():
        event_dict[key] = json_finite(value)
    return event_dict


def json_finite(value: object) -> Any:  # noqa: ANN401 - any JSON-ready value, as given
    """``value`` with every non-finite float (``inf``, ``nan``), however deep, as None.

    Mappings and sequences are copied (tuples become lists, as JSON writes them);
    everything else is returned as it is. The log lines and ``/status`` both go through it.
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_finite(v) for v in value]
    return value


def strict_json(obj: object, **kwargs: Any) -> str:  # noqa: ANN401 - json.dumps' own options
    """``json.dumps`` that refuses non-finite numbers (strict JSON, as shippers parse it).

    :func:`finite_numbers` runs first, so this only fails if a value escaped it: a loud
    error in the tests rather than a line every strict parser drops.
    """
    return json.dumps(obj, allow_nan=False, **kwargs)


# One line per cause per window at most; the next line of a cause after its window
# says how many were dropped in between (``suppressed``).
LIBRARY_LOG_WINDOW_S = 60.0
# Causes remembered at once. A cause is a call site and an exception type, so there
# are few; the cap only bounds memory if something generates them without end.
_MAX_CAUSES = 1024
_MESSAGE_CHARS = 2000
_LEVEL_METHODS = (
    (logging.CRITICAL, "critical"),
    (logging.ERROR, "error"),
    (logging.WARNING, "warning"),
    (logging.INFO, "info"),
)


class StdlibBridge(logging.Handler):
    """Routes standard-library log records into structlog, rate-limited per cause.

    aiohttp and asyncio log through :mod:`logging`, which kvguard never configured:
    their records went to stderr as plain text, a malformed request as an ERROR with
    an 11-line traceback, so anyone who could reach the proxy or API port could flood
    the log. Here each record becomes one structlog event (JSON with ``[log] format =
    "json"``), of one of three kinds:

    - ``http_request_rejected`` (debug): aiohttp's parser refused a request (a bad
      request line or header, a line too long). Only the error's type and status are
      kept: aiohttp's message quotes the offending bytes, which may hold a client's
      credentials.
    - ``http_client_disconnected`` (debug): the client left while its request was
      handled.
    - ``library_log`` (the record's level): anything else, with ``logger``,
      ``message`` and, when the record carries one, ``exception`` (the traceback as
      one string: one JSON line).

    A cause (logger, call site, exception type) is logged at most once per
    ``window_s``; its next line after the window carries ``suppressed``, the count
    dropped in between. ``min_level`` is the least severe level logged, judged after
    the demotions above.
    """

    def __init__(
        self,
        min_level: int = logging.INFO,
        *,
        window_s: float = LIBRARY_LOG_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(logging.DEBUG)
        self.min_level = min_level
        self.window_s = window_s
        self.clock = clock
        self._causes: dict[tuple[str, str, int, str], list[float]] = {}  # [since, suppressed]

    def emit(self, record: logging.LogRecord) -> None:
        """Log ``record`` as a structlog event, unless its cause spoke within the window."""
        try:
            event, levelno, fields = _translate(record)
            if levelno < self.min_level:
                return
            exc = record.exc_info[1] if record.exc_info else None
            cause = (record.name, record.pathname, record.lineno, type(exc).__name__)
            suppressed = self._admit(cause)
            if suppressed is None:
                return
            if suppressed:
                fields["suppressed"] = suppressed
            method = next((name for floor, name in _LEVEL_METHODS if levelno >= floor), "debug")
            getattr(structlog.get_logger(), method)(event, **fields)
        except Exception:  # noqa: BLE001 - logging must never raise into the code that logs
            self.handleError(record)

    def _admit(self, cause: tuple[str, str, int, str]) -> int | None:
        """None when ``cause`` is within its window (counted); else the count it dropped."""
        now = self.clock()
        entry = self._causes.get(cause)
        if entry is not None and now - entry[0] < self.window_s:
            entry[1] += 1
            return None
        if entry is None and len(self._causes) >= _MAX_CAUSES:
            self._causes = {
                key: value for key, value in self._causes.items() if now - value[0] < self.window_s
            }
            if len(self._causes) >= _MAX_CAUSES:
                self._causes.clear()
        self._causes[cause] = [now, 0]
        return int(entry[1]) if entry is not None else 0


def _translate(record: logging.LogRecord) -> tuple[str, int, dict[str, Any]]:
    """The event name, level and fields one record becomes."""
    exc = record.exc_info[1] if record.exc_info else None
    if record.name.startswith("aiohttp.") and isinstance(exc, HttpProcessingError):
        # Not exc.message: it quotes the request's bytes (an Authorization header too).
        return (
            "http_request_rejected",
            logging.DEBUG,
            {"logger": record.name, "error": type(exc).__name__, "status": exc.code},
        )
    if record.name == "aiohttp.server" and isinstance(exc, ConnectionError):
        return (
            "http_client_disconnected",
            logging.DEBUG,
            {"logger": record.name, "error": type(exc).__name__},
        )
    fields: dict[str, Any] = {"logger": record.name, "message": _message(record)}
    if record.exc_info and record.exc_info[0] is not None:
        fields["exception"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
    return "library_log", record.levelno, fields


def _message(record: logging.LogRecord) -> str:
    try:
        message = record.getMessage()
    except (TypeError, ValueError):  # arguments that do not fit the format
        message = str(record.msg)
    return message if len(message) <= _MESSAGE_CHARS else message[:_MESSAGE_CHARS] + "..."
