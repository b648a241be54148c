"""``kvguard probe``: read an engine, the GPUs and the host once and print what kvguard sees."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any, TypeVar
from urllib.parse import urlsplit

from kvguard.api.logs import configure_logging
from kvguard.config.settings import (
    CONFIG_ENV,
    Config,
    EngineConfig,
    config_for_engine,
    load_config,
)
from kvguard.core.snapshot import ENGINE_KINDS, EngineStats
from kvguard.core.units import format_bytes
from kvguard.errors import ConfigError, InvalidInputError, KvguardError
from kvguard.probes.engine import EngineProbe
from kvguard.runtime.daemon import Daemon

# What `kvguard probe --json` always reports about the engine, null when unknown.
PROBE_ENGINE_KEYS = tuple(EngineStats.__dataclass_fields__)

# Where scripts/install-service.sh puts the config that systemd/kvguard.service runs
# with: on such a host a bare `kvguard status` or `kvguard probe` reads it too. Read at
# call time (config_path), so a test can point it elsewhere.
DEFAULT_CONFIG_PATH = "/etc/kvguard/kvguard.toml"
T = TypeVar("T")
EXIT_DEFAULT_CONFIG = 1  # the default file is broken: the host's fault, not a usage error


class DefaultConfigError(KvguardError):
    """The default config (:data:`DEFAULT_CONFIG_PATH`, named by nobody) cannot be used."""

    def __init__(self, error: ConfigError) -> None:
        self.error = error
        super().__init__(str(error))

    def report(self, command: str, instead: str) -> int:
        """Say what is wrong with the file and how to do without it; the exit code (1)."""
        for line in self.error.lines():
            print(f"kvguard {command}: error: {self.error.source}: {line}", file=sys.stderr)
        print(
            f"kvguard {command}: {self.error.source} is read when neither --config nor"
            f" ${CONFIG_ENV} says which config: fix it, or {instead}",
            file=sys.stderr,
        )
        return EXIT_DEFAULT_CONFIG


def config_path(given: str | None, *, use_default: bool = True) -> tuple[str | None, bool]:
    """The config to read: ``given`` (--config), else $KVGUARD_CONFIG, else the default file.

    The default (:data:`DEFAULT_CONFIG_PATH`) only when it exists and ``use_default``.
    Returns the path (None: no config) and whether it is the default file.
    """
    if given is not None:
        return given, False
    if os.environ.get(CONFIG_ENV):
        return os.environ[CONFIG_ENV], False
    if use_default and os.path.lexists(DEFAULT_CONFIG_PATH):
        return DEFAULT_CONFIG_PATH, True
    return None, False


def read_chosen(path: str, default: bool, read: Callable[[str], T]) -> T:
    """``read(path)``, a broken default file (``default``) told apart.

    From the default file a :class:`ConfigError` is a :class:`DefaultConfigError`: the
    same problems, and how to do without it.
    """
    try:
        return read(path)
    except ConfigError as exc:
        if default:
            raise DefaultConfigError(exc) from exc
        raise


def register(commands: argparse._SubParsersAction[Any]) -> None:
    """Add ``kvguard probe``."""
    probe = commands.add_parser(
        "probe",
        help="read an engine, the GPUs and the host once and print what kvguard sees",
        description="Read every probe once against the engine (exit 1: engine unreachable,"
        f" or the config (--config, $KVGUARD_CONFIG, else {DEFAULT_CONFIG_PATH}) unreadable"
        " or invalid; 2: usage).",
    )
    probe.add_argument(
        "--engine-url",
        metavar="URL",
        help="the engine's base URL: http(s)://HOST:PORT, or HOST:PORT (http assumed; a"
        " host without a port is a usage error) (default: [engine] url of the config);"
        " given without --config or $KVGUARD_CONFIG, it is probed with default settings",
    )
    probe.add_argument(
        "--config",
        metavar="FILE",
        help="probe as this config says ([engine], [gpu], [poll]; default: $KVGUARD_CONFIG"
        f" when set, else {DEFAULT_CONFIG_PATH} when it exists and --engine-url is not"
        " given)",
    )
    probe.add_argument(
        "--engine-kind", default=None, choices=("auto", *ENGINE_KINDS), help="default: auto"
    )
    probe.add_argument(
        "--metrics-url",
        metavar="URL",
        help="the base URL the engine's metrics are read from, when not the engine's URL"
        " ([engine] metrics_url; Triton: its metrics port, 8002). Unset, a TensorRT-LLM"
        " engine URL on Triton's port 8000 is read at 8002 on the same host",
    )
    probe.add_argument(
        "--health-url",
        metavar="URL",
        help="the base URL the engine's health is asked at, when not the engine's URL"
        " ([engine] health_url). Unset, a TensorRT-LLM engine URL on Triton's port 8002"
        " asks health at 8000 on the same host",
    )
    probe.add_argument("--json", action="store_true", help="print one JSON object")
    probe.set_defaults(handler=run_probe)


def run_probe(args: argparse.Namespace) -> int:
    """One tick against --engine-url, printed."""
    configure_logging("error", "auto")
    try:
        config = _config(args)
    except DefaultConfigError as exc:
        return exc.report("probe", f"give --engine-url, --config or ${CONFIG_ENV}")

    async def once() -> dict[str, Any]:
        daemon = Daemon(config)
        try:
            await daemon.tick()
            return probe_document(daemon)
        finally:
            await daemon.close()

    document = asyncio.run(once())
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        print(render_probe(document))
    return 0 if document["sources"]["engine"]["ok"] else 1


URL_ALLOWED = (
    "must be an http:// or https:// URL with a host, or HOST:PORT without a scheme"
    " (http:// is assumed)"
)
PORT_NEEDED = (
    "has no port: give HOST:PORT, or a URL with its scheme (http://HOST means port 80,"
    " https://HOST port 443)"
)


def normalize_url(url: str, flag: str = "--url") -> str:
    """One spelling per kvguard: ``127.0.0.1:9108`` gets ``http://``, a trailing ``/`` goes.

    Anything but http(s) with a host (another scheme, no host, a bad port, a query) is
    a usage error: :class:`InvalidInputError` naming ``flag``, the command exits 2. So
    is a host without scheme and port (``127.0.0.1``): HOST:PORT was meant, and port 80
    would be read; with a scheme (``http://gateway``) the scheme's port is meant.
    """
    text = url.strip()
    bare = "://" not in text
    if bare:
        text = "http://" + text
    parts = urlsplit(text)
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:  # not a number, or past 65535
        port_ok = False
    if (
        parts.scheme.lower() not in ("http", "https")
        or not parts.hostname
        or not port_ok
        or parts.query
        or parts.fragment
    ):
        raise InvalidInputError(flag, url, URL_ALLOWED)
    if bare and parts.port is None:
        raise InvalidInputError(flag, url, PORT_NEEDED)
    return text.rstrip("/")


def _config(args: argparse.Namespace) -> Config:
    """What to probe: --engine-url alone, or a config file with --engine-url on top.

    The config: --config, else $KVGUARD_CONFIG, else :data:`DEFAULT_CONFIG_PATH` when it
    exists and --engine-url is not given; a broken default is :class:`DefaultConfigError`.
    """
    url = None if args.engine_url is None else normalize_url(args.engine_url, "--engine-url")
    # Where metrics and health are read when not at the engine's URL ([engine]
    # metrics_url, health_url), checked as --engine-url is: set on top of the config's.
    metrics_url = args.metrics_url and normalize_url(args.metrics_url, "--metrics-url")
    health_url = args.health_url and normalize_url(args.health_url, "--health-url")

    def beside(engine: EngineConfig) -> EngineConfig:
        return replace(
            engine,
            metrics_url=metrics_url or engine.metrics_url,
            health_url=health_url or engine.health_url,
        )

    # --engine-url alone probes that engine with default settings, as it always did;
    # the default file stands in only when nothing on the command line says what.
    path, default = config_path(args.config, use_default=url is None)
    if path is None:
        if url is None:
            raise InvalidInputError(
                "--engine-url",
                None,
                f"needed without --config (or ${CONFIG_ENV}, or {DEFAULT_CONFIG_PATH})",
            )
        config = config_for_engine(url, args.engine_kind or "auto")
        return replace(config, engine=beside(config.engine))
    config = read_chosen(path, default, load_config)
    engine = config.engine
    if url is not None:
        engine = replace(engine, url=config_for_engine(url).engine.url)  # checked as --config's
    if args.engine_kind is not None:
        engine = replace(engine, kind=args.engine_kind)
    return replace(config, engine=beside(engine))


def probe_document(daemon: Daemon) -> dict[str, Any]:
    """What ``kvguard probe`` reports: the normalized snapshot of one tick."""
    snapshot = daemon.state.snapshot
    assert snapshot is not None  # noqa: S101 - called after a tick
    engine: dict[str, Any] = dict.fromkeys(PROBE_ENGINE_KEYS)
    engine["kind"] = daemon.config.engine.kind if daemon.config.engine.kind != "auto" else None
    engine["up"] = False
    if snapshot.engine is not None:
        engine.update(asdict(snapshot.engine))
    engine["url"] = daemon.config.engine.url
    # The kind as the tick read it (or as configured).
    engine["kv_layout"] = kv_layout(daemon) if engine["kind"] == "llamacpp" else None
    probe = daemon.probes.engine
    engine["server"] = probe.server if isinstance(probe, EngineProbe) else None
    nvml = daemon.probes.nvml
    return {
        "engine": engine,
        "gpus": [asdict(g) for g in snapshot.gpus] if snapshot.gpus else None,
        "nvml": nvml.driver_info() if nvml is not None else None,
        "host": asdict(snapshot.host) if snapshot.host else None,
        "sources": {name: asdict(r) for name, r in snapshot.sources.items()},
    }


def kv_layout(daemon: Daemon) -> str | None:
    """llama.cpp's cache layout as kvguard reads it (:attr:`EngineProbe.kv_layout`).

    "unified" or "split" (declared, or from a supervised command); "unified (assumed)"
    when nothing says it (llama-server reports neither), "split (inferred)" once its
    slots have held more than a unified cache could.
    """
    probe = daemon.probes.engine
    return probe.kv_layout if isinstance(probe, EngineProbe) else None


# Said under the table when llama.cpp's layout is assumed: the default launch is
# unified, and a server started with -np N (split) reads N times too small until its
# slots show it.
ASSUMED_LAYOUT_HINT = (
    "  note: llama.cpp's cache layout is not declared; read as unified (one slot's n_ctx"
    " is the cache: llama-server's default -np). Started with -np N (split), set"
    " [engine] kv_unified = false, or capacity reads N times too small until the slots"
    " are seen holding more than one slot's n_ctx."
)


def render_probe(doc: dict[str, Any]) -> str:
    """The probe document as a short table."""
    engine = doc["engine"]
    kind = engine["kind"] or "unknown"
    if engine.get("server"):
        kind += f" ({engine['server']})"
    lines = [f"Engine   {engine['url']}  kind {kind}  up {engine['up']}"]
    lines += [
        f"  {key:<26} {fmt_value(engine[key])}"
        for key in PROBE_ENGINE_KEYS
        if key not in ("kind", "up")
    ]
    if engine.get("kv_layout") is not None:
        lines.append(f"  {'kv_layout':<26} {engine['kv_layout']}")
        if engine["kv_layout"] == "unified (assumed)":
            lines.append(ASSUMED_LAYOUT_HINT)
    lines += [gpu_line(gpu) for gpu in doc["gpus"] or []]
    host = doc["host"]
    if host:
        available, total = host["memory_available_bytes"], host["memory_total_bytes"]
        lines.append(f"Host     available {format_bytes(available)} of {format_bytes(total)}")
    lines += [f"Source   {name:<7} {source_state(s)}" for name, s in doc["sources"].items()]
    return "\n".join(lines)


def source_state(source: dict[str, Any]) -> str:
    """A source's state in words: ok, unavailable (why) or FAILED (why)."""
    if source["ok"]:
        return "ok"
    if not source.get("available", True):
        return f"unavailable ({source['error']})"
    return f"FAILED: {source['error']}"


def gpu_line(gpu: dict[str, Any]) -> str:
    """One GPU's memory as a line."""
    used, total = format_bytes(gpu["used_bytes"]), format_bytes(gpu["total_bytes"])
    return f"GPU {gpu['index']}    {gpu['name']}  used {used} of {total}"


def fmt_value(value: object) -> str:
    """A reported value for people: unknown, a number in short form, a dict inline."""
    if value is None:
        return "unknown"
    if isinstance(value, dict):
        return ", ".join(
            f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in value.items()
        )
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
