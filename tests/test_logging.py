"""kvguard's log under a flood of malformed requests, and the standard library routed into it.

aiohttp logs through :mod:`logging`, which kvguard never set up: 200 malformed requests
wrote 2,200 plain-text traceback lines. Now every record is a structlog event (JSON
here), a refused request costs at most one debug line per cause per minute, and the
bytes of the request (which may hold a credential) are never logged.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import signal
from collections.abc import Callable, Iterator

import aiohttp
import pytest
import structlog
from aiohttp.http_exceptions import BadStatusLine

from kvguard.api.logs import StdlibBridge, configure_logging
from kvguard.config.settings import parse_config
from kvguard.probes.engine import EngineProbe
from kvguard.runtime.assembly import build_guard
from kvguard.runtime.probing import Probes
from tests.helpers import free_port, strict_json
from tests.test_run import KVGUARD, read_events

SECRET = "sk-planted-flood-5151"
# Malformed requests of several kinds (several causes), one of them quoting a key.
MALFORMED = (
    b"GET / HTTP/9.9\r\n\r\n",  # BadStatusLine
    b"GET / HTTP/1.1\r\nBad Header\r\n\r\n",  # BadHttpMessage
    b"GET / HTTP/1.1\r\nAuthorization : Bearer " + SECRET.encode() + b"\r\n\r\n",
    b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n",  # LineTooLong
    b"POST / HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
    b"GARBAGE\r\n\r\n",  # BadHttpMethod
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # TLS to a plain-HTTP port
)
FLOOD = 200


async def send_raw(port: int, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection and read the answer until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


async def flood(port: int) -> None:
    """FLOOD malformed requests to ``port``, 20 at a time; each must get a 400 or a close."""
    for start in range(0, FLOOD, 20):
        answers = await asyncio.gather(
            *(send_raw(port, MALFORMED[i % len(MALFORMED)]) for i in range(start, start + 20))
        )
        assert all(a == b"" or a.split(b" ", 2)[1] == b"400" for a in answers), answers[:3]


async def test_a_flood_of_malformed_requests_costs_a_few_json_lines(sim_engine, tmp_path):
    """`kvguard run`: 200 bad requests on the proxy port and 200 on the API port, at debug.

    Every line is JSON, none is a traceback, the planted key is nowhere, and the
    refusals are one line per cause (not 2,200 lines).
    """
    engine_url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048)
    api_port, proxy_port = free_port(), free_port()
    path = tmp_path / "kvguard.toml"
    path.write_text(
        f'[engine]\nurl = "{engine_url}"\n'
        f'[server]\nlisten = "127.0.0.1:{api_port}"\n'
        f'[proxy]\nenabled = true\nlisten = "127.0.0.1:{proxy_port}"\n'
        '[poll]\ninterval_s = 0.5\n[log]\nlevel = "debug"\nformat = "json"\n'
    )
    proc = await asyncio.create_subprocess_exec(
        KVGUARD, "run", "--config", str(path), stderr=asyncio.subprocess.PIPE
    )
    try:
        await read_events(proc, until="started")
        await flood(proxy_port)
        await flood(api_port)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.stderr is not None
        rest = await asyncio.wait_for(proc.stderr.read(), 15)
        await asyncio.wait_for(proc.wait(), 10)
    text = rest.decode()
    assert "Traceback" not in text
    assert SECRET not in text
    events = [strict_json(line) for line in text.splitlines()]  # every line is strict JSON
    assert all(isinstance(event, dict) for event in events)
    rejected = [e for e in events if e["event"] == "http_request_rejected"]
    # One line per cause: a call site of aiohttp's and an error type (both ports share them).
    assert 1 <= len(rejected) <= len(MALFORMED)
    assert all(e["level"] == "debug" and e["status"] == 400 for e in rejected)
    assert {e["error"] for e in rejected} >= {"BadStatusLine", "BadHttpMessage", "LineTooLong"}
    from_libraries = [e for e in events if "logger" in e]
    assert len(from_libraries) <= 2 * len(MALFORMED)
    assert len(events) < 60, [e["event"] for e in events]


# ------------------------------------------------------------------ in process
@pytest.fixture
def log_to() -> Iterator[Callable[[str], Callable[[], list[dict]]]]:
    """configure_logging(level, "json") into a buffer; the events it got, parsed.

    Undone after: the bridge leaves the root logger, the root's level and structlog
    are restored.
    """
    root = logging.getLogger()
    level = root.level
    buffer = io.StringIO()

    def start(min_level: str) -> Callable[[], list[dict]]:
        configure_logging(min_level, "json")
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=buffer))
        return lambda: [strict_json(line) for line in buffer.getvalue().splitlines()]

    yield start
    for handler in [h for h in root.handlers if isinstance(h, StdlibBridge)]:
        root.removeHandler(handler)
    root.setLevel(level)
    structlog.reset_defaults()


def bridge() -> StdlibBridge:
    """The one bridge configure_logging put on the root logger."""
    (found,) = [h for h in logging.getLogger().handlers if isinstance(h, StdlibBridge)]
    return found


def caught(error: Exception) -> Exception:
    """``error`` raised and caught, so that it carries a traceback as a logged one does."""
    try:
        _throw(error)
    except Exception as exc:  # noqa: BLE001 - whatever it is, it is the result
        return exc
    raise AssertionError("not raised")


def _throw(error: Exception) -> None:
    raise error


def bad_request() -> Exception:
    """The error aiohttp's parser raises for a bad request line (quoting a key, as it may)."""
    return caught(BadStatusLine(f"GET / HTTP/9.9 Authorization: Bearer {SECRET}"))


def refuse() -> None:
    """Log a refused request as aiohttp does: ERROR, with the parser's error, from one place."""
    logging.getLogger("aiohttp.server").error(
        "Error handling request from %s", "127.0.0.1", exc_info=bad_request()
    )


def test_one_line_per_cause_per_window_then_the_count_suppressed(log_to):
    """100 identical refusals: one line; after the window, the next says 100 were dropped."""
    events = log_to("debug")
    now = [1000.0]
    bridge().clock = lambda: now[0]
    for _ in range(100):
        refuse()
    now[0] += 59.0
    refuse()
    assert len(events()) == 1
    now[0] += 2.0
    refuse()
    first, second = events()
    assert {k: first[k] for k in ("event", "level", "logger", "error", "status")} == {
        "event": "http_request_rejected",
        "level": "debug",
        "logger": "aiohttp.server",
        "error": "BadStatusLine",
        "status": 400,
    }
    assert "suppressed" not in first
    assert second["suppressed"] == 100
    assert SECRET not in json.dumps(events())


def test_a_refused_request_costs_nothing_at_info(log_to):
    """At [log] level info, aiohttp's ERROR for a bad request is demoted below the level."""
    events = log_to("info")
    refuse()
    assert events() == []


def test_asyncio_and_other_library_records_are_json_events(log_to):
    """The asyncio 'never retrieved' error: one JSON line with the traceback as one field."""
    events = log_to("info")
    error = caught(ValueError("boom"))
    logging.getLogger("asyncio").error("Task exception was never retrieved", exc_info=error)
    logging.getLogger("aiohttp.client").debug("below the level: %s", "dropped")
    logging.getLogger("some.library").warning("odd %s", "thing")
    first, second = events()
    assert first["event"] == "library_log"
    assert (first["level"], first["logger"]) == ("error", "asyncio")
    assert first["message"] == "Task exception was never retrieved"
    assert first["exception"].startswith("Traceback (most recent call last):")
    assert first["exception"].endswith("ValueError: boom")
    assert (second["level"], second["logger"], second["message"]) == (
        "warning",
        "some.library",
        "odd thing",
    )


def test_reconfiguring_keeps_one_bridge_and_its_limits(log_to):
    """A reload calls configure_logging again: still one bridge, its new level, its counts."""
    events = log_to("info")
    refuse()
    assert events() == []
    configure_logging("debug", "json")
    buffer = io.StringIO()
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=buffer))
    assert bridge().min_level == logging.DEBUG
    for _ in range(5):
        refuse()
    assert len(buffer.getvalue().splitlines()) == 1


# ------------------------------------------------------------------ strict JSON, levels
def test_non_finite_numbers_are_written_as_null(log_to):
    """Infinity and NaN, at the top or nested, become null: every line parses strictly."""
    events = log_to("info")
    structlog.get_logger("kvguard.test").warning(
        "forecast",
        time_to_exhaustion_s=float("inf"),
        signals={"kv_demand": float("nan"), "spans": [1.5, float("-inf")]},
        kv_usage=0.5,
    )
    (event,) = events()
    assert event["time_to_exhaustion_s"] is None
    assert event["signals"] == {"kv_demand": None, "spans": [1.5, None]}
    assert event["kv_usage"] == 0.5
    assert event["level"] == "warning"


async def test_level_changes_and_decisions_keep_the_pressure_level_apart(log_to, sim_server):
    """A real daemon entering `elevated`: from_level/to_level and pressure_level, severity kept."""
    events = log_to("info")
    # One sequence at a time: a second request waits in the engine's queue, so the
    # cache binds (binding_of) and its usage counts past elevated.
    server = await sim_server(
        kv_capacity_tokens=4096, max_model_len=2048, max_num_seqs=1, per_token_s=0.001
    )
    config = parse_config(
        {
            "engine": {"url": server.url, "kind": "vllm"},
            # Any use of the cache is high pressure here, so two requests bring actions.
            "policy": {
                "confirm_ticks": 1,
                "elevated": {"kv_usage": 0.001},
                "high": {"kv_usage": 0.002},
            },
        },
        env={},
    )
    guard = build_guard(
        config, probes=Probes(EngineProbe(server.url), nvml=None, host=None), serve_api=False
    )
    await guard.start()
    daemon = guard.daemon
    try:
        async with aiohttp.ClientSession() as http:
            requests = [
                asyncio.ensure_future(
                    http.post(
                        f"{server.url}/v1/completions",
                        json={"prompt": "word " * 200, "max_tokens": 400},
                    )
                )
                for _ in range(2)
            ]
            for _ in range(200):
                await daemon.tick()
                if daemon.brain.decision and daemon.brain.decision.level == "high":
                    break
                await asyncio.sleep(0.01)
            for request in requests:
                (await request).close()
    finally:
        await guard.close()
    logged = events()
    changes = [e for e in logged if e["event"] == "pressure_level_changed"]
    assert changes[0]["from_level"] == "ok"
    assert changes[-1]["to_level"] == "high"
    assert all(e["level"] == "warning" for e in changes)  # the severity, not the pressure
    decisions = [e for e in logged if e["event"] == "decision"]
    assert decisions, [e["event"] for e in logged]
    assert all(e["pressure_level"] == "high" and e["level"] == "warning" for e in decisions)
