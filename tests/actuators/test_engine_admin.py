"""Engine admin actions against simulated engines and small servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from kvguard.actuators.engine_admin import AdminResult, EngineAdmin
from kvguard.errors import InvalidInputError
from tests.helpers import free_port, until

TOKEN = "s3cret-admin-token"


class RecordingSleep:
    """The injected sleep: records each delay, waits for nothing, may act on a call."""

    def __init__(self, on_call=None) -> None:
        self.delays: list[float] = []
        self._on_call = on_call

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        if self._on_call is not None:
            self._on_call(len(self.delays))


@pytest.fixture
async def serve():
    """Serve aiohttp apps on loopback ports; clean up after the test."""
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> str:
        # handler_cancellation: a client that gave up (timeout) ends its slow handler too.
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in reversed(runners):
        await runner.cleanup()


@pytest.fixture
async def recorder(serve):
    """A server that records every request and answers from ``routes`` (path -> handler).

    Returns (url, seen); an unrouted path answers 404. With ``upstream`` it forwards
    everything to that server instead (a recording proxy in front of a sim engine).
    """

    async def start(routes=None, upstream: str | None = None):
        seen: list[dict] = []
        client = aiohttp.ClientSession(trust_env=False) if upstream else None

        async def handle(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            seen.append(
                {
                    "method": request.method,
                    "path": request.rel_url.raw_path_qs,
                    "authorization": request.headers.get("Authorization"),
                    "body": json.loads(body) if body else None,
                }
            )
            if client is not None:
                async with client.request(
                    request.method, upstream + request.rel_url.raw_path_qs, data=body
                ) as answer:
                    return web.Response(
                        status=answer.status,
                        body=await answer.read(),
                        content_type=answer.content_type,
                    )
            handler = (routes or {}).get(request.path)
            if handler is None:
                return web.json_response({"detail": "Not Found"}, status=404)
            return await handler(request)

        async def close_client(_: web.Application) -> None:
            if client is not None:
                await client.close()

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        app.on_cleanup.append(close_client)
        return await serve(app), seen

    return start


@dataclass
class Stream:
    """A streaming completion in progress, and the session it runs on."""

    session: aiohttp.ClientSession
    response: aiohttp.ClientResponse

    async def end(self) -> None:
        """Drop the stream (the engine aborts the request) and its session."""
        self.response.close()
        await self.session.close()


async def start_stream(url: str, max_tokens: int = 3000) -> Stream:
    """A long streaming completion, returned once its first token arrived (it holds KV)."""
    session = aiohttp.ClientSession(trust_env=False)
    response = await session.post(
        url + "/v1/completions",
        json={"prompt": "tell me a story " * 20, "max_tokens": max_tokens, "stream": True},
    )
    stream = Stream(session, response)
    if response.status != 200 or not (await response.content.readline()).startswith(b"data: "):
        await stream.end()
        pytest.fail(f"the stream did not start: HTTP {response.status}")
    return stream


async def complete(url: str, max_tokens: int = 8) -> tuple[int, dict]:
    """One whole (non-streamed) completion: status and body."""
    async with (
        aiohttp.ClientSession(trust_env=False) as session,
        session.post(
            url + "/v1/completions", json={"prompt": "hi there", "max_tokens": max_tokens}
        ) as response,
    ):
        return response.status, await response.json()


@pytest.fixture
async def admin_for():
    """Make EngineAdmin objects with a recording sleep; close them after the test."""
    made: list[EngineAdmin] = []

    def make(url: str, kind: str, **kwargs) -> tuple[EngineAdmin, RecordingSleep]:
        sleep = kwargs.pop("sleep", None) or RecordingSleep()
        admin = EngineAdmin(url, kind, sleep=sleep, **kwargs)
        made.append(admin)
        return admin, sleep

    yield make
    for admin in made:
        await admin.close()


# ---------------------------------------------------------------- vLLM
async def test_vllm_evict_resets_the_prefix_cache_of_an_idle_engine(sim_engine, admin_for):
    """An idle vLLM resets at the first attempt, with no backoff."""
    admin, sleep = admin_for(await sim_engine(), "vllm")
    result = await admin.evict()
    assert result == AdminResult("evict", True, True, "prefix cache reset", 1)
    assert sleep.delays == []


async def test_vllm_evict_is_retried_while_a_request_holds_blocks(sim_server, admin_for):
    """Refused while a stream holds blocks; retried with doubling backoff until it ends."""
    server = await sim_server()
    stream = await start_stream(server.url)

    def end_requests_on_second_backoff(calls: int) -> None:
        if calls == 2:
            for rid in server.engine.request_ids():
                server.engine.abort(rid)

    admin, sleep = admin_for(
        server.url,
        "vllm",
        retries=5,
        sleep=RecordingSleep(end_requests_on_second_backoff),
    )
    try:
        assert server.engine.scheduler.used_blocks > 0
        result = await admin.evict()
    finally:
        await stream.end()
    assert result.ok
    assert result.attempts == 3
    assert sleep.delays == [0.5, 1.0]
    assert server.engine.scheduler.used_blocks == 0


async def test_vllm_evict_gives_up_after_retries_attempts(sim_server, admin_for):
    """While blocks stay held, exactly ``retries`` attempts are made, then ok=False."""
    server = await sim_server()
    stream = await start_stream(server.url)
    admin, sleep = admin_for(server.url, "vllm", retries=3, backoff_s=0.25)
    try:
        result = await admin.evict()
        still_running = len(server.engine.scheduler.running)
    finally:
        await stream.end()
    assert (result.ok, result.supported, result.attempts) == (False, True, 3)
    assert sleep.delays == [0.25, 0.5]
    assert "blocks are held by running requests" in result.detail
    assert "gave up after 3 attempts" in result.detail
    assert still_running == 1  # never forced: the running request was not preempted
    assert server.engine.stats.preemptions_total == 0


async def test_vllm_without_dev_mode_is_detected_once(sim_engine, admin_for):
    """A 404 means dev mode is off: unsupported, told how to fix, logged once, not re-asked."""
    admin, sleep = admin_for(await sim_engine(dev_endpoints=False), "vllm")
    assert admin.supports("evict")
    with capture_logs() as logs:
        first = await admin.evict()
        later = [await admin.pause(), await admin.resume(), await admin.evict()]
    assert (first.ok, first.supported, first.attempts) == (False, False, 1)
    assert "VLLM_SERVER_DEV_MODE=1" in first.detail
    assert sleep.delays == []  # a missing endpoint is not retried
    assert [(r.action, r.supported, r.attempts) for r in later] == [
        ("pause", False, 0),
        ("resume", False, 0),
        ("evict", False, 0),
    ]
    assert all("VLLM_SERVER_DEV_MODE=1" in r.detail for r in later)
    assert not any(admin.supports(action) for action in ("evict", "pause", "resume"))
    unavailable = [entry for entry in logs if entry["event"] == "engine_admin_unavailable"]
    assert len(unavailable) == 1
    assert unavailable[0]["log_level"] == "warning"
    assert sorted(unavailable[0]["actions"]) == ["evict", "pause", "resume"]


async def test_vllm_pause_refuses_new_requests_and_resume_admits_them(sim_server, admin_for):
    """Paused (mode=wait), new requests get 503 and the running one finishes; resume admits."""
    server = await sim_server()
    admin, _ = admin_for(server.url, "vllm")
    running = asyncio.ensure_future(complete(server.url, max_tokens=150))
    await until(lambda: len(server.engine.scheduler.running) == 1)

    paused = await admin.pause()
    assert (paused.ok, paused.supported, paused.attempts) == (True, True, 1)
    assert server.engine.pause_mode == "wait"
    status, body = await complete(server.url)
    assert status == 503, body
    status, body = await running
    assert status == 200
    assert body["choices"][0]["finish_reason"] == "length"  # it ran to the end

    resumed = await admin.resume()
    assert resumed.ok
    assert server.engine.pause_mode is None
    status, body = await complete(server.url)
    assert status == 200
    assert body["usage"]["completion_tokens"] == 8


async def test_vllm_pause_that_outlasts_the_timeout_is_confirmed_by_is_paused(recorder, admin_for):
    """mode=wait may answer only after the drain: a timeout then GET /is_paused true is ok."""

    async def slow_pause(_: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.json_response({"status": "paused"})

    async def is_paused(_: web.Request) -> web.Response:
        return web.json_response({"is_paused": True})

    url, seen = await recorder({"/pause": slow_pause, "/is_paused": is_paused})
    admin, sleep = admin_for(url, "vllm", timeout_s=1.0)
    result = await admin.pause()
    assert (result.ok, result.attempts) == (True, 1)
    assert "still finishing" in result.detail
    assert [(s["method"], s["path"]) for s in seen] == [
        ("POST", "/pause?mode=wait&clear_cache=false"),
        ("GET", "/is_paused"),
    ]
    assert sleep.delays == []


async def test_a_pause_that_cannot_be_recorded_is_never_sent(sim_server, recorder, admin_for):
    """The state file refused the note: no pause reaches the engine, and the result says why.

    An unrecorded pause would outlive a kvguard killed while holding it: the next one
    would find no note and never resume the engine.
    """
    server = await sim_server()
    url, seen = await recorder(upstream=server.url)
    told: list[bool] = []

    def unwritable(paused: bool) -> bool:
        told.append(paused)
        return False

    admin, _ = admin_for(url, "vllm", on_pause_change=unwritable)
    result = await admin.pause()
    assert (result.ok, result.supported, result.attempts) == (False, True, 0)
    assert result.unrecorded
    assert not result.uncertain  # nothing was sent: no resume is owed
    assert "could not record the pause in its state file" in result.detail
    assert told == [True]
    assert seen == []
    assert server.engine.pause_mode is None
    assert admin.supports("pause")  # the endpoint is there: a later pause may be recorded


async def test_is_paused_asks_vllm_and_changes_nothing(sim_server, recorder, admin_for):
    """GET /is_paused on vLLM, before and after a pause made by someone else."""
    server = await sim_server()
    url, seen = await recorder(upstream=server.url)
    admin, _ = admin_for(url, "vllm")
    assert await admin.is_paused() is False
    server.engine.pause("wait")  # another client's pause
    assert await admin.is_paused() is True
    assert [(s["method"], s["path"]) for s in seen] == [("GET", "/is_paused")] * 2
    assert server.engine.pause_mode == "wait"


async def test_is_paused_is_unknown_without_an_endpoint_that_says_it(
    sim_server, recorder, admin_for
):
    """Without dev mode, vLLM's 404 is "unknown" (no action marked missing by a question).

    SGLang and llama.cpp have no endpoint that answers it: unknown, no request.
    """
    server = await sim_server(dev_endpoints=False)
    admin, _ = admin_for(server.url, "vllm")
    with capture_logs() as logs:
        assert await admin.is_paused() is None
    assert logs == []
    assert admin.supports("pause")
    for kind in ("sglang", "llamacpp", "tgi"):
        url, seen = await recorder()
        other, _ = admin_for(url, kind)
        assert await other.is_paused() is None
        assert seen == []


# ---------------------------------------------------------------- SGLang
async def test_sglang_flush_pause_in_place_and_continue(sim_server, recorder, admin_for):
    """Flush when idle; paused in place, new requests wait and flush is refused; continue runs."""
    server = await sim_server(flavor="sglang")
    url, seen = await recorder(upstream=server.url)
    admin, sleep = admin_for(url, "sglang", retries=2)

    assert (await admin.evict()).ok

    paused = await admin.pause()
    assert paused.ok
    assert "in_place" in paused.detail
    assert seen[-1]["body"] == {"mode": "in_place"}  # never abort or retract
    waiting = asyncio.ensure_future(complete(server.url))
    await until(lambda: len(server.engine.request_ids()) == 1)
    await asyncio.sleep(0.1)  # ~50 engine steps: a scheduled request would have tokens
    assert not waiting.done()
    assert server.engine.stats.generation_tokens_total == 0

    refused = await admin.evict()
    assert (refused.ok, refused.supported, refused.attempts) == (False, True, 2)
    assert "HTTP 400" in refused.detail
    assert sleep.delays == [0.5]

    resumed = await admin.resume()
    assert resumed.ok
    assert seen[-1]["path"] == "/continue_generation"
    status, body = await waiting
    assert status == 200
    assert body["usage"]["completion_tokens"] == 8
    flushed = await admin.evict()
    assert (flushed.ok, flushed.attempts) == (True, 1)


# ---------------------------------------------------------------- llama.cpp
async def test_llamacpp_evict_erases_idle_slots_only(sim_server, recorder, admin_for):
    """Two of four slots busy: exactly the two idle ones are erased."""
    server = await sim_server(flavor="llamacpp", max_num_seqs=4)
    url, seen = await recorder(upstream=server.url)
    admin, _ = admin_for(url, "llamacpp")
    streams = [await start_stream(server.url, max_tokens=2000) for _ in range(2)]
    try:
        await until(lambda: len(server.engine.scheduler.running) == 2)
        result = await admin.evict()
        busy_after = len(server.engine.scheduler.running)
    finally:
        for stream in streams:
            await stream.end()
    assert (result.ok, result.supported, result.attempts) == (True, True, 1)
    assert "erased 2 idle slot(s)" in result.detail
    assert "left 2 busy slot(s) alone" in result.detail
    erased = sorted(s["path"] for s in seen if s["method"] == "POST")
    assert erased == ["/slots/2?action=erase", "/slots/3?action=erase"]
    assert busy_after == 2


async def test_llamacpp_without_slot_save_path_is_unsupported(recorder, admin_for):
    """llama-server answers 501 to slot actions without --slot-save-path: say so, remember it."""

    async def slots(_: web.Request) -> web.Response:
        return web.json_response(
            [{"id": 0, "is_processing": False}, {"id": 1, "is_processing": True}]
        )

    async def refuse(_: web.Request) -> web.Response:
        message = "This server does not support slots action. Start it with `--slot-save-path`"
        return web.json_response({"error": {"code": 501, "message": message}}, status=501)

    url, seen = await recorder({"/slots": slots, "/slots/0": refuse})
    admin, _ = admin_for(url, "llamacpp")
    with capture_logs() as logs:
        result = await admin.evict()
        again = await admin.evict()
    assert (result.ok, result.supported) == (False, False)
    assert "--slot-save-path" in result.detail
    assert not admin.supports("evict")
    assert again.attempts == 0
    assert len(seen) == 2  # GET /slots, POST /slots/0 (slot 1 is busy); nothing after
    assert [entry["event"] for entry in logs] == ["engine_admin_unavailable"]


# ---------------------------------------------------------------- engines without admin
@pytest.mark.parametrize(
    ("kind", "action", "says"),
    [
        ("tgi", "evict", "TGI has no cache-eviction endpoint"),
        ("tgi", "pause", "TGI has no endpoint to pause admission"),
        ("trtllm", "evict", "TensorRT-LLM has no cache-eviction endpoint"),
        ("trtllm", "resume", "TensorRT-LLM has no endpoint to resume admission"),
        ("llamacpp", "pause", "llama.cpp has no endpoint to pause admission"),
    ],
)
async def test_unsupported_actions_make_no_http_call(recorder, admin_for, kind, action, says):
    """By kind alone: supported=False, no request sent."""
    url, seen = await recorder()
    admin, _ = admin_for(url, kind)
    assert not admin.supports(action)
    result = await getattr(admin, action)()
    assert result == AdminResult(action, False, False, says, 0)
    assert seen == []


def test_supports_follows_the_kind():
    """By kind: vLLM and SGLang offer all three, llama.cpp evict only, TGI and TRT-LLM none."""
    offered = {
        kind: {a for a in ("evict", "pause", "resume") if EngineAdmin("http://x", kind).supports(a)}
        for kind in ("vllm", "sglang", "llamacpp", "tgi", "trtllm")
    }
    assert offered == {
        "vllm": {"evict", "pause", "resume"},
        "sglang": {"evict", "pause", "resume"},
        "llamacpp": {"evict"},
        "tgi": set(),
        "trtllm": set(),
    }
    assert not EngineAdmin("http://x", "vllm").supports("abort")


@pytest.mark.parametrize(
    ("args", "kwargs", "field"),
    [
        (("http://x", "ollama"), {}, "engine kind"),
        (("ftp://x", "vllm"), {}, "engine url"),
        (("http://user:pw@x", "vllm"), {}, "engine url"),
        (("http://x", "vllm"), {"retries": 0}, "retries"),
        (("http://x", "vllm"), {"timeout_s": 0}, "timeout_s"),
        (("http://x", "vllm"), {"backoff_s": -1}, "backoff_s"),
    ],
)
def test_bad_settings_are_refused(args, kwargs, field):
    """Configuration mistakes raise at construction, naming the field."""
    with pytest.raises(InvalidInputError) as caught:
        EngineAdmin(*args, **kwargs)
    assert caught.value.field == field
    assert "pw" not in str(caught.value)


# ---------------------------------------------------------------- HTTP behaviour
@pytest.mark.parametrize("status", [503, 500, 429])
async def test_transient_answers_are_retried_with_backoff(recorder, admin_for, status):
    """Two transient answers, then success: three attempts, backoff 0.5 then 1.0."""
    answers = iter([status, status, 200])

    async def reset(_: web.Request) -> web.Response:
        code = next(answers)
        body = {"success": True} if code == 200 else {"error": "busy"}
        return web.json_response(body, status=code)

    url, seen = await recorder({"/reset_prefix_cache": reset})
    admin, sleep = admin_for(url, "vllm")
    result = await admin.evict()
    assert (result.ok, result.attempts) == (True, 3)
    assert sleep.delays == [0.5, 1.0]
    assert len(seen) == 3


async def test_other_client_errors_are_final(recorder, admin_for):
    """A 400 is not retried; the detail has the status and the start of the body."""

    async def refuse(_: web.Request) -> web.Response:
        return web.json_response({"message": "mode must be abort, wait or keep"}, status=400)

    url, seen = await recorder({"/pause": refuse})
    admin, sleep = admin_for(url, "vllm")
    result = await admin.pause()
    assert (result.ok, result.supported, result.attempts) == (False, True, 1)
    assert "HTTP 400" in result.detail
    assert "mode must be abort, wait or keep" in result.detail
    assert sleep.delays == []
    assert len(seen) == 1


async def test_connection_refused_gives_up_after_bounded_attempts(admin_for):
    """Nothing listening: ok=False after ``retries`` attempts, no exception."""
    admin, sleep = admin_for(f"http://127.0.0.1:{free_port()}", "sglang", retries=4)
    result = await admin.evict()
    assert (result.ok, result.supported, result.attempts) == (False, True, 4)
    assert sleep.delays == [0.5, 1.0, 2.0]
    assert "gave up after 4 attempts" in result.detail


async def test_a_request_that_times_out_is_retried(recorder, admin_for):
    """Each request is bounded by timeout_s; a timeout counts as transient."""

    async def hang(_: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.Response(text="Cache flushed.")

    url, seen = await recorder({"/flush_cache": hang})
    admin, _ = admin_for(url, "sglang", timeout_s=0.1, retries=2)
    result = await admin.evict()
    assert (result.ok, result.attempts) == (False, 2)
    assert "no answer within 0.1 s" in result.detail
    assert len(seen) == 2


async def test_token_is_sent_and_never_shown(recorder, admin_for):
    """Authorization: Bearer goes out; an echoed token is masked in the detail and logs."""

    async def echo_denied(request: web.Request) -> web.Response:
        return web.Response(status=403, text=f"bad credentials {request.headers['Authorization']}")

    url, seen = await recorder({"/flush_cache": echo_denied})
    admin, _ = admin_for(url, "sglang", token=TOKEN)
    with capture_logs() as logs:
        denied = await admin.evict()
        missing = await admin.pause()  # unrouted: 404, logged
    assert [s["authorization"] for s in seen] == [f"Bearer {TOKEN}"] * 2
    assert (denied.ok, denied.attempts) == (False, 1)
    assert "HTTP 403" in denied.detail
    assert "***" in denied.detail
    assert not missing.supported
    assert logs
    assert TOKEN not in denied.detail + missing.detail + repr(logs)


async def test_close_ends_the_session_and_a_later_call_opens_a_new_one(sim_engine, admin_for):
    """close() is not final: the next action works on a fresh session."""
    admin, _ = admin_for(await sim_engine(), "vllm")
    assert (await admin.evict()).ok
    session = admin._session
    await admin.close()
    assert session is not None
    assert session.closed
    assert (await admin.evict()).ok
