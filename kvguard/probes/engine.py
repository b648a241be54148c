"""The engine probe: scrape an inference server over HTTP and normalize what it says.

One :meth:`EngineProbe.sample` fetches the metrics endpoint, the adapter's extra
JSON endpoints (llama.cpp ``/slots`` and ``/props``) and the health endpoint
concurrently, each under its own timeout, then hands the bodies to the pure
adapter of :mod:`kvguard.probes.engines`. With ``kind="auto"`` the engine is told
from its metric names on the first good scrape and kept from then on.

Every failure to read the metrics (refused, timed out, non-200, oversized,
malformed) becomes :class:`~kvguard.errors.ProbeError`; aiohttp and asyncio
errors never escape. A failing extra or health endpoint does not fail the tick:
the fields it feeds become unknown, or ``up`` turns false.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar

import aiohttp
import structlog
from yarl import URL

from kvguard.core.snapshot import EngineAction, EngineKind, EngineStats
from kvguard.errors import InvalidInputError, ProbeError
from kvguard.http_client import client_session, describe_client_error
from kvguard.probes.engines import ADAPTERS, EngineAdapter, EngineScrape
from kvguard.probes.engines.base import KIND_PREFIXES, PROBE_NAME, detect_kind, health_path_for
from kvguard.probes.engines.llamacpp import LlamacppAdapter, shows_split
from kvguard.probes.engines.wanted import FamilyCache

T = TypeVar("T")
log = structlog.get_logger("kvguard.probes.engine")

MiB = 1024 * 1024
# Real expositions are tens to hundreds of KB; far more means a wrong endpoint or a runaway one.
DEFAULT_MAX_BODY_BYTES = 16 * MiB
_CHUNK_BYTES = 64 * 1024
# Parsing is pure Python; large bodies go to a thread so the daemon's loop keeps ticking.
_PARSE_IN_THREAD_BYTES = 256 * 1024
# Ask for the classic text format: some servers answer OpenMetrics or protobuf if allowed.
_ACCEPT_METRICS = "text/plain;version=0.0.4;q=1.0,*/*;q=0.1"

# Errors a request can end in: aiohttp's own tree, timeouts, and OS-level socket errors.
_HTTP_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


class _UnavailableError(Exception):
    """An endpoint did not give a usable answer; ``str()`` says why (for ProbeError)."""


@dataclass(eq=False)
class _SharedScrape:
    """One scrape in progress and how many callers wait for it."""

    task: asyncio.Future[EngineStats]
    waiters: int = 0


# Engines whose /v1/models says the longest sequence they serve (``max_model_len``
# on each model card: vLLM's and SGLang's OpenAI servers), and how often it is read
# again (an engine restarted with another --max-model-len is seen within this).
CONTEXT_KINDS: frozenset[EngineKind] = frozenset({"vllm", "sglang"})
CONTEXT_REFRESH_S = 60.0
MAX_CONTEXT_TOKENS = 1 << 24  # past 16M tokens a figure is garbage, not a context

# Triton Inference Server's default ports (tritonserver --http-port, --metrics-port).
TRITON_HTTP_PORT = 8000
TRITON_METRICS_PORT = 8002


def engine_bases(
    url: str, metrics_url: str | None, health_url: str | None, *, triton: bool
) -> tuple[str, str]:
    """Where an engine's metrics and its health are read: the two base URLs.

    As set (``[engine] metrics_url``, ``health_url``; a trailing ``/`` dropped), else
    ``url``. For TensorRT-LLM (``triton``: ``kind = "trtllm"``, or detected so) a
    ``url`` on one of Triton's default ports finds the other beside it, unless set:
    on the HTTP port (8000: health, inference) the metrics are read at 8002, on the
    metrics port (8002) health is asked at 8000.
    """
    base = url.rstrip("/")
    metrics = metrics_url.rstrip("/") if metrics_url else base
    health = health_url.rstrip("/") if health_url else base
    if triton:
        parts = URL(base)
        if metrics_url is None and parts.port == TRITON_HTTP_PORT:
            metrics = str(parts.with_port(TRITON_METRICS_PORT)).rstrip("/")
        if health_url is None and parts.port == TRITON_METRICS_PORT:
            health = str(parts.with_port(TRITON_HTTP_PORT)).rstrip("/")
    return metrics, health


class EngineProbe:
    """Reads one engine's metrics (and llama.cpp's slots) into :class:`EngineStats`.

    A :class:`~kvguard.probes.base.EngineSource`: it also says the engine's kind and
    admin actions.

    ``url`` is the engine's base URL (``http://127.0.0.1:8000``); paths are
    appended to it, and redirects are not followed, so the probe talks to that
    server only. ``token`` is sent as ``Authorization: Bearer`` and never logged
    or put in an error message. ``timeout_s`` bounds each request, and a body over
    ``max_body_bytes`` is refused. A ``session`` passed in is used as is and left
    open by :meth:`close`.
    """

    name = PROBE_NAME
    available = True  # an engine that does not answer is failing, not absent

    def __init__(
        self,
        url: str,
        *,
        kind: EngineKind | Literal["auto"] = "auto",
        metrics_path: str = "/metrics",
        token: str | None = None,
        timeout_s: float = 2.0,
        session: aiohttp.ClientSession | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        kv_unified: bool | None = None,
        metrics_url: str | None = None,
        health_url: str | None = None,
    ) -> None:
        base = URL(url)
        if base.scheme not in ("http", "https") or not base.host:
            raise InvalidInputError("engine url", url, "must be an http:// or https:// URL")
        for name, other in (("metrics_url", metrics_url), ("health_url", health_url)):
            parts = URL(other) if other is not None else None
            if parts is not None and (parts.scheme not in ("http", "https") or not parts.host):
                raise InvalidInputError(name, other, "must be an http:// or https:// URL")
        if kind != "auto" and kind not in ADAPTERS:
            raise InvalidInputError("engine kind", kind, f"must be auto or one of {_kinds()}")
        if not metrics_path.startswith("/"):
            raise InvalidInputError("metrics_path", metrics_path, "must start with /")
        if timeout_s <= 0:
            raise InvalidInputError("timeout_s", timeout_s, "must be > 0")
        self._base = str(base).rstrip("/")
        # Triton serves its metrics and its health on different ports ([engine]
        # metrics_url, health_url); every other engine serves both beside its API.
        # With kind "auto" the pairing waits for the kind (_detect).
        self._metrics_url, self._health_url = metrics_url, health_url
        self._metrics_base, self._health_base = engine_bases(
            self._base, metrics_url, health_url, triton=kind == "trtllm"
        )
        self._kind: EngineKind | None = None if kind == "auto" else kind
        self._metrics_path = metrics_path
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session = session
        self._owns_session = session is None
        self._max_body_bytes = max_body_bytes
        # llama.cpp's cache layout as the operator declared it ([engine] kv_unified, or
        # the supervised command); None: assumed unified until the slots show a split.
        self._adapters: dict[EngineKind, EngineAdapter] = dict(ADAPTERS)
        self._adapters["llamacpp"] = LlamacppAdapter(kv_unified=kv_unified)
        self._layout_declared = kv_unified is not None
        self._layout_said = False  # engine_layout_assumed logged (once per probe)
        # Set while a large exposition is parsed in a thread. A parse that outlives the
        # daemon's timeout keeps running (threads cannot be cancelled); scraping and
        # queueing another behind it every tick would pile up threads and copies of
        # the body, so samples fail fast until it ends (as the NVML probe does).
        self._parsing_bytes: int | None = None
        # The scrape in progress, shared by concurrent callers (the tick and a drain
        # watching the engine): one scrape and one parse, not two racing each other.
        self._shared: _SharedScrape | None = None
        # The last reading, handed to the adapter with the next scrape (trtllm-serve's
        # empty answer keeps the capacity it reported before).
        self._last: EngineStats | None = None
        # The health path the last metrics body called for, when the adapter's engine
        # comes in servers with different ones (TensorRT-LLM: Triton or trtllm-serve).
        self._health_path: str | None = None
        # The families read at the last scrape: those unchanged are not parsed again.
        self._families = FamilyCache()
        # The engine's context length from its /v1/models, and when it was last read.
        self._context: int | None = None
        self._context_read_at: float | None = None

    @property
    def kind(self) -> EngineKind | None:
        """The engine's kind: as configured, or as detected (None until then)."""
        return self._kind

    @property
    def server(self) -> str | None:
        """Which TensorRT-LLM server answered: "triton" or "trtllm-serve" (None otherwise).

        Told by the health path its metrics body called for (Triton's exposition text,
        or trtllm-serve's JSON iteration stats).
        """
        if self._kind != "trtllm" or self._health_path is None:
            return None
        return "triton" if self._health_path.startswith("/v2/") else "trtllm-serve"

    @property
    def kv_unified(self) -> bool | None:
        """llama.cpp's cache layout as kvguard reads it: True unified, False split.

        Declared (``[engine] kv_unified``) or from the supervised command; else assumed
        unified, llama-server's default launch, until the slots show a split cache
        (:func:`~kvguard.probes.engines.llamacpp.shows_split`), then split from then on.
        :attr:`kv_layout` says which of these it is. None once the engine is known to
        be another kind than llama.cpp.
        """
        if self._kind is not None and self._kind != "llamacpp":
            return None
        adapter = self._adapters["llamacpp"]
        return not isinstance(adapter, LlamacppAdapter) or adapter.kv_unified is not False

    @property
    def kv_layout(self) -> str | None:
        """llama.cpp's cache layout in words, as ``kvguard probe`` reports it.

        "unified" or "split" when declared or read from the supervised command;
        "unified (assumed)" when nothing says it; "split (inferred)" once the slots
        have held more tokens together than a unified cache could. None for another
        kind of engine.
        """
        unified = self.kv_unified
        if unified is None:
            return None
        if self._layout_declared:
            return "unified" if unified else "split"
        return "unified (assumed)" if unified else "split (inferred)"

    @property
    def actions(self) -> frozenset[EngineAction]:
        """Admin actions the engine offers; empty while its kind is unknown."""
        return ADAPTERS[self._kind].actions if self._kind is not None else frozenset()

    async def sample(self) -> EngineStats:
        """Scrape the engine once; raises :class:`ProbeError` when its metrics cannot be read.

        A call made while another is in progress shares its scrape. A caller that
        gives up (a timeout) leaves the scrape to the others; the last one to give up
        cancels it, as a lone caller's timeout always did.
        """
        shared = self._shared
        if shared is None:
            shared = self._shared = _SharedScrape(asyncio.ensure_future(self._sample_once()))
            shared.task.add_done_callback(lambda task: self._scrape_ended(shared, task))
        shared.waiters += 1
        try:
            return await asyncio.shield(shared.task)
        finally:
            shared.waiters -= 1
            if shared.waiters == 0 and not shared.task.done():
                # Nobody waits for it any more: stop it, and let no later caller join
                # a scrape that is being cancelled (it would get a CancelledError).
                self._drop(shared)
                shared.task.cancel()

    def _scrape_ended(self, shared: _SharedScrape, task: asyncio.Future[EngineStats]) -> None:
        """Forget a finished scrape; its error counts as seen when no one was left to see it."""
        self._drop(shared)
        if not task.cancelled():
            task.exception()  # else asyncio logs "Task exception was never retrieved"

    def _drop(self, shared: _SharedScrape) -> None:
        if self._shared is shared:
            self._shared = None

    async def _sample_once(self) -> EngineStats:
        if self._parsing_bytes is not None:
            raise ProbeError(
                PROBE_NAME,
                f"the previous exposition ({self._parsing_bytes} bytes) is still being parsed;"
                " skipped this scrape",
            )
        session = self._client()
        if self._kind is None:
            text, kind = await self._detect(session)
            self._kind = kind
            adapter = self._adapters[kind]
            asked = health_path_for(adapter, text)
            extras, healthy = await asyncio.gather(
                self._extras(session, adapter), self._healthy(session, asked)
            )
        else:
            adapter = self._adapters[self._kind]
            asked = self._health_path or adapter.health_path
            # return_exceptions: when the metrics fail, the other requests still
            # finish here instead of running on unobserved after we raise.
            metrics, extras, healthy = await asyncio.gather(
                self._metrics(session),
                self._extras(session, adapter),
                self._healthy(session, asked),
                return_exceptions=True,
            )
            if isinstance(metrics, BaseException):
                raise metrics
            if isinstance(extras, BaseException):
                raise extras
            if isinstance(healthy, BaseException):
                raise healthy
            text = metrics
        wanted = health_path_for(adapter, text)
        if wanted != asked:
            # The body is another server's than the one last asked (the first scrape of
            # a kind set in the config, or the server was replaced): ask its own path.
            healthy = await self._healthy(session, wanted)
        self._health_path = wanted
        scrape = EngineScrape(
            metrics_text=text,
            slots=_json_list(extras.get("/slots")),
            props=_json_object(extras.get("/props")),
            healthy=healthy,
            previous=self._last,
            families=self._families,
        )
        stats = await self._off_loop(len(text), lambda: adapter.parse(scrape))
        if self._kind == "llamacpp" and not self._layout_declared:
            self._follow_layout(scrape, stats)
        if self._kind in CONTEXT_KINDS and healthy:
            await self._refresh_context(session)
            stats = replace(stats, context_tokens=self._context)
        self._last = stats
        return stats

    async def _detect(self, session: aiohttp.ClientSession) -> tuple[str, EngineKind]:
        """The first metrics body and the kind it says (``kind = "auto"``).

        TensorRT-LLM behind Triton takes the pairing of its default ports that
        ``kind = "trtllm"`` takes (:func:`engine_bases`): a url on the HTTP port (8000),
        where Triton has no metrics, is read at 8002 when a TensorRT-LLM exposition
        answers there; a url on the metrics port asks health at 8000.
        """
        try:
            text = await self._metrics(session)
            kind = await self._off_loop(len(text), lambda: detect_kind(text))
        except ProbeError as exc:
            error: ProbeError | None = exc
            text, kind = "", None
        else:
            error = None
        if kind is None:
            paired = await self._triton_metrics(session)
            if paired is not None:
                return paired, "trtllm"
        if error is not None:
            raise error
        if kind is None:
            prefixes = ", ".join(prefix for _, prefix in KIND_PREFIXES)
            raise ProbeError(
                PROBE_NAME,
                f"no known engine metrics at {self._metrics_base}{self._metrics_path}"
                f" (looked for names starting {prefixes}); set the engine kind",
            )
        if kind == "trtllm":
            # Read where they answered; a url on Triton's metrics port asks health at 8000.
            _, self._health_base = engine_bases(
                self._base, self._metrics_base, self._health_url, triton=True
            )
        return text, kind

    async def _triton_metrics(self, session: aiohttp.ClientSession) -> str | None:
        """TensorRT-LLM's exposition at Triton's metrics port beside the url, if it answers.

        Only when the url is on Triton's HTTP port (8000) and no metrics_url is set;
        None otherwise, or when what answers there is not TensorRT-LLM's. On success
        the probe reads its metrics (and health) as ``kind = "trtllm"`` would.
        """
        metrics, health = engine_bases(self._base, self._metrics_url, self._health_url, triton=True)
        if metrics == self._metrics_base:
            return None
        try:
            status, body = await self._get(session, self._metrics_path, _ACCEPT_METRICS, metrics)
        except _UnavailableError:
            return None
        if status != 200:
            return None
        text = body.decode("utf-8", errors="replace")
        try:
            kind = await self._off_loop(len(text), lambda: detect_kind(text))
        except ProbeError:
            return None
        if kind != "trtllm":
            return None
        self._metrics_base, self._health_base = metrics, health
        return text

    def _follow_layout(self, scrape: EngineScrape, stats: EngineStats) -> None:
        """llama.cpp, layout undeclared: say once that it is assumed; keep a split once shown.

        The adapter read this scrape as split already if its slots showed it; from
        then on every scrape is (an idle split cache shows nothing), and it is logged
        once (``engine_layout_inferred``).
        """
        if not self._layout_said:
            self._layout_said = True
            log.warning(
                "engine_layout_assumed",
                engine="llamacpp",
                read_as="unified",
                kv_capacity_tokens=stats.kv_capacity_tokens,
                hint="llama-server does not say how its slots hold the cache; read as"
                " unified, its default -np (auto). Started with -np N (split), set [engine]"
                " kv_unified = false (or run it under kvguard, which reads its command"
                " line): until its slots are seen holding more than one slot's n_ctx,"
                " capacity reads N times too small",
            )
        if self.kv_unified and shows_split(scrape.slots):
            self._adapters["llamacpp"] = LlamacppAdapter(kv_unified=False)
            log.warning(
                "engine_layout_inferred",
                engine="llamacpp",
                read_as="split",
                kv_capacity_tokens=stats.kv_capacity_tokens,  # this scrape's, read as split
                kv_used_tokens=stats.kv_used_tokens,
                reason="the busy slots hold more tokens together than one slot's n_ctx,"
                " which a unified cache could not",
                hint="set [engine] kv_unified = false to read it so from the start",
            )

    async def _refresh_context(self, session: aiohttp.ClientSession) -> None:
        """Read the engine's ``max_model_len`` from ``/v1/models``, at most once a minute.

        The smallest of its model cards' (one engine serves one context; adapters
        share it). A failed or unreadable answer keeps what was known and is retried
        at the next refresh; it never fails the tick.
        """
        now = time.monotonic()
        if self._context_read_at is not None and now - self._context_read_at < CONTEXT_REFRESH_S:
            return
        self._context_read_at = now
        try:
            status, body = await self._get(session, "/v1/models", "application/json")
        except _UnavailableError:
            return
        if status != 200:
            return
        try:
            cards = json.loads(body).get("data")
        except (ValueError, RecursionError, AttributeError):
            return
        lengths = [
            card["max_model_len"]
            for card in (cards if isinstance(cards, list) else [])
            if isinstance(card, dict)
            and isinstance(card.get("max_model_len"), int)
            and not isinstance(card.get("max_model_len"), bool)
            and 0 < card["max_model_len"] < MAX_CONTEXT_TOKENS
        ]
        if lengths:
            self._context = min(lengths)

    async def close(self) -> None:
        """Close the HTTP session if this probe created it."""
        if self._owns_session and self._session is not None:
            await self._session.close()
        self._session = None

    async def _off_loop(self, size: int, work: Callable[[], T]) -> T:
        """Run pure parsing inline when small, in a thread when large (one at a time)."""
        if size < _PARSE_IN_THREAD_BYTES:
            return work()

        def parse() -> T:
            try:
                return work()
            finally:
                self._parsing_bytes = None  # from the thread: one store, atomic under the GIL

        # Cleared by the thread when it ends, even after the daemon's timeout gave up on it
        # (a queued job always runs: the executor does not drop work).
        self._parsing_bytes = size
        return await asyncio.to_thread(parse)

    # ------------------------------------------------------------------ HTTP
    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # Created lazily: a ClientSession must be made inside the running loop.
            self._session = client_session()
            self._owns_session = True
        return self._session

    async def _get(
        self, session: aiohttp.ClientSession, path: str, accept: str, base: str | None = None
    ) -> tuple[int, bytes]:
        """Status and body of ``GET path`` (at ``base``, default the engine's url).

        Raises :class:`_UnavailableError`.
        """
        url = (base or self._base) + path
        try:
            async with session.get(
                url,
                headers={**self._headers, "Accept": accept},
                timeout=self._timeout,
                allow_redirects=False,
            ) as response:
                if response.status != 200:
                    return response.status, b""
                return response.status, await self._read_capped(response, url)
        except asyncio.TimeoutError as exc:
            raise _UnavailableError(f"{url}: no answer within {self._timeout.total:g} s") from exc
        except _HTTP_ERRORS as exc:
            # aiohttp's messages name the host and the cause, never the headers.
            raise _UnavailableError(f"{url}: {describe_client_error(exc)}") from exc

    async def _read_capped(self, response: aiohttp.ClientResponse, url: str) -> bytes:
        limit = self._max_body_bytes
        if response.content_length is not None and response.content_length > limit:
            raise _UnavailableError(f"{url}: body of {response.content_length} bytes over {limit}")
        body = bytearray()
        async for chunk in response.content.iter_chunked(_CHUNK_BYTES):
            body += chunk
            if len(body) > limit:  # counts decompressed bytes, so gzip bombs stop here too
                raise _UnavailableError(f"{url}: body over {limit} bytes")
        return bytes(body)

    async def _metrics(self, session: aiohttp.ClientSession) -> str:
        try:
            status, body = await self._get(
                session, self._metrics_path, _ACCEPT_METRICS, self._metrics_base
            )
        except _UnavailableError as exc:
            raise ProbeError(PROBE_NAME, str(exc)) from exc
        if status != 200:
            url = self._metrics_base + self._metrics_path
            raise ProbeError(PROBE_NAME, f"{url}: HTTP {status}")
        return body.decode("utf-8", errors="replace")

    async def _extras(
        self, session: aiohttp.ClientSession, adapter: EngineAdapter
    ) -> dict[str, Any]:
        """The adapter's extra endpoints as parsed JSON; a failing one is left out."""
        paths = adapter.extra_paths
        answers = await asyncio.gather(
            *(self._get(session, path, "application/json") for path in paths),
            return_exceptions=True,
        )
        found: dict[str, Any] = {}
        for path, answer in zip(paths, answers, strict=True):
            if isinstance(answer, BaseException):
                if not isinstance(answer, _UnavailableError):
                    raise answer  # cancellation and bugs must not be swallowed
                continue
            status, body = answer
            if status == 200:
                try:
                    found[path] = json.loads(body)
                except (ValueError, RecursionError):  # not JSON, bad UTF-8, absurd nesting
                    continue
        return found

    async def _healthy(self, session: aiohttp.ClientSession, path: str) -> bool:
        try:
            status, _ = await self._get(session, path, "*/*", self._health_base)
        except _UnavailableError:
            return False
        # _get reads bodies of 200 only; any 2xx is healthy.
        return 200 <= status < 300


def _json_list(value: object) -> list[dict[str, Any]] | None:
    if isinstance(value, list) and all(isinstance(item, dict) for item in value):
        return value
    return None


def _json_object(value: object) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None


def _kinds() -> str:
    return ", ".join(ADAPTERS)
