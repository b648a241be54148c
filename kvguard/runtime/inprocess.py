"""kvguard in this process, in front of one engine: for the demo and the benchmarks.

:func:`start_guard` builds what ``kvguard run`` builds with ``[proxy] enabled`` — the
daemon (live) and its admission proxy on a free port of 127.0.0.1 — without the HTTP
API, signals or systemd, so a caller can run the tick loop and load in one event loop.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from kvguard.cli.daemon import listen, make_proxy
from kvguard.config.settings import parse_config
from kvguard.errors import KvguardError
from kvguard.probes.engine import EngineProbe
from kvguard.runtime.daemon import Daemon, Probes

PORT_ATTEMPTS = 5  # a free port can be taken between finding it and binding it


def free_port() -> int:
    """A port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def start_guard(
    engine_url: str,
    *,
    poll: Mapping[str, float],
    proxy: Mapping[str, Any] | None = None,
    policy: Mapping[str, Any] | None = None,
) -> tuple[Daemon, web.AppRunner, str]:
    """The live daemon watching ``engine_url`` and its proxy: (daemon, runner, proxy URL).

    ``proxy`` and ``policy`` are ``[proxy]`` / ``[policy]`` tables on top of the
    defaults. The caller runs ``daemon.run`` and cleans up the runner and the daemon.
    """
    for attempt in range(PORT_ATTEMPTS):
        address = f"127.0.0.1:{free_port()}"
        config = parse_config(
            {
                "engine": {"url": engine_url},
                "poll": dict(poll),
                "proxy": {**(proxy or {}), "enabled": True, "listen": address},
                "policy": dict(policy or {}),
            },
            env={},
        )
        daemon = Daemon(
            config,
            probes=Probes(
                engine=EngineProbe(engine_url, timeout_s=config.poll.timeout_s),
                nvml=None,
                host=None,
            ),
        )
        proxy_app = make_proxy(config, daemon)
        try:
            runner = await listen(proxy_app.app(), address, cancel=True)
        except KvguardError:
            await daemon.close()
            if attempt == PORT_ATTEMPTS - 1:
                raise
            continue
        daemon.proxy = proxy_app
        return daemon, runner, f"http://{address}"
    raise AssertionError("unreachable")  # pragma: no cover


def start_watcher(
    engine_url: str,
    *,
    poll: Mapping[str, float],
    policy: Mapping[str, Any] | None = None,
) -> Daemon:
    """A daemon watching ``engine_url`` with no proxy: ``kvguard run`` in watch-only mode.

    With ``policy = {"dry_run": True}`` it decides and logs but acts on nothing: what
    the benchmarks use to time kvguard's warnings on traffic it does not touch. The
    caller runs ``daemon.run`` and closes the daemon.
    """
    config = parse_config(
        {"engine": {"url": engine_url}, "poll": dict(poll), "policy": dict(policy or {})},
        env={},
    )
    return Daemon(
        config,
        probes=Probes(
            engine=EngineProbe(engine_url, timeout_s=config.poll.timeout_s), nvml=None, host=None
        ),
    )
