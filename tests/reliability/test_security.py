"""Security: /control/* behind a bearer token, redacted secrets, loopback by default, no open proxy.

Every test runs real servers on 127.0.0.1: kvguard's API over a daemon watching the
simulated engine, the admission proxy in front of a recording upstream. Requests an
HTTP client would normalise are written raw to a socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import shutil
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import structlog
from aiohttp import web
from structlog.testing import capture_logs

from kvguard.actuators.dispatch import Actuators
from kvguard.actuators.drain import ProxyDrain
from kvguard.actuators.engine_admin import EngineAdmin
from kvguard.actuators.mitigations import Mitigations
from kvguard.actuators.proxy import AdmissionProxy, ProxySettings
from kvguard.actuators.reconfigure import CommandRestarter, Reconfigurer
from kvguard.api.app import build_app
from kvguard.api.control import DENIED_LOG_CALLERS, ControlLog
from kvguard.api.logs import configure_logging
from kvguard.api.telemetry import daemon_registry
from kvguard.config.secrets import CONTROL_TOKEN_ENV
from kvguard.config.settings import Config, parse_config
from kvguard.core.policy import Action, GuardState
from kvguard.errors import ConfigError
from kvguard.probes.engine import EngineProbe
from kvguard.runtime.daemon import Daemon
from kvguard.runtime.probing import Probes

TOKEN = "ctl-0123456789abcdef-planted"  # planted: must never appear in logs or /status
UNIT = Path(__file__).parents[2] / "systemd" / "kvguard.service"
# `systemd-analyze security` exposure (0 = locked down, 10 = open). Recorded in
# docs/security.md; a change that loosens the unit past this fails the test.
MAX_EXPOSURE = 2.5


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[web.Application], Awaitable[str]]]:
    """Serve aiohttp apps on free loopback ports; clean up after the test."""
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> str:
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in reversed(runners):
        await runner.cleanup()


def make_daemon(url: str, *, env: dict[str, str] | None = None, **tables: Any) -> Daemon:
    """A live daemon watching ``url`` (engine probe only), config from ``tables``."""
    config = parse_config({"engine": {"url": url}, **tables}, env=env or {})
    return Daemon(
        config,
        probes=Probes(engine=EngineProbe(url, timeout_s=2.0), nvml=None, host=None),
    )


@pytest.fixture
async def guarded(sim_engine, serve):
    """(API URL, daemon) for a daemon with the control token set, over a sim engine."""
    daemons: list[Daemon] = []

    async def start(**tables: Any) -> tuple[str, Daemon]:
        url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048)
        daemon = make_daemon(url, env={CONTROL_TOKEN_ENV: TOKEN}, **tables)
        daemons.append(daemon)
        return await serve(build_app(daemon)), daemon

    yield start
    for daemon in daemons:
        await daemon.close()


async def call(
    http: aiohttp.ClientSession, method: str, url: str, token: str | None = None, **kw: Any
) -> tuple[int, dict[str, Any], Any]:
    """(status, headers, JSON body) of one request, with ``token`` as the bearer."""
    headers = dict(kw.pop("headers", {}))
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    async with http.request(method, url, headers=headers, **kw) as resp:
        text = await resp.text()
        try:
            body = json.loads(text)
        except ValueError:
            body = text  # aiohttp's own plain-text answers (an unrouted path)
        return resp.status, dict(resp.headers), body


# ---------------------------------------------------------------------- /control/*
async def test_control_is_off_without_a_token(sim_engine, serve):
    """No token configured: every /control path is 404 and says how to enable it."""
    url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048)
    daemon = make_daemon(url)
    api = await serve(build_app(daemon))
    async with aiohttp.ClientSession() as http:
        for method, path in (("POST", "/control/dry-run"), ("GET", "/control"), ("POST", "/x")):
            status, _, body = await call(http, method, f"{api}{path}", token=TOKEN)
            assert status == 404
        status, _, body = await call(http, "POST", f"{api}/control/release", token=TOKEN)
        assert "control_token_file" in body["error"]
    assert daemon.mitigations.enforcing  # nothing changed


async def test_control_needs_the_bearer_token(guarded):
    """401 without a bearer token (with WWW-Authenticate), 403 with a wrong one."""
    api, daemon = await guarded()
    async with aiohttp.ClientSession() as http:
        for headers in ({}, {"Authorization": f"Basic {TOKEN}"}, {"Authorization": "Bearer "}):
            status, head, _ = await call(http, "POST", f"{api}/control/dry-run", headers=headers)
            assert status == 401
            assert head["WWW-Authenticate"].startswith("Bearer")
        for wrong in (TOKEN[:-1], TOKEN + "x", "é" * 20, TOKEN.upper()):
            status, _, _ = await call(http, "POST", f"{api}/control/dry-run", token=wrong)
            assert status == 403
        # Without the token nothing is said about which actions or methods exist.
        status, _, _ = await call(http, "POST", f"{api}/control/no-such-action")
        assert status == 401
        status, _, body = await call(http, "POST", f"{api}/control/no-such-action", token=TOKEN)
        assert status == 404
        assert "dry-run, live, release" in body["error"]
        status, head, _ = await call(http, "GET", f"{api}/control/dry-run", token=TOKEN)
        assert (status, head["Allow"]) == (405, "POST")
        # The scheme is case-insensitive (RFC 9110 section 11.1).
        status, _, _ = await call(
            http, "POST", f"{api}/control/live", headers={"Authorization": f"bearer {TOKEN}"}
        )
        assert status == 200
    assert daemon.mitigations.enforcing


async def test_dry_run_live_and_release_act_and_show_in_status(guarded, serve):
    """Dry-run stops the proxy shedding, live resumes it, release lifts every mitigation."""
    api, daemon = await guarded()
    proxy = AdmissionProxy(
        ProxySettings(upstream=daemon.config.engine.url, shed_ratio=0.0), daemon.mitigations
    )
    daemon.proxy = proxy
    front = await serve(proxy.app())
    plan = [
        Action("shed", "test", priority="standard"),
        Action("tighten_window", "test", max_prompt_tokens=1000, max_tokens=64),
    ]
    daemon.mitigations.apply(plan, "critical", 7)
    daemon.brain.guard = GuardState(level="critical", active={a.kind: a for a in plan})
    completion = {"prompt": "hello there", "max_tokens": 8}

    async def through_proxy(http: aiohttp.ClientSession) -> int:
        async with http.post(f"{front}/v1/completions", json=completion) as resp:
            await resp.read()
            return resp.status

    async with aiohttp.ClientSession() as http:
        assert await through_proxy(http) == 503  # standard traffic is shed
        status, _, body = await call(http, "POST", f"{api}/control/dry-run", token=TOKEN)
        assert (status, body["result"], body["dry_run"]) == (200, "changed", True)
        assert body["mitigations"]["enforcing"] is False
        assert await through_proxy(http) == 200  # recorded, not enforced
        status, _, body = await call(http, "POST", f"{api}/control/dry-run", token=TOKEN)
        assert body["result"] == "unchanged"
        _, _, doc = await call(http, "GET", f"{api}/status")
        assert doc["dry_run"] is True
        assert doc["mitigations"]["shed_floor"] == "standard"  # what would be in force

        status, _, body = await call(http, "POST", f"{api}/control/live", token=TOKEN)
        assert (status, body["dry_run"]) == (200, False)
        assert await through_proxy(http) == 503

        status, _, body = await call(http, "POST", f"{api}/control/release", token=TOKEN)
        assert status == 200
        assert body["released"] == ["shed", "tighten_window"]
        assert await through_proxy(http) == 200
        _, _, doc = await call(http, "GET", f"{api}/status")
    mitigations = doc["mitigations"]
    assert (mitigations["shed_floor"], mitigations["max_tokens"]) == (None, None)
    # The ladder forgets them too: it re-applies them only if pressure still calls for it.
    assert set(daemon.brain.guard.active) == set()
    actions = doc["control"]["actions"]
    assert doc["control"]["enabled"] is True
    assert [a["action"] for a in actions] == ["release", "live", "dry-run", "dry-run"]
    assert actions[0]["released"] == ["shed", "tighten_window"]
    # Who acted is in the log only: /status needs no token.
    assert all("remote" not in a for a in actions)
    # A switch at run time exports its decisions under the new mode from 0 (a Counter
    # reads 0 for any key: the exported sample is what must exist).
    registry = daemon_registry(daemon)
    for mode in ("dry_run", "applied"):
        sample = registry.get_sample_value(
            "kvguard_decisions_total", {"action": "shed", "mode": mode}
        )
        assert sample == 0.0, mode


def fp8_switch(daemon: Daemon) -> Reconfigurer:
    """Actuators with an fp8 switch (a no-op restart command) attached to ``daemon``."""
    url = daemon.config.engine.url
    proxy = AdmissionProxy(ProxySettings(upstream=url), daemon.mitigations)
    reconfigurer = Reconfigurer(
        CommandRestarter(["true"], "vllm"),
        ProxyDrain(proxy, daemon.mitigations),
        engine_stats=EngineProbe(url, timeout_s=2.0).sample,
    )
    actuators = Actuators(
        lambda _kind: (None, reconfigurer),
        on_fp8=lambda on: daemon.brain.fp8_result(fp8_on=on),
    )
    actuators.set_kind("vllm")
    daemon.actuators = actuators
    return reconfigurer


@pytest.mark.parametrize("engine_fp8", [False, True])
async def test_going_live_forgets_what_dry_run_only_recorded(guarded, engine_fp8):
    """After dry-run the ladder's fp8 state is the engine's real one, and no async action stays.

    In dry-run the ladder's kv_fp8 marks fp8 on without any switch: kept, the first live
    ticks would start a real revert_kv_fp8 of an engine that never changed.
    """
    api, daemon = await guarded()
    reconfigurer = fp8_switch(daemon)
    reconfigurer.fp8 = engine_fp8
    async with aiohttp.ClientSession() as http:
        status, _, _ = await call(http, "POST", f"{api}/control/dry-run", token=TOKEN)
        assert status == 200
        recorded = [
            Action("shed", "test", priority="standard"),
            Action("kv_fp8", "test"),
            Action("evict", "test"),
        ]
        since = daemon.brain.dry_run_since
        assert since is not None
        before, during = since - 100.0, since + 1.0  # a real switch before, a dry-run one after
        daemon.brain.guard = GuardState(
            level="critical",
            fp8_on=True,
            active={a.kind: a for a in recorded},
            last_action_at={"shed": during, "kv_fp8": during, "evict": before},
            restarts=(before, during),
        )
        status, _, _ = await call(http, "POST", f"{api}/control/live", token=TOKEN)
        assert status == 200
    guard = daemon.brain.guard
    assert guard.fp8_on is engine_fp8
    assert set(guard.active) == {"shed"}  # in force through the proxy: kept
    # The dry-run switch's cooldown and restart are given back; the real ones stay.
    assert guard.last_action_at == {"shed": during, "evict": before}
    assert guard.restarts == (before,)
    assert daemon.brain.dry_run_since is None


async def test_mode_switches_are_refused_during_an_fp8_drain(guarded):
    """While the fp8 switch drains or restarts, dry-run and live answer 409 and change nothing."""
    api, daemon = await guarded()
    reconfigurer = fp8_switch(daemon)
    async with aiohttp.ClientSession() as http:
        for busy, draining in ((True, False), (False, True)):
            reconfigurer.busy, daemon.mitigations.draining = busy, draining
            for action in ("dry-run", "live"):
                with capture_logs() as logs:
                    status, _, body = await call(
                        http, "POST", f"{api}/control/{action}", token=TOKEN
                    )
                assert status == 409, (action, busy, draining)
                assert "fp8 KV switch" in body["error"]
                assert [e["event"] for e in logs] == ["control_refused"]
                assert daemon.mitigations.enforcing
                assert daemon.dry_run is False
        reconfigurer.busy = daemon.mitigations.draining = False
        status, _, _ = await call(http, "POST", f"{api}/control/dry-run", token=TOKEN)
        assert status == 200
        _, _, doc = await call(http, "GET", f"{api}/status")
    assert [a["action"] for a in doc["control"]["actions"]] == ["dry-run"]


async def test_refused_control_calls_are_logged_once_a_minute_per_caller(sim_engine, serve):
    """A flood of bad tokens logs one control_denied per caller per 60 s, with a count."""
    url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048)
    now = [1000.0]
    config = parse_config({"engine": {"url": url}}, env={CONTROL_TOKEN_ENV: TOKEN})
    daemon = Daemon(
        config,
        probes=Probes(engine=EngineProbe(url, timeout_s=2.0), nvml=None, host=None),
        clock=lambda: now[0],
    )
    api = await serve(build_app(daemon))
    async with aiohttp.ClientSession() as http:
        with capture_logs() as logs:
            for _ in range(5):
                status, _, _ = await call(http, "POST", f"{api}/control/live", token="wrong")
                assert status == 403
            now[0] += 61
            await call(http, "POST", f"{api}/control/live")
    denied = [e for e in logs if e["event"] == "control_denied"]
    assert [(e["reason"], e["suppressed"]) for e in denied] == [
        ("wrong token", 0),
        ("no bearer token", 4),
    ]
    assert all(e["log_level"] == "warning" for e in denied)
    await daemon.close()


def test_the_refusal_log_table_is_bounded():
    """However many callers, the pacing table holds at most DENIED_LOG_CALLERS of them."""
    control = ControlLog()
    for i in range(DENIED_LOG_CALLERS * 3):
        assert control.denied_to_log(f"10.0.{i // 256}.{i % 256}", 5.0) == 0
    assert len(control.denied) == DENIED_LOG_CALLERS
    assert control.denied_to_log("10.0.11.255", 6.0) is None  # the newest are kept


async def test_readyz_fails_while_the_fp8_switch_drains(guarded):
    """The proxy refuses every generation request during a drain: the pod must leave the Service."""
    api, daemon = await guarded()
    await daemon.tick()
    async with aiohttp.ClientSession() as http:
        status, _, body = await call(http, "GET", f"{api}/readyz")
        assert (status, body["status"]) == (200, "ready")
        daemon.mitigations.draining = True
        status, _, body = await call(http, "GET", f"{api}/readyz")
        assert status == 503
        assert "draining" in body["reason"]
        daemon.mitigations.enforcing = False  # dry-run: the proxy refuses nothing
        status, _, _ = await call(http, "GET", f"{api}/readyz")
        assert status == 200


async def test_admission_ignores_an_untrusted_priority_header(guarded):
    """With trust_priority_header = false, /admission sheds X-Priority: critical like the rest."""
    critical = {"X-Priority": "critical"}
    for trust, expected in ((True, 200), (False, 429)):
        api, daemon = await guarded(proxy={"trust_priority_header": trust})
        daemon.mitigations.shed_floor = "standard"
        async with aiohttp.ClientSession() as http:
            status, _, body = await call(http, "GET", f"{api}/admission", headers=critical)
        assert status == expected, trust
        assert body["priority"] == ("critical" if trust else "standard")


async def test_release_and_dry_run_resume_an_engine_kvguard_paused(guarded):
    """An engine paused for a critical shed is resumed by /control/release and by dry-run."""
    api, daemon = await guarded()
    url = daemon.config.engine.url
    actuators = Actuators(
        lambda kind: (EngineAdmin(url, kind, backoff_s=0.01), None),
        on_fp8=lambda _on: None,
        shed_by_pause=True,
    )
    actuators.set_kind("vllm")
    daemon.actuators = actuators
    daemon.mitigations.launch = actuators.launch

    async def settle() -> None:
        await asyncio.wait_for(asyncio.gather(*actuators._tasks.values()), 10)

    async def paused(http: aiohttp.ClientSession) -> bool:
        async with http.get(f"{url}/is_paused") as resp:
            return bool((await resp.json())["is_paused"])

    async with aiohttp.ClientSession() as http:
        for action in ("release", "dry-run"):
            await call(http, "POST", f"{api}/control/live", token=TOKEN)
            daemon.mitigations.apply([Action("shed", "test", priority="standard")], "critical", 5)
            await settle()
            assert await paused(http)
            status, _, body = await call(http, "POST", f"{api}/control/{action}", token=TOKEN)
            assert status == 200
            await settle()
            assert not await paused(http), action
            assert not actuators.paused
            if action == "release":
                assert body["released"] == ["shed", "engine_pause"]
        # Back to live with the shed still recorded: the engine-side shed is re-applied.
        await call(http, "POST", f"{api}/control/live", token=TOKEN)
        await settle()
        assert await paused(http)
    await actuators.close()  # never leaves the engine paused
    async with aiohttp.ClientSession() as http:
        assert not await paused(http)


# ---------------------------------------------------------------------- secrets
@pytest.fixture
def captured_log():
    """The JSON log at debug level, rendered as in production; structlog reset after."""
    buffer = io.StringIO()
    configure_logging("debug", "json")
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=buffer))
    yield buffer.getvalue
    structlog.reset_defaults()


async def test_secrets_never_reach_status_or_logs(tmp_path, sim_engine, serve, captured_log):
    """Planted control, engine and webhook secrets and API keys: absent from logs and /status."""
    secrets = {
        "control": TOKEN,
        "engine": "engine-token-planted-4242",
        "webhook": "webhook-secret-planted-4343-4343-4343",
        "api_key": "sk-apikey-planted-4444",
        "webhook_path": "slackpath-planted-4545",  # Slack, Teams, Discord: in the path
        "webhook_at_path": "atpath-planted-4646",  # an '@' in the path, not userinfo
    }
    (tmp_path / "control.token").write_text(secrets["control"] + "\n")
    (tmp_path / "engine.token").write_text(secrets["engine"])
    (tmp_path / "hook.secret").write_text(secrets["webhook"])
    url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048)
    config = parse_config(
        {
            "engine": {"url": url, "token_file": "engine.token"},
            "server": {"control_token_file": "control.token"},
            "webhook": {
                "urls": [
                    "http://127.0.0.1:9/hook?key=x",
                    f"https://hooks.slack.com/services/T0/B0/{secrets['webhook_path']}",
                    f"http://127.0.0.1:9/a@b/{secrets['webhook_at_path']}",
                ],
                "secret_file": "hook.secret",
            },
            "proxy": {"api_key_priorities": {secrets["api_key"]: "sheddable"}},
        },
        source=str(tmp_path / "kvguard.toml"),
        env={},
    )
    daemon = Daemon(
        config, probes=Probes(engine=EngineProbe(url, timeout_s=2.0), nvml=None, host=None)
    )
    api = await serve(build_app(daemon))
    await daemon.tick()
    await daemon.close()
    async with aiohttp.ClientSession() as http:
        for token in (TOKEN[:-1], TOKEN + "0", None):
            await call(http, "POST", f"{api}/control/release", token=token)
        for action in ("dry-run", "live", "release"):
            status, _, _ = await call(http, "POST", f"{api}/control/{action}", token=TOKEN)
            assert status == 200
        await call(
            http,
            "GET",
            f"{api}/admission",
            headers={"Authorization": f"Bearer {secrets['api_key']}"},
        )
        async with http.get(f"{api}/status") as resp:
            status_text = await resp.text()
    logged = captured_log()
    assert '"event": "control_action"' in logged
    assert '"event": "control_denied"' in logged
    for name, secret in secrets.items():
        for text, where in ((logged, "log"), (status_text, "/status"), (repr(config), "repr")):
            # A near miss is most of a secret too: no 12-character piece of it either.
            pieces = {secret[i : i + 12] for i in range(len(secret) - 11)}
            leaked = [p for p in pieces if p in text]
            assert not leaked, f"{name} secret in {where}: {leaked}"
    shown = json.loads(status_text)
    assert shown["config"]["server"]["control_token"] == "***"
    assert shown["config"]["server"]["control_token_file"] == "***"  # where it lies: log only
    assert "control.token" not in status_text
    assert shown["config"]["webhook"]["urls"] == [
        "http://127.0.0.1:9",
        "https://hooks.slack.com",
        "http://127.0.0.1:9",
    ]


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("short", "at least 16"),
        ("has spaces in the middle of it", "visible ASCII"),
        ("tökentökentökentöken", "visible ASCII"),
    ],
)
def test_weak_or_unusable_control_tokens_are_refused(tmp_path, value, problem):
    """A guessable or unsendable token is a config error that names where it came from."""
    (tmp_path / "t").write_text(value)
    with pytest.raises(ConfigError, match=problem) as err:
        parse_config(
            {"engine": {"url": "http://127.0.0.1:1"}, "server": {"control_token_file": "t"}},
            source=str(tmp_path / "k.toml"),
            env={},
        )
    assert "server.control_token_file" in str(err.value)
    assert value not in str(err.value)
    with pytest.raises(ConfigError, match=problem) as err:
        parse_config({"engine": {"url": "http://127.0.0.1:1"}}, env={CONTROL_TOKEN_ENV: value})
    assert CONTROL_TOKEN_ENV in str(err.value)
    assert value not in str(err.value)


def test_the_control_token_file_wins_over_the_environment(tmp_path):
    """[server] control_token_file, when set, is the token; the environment is the fallback."""
    (tmp_path / "t").write_text(TOKEN)
    config: Config = parse_config(
        {"engine": {"url": "http://127.0.0.1:1"}, "server": {"control_token_file": "t"}},
        source=str(tmp_path / "k.toml"),
        env={CONTROL_TOKEN_ENV: "another-token-from-the-env"},
    )
    assert config.server.control_token is not None
    assert config.server.control_token.reveal() == TOKEN


# ---------------------------------------------------------------------- binding
def test_listening_beyond_loopback_is_logged():
    """A non-loopback listen address (API or proxy) logs listen_not_loopback; loopback does not."""
    url = "http://127.0.0.1:1"
    with capture_logs() as logs:
        build_app(make_daemon(url, server={"listen": "0.0.0.0:9108"}))
        AdmissionProxy(ProxySettings(upstream=url, listen="[::]:9000"), Mitigations()).app()
        build_app(make_daemon(url, server={"listen": "localhost:9108"}))
        AdmissionProxy(ProxySettings(upstream=url, listen="[::1]:9000"), Mitigations()).app()
    warned = [(e["server"], e["listen"]) for e in logs if e["event"] == "listen_not_loopback"]
    assert warned == [("api", "0.0.0.0:9108"), ("proxy", "[::]:9000")]
    assert all(e["log_level"] == "warning" for e in logs if e["event"] == "listen_not_loopback")


def test_defaults_listen_on_loopback_only():
    """Both servers default to 127.0.0.1."""
    config = parse_config({"engine": {"url": "http://127.0.0.1:1"}}, env={})
    assert config.server.listen.startswith("127.0.0.1:")
    assert config.proxy.listen.startswith("127.0.0.1:")
    assert ProxySettings(upstream="http://127.0.0.1:1").listen.startswith("127.0.0.1:")


# ---------------------------------------------------------------------- no open proxy
@pytest.fixture
async def recorder(serve):
    """(upstream URL, requests seen): an upstream that records each request it receives."""
    seen: list[dict[str, Any]] = []

    async def record(request: web.Request) -> web.Response:
        seen.append(
            {
                "method": request.method,
                "target": request.raw_path,
                "headers": dict(request.headers),
                "body": await request.read(),
            }
        )
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    return await serve(app), seen


async def raw_exchange(base: str, request: bytes) -> tuple[int, bytes]:
    """Write ``request`` as bytes to the server at ``base``; (status, whole answer)."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        length = next(
            (
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ),
            0,
        )
        body = await asyncio.wait_for(reader.readexactly(length), 5) if length else b""
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return int(head.split(b" ", 2)[1]), head + body


MALFORMED = [
    (b"GET http://evil.example/v1/models HTTP/1.1\r\nHost: evil.example\r\n\r\n", 400),
    (b"GET https://127.0.0.1:1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 400),
    (b"CONNECT evil.example:443 HTTP/1.1\r\nHost: evil.example:443\r\n\r\n", 405),
    (b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"TRACE /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 405),
    (b"PROPFIND /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", {400, 405}),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: a\rInjected: 1\r\n\r\n", 400),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: a\nInjected: 1\r\n\r\n", 400),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", 400),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: \xff\xfe\r\n\r\n", 400),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: a\r\n folded: 1\r\n\r\n", 400),
    (b"GET /v1/../reset_prefix_cache HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET /v1/%2e%2e/reset_prefix_cache HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET /v1%2freset_prefix_cache HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET /v1%5Cmodels HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET /v1/models%00 HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"POST /reset_prefix_cache HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 403),
    (b"POST //Pause/?mode=abort HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 403),
    (b"POST /slots/0?action=erase HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 403),
    (b"GET /admin/secret HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        400,
    ),
]


@pytest.mark.parametrize(("raw", "expected"), MALFORMED, ids=lambda v: repr(v)[:40])
async def test_malformed_or_foreign_requests_never_reach_the_upstream(
    recorder, serve, raw, expected
):
    """Absolute URIs, CONNECT, odd methods, CR/LF, dot segments, admin paths: 4xx, nothing sent."""
    upstream, seen = recorder
    proxy = AdmissionProxy(
        # Admin paths allowed too, to show blocked_paths wins over allowed_paths.
        ProxySettings(
            upstream=upstream,
            allowed_paths=("/v1", "/health", "/reset_prefix_cache", "/pause", "/slots"),
        ),
        Mitigations(),
    )
    front = await serve(proxy.app())
    status, answer = await raw_exchange(front, raw)
    assert status in (expected if isinstance(expected, set) else {expected}), answer
    assert 400 <= status < 500
    assert seen == []
    # And the proxy still serves a well-formed request afterwards.
    status, _ = await raw_exchange(front, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 200
    assert [s["target"] for s in seen] == ["/v1/models"]


@pytest.mark.parametrize(
    ("value", "ours"),
    [(b"a\x00b", False), (b"a\x01b", False), (b"a\x7fb", False), (b"\xff\xfe", True)],
    ids=["nul", "soh", "del", "not-utf8"],
)
async def test_who_refuses_a_bad_header_value(recorder, serve, value, ours):
    """Control characters: the HTTP parser's plain-text 400; non-UTF-8: kvguard's screen.

    As docs/proxy.md says: only bytes that are not UTF-8 reach kvguard's screen (JSON,
    counted as bad_header); the parser's own 400 is plain text and not counted.
    """
    upstream, seen = recorder
    proxy = AdmissionProxy(ProxySettings(upstream=upstream), Mitigations())
    front = await serve(proxy.app())
    raw = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: " + value + b"\r\n\r\n"
    status, answer = await raw_exchange(front, raw)
    assert status == 400
    body = answer.split(b"\r\n\r\n", 1)[1]
    if ours:
        assert json.loads(body)["error"]["code"] == "bad_header"
        assert proxy.counters.rejected == {"bad_header": 1}
    else:
        assert not body.startswith(b"{")
        assert proxy.counters.rejected == {}
    assert seen == []


async def test_host_and_hop_by_hop_headers_never_pass(recorder, serve):
    """The upstream sees its own Host and none of the client's hop-by-hop headers."""
    upstream, seen = recorder
    front = await serve(AdmissionProxy(ProxySettings(upstream=upstream), Mitigations()).app())
    request = (
        b"GET /v1/models HTTP/1.1\r\n"
        b"Host: evil.example\r\n"
        b"Connection: keep-alive, X-Private-Hop\r\n"
        b"X-Private-Hop: secret\r\n"
        b"Keep-Alive: timeout=5\r\n"
        b"Proxy-Authorization: Basic Zm9vOmJhcg==\r\n"
        b"Proxy-Connection: keep-alive\r\n"
        b"TE: trailers\r\n"
        b"Trailer: X-Checksum\r\n"
        b"Upgrade: websocket\r\n"
        b"X-Kept: yes\r\n\r\n"
    )
    status, _ = await raw_exchange(front, request)
    assert status == 200
    headers = {k.lower(): v for k, v in seen[0]["headers"].items()}
    assert headers["host"] == upstream.removeprefix("http://")
    assert headers["x-kept"] == "yes"
    for gone in (
        "x-private-hop",
        "keep-alive",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
    ):
        assert gone not in headers, gone


async def test_hop_by_hop_headers_of_the_answer_never_pass(serve):
    """Headers the engine's Connection names, Proxy-* and Keep-Alive stop at the proxy."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
            b"Connection: X-Engine-Private\r\nX-Engine-Private: internal\r\n"
            b"Proxy-Authenticate: Basic\r\nKeep-Alive: timeout=9\r\nX-Kept: yes\r\n\r\n{}"
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        proxy = AdmissionProxy(ProxySettings(upstream=f"http://127.0.0.1:{port}"), Mitigations())
        front = await serve(proxy.app())
        async with aiohttp.ClientSession() as http, http.get(f"{front}/v1/models") as resp:
            assert resp.status == 200
            names = {k.lower() for k in resp.headers}
            assert "x-kept" in names
            assert not names & {"x-engine-private", "proxy-authenticate", "keep-alive"}
    finally:
        server.close()
        await server.wait_closed()


# ---------------------------------------------------------------------- systemd
def test_the_unit_scores_as_hardened():
    """`systemd-analyze security` rates the shipped unit at or below MAX_EXPOSURE."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed: the unit's score is not checked here")
    result = subprocess.run(
        [analyze, "security", "--offline=yes", "--no-pager", str(UNIT)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    overall = [line for line in result.stdout.splitlines() if "Overall exposure level" in line]
    if result.returncode not in (0, 1) or not overall:
        pytest.skip(f"systemd-analyze security --offline cannot rate units here: {result.stderr}")
    score = float(overall[0].split(":", 1)[1].split()[0])
    assert score <= MAX_EXPOSURE, result.stdout
