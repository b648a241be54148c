"""A real nginx enforces kvguard's decisions through `auth_request` to /admission.

The site configuration below is the one docs/integrations.md shows, line for line;
only the ports differ (there: 8080, the engine on 8000, kvguard on 9108).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvguard.config.settings import parse_config
from kvguard.runtime.daemon import Daemon
from tests.helpers import free_port
from tests.test_run import start_api

DOCS = Path(__file__).resolve().parent.parent / "docs" / "integrations.md"
# Debian puts nginx in /usr/sbin, which is not on an ordinary user's PATH.
NGINX = shutil.which("nginx", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin"]))
BATCH_KEY = "sk-batch-made-up"

# What a user copies into their nginx (inside `http { }`). LISTEN, ENGINE and
# KVGUARD are replaced with the test's ports. One line is long: the 503 body is a
# single nginx string, and docs/integrations.md shows it exactly as tested.
SITE = """\
upstream engine {
    server ENGINE;
    keepalive 16;
}

upstream kvguard {
    server KVGUARD max_fails=0;
    keepalive 4;
}

server {
    listen LISTEN;

    proxy_http_version 1.1;
    proxy_set_header Connection "";
    proxy_buffering off;
    proxy_read_timeout 600s;

    location / {
        proxy_pass http://engine;
    }

    location ~ ^/v1/(chat/)?completions$ {
        auth_request /_kvguard;
        auth_request_set $kvguard_status $upstream_status;
        auth_request_set $kvguard_retry_after $upstream_http_retry_after;
        auth_request_set $kvguard_priority $upstream_http_x_kvguard_priority;
        auth_request_set $kvguard_level $upstream_http_x_kvguard_level;
        error_page 500 = @kvguard_refused;
        proxy_pass http://engine;
    }

    location = /_kvguard {
        internal;
        proxy_pass http://kvguard/admission;
        proxy_pass_request_body off;
        proxy_set_header Content-Length "";
        proxy_set_header Connection "";
        proxy_set_header X-Priority $http_x_priority;
        proxy_connect_timeout 1s;
        proxy_read_timeout 2s;
    }

    location @kvguard_refused {
        default_type application/json;
        if ($kvguard_status = 429) {
            add_header Retry-After $kvguard_retry_after always;
            add_header X-Kvguard-Priority $kvguard_priority always;
            add_header X-Kvguard-Level $kvguard_level always;
            return 503 '{"error":{"message":"kvguard is shedding $kvguard_priority traffic: the KV cache is under pressure ($kvguard_level); retry after $kvguard_retry_after s","type":"server_overloaded","code":"kv_cache_pressure"}}';
        }
        proxy_pass http://engine;
    }
}
"""  # noqa: E501

# auth_request alone, without the mapping: to show what nginx does with a 429.
BARE_SITE = """\
server {
    listen LISTEN;

    location /v1/ {
        auth_request /_kvguard;
        proxy_pass http://ENGINE;
    }

    location = /_kvguard {
        internal;
        proxy_pass http://KVGUARD/admission;
        proxy_pass_request_body off;
        proxy_set_header Content-Length "";
        proxy_set_header X-Priority $http_x_priority;
    }
}
"""

# The harness around a site: everything in the test's directory, in the foreground.
MAIN = """\
daemon off;
worker_processes 1;
pid PREFIX/nginx.pid;
error_log PREFIX/error.log warn;
USER
events {
    worker_connections 64;
}
http {
    access_log PREFIX/access.log;
    client_body_temp_path PREFIX/client_body;
    proxy_temp_path PREFIX/proxy;
    fastcgi_temp_path PREFIX/fastcgi;
    uwsgi_temp_path PREFIX/uwsgi;
    scgi_temp_path PREFIX/scgi;

SITE
}
"""


def nginx_conf(site: str, prefix: Path, listen: str, engine: str, kvguard: str) -> str:
    """A whole nginx.conf running ``site`` with every path under ``prefix``."""
    # As root, nginx would switch its worker to `nobody`, which cannot enter the
    # test's private directory; run it as ourselves instead (ignored when not root).
    user = "user root;" if os.geteuid() == 0 else ""
    return (
        MAIN.replace("PREFIX", str(prefix))
        .replace("USER", user)
        .replace("SITE", textwrap.indent(fill(site, listen, engine, kvguard), "    ").rstrip())
    )


def fill(site: str, listen: str, engine: str, kvguard: str) -> str:
    """``site`` with its listen address, engine and kvguard API addresses filled in."""
    return site.replace("LISTEN", listen).replace("ENGINE", engine).replace("KVGUARD", kvguard)


@dataclass
class Stack:
    """nginx in front of a sim engine, asking a kvguard daemon's /admission."""

    url: str  # nginx
    daemon: Daemon
    api: web.AppRunner
    error_log: Path


def logged(path: Path) -> str:
    """What nginx wrote to a log so far (small files: a blocking read is fine)."""
    return path.read_text(errors="replace")


async def wait_listening(port: int, proc: asyncio.subprocess.Process, log: Path) -> None:
    """Return once ``port`` accepts connections; fail if nginx exits or 5 s pass."""
    for _ in range(500):
        if proc.returncode is not None:
            pytest.fail(f"nginx exited {proc.returncode}: {logged(log)}")
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            await writer.wait_closed()
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"nginx did not listen on 127.0.0.1:{port} in 5 s")


async def stop(proc: asyncio.subprocess.Process) -> None:
    """Graceful shutdown (SIGQUIT), then SIGKILL after 5 s."""
    if proc.returncode is not None:
        return
    proc.send_signal(signal.SIGQUIT)
    try:
        await asyncio.wait_for(proc.wait(), 5)
    except (asyncio.TimeoutError, TimeoutError):
        proc.kill()
        await proc.wait()


@pytest.fixture
async def nginx_stack(sim_engine, tmp_path):
    """Start a sim engine, kvguard's API and nginx (``site``) on 127.0.0.1; stop them after."""
    if NGINX is None:
        pytest.skip("nginx not installed: run scripts/install-system.sh (Debian package nginx)")
    procs: list[asyncio.subprocess.Process] = []
    stacks: list[Stack] = []

    async def start(site: str = SITE, proxy: dict[str, Any] | None = None) -> Stack:
        engine_url = await sim_engine(kv_capacity_tokens=8192, max_model_len=4096)
        engine = engine_url.removeprefix("http://")
        table: dict[str, Any] = {"engine": {"url": engine_url}, "proxy": proxy or {}}
        daemon = Daemon(parse_config(table, env={}))
        api, api_url = await start_api(daemon)
        port = free_port()
        conf = tmp_path / "nginx.conf"
        conf.write_text(
            nginx_conf(site, tmp_path, f"127.0.0.1:{port}", engine, api_url.removeprefix("http://"))
        )
        log = tmp_path / "error.log"
        # -e: the log for messages before the configuration is read (Debian's
        # built-in default is /var/log/nginx, not writable by everyone).
        proc = await asyncio.create_subprocess_exec(
            str(NGINX), "-p", f"{tmp_path}/", "-c", str(conf), "-e", str(log),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        procs.append(proc)
        await wait_listening(port, proc, log)
        stack = Stack(f"http://127.0.0.1:{port}", daemon, api, log)
        stacks.append(stack)
        return stack

    yield start
    for proc in procs:
        await stop(proc)
    for stack in stacks:
        await stack.api.cleanup()
        await stack.daemon.close()


def shed(daemon: Daemon, floor: str, retry_after_s: int = 9) -> None:
    """Force a shed at critical, as a live plan would put it in force."""
    daemon.mitigations.shed_floor = floor  # type: ignore[assignment]
    daemon.mitigations.level = "critical"
    daemon.mitigations.retry_after_s = retry_after_s


COMPLETION = {"model": "kvguard-sim", "prompt": "hello " * 20, "max_tokens": 8}


async def complete(
    url: str, headers: dict[str, str] | None = None, **extra: Any
) -> tuple[int, dict[str, str], str]:
    """POST /v1/completions through nginx: status, headers, body text."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{url}/v1/completions", json={**COMPLETION, **extra}, headers=headers or {}
        ) as resp,
    ):
        return resp.status, dict(resp.headers), await resp.text()


async def test_nginx_passes_requests_to_the_engine_when_nothing_is_shed(nginx_stack):
    """Every class reaches the sim through nginx: 200 with usage, and streams end in [DONE]."""
    stack = await nginx_stack()
    for priority in ("sheddable", "standard", "critical"):
        status, _, text = await complete(stack.url, {"X-Priority": priority})
        assert status == 200, text
        assert json.loads(text)["usage"]["completion_tokens"] == 8
    status, headers, text = await complete(stack.url, {"X-Priority": "sheddable"}, stream=True)
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    assert text.count("data: ") >= 9
    assert text.rstrip().endswith("data: [DONE]")


async def test_nginx_refuses_shed_classes_with_503_and_retry_after(nginx_stack):
    """Shedding `sheddable`: those get kvguard's 503 + Retry-After; critical and standard pass."""
    stack = await nginx_stack(proxy={"api_key_priorities": {BATCH_KEY: "sheddable"}})
    shed(stack.daemon, "sheddable", retry_after_s=9)
    status, headers, text = await complete(stack.url, {"X-Priority": "sheddable"})
    assert status == 503
    assert headers["Retry-After"] == "9"
    assert headers["Content-Type"] == "application/json"
    assert headers["X-Kvguard-Priority"] == "sheddable"
    assert headers["X-Kvguard-Level"] == "critical"
    error = json.loads(text)["error"]
    assert error["code"] == "kv_cache_pressure"
    assert "shedding sheddable traffic" in error["message"]
    assert "retry after 9 s" in error["message"]
    # nginx forwards Authorization to the subrequest: the API-key map applies too.
    batch = {"Authorization": f"Bearer {BATCH_KEY}", "X-Priority": "critical"}
    assert (await complete(stack.url, batch))[0] == 503
    for priority in ("critical", "standard"):
        status, _, text = await complete(stack.url, {"X-Priority": priority})
        assert status == 200, text
        assert "usage" in text


async def test_nginx_checks_only_generation_requests(nginx_stack):
    """Shedding every class: completions and chat get 503; health, models and tokenize pass."""
    stack = await nginx_stack()
    shed(stack.daemon, "critical")
    assert (await complete(stack.url, {"X-Priority": "critical"}))[0] == 503
    chat = {"model": "kvguard-sim", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{stack.url}/v1/chat/completions", json=chat) as resp:
            assert resp.status == 503
            assert resp.headers["Retry-After"] == "9"
        for path in ("/health", "/v1/models"):
            async with http.get(f"{stack.url}{path}") as resp:
                assert resp.status == 200, path
        async with http.post(f"{stack.url}/tokenize", json={"prompt": "hello"}) as resp:
            assert resp.status == 200


async def test_nginx_fails_open_when_kvguard_is_down(nginx_stack):
    """With kvguard's API gone, requests still reach the engine (nginx logs the error)."""
    stack = await nginx_stack()
    shed(stack.daemon, "critical")
    assert (await complete(stack.url, {"X-Priority": "critical"}))[0] == 503
    await stack.api.cleanup()
    status, headers, text = await complete(stack.url, {"X-Priority": "critical"})
    assert status == 200, text
    assert "Retry-After" not in headers
    assert "usage" in text
    assert "connect() failed" in logged(stack.error_log)


async def test_bare_auth_request_turns_kvguards_429_into_500(nginx_stack):
    """Without the mapping, nginx answers a denied request with 500 and no Retry-After."""
    stack = await nginx_stack(BARE_SITE)
    assert (await complete(stack.url, {"X-Priority": "sheddable"}))[0] == 200
    shed(stack.daemon, "sheddable")
    status, headers, _ = await complete(stack.url, {"X-Priority": "sheddable"})
    assert status == 500
    assert "Retry-After" not in headers
    assert "auth request unexpected status: 429" in logged(stack.error_log)


def test_docs_show_the_tested_nginx_config():
    """docs/integrations.md shows the SITE tested here verbatim, with its usual ports."""
    shown = fill(SITE, "8080", "127.0.0.1:8000", "127.0.0.1:9108")
    assert f"```nginx\n{shown}```" in DOCS.read_text()
