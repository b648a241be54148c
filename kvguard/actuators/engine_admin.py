"""Engine admin actions: evict the prefix cache, pause admission, resume it.

:class:`EngineAdmin` drives one engine's own admin endpoints over HTTP
(docs/engines.md, "Admin endpoints", lists them):

=========  ====================================  ===================================
engine     evict                                 pause / resume
=========  ====================================  ===================================
vLLM       ``POST /reset_prefix_cache``          ``POST /pause?mode=wait`` /
                                                 ``POST /resume``
SGLang     ``POST /flush_cache``                 ``POST /pause_generation``
                                                 ``{"mode": "in_place"}`` /
                                                 ``POST /continue_generation``
llama.cpp  ``GET /slots``, then ``POST            none
           /slots/{id}?action=erase`` per idle
           slot
TGI,       none                                  none
TRT-LLM
=========  ====================================  ===================================

Why these choices:

* vLLM serves its admin endpoints only with ``VLLM_SERVER_DEV_MODE=1``; a 404 means
  dev mode is off. That is detected once, logged once (``engine_admin_unavailable``
  on the ``kvguard.engine_admin`` logger), and every vLLM action is unsupported from
  then on, without further HTTP calls.
* Evicting never forces: vLLM's ``reset_running_requests=true`` would preempt every
  running request, so a reset refused because running requests hold blocks
  (``{"success": false}``, or HTTP 409 in versions that say so with a status) is
  retried with backoff instead, as is SGLang's 400 "pending requests" refusal.
* vLLM ``mode=wait`` stops admission and lets running requests finish; the call may
  answer only once they have, so a timeout is followed by ``GET /is_paused``.
* No pause is sent unless ``on_pause_change(True)`` recorded it (kvguard's state
  file): an unrecorded pause would stay in force after a kvguard killed meanwhile,
  and the next kvguard would not know to resume it.
* :meth:`EngineAdmin.is_paused` asks the engine itself: vLLM ``GET /is_paused``.
  SGLang (checked in 0.5.23, ``http_server.py``) has no endpoint that says so:
  ``GET /ready`` answers 503 when paused *or* unhealthy; llama.cpp, TGI and
  TensorRT-LLM have no pause. Those answer None (unknown).
* SGLang has no mode that lets running requests finish (``abort``, ``retract``,
  ``in_place``). ``in_place`` is the least destructive: nothing is aborted and no KV
  is recomputed; running requests stop where they are, new ones queue, and both
  continue on resume. While paused so, ``/flush_cache`` is refused.
* llama.cpp erases a busy slot only after its request ends (the erase waits), so
  only slots ``/slots`` reports idle are erased; a slot whose state is unclear is
  left alone. Erasing needs ``--slot-save-path`` (501 without it).

Retries: ``retries`` is the number of **attempts** in total (3 means one try and at
most two more), never more. Between attempts the injected ``sleep`` waits
``backoff_s``, then twice that, and so on. Retried: connection refused or reset,
timeouts, 5xx (except 501), 429, and the "busy" refusals above. A 404 (or 501) means
the endpoint does not exist: unsupported, remembered. Any other 4xx is final.
For llama.cpp one attempt is one round (read ``/slots``, erase each idle slot): a
round that fails transiently is redone from a fresh ``/slots``, since slots change
state meanwhile and erasing an idle slot twice is harmless.

No method raises for engine or network failures: each returns an
:class:`AdminResult`. The token is sent as ``Authorization: Bearer`` and appears
in no detail or log line.

One module of ~600 lines on purpose: the per-engine rules above share one retry and
one "unsupported, remembered" discipline, and most of its length is this table of
the engines' behaviour.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeGuard

import aiohttp
import structlog
from yarl import URL

from kvguard.actuators.retry import retry
from kvguard.errors import InvalidInputError
from kvguard.http_client import client_session

AdminAction = Literal["evict", "pause", "resume"]
ADMIN_ACTIONS: tuple[AdminAction, ...] = ("evict", "pause", "resume")

# What each engine offers; the caller detected the kind.
_OFFERED: dict[str, frozenset[AdminAction]] = {
    "vllm": frozenset(ADMIN_ACTIONS),
    "sglang": frozenset(ADMIN_ACTIONS),
    "llamacpp": frozenset({"evict"}),
    "tgi": frozenset(),
    "trtllm": frozenset(),
}
_ENGINE_NAMES = {
    "vllm": "vLLM",
    "sglang": "SGLang",
    "llamacpp": "llama.cpp",
    "tgi": "TGI",
    "trtllm": "TensorRT-LLM",
}
_NO_ENDPOINT = {
    "evict": "has no cache-eviction endpoint",
    "pause": "has no endpoint to pause admission",
    "resume": "has no endpoint to resume admission",
}

VLLM_PAUSE_MODE = "wait"  # stop admitting, let running requests finish
SGLANG_PAUSE_MODE = "in_place"  # no drain mode in SGLang: the least destructive one

_DEV_MODE_HINT = (
    "vLLM answered 404 for {line}: its admin endpoints exist only in dev mode;"
    " set VLLM_SERVER_DEV_MODE=1 in the engine's environment and restart it"
)

# Admin answers are short; /slots of a many-slot llama-server is the largest.
_MAX_BODY_BYTES = 4 * 1024 * 1024
_EXCERPT_CHARS = 160

# Errors a request can end in: aiohttp's own tree, timeouts, and OS-level socket errors.
_HTTP_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)

log = structlog.get_logger("kvguard.engine_admin")


@dataclass(frozen=True)
class AdminResult:
    """What one admin action did."""

    action: str  # evict | pause | resume
    ok: bool  # it took effect
    supported: bool  # False: this engine has no such endpoint (by kind, or it answered 404/501)
    detail: str  # one line for logs/status: what happened and why (never the token)
    attempts: int
    # Not ok, yet an attempt may have reached the engine and acted: it timed out or got
    # a transient error (5xx, 429, a dropped connection) before the final answer.
    uncertain: bool = False
    # A pause not sent because kvguard could not record it (its state file is unwritable).
    unrecorded: bool = False


@dataclass(frozen=True)
class _Reply:
    """An HTTP answer: status and (capped) body text."""

    status: int
    text: str

    @property
    def success(self) -> bool:
        return 200 <= self.status < 300


@dataclass(frozen=True)
class _NoReply:
    """No HTTP answer: refused, reset, timed out."""

    detail: str
    timed_out: bool


@dataclass(frozen=True)
class _Step:
    """One attempt's verdict: done, retry (transient or busy), fail (final), unsupported."""

    verdict: Literal["done", "retry", "fail", "unsupported"]
    detail: str


class EngineAdmin:
    """Evicts, pauses and resumes one engine through its admin endpoints.

    ``url`` is the engine's base URL and ``kind`` one of vllm, sglang, llamacpp,
    tgi, trtllm. ``timeout_s`` bounds each HTTP request; ``retries`` is the number
    of attempts in total (at least 1), with ``backoff_s``, doubling, slept through
    ``sleep`` between them. ``on_pause_change`` is told ``True`` before a pause is
    sent and ``False`` after a resume that worked (kvguard records it in its state
    file, :mod:`kvguard.actuators.state`); when it returns ``False`` for a pause, the
    pause could not be recorded and is not sent. The HTTP session is made on first
    use; :meth:`close` closes it.
    """

    def __init__(
        self,
        url: str,
        kind: str,
        *,
        token: str | None = None,
        timeout_s: float = 5.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        on_pause_change: Callable[[bool], bool | None] | None = None,
    ) -> None:
        base = URL(url)
        if base.scheme not in ("http", "https") or not base.host:
            raise InvalidInputError("engine url", url, "must be an http:// or https:// URL")
        if base.user is not None or base.password is not None:
            # They would be sent as Basic auth beside our Bearer header, and logged with the URL.
            shown = str(base.with_user(None))  # the error message must not carry them either
            raise InvalidInputError("engine url", shown, "must carry no credentials; give a token")
        if kind not in _OFFERED:
            raise InvalidInputError("engine kind", kind, f"must be one of {', '.join(_OFFERED)}")
        if timeout_s <= 0:
            raise InvalidInputError("timeout_s", timeout_s, "must be > 0")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 1:
            raise InvalidInputError("retries", retries, "must be an integer >= 1 (attempts)")
        if backoff_s < 0:
            raise InvalidInputError("backoff_s", backoff_s, "must be >= 0")
        self._base = str(base).rstrip("/")
        self._kind = kind
        self._token = token or None
        self._headers = {"Accept": "application/json"}
        if self._token:
            self._headers["Authorization"] = f"Bearer {self._token}"
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._retries = retries
        self._backoff_s = backoff_s
        self._sleep = sleep
        # Told True before a pause is sent and False after a resume worked: kvguard's
        # state file (kvguard.actuators.state), so a kvguard killed meanwhile resumes on
        # restart. False back for a pause: not recorded, so not sent.
        self._on_pause_change: Callable[[bool], bool | None] = on_pause_change or (
            lambda _paused: None
        )
        self._session: aiohttp.ClientSession | None = None
        # Actions found missing on this engine (404/501), with the detail to repeat.
        self._unavailable: dict[str, str] = {}

    @property
    def kind(self) -> str:
        """The engine's kind, as given."""
        return self._kind

    @property
    def url(self) -> str:
        """The engine's base URL, without a trailing slash."""
        return self._base

    def supports(self, action: str) -> bool:
        """Whether ``action`` can work here: the kind offers it and it was not found missing."""
        return action in _OFFERED[self._kind] and action not in self._unavailable

    async def evict(self) -> AdminResult:
        """Free cached KV the engine is not using (prefix cache, idle llama.cpp slots)."""
        if self._kind == "vllm":
            return await self._run("evict", self._vllm_reset_prefix_cache)
        if self._kind == "sglang":
            return await self._run("evict", self._sglang_flush_cache)
        if self._kind == "llamacpp":
            return await self._run("evict", self._llamacpp_erase_idle_slots)
        return self._not_offered("evict")

    async def pause(self) -> AdminResult:
        """Stop admitting new requests; running ones finish (vLLM) or wait in place (SGLang)."""
        # Recorded before sending: the engine may pause without ever answering (mode=wait).
        if self.supports("pause") and self._on_pause_change(True) is False:
            # Never pause what a kvguard killed meanwhile would leave paused for good.
            return AdminResult(
                "pause",
                False,
                True,
                "not paused: kvguard could not record the pause in its state file"
                " (state_file_write_failed says why); unrecorded, a pause would outlive a"
                " kvguard that dies, with nothing to resume it",
                0,
                unrecorded=True,
            )
        if self._kind == "vllm":
            return await self._run("pause", self._vllm_pause)
        if self._kind == "sglang":
            return await self._run(
                "pause",
                lambda: self._simple_post(
                    "/pause_generation",
                    f"paused in place (mode {SGLANG_PAUSE_MODE}: SGLang cannot drain;"
                    " running requests keep their KV and continue on resume)",
                    json_body={"mode": SGLANG_PAUSE_MODE},
                ),
            )
        return self._not_offered("pause")

    async def resume(self) -> AdminResult:
        """Admit and run requests again after :meth:`pause`."""
        if self._kind == "vllm":
            result = await self._run("resume", lambda: self._simple_post("/resume", "resumed"))
        elif self._kind == "sglang":
            result = await self._run(
                "resume",
                # SGLang parses a (field-less) JSON body here; an empty one is refused.
                lambda: self._simple_post("/continue_generation", "resumed", json_body={}),
            )
        else:
            return self._not_offered("resume")
        if result.ok:
            self._on_pause_change(False)
        return result

    async def is_paused(self) -> bool | None:
        """Whether the engine says it is paused; None when it cannot say.

        vLLM only (``GET /is_paused``, retried like an action). None for the other
        kinds (no endpoint answers it: see the module doc), for a vLLM without dev
        mode, and when no clear answer came. Asking changes nothing, so a 404 here is
        not remembered as a missing action: the actions find out for themselves.
        """
        if self._kind != "vllm" or "pause" in self._unavailable:
            return None
        ran = await retry(
            lambda: self._send("GET", "/is_paused"),
            attempts=self._retries,
            backoff_s=self._backoff_s,
            retryable=lambda reply: (
                isinstance(reply, _NoReply) or reply.status == 429 or reply.status >= 500
            ),
            sleep=self._sleep,
        )
        reply = ran.outcome
        if not isinstance(reply, _Reply) or not reply.success:
            return None
        value = _json_object(reply.text).get("is_paused")
        return value if isinstance(value, bool) else None

    async def close(self) -> None:
        """Close the HTTP session (a later call opens a new one)."""
        if self._session is not None:
            await self._session.close()
        self._session = None

    # ------------------------------------------------------------------ attempts
    async def _run(
        self, action: AdminAction, attempt: Callable[[], Awaitable[_Step]]
    ) -> AdminResult:
        """Run ``attempt`` until it is done, final, or ``retries`` attempts were made."""
        if action in self._unavailable:
            # Found missing before: say so again without another request.
            return AdminResult(action, False, False, self._unavailable[action], 0)
        ran = await retry(
            attempt,
            attempts=self._retries,
            backoff_s=self._backoff_s,
            retryable=lambda step: step.verdict == "retry",
            sleep=self._sleep,
        )
        step, made = ran.outcome, ran.attempts
        # Every attempt before the last was retried: a transient failure may have acted.
        uncertain = made > 1
        if step.verdict == "done":
            return AdminResult(action, True, True, step.detail, made)
        if step.verdict == "fail":
            return AdminResult(action, False, True, step.detail, made, uncertain)
        if step.verdict == "unsupported":
            self._mark_unavailable(action, step.detail)
            return AdminResult(action, False, False, step.detail, made, uncertain)
        detail = f"{step.detail}; gave up after {made} attempt{'s' if made > 1 else ''}"
        return AdminResult(action, False, True, detail, made, uncertain=True)

    def _not_offered(self, action: AdminAction) -> AdminResult:
        name = _ENGINE_NAMES[self._kind]
        return AdminResult(action, False, False, f"{name} {_NO_ENDPOINT[action]}", 0)

    def _mark_unavailable(self, action: AdminAction, detail: str) -> None:
        # vLLM's dev mode gates all three endpoints at once: one 404 answers for all.
        actions = ADMIN_ACTIONS if self._kind == "vllm" else (action,)
        new = [name for name in actions if name not in self._unavailable]
        for name in new:
            self._unavailable[name] = detail
        if new:
            log.warning(
                "engine_admin_unavailable",
                engine=self._base,
                kind=self._kind,
                actions=new,
                reason=detail,
            )

    # ------------------------------------------------------------------ per engine
    async def _simple_post(
        self, path: str, done: str, json_body: dict[str, Any] | None = None
    ) -> _Step:
        """A POST that worked when it answered 2xx."""
        line = f"POST {path}"
        reply = self._screen(line, await self._send("POST", path, json_body=json_body))
        if isinstance(reply, _Step):
            return reply
        return _Step("done", done) if reply.success else self._rejected(line, reply)

    async def _vllm_reset_prefix_cache(self) -> _Step:
        # Never reset_running_requests=true: it preempts every running request.
        line = "POST /reset_prefix_cache"
        reply = self._screen(line, await self._send("POST", "/reset_prefix_cache"))
        if isinstance(reply, _Step):
            return reply
        held = f"{line}: not reset, blocks are held by running requests"
        if reply.status == 409:  # versions that report the refusal with a status
            return _Step("retry", f"{held} (HTTP 409)")
        if not reply.success:
            return self._rejected(line, reply)
        success = _json_object(reply.text).get("success")
        if success is False:
            return _Step("retry", held)
        if success is True:
            return _Step("done", "prefix cache reset")
        # Some versions answer an empty 200 and do not check the outcome themselves.
        return _Step("done", "prefix cache reset requested (this vLLM does not report the outcome)")

    async def _sglang_flush_cache(self) -> _Step:
        line = "POST /flush_cache"
        reply = self._screen(line, await self._send("POST", "/flush_cache"))
        if isinstance(reply, _Step):
            return reply
        if reply.success:
            return _Step("done", "radix cache flushed")
        if reply.status == 400:  # SGLang's only refusal: requests are running or waiting
            return _Step("retry", f"{line}: refused while requests run or wait (HTTP 400)")
        return self._rejected(line, reply)

    async def _vllm_pause(self) -> _Step:
        # clear_cache=false: vLLM would otherwise drop its whole prefix cache once the
        # drain ends, a side effect a pause is not meant to have.
        line = f"POST /pause?mode={VLLM_PAUSE_MODE}&clear_cache=false"
        sent = await self._send(
            "POST", "/pause", params={"mode": VLLM_PAUSE_MODE, "clear_cache": "false"}
        )
        if isinstance(sent, _NoReply) and sent.timed_out and await self._vllm_is_paused():
            # mode=wait may answer only once running requests finish; admission is
            # already stopped, which is what pausing is for.
            return _Step("done", "paused (admission stopped; running requests still finishing)")
        reply = self._screen(line, sent)
        if isinstance(reply, _Step):
            return reply
        if not reply.success:
            return self._rejected(line, reply)
        return _Step("done", "paused (new requests refused; running requests finish)")

    async def _vllm_is_paused(self) -> bool:
        reply = await self._send("GET", "/is_paused")
        return (
            isinstance(reply, _Reply)
            and reply.success
            and _json_object(reply.text).get("is_paused") is True
        )

    async def _llamacpp_erase_idle_slots(self) -> _Step:
        """One round: read /slots, erase every slot it reports idle."""
        line = "GET /slots"
        reply = self._screen(
            line,
            await self._send("GET", "/slots"),
            missing="llama-server answered 404 for GET /slots (a build without slots?)",
            not_implemented="llama-server serves no /slots: start it without --no-slots",
        )
        if isinstance(reply, _Step):
            return reply
        if not reply.success:
            return self._rejected(line, reply)
        slots = _json_list(reply.text)
        if slots is None:
            return _Step("fail", f"{line}: not a JSON list of slots{self._excerpt(reply.text)}")
        # Idle only when it says so: erasing a busy slot waits for its request to end.
        idle = [
            slot["id"]
            for slot in slots
            if slot.get("is_processing") is False and _is_int(slot.get("id"))
        ]
        erased_tokens = 0
        for number, slot_id in enumerate(idle):
            erase_line = f"POST /slots/{slot_id}?action=erase"
            answer = self._screen(
                erase_line,
                await self._send("POST", f"/slots/{slot_id}", params={"action": "erase"}),
                missing=f"llama-server answered 404 for {erase_line}",
                not_implemented="llama-server refuses slot actions (HTTP 501):"
                " start it with --slot-save-path to allow erasing idle slots",
            )
            if isinstance(answer, _Reply) and not answer.success:
                answer = self._rejected(erase_line, answer)
            if isinstance(answer, _Step):
                if answer.verdict == "unsupported":
                    return answer
                done_so_far = f" (after erasing {number} of {len(idle)} idle slots)"
                return _Step(answer.verdict, answer.detail + done_so_far)
            n_erased = _json_object(answer.text).get("n_erased")
            erased_tokens += n_erased if _is_int(n_erased) else 0
        return _Step(
            "done",
            f"erased {len(idle)} idle slot(s) ({erased_tokens} cached tokens);"
            f" left {len(slots) - len(idle)} busy slot(s) alone",
        )

    # ------------------------------------------------------------------ HTTP
    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # Made lazily: a ClientSession belongs to the running loop. No proxy from the
            # environment stands between us and a local engine (client_session).
            self._session = client_session()
        return self._session

    async def _send(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        json_body: dict[str, Any] | None = None,
    ) -> _Reply | _NoReply:
        """One request under the timeout; network failures come back as :class:`_NoReply`."""
        try:
            async with self._client().request(
                method,
                self._base + path,
                params=params,
                json=json_body,
                headers=self._headers,
                timeout=self._timeout,
                allow_redirects=False,  # talk to this server only
            ) as response:
                body = await _read_capped(response)
                return _Reply(response.status, body.decode("utf-8", errors="replace"))
        except asyncio.TimeoutError:
            return _NoReply(f"no answer within {self._timeout.total:g} s", timed_out=True)
        except _HTTP_ERRORS as exc:
            # aiohttp's messages name the host and the cause, never the headers.
            return _NoReply(f"{type(exc).__name__}: {exc}", timed_out=False)

    def _screen(
        self,
        line: str,
        reply: _Reply | _NoReply,
        *,
        missing: str | None = None,
        not_implemented: str | None = None,
    ) -> _Step | _Reply:
        """The verdict for answers every endpoint treats alike; other replies pass through.

        No answer, 5xx (but 501) and 429 are retried; 404 and 501 mean the endpoint
        is missing (``missing``/``not_implemented`` say why, for the operator).
        """
        if isinstance(reply, _NoReply):
            return _Step("retry", f"{line}: {reply.detail}")
        if reply.status == 404:
            if missing is None:
                name = _ENGINE_NAMES[self._kind]
                missing = (
                    _DEV_MODE_HINT.format(line=line)
                    if self._kind == "vllm"
                    else f"{name} answered 404 for {line}: this version has no such endpoint"
                )
            return _Step("unsupported", missing)
        if reply.status == 501:
            return _Step(
                "unsupported", not_implemented or f"{line}: not implemented here (HTTP 501)"
            )
        if reply.status == 429 or reply.status >= 500:
            return _Step("retry", f"{line}: HTTP {reply.status}{self._excerpt(reply.text)}")
        return reply

    def _rejected(self, line: str, reply: _Reply) -> _Step:
        return _Step("fail", f"{line}: HTTP {reply.status}{self._excerpt(reply.text)}")

    def _excerpt(self, text: str) -> str:
        """The start of a body, on one line, without the token (a server may echo it)."""
        flat = " ".join(text.split())
        if self._token:
            flat = flat.replace(self._token, "***")
        if not flat:
            return ""
        cut = flat[:_EXCERPT_CHARS] + ("..." if len(flat) > _EXCERPT_CHARS else "")
        return f": {cut}"


async def _read_capped(response: aiohttp.ClientResponse) -> bytes:
    body = bytearray()
    async for chunk in response.content.iter_chunked(64 * 1024):
        body += chunk
        if len(body) > _MAX_BODY_BYTES:  # an admin answer this large is not one
            break
    return bytes(body[:_MAX_BODY_BYTES])


def _json_object(text: str) -> dict[str, Any]:
    """The body as a JSON object; empty when it is not one."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _json_list(text: str) -> list[dict[str, Any]] | None:
    """The body as a JSON list of objects; None when it is not one."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if isinstance(value, list) and all(isinstance(item, dict) for item in value):
        return value
    return None


def _is_int(value: object) -> TypeGuard[int]:
    """An int that is not a bool (JSON true is no slot id)."""
    return isinstance(value, int) and not isinstance(value, bool)
