"""What the proxy accepts: request targets, methods, paths, headers and generation bodies.

Everything here reads a request (or its parsed body) and says whether it may reach
the engine, and nothing else: no counters, no forwarding, no answers. Kept apart
because it is the proxy's security boundary (docs/security.md) and is easiest to
review, fuzz and change on its own.

It is no open proxy and forwards nothing malformed: absolute-URI, authority
(CONNECT) and asterisk request targets, unusual methods, dot segments and encoded
slashes in paths, control characters in header values, paths outside
``allowed_paths`` or inside ``blocked_paths`` (the engines' admin endpoints by
default), variants of a generation path (``/V1/completions``,
``/v1/completions/``) that would slip past shedding and accounting, and generation
bodies that are not a JSON object or carry a ``max_tokens`` that is not a positive
integer are all refused here.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from kvguard.actuators.proxy.settings import ProxySettings
from kvguard.config.fields import PATH_METHODS

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# What an inference API is called with; TRACE, CONNECT and inventions are refused.
ALLOWED_METHODS = frozenset(PATH_METHODS)
# No engine takes more tokens than this (int32); a bigger max_tokens is malformed.
MAX_TOKENS_LIMIT = 2**31 - 1


def screen_request(request: web.Request, settings: ProxySettings) -> tuple[int, str, str] | None:
    """Why ``request`` must not be forwarded, as (status, reason, message); None if it may."""
    if request.method not in ALLOWED_METHODS:
        return (
            405,
            "method_not_allowed",
            (
                f"method {request.method} is not forwarded"
                f" (allowed: {', '.join(sorted(ALLOWED_METHODS))}); kvguard is no forward proxy"
            ),
        )
    raw = request.raw_path
    if not raw.startswith("/"):
        # Absolute-URI ("GET http://other/ HTTP/1.1") and asterisk ("OPTIONS *") targets:
        # the upstream is fixed, so a target naming a host is a client mistake or a probe.
        return (
            400,
            "bad_target",
            (
                "the request target must be a path (origin-form, like /v1/models);"
                " kvguard forwards only to its configured engine and is no forward proxy"
            ),
        )
    for name, value in request.headers.items():
        if not _clean_header(name, value):
            return (
                400,
                "bad_header",
                (f"header {_shown(name)} holds a control character or bytes that are not UTF-8"),
            )
    path_problem = _path_problem(raw, request.path)
    if path_problem is not None:
        return 400, "bad_path", path_problem
    normal = normal_path(request.path)
    if not any(_under(normal, prefix) for prefix in settings.allowed_paths):
        return (
            404,
            "path_not_allowed",
            (f"{_shown(request.path)} is not forwarded to the engine ([proxy] allowed_paths)"),
        )
    if any(_blocks(entry, request.method, normal) for entry in settings.blocked_paths):
        return (
            403,
            "path_blocked",
            (
                f"{request.method} {_shown(request.path)} is an engine admin endpoint and is not"
                " served through the proxy ([proxy] blocked_paths); call it on the engine's"
                " own address"
            ),
        )
    if normal in GENERATION_PATHS and request.path != normal:
        # Shedding, capping and accounting key on the exact path: a variant the engine
        # would redirect or 404 anyway must not slip past them.
        return (
            400,
            "bad_path",
            f"{_shown(request.path)} is not a generation path: write it as {normal}",
        )
    return None


def normal_path(path: str) -> str:
    """``path`` lower-cased, repeated and trailing slashes collapsed: what rules match."""
    return "/" + "/".join(part for part in path.lower().split("/") if part)


def _blocks(entry: str, method: str, path: str) -> bool:
    """Whether a ``blocked_paths`` entry ("/slots" or "POST /props") covers the request."""
    only, _, prefix = entry.rpartition(" ")
    return (not only or only == method) and _under(path, prefix)


def _under(path: str, prefix: str) -> bool:
    """Whether normalised ``path`` is ``prefix`` or below it, in whole segments."""
    prefix = prefix.lower().rstrip("/")
    return not prefix or path == prefix or path.startswith(prefix + "/")


def _path_problem(raw: str, decoded: str) -> str | None:
    """Why a path is malformed, or None: what an engine could read as another path."""
    raw_path = raw.split("?", 1)[0].lower()
    if "%2f" in raw_path or "%5c" in raw_path or "\\" in decoded:
        return "the path holds an encoded slash or a backslash"
    if any(part in (".", "..") for part in decoded.split("/")):
        return 'the path holds a "." or ".." segment'
    if any(ord(ch) < 32 or ord(ch) == 127 or 0xD800 <= ord(ch) <= 0xDFFF for ch in decoded):
        return "the path holds a control character or bytes that are not UTF-8"
    return None


def _clean_header(name: str, value: str) -> bool:
    """No CR, LF, NUL or other control character (tab aside), no undecodable bytes."""
    return all(
        (ord(ch) >= 32 or ch == "\t") and ord(ch) != 127 and not 0xD800 <= ord(ch) <= 0xDFFF
        for ch in name + value
    )


def _shown(text: str, limit: int = 80) -> str:
    """``text`` safe to echo in an error: printable, bounded."""
    cleaned = "".join(ch if ch.isprintable() else "?" for ch in text[:limit])
    return repr(cleaned + ("..." if len(text) > limit else ""))


class _MalformedJSONError(ValueError):
    """A body that is not strict JSON (RFC 8259)."""


def _reject_constant(name: str) -> object:
    raise _MalformedJSONError(f"{name} is not JSON")


def _json_or_error(body: bytes) -> object:
    """``body`` parsed as strict JSON, or a :class:`_MalformedJSONError` instance."""
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError too
        # Deep nesting raises RecursionError: malformed for us, never a 500.
        return _MalformedJSONError(type(exc).__name__)


def _malformed_generation(payload: object, body: bytes, *, chat: bool) -> str | None:
    """Why a generation request's body must not be forwarded, or None."""
    if not body:
        return None  # nothing to parse; the engine says what it needs
    if isinstance(payload, _MalformedJSONError):
        return "the body must be one JSON object (strict JSON: no NaN or Infinity)"
    if not isinstance(payload, dict):
        return f"the body must be a JSON object, not {type(payload).__name__}"
    for key in ("max_tokens", "max_completion_tokens"):
        value = payload.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{key} must be an integer, not {type(value).__name__}"
        if not 1 <= value <= MAX_TOKENS_LIMIT:
            return f"{key} must be from 1 to {MAX_TOKENS_LIMIT}, not {value}"
    field, kinds = ("messages", (list,)) if chat else ("prompt", (str, list))
    value = payload.get(field)
    if value is not None and not isinstance(value, kinds):
        allowed = "a list" if chat else "a string or a list"
        return f"{field} must be {allowed}, not {type(value).__name__}"
    return None


def _requested_max_tokens(payload: dict[str, Any], *, chat: bool) -> tuple[str, int | None]:
    """The body field that caps the answer, and its value when it is an integer.

    Chat requests may use ``max_completion_tokens`` (OpenAI's newer name); a clamp
    must rewrite the field the client used, or the engine would read the other.
    """
    key = "max_completion_tokens" if chat and "max_completion_tokens" in payload else "max_tokens"
    requested = payload.get(key)
    if isinstance(requested, int) and not isinstance(requested, bool):
        return key, requested
    return key, None
