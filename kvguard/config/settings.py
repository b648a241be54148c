"""kvguard's configuration: one TOML file, validated into frozen objects.

Every problem in a file is collected before anything is reported, so
``kvguard check-config`` shows them all at once (field, value, what is allowed).
Unknown keys are errors: a typo must never silently fall back to a default.
Secrets (the engine's admin token, the control token, the webhook secret) come from
a file or the environment and are held in a :class:`Secret`, whose ``repr`` never
shows the value.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from kvguard.config.fields import (
    Parser,
    argv,
    blocked_path,
    boolean,
    choice,
    integer,
    key_map,
    list_of,
    listen,
    number,
    path_in_url,
    path_prefix,
    size,
    text,
    url,
    webhook_url,
)
from kvguard.core.forecast import ForecastSettings
from kvguard.core.policy import ACTION_KINDS, PolicyConfig
from kvguard.core.snapshot import ENGINE_KINDS, EngineKind
from kvguard.core.units import KV_DTYPES
from kvguard.errors import ConfigError, InvalidInputError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

CONFIG_ENV = "KVGUARD_CONFIG"
TOKEN_ENV = "KVGUARD_ENGINE_TOKEN"  # noqa: S105 - the variable's name, not a secret
CONTROL_TOKEN_ENV = "KVGUARD_CONTROL_TOKEN"  # noqa: S105 - the variable's name, not a secret
# A bearer token anyone can guess is no lock: at least this many characters.
CONTROL_TOKEN_MIN_CHARS = 16
# The engines' own admin and debug endpoints (DESIGN.md section 7, ENGINES.md): they
# pause, flush, abort, sleep or describe the engine. kvguard calls them itself, on the
# engine's own address; through the proxy's public port they would let any client do so.
ENGINE_ADMIN_PATHS: tuple[str, ...] = (
    # vLLM (VLLM_SERVER_DEV_MODE=1; LoRA with VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    "/pause",
    "/resume",
    "/is_paused",
    "/abort_requests",
    "/reset_prefix_cache",
    "/reset_mm_cache",
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/release_kv_cache_memory",
    "/collective_rpc",
    "/start_profile",
    "/stop_profile",
    "/server_info",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/scale_elastic_ep",
    # SGLang (and its /start_profile, /stop_profile above)
    "/flush_cache",
    "/pause_generation",
    "/continue_generation",
    "/abort_request",
    "/get_server_info",
    "/update_weights",
    "/update_weights_from_disk",
    "/update_weights_from_distributed",
    "/update_weights_from_tensor",
    "/init_weights_update_group",
    "/load_lora_adapter",
    "/unload_lora_adapter",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/configure_logging",
    "/start_expert_distribution_record",
    "/stop_expert_distribution_record",
    "/dump_expert_distribution_record",
    # llama.cpp: slot save/restore/erase (GET /slots shows what each slot holds), LoRA
    # scales, and POST /props, which changes server settings (GET /props stays open).
    "/slots",
    "/lora-adapters",
    "POST /props",
)
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "json", "console")


class Secret:
    """A value that must never reach a log, a status page or a repr."""

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        """The secret itself, for the one place that sends it."""
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


@dataclass(frozen=True)
class EngineConfig:
    """``[engine]``: the inference server kvguard watches."""

    url: str
    kind: EngineKind | Literal["auto"] = "auto"
    metrics_path: str = "/metrics"
    token_file: str | None = None
    token: Secret | None = field(default=None, compare=False)
    pid: int | None = None
    process_name: str | None = None
    shed_by_pause: bool = False  # without the proxy, a critical shed pauses the engine
    admin_timeout_s: float = 5.0
    admin_attempts: int = 3


@dataclass(frozen=True)
class ModelConfig:
    """``[model]``: what the engine serves and how, for the VRAM budget."""

    config: str | None = None
    tp: int = 1
    pp: int = 1
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    block_size: int = 16
    weights_bytes: int | None = None
    activation_bytes: int | None = None
    overhead_bytes: int | None = None


@dataclass(frozen=True)
class GpuConfig:
    """``[gpu]``: which GPUs to watch, and their memory for the budget."""

    indices: tuple[int, ...] = ()
    uuids: tuple[str, ...] = ()
    memory_bytes: int | None = None
    # Supervisor mode: watch the GPUs the supervised engine's processes use. Off by
    # default: in a container NVML reports host PIDs, which then match nothing.
    follow_engine: bool = False


@dataclass(frozen=True)
class PollConfig:
    """``[poll]``: how often to tick and how long a probe may take."""

    interval_s: float = 0.5
    min_interval_s: float = 0.1
    timeout_s: float = 2.0


@dataclass(frozen=True)
class ServerConfig:
    """``[server]``: kvguard's own HTTP API."""

    listen: str = "127.0.0.1:9108"
    # /control/* is off (404) unless a token is configured (file, else environment).
    control_token_file: str | None = None
    control_token: Secret | None = field(default=None, compare=False)

    @property
    def host(self) -> str:
        """The address part of ``listen``."""
        return self.listen.rsplit(":", 1)[0].strip("[]")

    @property
    def port(self) -> int:
        """The port part of ``listen``."""
        return int(self.listen.rsplit(":", 1)[1])


@dataclass(frozen=True)
class LogConfig:
    """``[log]``: level and format (``auto``: JSON unless stderr is a terminal)."""

    level: str = "info"
    format: str = "auto"


@dataclass(frozen=True)
class ProxyConfig:
    """``[proxy]``: the admission proxy in front of the engine (off unless enabled)."""

    enabled: bool = False
    listen: str = "127.0.0.1:9000"
    upstream: str | None = None  # default: [engine] url
    priority_header: str = "X-Priority"
    # False: the header is ignored; only api_key_priorities or default_priority decide.
    trust_priority_header: bool = True
    default_priority: str = "standard"
    # The keys are secrets: never in a repr (a logged config, a traceback's locals).
    api_key_priorities: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    max_body_bytes: int = 16 * 1024 * 1024
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    # Idle upstream connections are dropped after this (0: one connection per request).
    # Keep it under the engine's keep-alive timeout (5 s for uvicorn and llama-server).
    upstream_keepalive_s: float = 4.0  # kvguard.http_client.DEFAULT_KEEPALIVE_S
    min_completion_tokens: int = 16
    fail_readiness_at: str = "critical"  # or "never": /readyz 503 while shedding at this level
    admission: str = "off"  # "projected": admit against the engine's pool, no poll delay
    admission_ratio: float = 0.95
    admission_wait_s: float = 5.0
    shed_ratio: float = 0.8  # while shedding, a shed class still fills the pool up to this
    shed_wait_s: float = 2.0  # ... held this long at most for room, then 503
    allowed_paths: tuple[str, ...] = ("/",)  # path prefixes forwarded (default: all)
    blocked_paths: tuple[str, ...] = ENGINE_ADMIN_PATHS  # ... except these: 403


@dataclass(frozen=True)
class ReconfigureConfig:
    """``[reconfigure]``: how the fp8 KV switch restarts the engine."""

    mode: str = "auto"  # auto: supervisor with a command after `--`, else off
    drain_timeout_s: float = 60.0
    start_timeout_s: float = 600.0
    stop_timeout_s: float = 30.0
    crash_backoff_s: float = 1.0
    systemd_unit: str | None = None
    systemd_dropin_dir: str = "/etc/systemd/system"
    systemctl: tuple[str, ...] = ("systemctl",)
    command: tuple[str, ...] = ()
    command_timeout_s: float = 600.0


@dataclass(frozen=True)
class WebhookConfig:
    """``[webhook]``: where events are POSTed, and how."""

    urls: tuple[str, ...] = field(default=(), repr=False)  # a query may hold a token
    secret_file: str | None = None
    secret: Secret | None = field(default=None, compare=False)
    timeout_s: float = 5.0
    retries: int = 3


@dataclass(frozen=True)
class Config:
    """The whole validated configuration."""

    engine: EngineConfig
    model: ModelConfig = ModelConfig()
    gpu: GpuConfig = GpuConfig()
    poll: PollConfig = PollConfig()
    server: ServerConfig = ServerConfig()
    log: LogConfig = LogConfig()
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    forecast: ForecastSettings = field(default_factory=ForecastSettings)
    pattern_window_s: float = 60.0
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    reconfigure: ReconfigureConfig = field(default_factory=ReconfigureConfig)
    webhook: WebhookConfig = field(default_factory=WebhookConfig)
    dry_run: bool = False
    source: str = "<defaults>"

    def redacted(self) -> dict[str, Any]:
        """The configuration as plain values for /status and check-config, secrets hidden."""
        engine = self.engine
        return {
            "source": self.source,
            "engine": {
                "url": engine.url,
                "kind": engine.kind,
                "metrics_path": engine.metrics_path,
                "token_file": engine.token_file,
                "token": "***" if engine.token is not None else None,
                "pid": engine.pid,
                "process_name": engine.process_name,
                "shed_by_pause": engine.shed_by_pause,
                "admin_timeout_s": engine.admin_timeout_s,
                "admin_attempts": engine.admin_attempts,
            },
            "model": dict(vars(self.model)),
            "gpu": {
                "indices": list(self.gpu.indices),
                "uuids": list(self.gpu.uuids),
                "memory_bytes": self.gpu.memory_bytes,
                "follow_engine": self.gpu.follow_engine,
            },
            "poll": dict(vars(self.poll)),
            "server": {
                "listen": self.server.listen,
                "control_token_file": self.server.control_token_file,
                "control_token": "***" if self.server.control_token is not None else None,
            },
            "log": dict(vars(self.log)),
            "policy": _plain(self.policy),
            "forecast": _plain(self.forecast),
            "pattern": {"window_s": self.pattern_window_s},
            "proxy": {
                **{k: v for k, v in vars(self.proxy).items() if k != "api_key_priorities"},
                # API keys are secrets: only how many are mapped is shown.
                "api_key_priorities": f"{len(self.proxy.api_key_priorities)} keys",
            },
            "reconfigure": {
                **_plain(self.reconfigure),  # type: ignore[dict-item]
                # A restart command may carry credentials: the program and a count only.
                "command": _program_only(self.reconfigure.command),
            },
            "webhook": {
                # Webhook URLs carry tokens in their path (Slack, Teams, Discord) or
                # query: scheme, host and port only.
                "urls": [_origin_only(u) for u in self.webhook.urls],
                "secret_file": self.webhook.secret_file,
                "secret": "***" if self.webhook.secret is not None else None,
                "timeout_s": self.webhook.timeout_s,
                "retries": self.webhook.retries,
            },
            "dry_run": self.dry_run,
        }


def _program_only(argv: tuple[str, ...]) -> list[str]:
    if not argv:
        return []
    return [argv[0], f"<{len(argv) - 1} more arguments>"] if len(argv) > 1 else [argv[0]]


def _origin_only(address: str) -> str:
    """``scheme://host[:port]`` of a URL: no userinfo, path, query or fragment."""
    parts = urlsplit(address)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"


def _plain(value: object) -> object:
    """A dataclass tree as JSON-ready values (tuples and sets become lists)."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list, set, frozenset)):
        return (
            [_plain(v) for v in sorted(value)]
            if isinstance(value, (set, frozenset))
            else [_plain(v) for v in value]
        )
    return value


_SCHEMA: dict[str, dict[str, Parser]] = {
    "engine": {
        "url": url,
        "kind": choice(("auto", *ENGINE_KINDS)),
        "metrics_path": path_in_url,
        "token_file": text,
        "pid": integer(1, 2**22),
        "process_name": text,
        "shed_by_pause": boolean,
        "admin_timeout_s": number(0.0, 600.0),
        "admin_attempts": integer(1, 20),
    },
    "model": {
        "config": text,
        "tp": integer(1, 1024),
        "pp": integer(1, 1024),
        "max_model_len": integer(1),
        "max_num_seqs": integer(1, 1_000_000),
        "max_num_batched_tokens": integer(1),
        "kv_cache_dtype": choice(KV_DTYPES),
        "gpu_memory_utilization": number(0.0, 1.0),
        "kv_cache_memory_bytes": size,
        "block_size": integer(1, 4096),
        "weights_bytes": size,
        "activation_bytes": size,
        "overhead_bytes": size,
    },
    "gpu": {
        "indices": list_of(integer(0, 1023)),
        "uuids": list_of(text),
        "memory": size,
        "follow_engine": boolean,
    },
    "poll": {
        "interval_s": number(0.0, 60.0),
        "min_interval_s": number(0.0, 60.0),
        "timeout_s": number(0.0, 60.0),
    },
    "server": {"listen": listen, "control_token_file": text},
    "log": {"level": choice(LOG_LEVELS), "format": choice(LOG_FORMATS)},
    "policy": {
        "tte_min_usage": number(0.0, 1.0, low_open=False),
        "confirm_ticks": integer(1, 1000),
        "instant_kv_demand": number(0.0, 100.0),
        "exit_usage_margin": number(0.0, 1.0, low_open=False),
        "exit_tte_factor": number(1.0, 100.0, low_open=False),
        "hold_s": number(0.0, 86_400.0, low_open=False),
        "window_share_high": number(0.0, 1.0),
        "window_share_critical": number(0.0, 1.0),
        "min_window_tokens": integer(1),
        "fp8_after_s": number(0.0, 86_400.0, low_open=False),
        "fp8_revert_calm_s": number(0.0, 604_800.0, low_open=False),
        "max_restarts_per_hour": integer(0, 60),
        "disabled_actions": list_of(choice(ACTION_KINDS)),
        "dry_run": boolean,
    },
    **{
        f"policy.{level}": {
            "kv_usage": number(0.0, 1.0),
            "time_to_exhaustion_s": number(0.0, 86_400.0),
            "gpu_free_ratio": number(0.0, 1.0, low_open=False),
            "preemptions_per_s": number(0.0, 1e6),
        }
        for level in ("elevated", "high", "critical")
    },
    "policy.cooldowns": {kind: number(0.0, 86_400.0, low_open=False) for kind in ACTION_KINDS},
    "forecast": {
        "horizons_s": list_of(number(0.0, 86_400.0)),
        "window_s": number(0.0, 3600.0),
        "kv_reserve_ratio": number(0.0, 0.5, low_open=False),
        "gpu_reserve": size,
        "min_rise_ratio_per_s": number(0.0, 1.0, low_open=False),
    },
    "pattern": {"window_s": number(0.0, 3600.0)},
    "proxy": {
        "enabled": boolean,
        "listen": listen,
        "upstream": url,
        "priority_header": text,
        "trust_priority_header": boolean,
        "default_priority": choice(("critical", "standard", "sheddable")),
        "api_key_priorities": key_map,
        "max_body_bytes": size,
        "connect_timeout_s": number(0.0, 600.0),
        "read_timeout_s": number(0.0, 86_400.0),
        "upstream_keepalive_s": number(0.0, 3600.0, low_open=False),
        "min_completion_tokens": integer(1),
        "fail_readiness_at": choice(("critical", "high", "never")),
        "admission": choice(("off", "projected")),
        "admission_ratio": number(0.0, 1.0),
        "admission_wait_s": number(0.0, 600.0, low_open=False),
        "shed_ratio": number(0.0, 1.0, low_open=False),
        "shed_wait_s": number(0.0, 600.0, low_open=False),
        "allowed_paths": list_of(path_prefix),
        "blocked_paths": list_of(blocked_path),
    },
    "reconfigure": {
        "mode": choice(("auto", "off", "supervisor", "systemd", "command")),
        "drain_timeout_s": number(0.0, 86_400.0, low_open=False),
        "start_timeout_s": number(0.0, 86_400.0),
        "stop_timeout_s": number(0.0, 3600.0),
        "crash_backoff_s": number(0.0, 3600.0),
        "systemd_unit": text,
        "systemd_dropin_dir": text,
        "systemctl": argv,
        "command": argv,
        "command_timeout_s": number(0.0, 86_400.0),
    },
    "webhook": {
        "urls": list_of(webhook_url),
        "secret_file": text,
        "timeout_s": number(0.0, 600.0),
        "retries": integer(0, 20),
    },
}
_RENAMED = {("gpu", "memory"): "memory_bytes"}


def parse_config(
    data: Mapping[str, object], source: str = "<config>", env: Mapping[str, str] | None = None
) -> Config:
    """Validate parsed TOML into a :class:`Config`.

    Raises :class:`ConfigError` listing every problem found.
    """
    env = os.environ if env is None else env
    problems: list[tuple[str, object, str]] = []
    sections: dict[str, dict[str, object]] = {name: {} for name in _SCHEMA}
    for section, body in _flatten_tables(data):
        if section not in _SCHEMA:
            problems.append((section, body, f"unknown section (known: {', '.join(_SCHEMA)})"))
            continue
        if not isinstance(body, Mapping):
            problems.append((section, body, "must be a table ([section])"))
            continue
        for key, value in body.items():
            name = f"{section}.{key}"
            parser = _SCHEMA[section].get(key)
            if parser is None:
                known = ", ".join(_SCHEMA[section])
                problems.append((name, value, f"unknown key (known in [{section}]: {known})"))
                continue
            try:
                target = _RENAMED.get((section, str(key)), str(key))
                sections[section][target] = parser(name, value)
            except InvalidInputError as exc:
                problems.append((exc.field, exc.value, exc.allowed))
    if "url" not in sections["engine"] and not any(p[0] == "engine.url" for p in problems):
        problems.append(("engine.url", None, "is required: the engine's base URL"))
    problems += _cross_checks(sections)
    token = secret = control = None
    if not problems:
        base = Path(source).parent
        token, token_problem = _read_token(sections["engine"], env, base)
        secret, secret_problem = _read_secret(sections["webhook"], base)
        control, control_problem = _read_control_token(sections["server"], env, base)
        problems += [p for p in (token_problem, secret_problem, control_problem) if p]
    if problems:
        raise ConfigError(source, problems)
    return Config(
        engine=EngineConfig(**sections["engine"], token=token),  # type: ignore[arg-type]
        model=ModelConfig(**sections["model"]),  # type: ignore[arg-type]
        gpu=GpuConfig(**sections["gpu"]),  # type: ignore[arg-type]
        poll=PollConfig(**sections["poll"]),  # type: ignore[arg-type]
        server=ServerConfig(**sections["server"], control_token=control),  # type: ignore[arg-type]
        log=LogConfig(**sections["log"]),  # type: ignore[arg-type]
        policy=_policy(sections),
        forecast=_forecast(sections),
        pattern_window_s=float(sections["pattern"].get("window_s", 60.0)),  # type: ignore[arg-type]
        proxy=ProxyConfig(**sections["proxy"]),  # type: ignore[arg-type]
        reconfigure=ReconfigureConfig(**sections["reconfigure"]),  # type: ignore[arg-type]
        webhook=WebhookConfig(**sections["webhook"], secret=secret),  # type: ignore[arg-type]
        dry_run=bool(sections["policy"].get("dry_run", False)),
        source=source,
    )


def _flatten_tables(data: Mapping[str, object]) -> list[tuple[str, object]]:
    """Top-level tables, with nested ones known to the schema ([policy.high]) lifted out."""
    out: list[tuple[str, object]] = []
    for section, body in data.items():
        if isinstance(body, Mapping):
            nested = {
                k for k, v in body.items() if f"{section}.{k}" in _SCHEMA and isinstance(v, Mapping)
            }
            out.append((section, {k: v for k, v in body.items() if k not in nested}))
            out += [(f"{section}.{k}", body[k]) for k in nested]
        else:
            out.append((section, body))
    return out


def _policy(sections: dict[str, dict[str, object]]) -> PolicyConfig:
    base = PolicyConfig()
    levels = {
        level: replace(getattr(base, level), **sections[f"policy.{level}"])
        for level in ("elevated", "high", "critical")
    }
    options: dict[str, Any] = dict(sections["policy"])
    disabled: tuple[str, ...] = options.pop("disabled_actions", ())
    options.pop(
        "dry_run", None
    )  # a daemon setting ([policy] is where operators look), not the ladder's
    cooldowns: dict[str, Any] = {**base.cooldowns_s, **sections["policy.cooldowns"]}
    return replace(
        base,
        **levels,
        **options,
        cooldowns_s=cooldowns,
        disabled=frozenset(disabled),
    )


def _forecast(sections: dict[str, dict[str, object]]) -> ForecastSettings:
    options = dict(sections["forecast"])
    if "gpu_reserve" in options:
        options["gpu_reserve_bytes"] = float(options.pop("gpu_reserve"))  # type: ignore[arg-type]
    return replace(ForecastSettings(), **options)  # type: ignore[arg-type]


def _cross_checks(sections: dict[str, dict[str, object]]) -> list[tuple[str, object, str]]:
    problems: list[tuple[str, object, str]] = []
    engine, gpu, poll = sections["engine"], sections["gpu"], sections["poll"]
    if "pid" in engine and "process_name" in engine:
        problems.append(("engine.pid", engine["pid"], "give pid or process_name, not both"))
    if gpu.get("indices") and gpu.get("uuids"):
        problems.append(("gpu.indices", gpu["indices"], "give indices or uuids, not both"))
    reconfigure = sections["reconfigure"]
    mode = reconfigure.get("mode")
    if mode == "systemd" and not reconfigure.get("systemd_unit"):
        problems.append(("reconfigure.systemd_unit", None, 'is required with mode = "systemd"'))
    if mode == "command" and not reconfigure.get("command"):
        problems.append(("reconfigure.command", None, 'is required with mode = "command"'))
    if sections["proxy"].get("allowed_paths") == ():
        problems.append(
            ("proxy.allowed_paths", [], 'must name at least one path prefix ("/" for all)')
        )
    interval = poll.get("interval_s", PollConfig.interval_s)
    minimum = poll.get("min_interval_s", PollConfig.min_interval_s)
    if isinstance(interval, float) and isinstance(minimum, float) and minimum > interval:
        problems.append(
            ("poll.min_interval_s", minimum, f"must be <= poll.interval_s ({interval:g})")
        )
    return problems


Problem = tuple[str, object, str]


def _secret_file(
    field_name: str, name: str, base: Path, *, one_line: bool
) -> tuple[Secret | None, Problem | None]:
    """A secret read from file ``name`` (relative to the config file's folder)."""
    path = Path(name)
    path = path if path.is_absolute() else base / path
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        return None, (field_name, name, f"must be a readable file ({exc.strerror})")
    if not text:
        return None, (field_name, name, "must not be empty")
    if one_line and not _printable(text):
        return None, (field_name, name, "must hold one line of printable text")
    return Secret(text), None


def _read_token(
    engine: dict[str, object], env: Mapping[str, str], base: Path
) -> tuple[Secret | None, Problem | None]:
    """The engine token from ``token_file`` (relative to the config file) or the environment."""
    token_file = engine.get("token_file")
    if isinstance(token_file, str):
        # It travels in an HTTP header: one line of printable text.
        return _secret_file("engine.token_file", token_file, base, one_line=True)
    if env.get(TOKEN_ENV):
        text = env[TOKEN_ENV].strip()
        if not _printable(text):
            return None, (TOKEN_ENV, None, "must be one line of printable text")
        return Secret(text), None
    return None, None


def _read_secret(webhook: dict[str, object], base: Path) -> tuple[Secret | None, Problem | None]:
    """The webhook signing secret from ``secret_file`` (relative to the config file)."""
    secret_file = webhook.get("secret_file")
    if not isinstance(secret_file, str):
        return None, None
    return _secret_file("webhook.secret_file", secret_file, base, one_line=False)


def _read_control_token(
    server: dict[str, object], env: Mapping[str, str], base: Path
) -> tuple[Secret | None, Problem | None]:
    """The /control/* bearer token from ``control_token_file``, else the environment."""
    token_file = server.get("control_token_file")
    if isinstance(token_file, str):
        field_name = "server.control_token_file"
        token, problem = _secret_file(field_name, token_file, base, one_line=True)
        shown: object = token_file
    else:
        field_name, shown = CONTROL_TOKEN_ENV, None
        value = env.get(CONTROL_TOKEN_ENV, "").strip()
        token, problem = (Secret(value), None) if value else (None, None)
    if token is None or problem is not None:
        return token, problem
    # A bearer token is token68 (RFC 6750): visible ASCII, nothing to escape or fold.
    value = token.reveal()
    if not all(33 <= ord(ch) <= 126 for ch in value):
        return None, (field_name, shown, "must be one line of visible ASCII, no spaces")
    if len(value) < CONTROL_TOKEN_MIN_CHARS:
        return None, (
            field_name,
            shown,
            f"must hold at least {CONTROL_TOKEN_MIN_CHARS} characters"
            " (e.g. from `openssl rand -hex 32`)",
        )
    return token, None


def _printable(text: str) -> bool:
    """Whether ``text`` can travel in an HTTP header (no control characters)."""
    return all(32 <= ord(ch) != 127 for ch in text)


def load_config(path: str | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Read and validate the config at ``path`` (or ``$KVGUARD_CONFIG``)."""
    env = os.environ if env is None else env
    chosen = path or env.get(CONFIG_ENV)
    if not chosen:
        raise ConfigError(
            "<config>", [("--config", None, f"give a config file or set {CONFIG_ENV}")]
        )
    try:
        raw = Path(chosen).read_bytes()
    except OSError as exc:
        raise ConfigError(chosen, [("file", chosen, f"must be readable ({exc.strerror})")]) from exc
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(chosen, [("file", chosen, f"must be valid TOML ({exc})")]) from exc
    return parse_config(data, source=chosen, env=env)


def config_for_engine(url: str, kind: str = "auto") -> Config:
    """A minimal config watching ``url`` (for ``kvguard probe`` and tests)."""
    return parse_config({"engine": {"url": url, "kind": kind}}, source="<command line>", env={})
