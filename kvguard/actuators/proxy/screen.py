"""What the proxy accepts: request targets, methods, paths, headers and generation bodies.

Everything here reads a request (or its parsed body) and says whether it may reach
the engine, and nothing else: no counters, no forwarding, no answers. Kept apart
because it is the proxy's security boundary (docs/security.md) and is easiest to
review, fuzz and change on its own.

It is no open proxy and forwards nothing malformed: absolute-URI, authority
(CONNECT) and asterisk request targets, unusual methods, dot segments and encoded
slashes in paths, control characters in header values, paths that are no route
the engine serves its clients (an allowlist per engine, :mod:`.routes`) unless
``allowed_paths`` adds them, paths inside ``blocked_paths`` (the engines' admin
endpoints by default), variants of a generation path (``/V1/completions``,
``/v1/completions/``) that would slip past shedding and accounting, and generation
bodies that are not a JSON object or carry a ``max_tokens`` that is not a positive
integer are all refused here. So are bodies kvguard could not parse cheaply or pass
on: more than ``max_body_values`` JSON values (counted before parsing), text that is
not UTF-8 or holds a lone surrogate, numbers no double holds (:func:`parse_json`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import re
from collections.abc import Callable, Mapping
from functools import lru_cache
from types import MappingProxyType
from typing import TypeVar

from aiohttp import web

from kvguard.actuators.proxy.routes import (
    ADMIN_ROUTES,
    ALL_ROUTES,
    Route,
    find_route,
    path_served,
    routes_for,
)
from kvguard.actuators.proxy.settings import ProxySettings
from kvguard.config.fields import PATH_METHODS

# Every engine's generation routes (their patterns); which ones a request may take
# depends on the engine's kind (routes.py).
GENERATION_PATHS = frozenset(r.pattern for r in ALL_ROUTES if r.role == "generation")
# Roles of the routes forwarded; admin and unserved ones are refused (routes.py).
FORWARDED_ROLES = frozenset({"generation", "client", "model"})
# Where screen_request leaves the route a request is, for the handler.
ROUTE_KEY: web.RequestKey[Route | None] = web.RequestKey("kvguard_route")
# What an inference API is called with; TRACE, CONNECT and inventions are refused.
ALLOWED_METHODS = frozenset(PATH_METHODS)
# No engine takes more tokens than this (int32); a bigger max_tokens is malformed.
MAX_TOKENS_LIMIT = 2**31 - 1
# Bodies up to this size are parsed on the loop (at most ~20k values: milliseconds);
# larger ones in _PARSER's thread.
PARSE_INLINE_BYTES = 64 * 1024
# One thread parses large bodies, one at a time: the parse holds the GIL, so more
# threads would not parse faster, and the loop's default executor (the probes') stays
# free during a flood of large bodies.
_T = TypeVar("_T")
_PARSER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvguard-json")
_SURROGATE = re.compile("[\ud800-\udfff]")


def screen_request(
    request: web.Request, settings: ProxySettings, kind: str | None = None
) -> tuple[int, str, str] | None:
    """Why ``request`` must not be forwarded, as (status, reason, message); None if it may.

    ``kind`` is the engine's (None while unknown): it picks the routes forwarded. The
    route the request is goes in ``request[ROUTE_KEY]`` (None: ``allowed_paths``).
    """
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
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        # aiohttp decompresses a request body as it reads it: forwarded, the engine would
        # get other bytes than the client sent, under a header that no longer says so
        # (and a corrupt one arrived empty). The engines read plain bodies anyway.
        return (
            415,
            "content_encoding",
            (
                f"request bodies with Content-Encoding {_shown(encoding)} are not"
                " forwarded: send the body uncompressed"
            ),
        )
    path_problem = _path_problem(raw, request.path)
    if path_problem is not None:
        return 400, "bad_path", path_problem
    refusal, route = check_path(request.method, request.path, settings, kind)
    # The handler reads the route (its role and body shape) instead of matching again.
    request[ROUTE_KEY] = route
    return refusal


def check_path(
    method: str, path: str, settings: ProxySettings, kind: str | None = None
) -> tuple[tuple[int, str, str] | None, Route | None]:
    """Whether ``method`` on (decoded) ``path`` may reach the engine, and as which route.

    The refusal (status, reason, message) or None, and the engine route it is (None
    when ``[proxy] allowed_paths`` is what lets it through). In order:
    ``blocked_paths`` refuses (403); a route of the engine's table
    (:mod:`.routes`, every engine's while ``kind`` is unknown) that is served
    passes — a generation route only as the engine writes it; an admin route of any
    engine is refused (403) unless an ``allowed_paths`` entry names that very path (a
    prefix such as ``/`` or ``/v1/models`` does not open one: the admin table names
    routes ``blocked_paths``' prefixes cannot, like Triton's per-model load and trace
    routes); ``allowed_paths`` lets anything else under its prefixes through, as is;
    everything else is not forwarded (404).
    """
    normal = normal_path(path)
    if is_blocked(method, normal, settings.blocked_paths):
        return (
            403,
            "path_blocked",
            (
                f"{method} {_shown(path)} is an engine admin endpoint and is not"
                " served through the proxy ([proxy] blocked_paths); call it on the engine's"
                " own address"
            ),
        ), None
    routes = routes_for(kind)
    route = find_route(routes, method, normal)
    if route is not None and route.role in FORWARDED_ROLES:
        if route.role == "generation" and not route.canonical(path):
            # Shedding, capping and accounting key on the route: a variant the engine
            # would redirect or 404 anyway must not slip past them.
            return (
                400,
                "bad_path",
                f"{_shown(path)} is not a generation path: write it as {route.pattern}",
            ), None
        return None, route
    named = any(normal == normal_path(prefix) for prefix in settings.allowed_paths)
    if find_route(ADMIN_ROUTES, method, normal) is not None and not named:
        return (
            403,
            "path_blocked",
            (
                f"{method} {_shown(path)} is an engine admin endpoint and is not served"
                " through the proxy; call it on the engine's own address"
            ),
        ), None
    if any(_under(normal, prefix) for prefix in settings.allowed_paths):
        return None, None
    served = path_served(routes, normal)
    if served:
        because = f": the engine serves it for {', '.join(served)} only"
    elif route is not None:
        because = f": {route.why}"
    else:
        because = " ([proxy] allowed_paths adds paths)"
    return (
        404,
        "path_not_allowed",
        f"{method} {_shown(path)} is not forwarded to the engine{because}",
    ), None


def normal_path(path: str) -> str:
    """``path`` lower-cased, repeated and trailing slashes collapsed: what rules match."""
    return "/" + "/".join(part for part in path.lower().split("/") if part)


def _blocks(entry: str, method: str, path: str) -> bool:
    """Whether a ``blocked_paths`` entry ("/slots" or "POST /props") covers the request."""
    only, _, prefix = entry.rpartition(" ")
    return (not only or only == method) and _under(path, prefix)


@lru_cache(maxsize=16)
def _parsed_blocks(entries: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """``blocked_paths`` entries ("/slots", "POST /props") as (method or "", prefix).

    Parsed once per settings, not once per request: the default list is long.
    """
    parsed = []
    for entry in entries:
        only, _, prefix = entry.rpartition(" ")
        parsed.append((only, prefix.lower().rstrip("/")))
    return tuple(parsed)


@lru_cache(maxsize=16)
def _block_index(entries: tuple[str, ...]) -> Mapping[str, frozenset[str]]:
    """``blocked_paths`` as prefix -> the methods it blocks ("" for every method)."""
    index: dict[str, set[str]] = {}
    for only, prefix in _parsed_blocks(entries):
        index.setdefault(prefix, set()).add(only)
    return MappingProxyType({prefix: frozenset(methods) for prefix, methods in index.items()})


def is_blocked(method: str, normal: str, entries: tuple[str, ...]) -> bool:
    """Whether a ``blocked_paths`` entry covers ``method`` on the normalised path ``normal``.

    Looked up by the path's own segment prefixes (a handful) rather than testing
    every entry (the default list is long, and every request asks).
    """
    index = _block_index(entries)
    if not index:
        return False

    def hit(prefix: str) -> bool:
        methods = index.get(prefix)
        return methods is not None and ("" in methods or method in methods)

    if hit("") or hit(normal):
        return True
    cut = normal.find("/", 1)
    while cut != -1:
        if hit(normal[:cut]):
            return True
        cut = normal.find("/", cut + 1)
    return False


def _under(path: str, prefix: str) -> bool:
    """Whether normalised ``path`` is ``prefix`` or below it, in whole segments."""
    return _under_normal(path, prefix.lower().rstrip("/"))


def _under_normal(path: str, prefix: str) -> bool:
    """:func:`_under` for a prefix already lower-cased without its trailing slash."""
    return not prefix or path == prefix or path.startswith(prefix + "/")


def _path_problem(raw: str, decoded: str) -> str | None:
    """Why a path is malformed, or None: what an engine could read as another path."""
    raw_path = raw.split("?", 1)[0].lower()
    if "%2f" in raw_path or "%5c" in raw_path or "\\" in decoded:
        return "the path holds an encoded slash or a backslash"
    if any(part in (".", "..") for part in decoded.split("/")):
        return 'the path holds a "." or ".." segment'
    if _UNCLEAN.search(decoded):
        return "the path holds a control character or bytes that are not UTF-8"
    return None


# Control characters (DEL too) and lone surrogates (bytes that were not UTF-8),
# found in one C-level scan rather than a Python test per character.
_UNCLEAN = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")
_UNCLEAN_HEADER = re.compile("[\x00-\x08\x0a-\x1f\x7f\ud800-\udfff]")  # tab allowed


def _clean_header(name: str, value: str) -> bool:
    """No CR, LF, NUL or other control character (tab aside), no undecodable bytes."""
    return _UNCLEAN_HEADER.search(name) is None and _UNCLEAN_HEADER.search(value) is None


def _shown(text: str, limit: int = 80) -> str:
    """``text`` safe to echo in an error: printable, bounded."""
    cleaned = "".join(ch if ch.isprintable() else "?" for ch in text[:limit])
    return repr(cleaned + ("..." if len(text) > limit else ""))


class _MalformedJSONError(ValueError):
    """A body that is not strict JSON (RFC 8259), or holds what kvguard cannot pass on."""


def _reject_constant(name: str) -> object:
    raise _MalformedJSONError(f"{name} is not JSON")


def count_values(body: bytes, limit: int) -> int:
    """About how many JSON values ``body`` holds: its ``{``, ``[`` and ``,`` outside strings.

    What parsing a body costs (time holding the GIL, memory: 50 to 100 bytes a
    value) grows with its values, not its bytes. The raw bytes are counted first
    (in C, no copy); only a body whose raw count is over ``limit`` (commas in its
    text count there too) is walked string by string, and only until it passes
    ``limit``.
    """
    raw = body.count(b"{") + body.count(b"[") + body.count(b",")
    if raw <= limit:
        return raw
    count, start, end, find = 0, 0, len(body), body.find
    while True:
        quote = find(b'"', start)
        stop = end if quote < 0 else quote
        count += body.count(b"{", start, stop) + body.count(b"[", start, stop)
        count += body.count(b",", start, stop)
        if count > limit or quote < 0:
            return count
        close = quote  # the string ends at the next quote no backslash escapes
        while True:
            close = find(b'"', close + 1)
            if close < 0:
                return count  # unterminated: the parser calls it malformed
            slashes = 0
            while body[close - 1 - slashes] == 0x5C:  # stops at the opening quote
                slashes += 1
            if slashes % 2 == 0:
                break
        start = close + 1


def parse_json(body: bytes, max_values: int) -> object:
    r"""``body`` parsed as strict JSON, or a :class:`_MalformedJSONError` saying why not.

    Strict: UTF-8 (RFC 8259), no NaN or Infinity, at most ``max_values`` values
    (:func:`count_values`, before anything is parsed), and nothing kvguard could
    not pass on or measure: a lone surrogate (``"\udfff"``), which no UTF-8 text
    holds, and a number too large for a double (``1e999``), which would be
    forwarded as ``Infinity`` once a cap rewrites the body.
    """
    if count_values(body, max_values) > max_values:
        return _MalformedJSONError(
            f"it holds more than {max_values} JSON values ([proxy] max_body_values)"
        )
    if json.detect_encoding(body) not in ("utf-8", "utf-8-sig"):
        return _MalformedJSONError("it is not UTF-8 (RFC 8259)")
    try:
        # Strict UTF-8: raw surrogate bytes are malformed here (json.loads would let
        # them through as text no encoder can write back).
        payload = json.loads(body.decode("utf-8-sig"), parse_constant=_reject_constant)
    except UnicodeDecodeError:
        return _MalformedJSONError("it is not UTF-8 (RFC 8259)")
    except RecursionError:
        return _MalformedJSONError("it is nested too deeply")
    except ValueError as exc:  # JSONDecodeError (where it broke), or NaN/Infinity
        return _MalformedJSONError(str(exc))
    problem = _unsendable(payload)
    return payload if problem is None else _MalformedJSONError(problem)


async def read_json(body: bytes, max_values: int) -> object:
    """:func:`parse_json`, in the parsing thread for a body over ``PARSE_INLINE_BYTES``.

    The thread keeps the loop free while a large body is counted and checked
    (Python code, which yields the GIL); the parse itself is C that holds the GIL
    throughout, so what bounds how long a parse can stall the loop is
    ``max_values``, not the thread.
    """
    return await beside_the_loop(len(body), parse_json, body, max_values)


async def beside_the_loop(size: int, work: Callable[..., _T], *args: object) -> _T:
    """``work(*args)``, in the parsing thread when the body is over ``PARSE_INLINE_BYTES``.

    For pure work on a parsed body whose cost grows with its size (measuring a
    prompt of 10,000 messages): inline, a small body's work costs less than the
    hop to the thread.
    """
    if size <= PARSE_INLINE_BYTES:
        return work(*args)
    return await asyncio.get_running_loop().run_in_executor(_PARSER, work, *args)


def _unsendable(payload: object) -> str | None:
    """Why a parsed body cannot be passed on as text, or None (one walk, no copies)."""
    stack = [payload]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            # isascii() reads a flag: only non-ASCII text is searched.
            if not item.isascii() and _SURROGATE.search(item):
                return "a string holds a lone surrogate (an unpaired \\ud800-\\udfff escape)"
        elif isinstance(item, float):
            if not math.isfinite(item):
                return "a number is too large for a double"
        elif isinstance(item, dict):
            stack.extend(item)  # the keys: strings too
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


def _malformed_generation(payload: object, body: bytes, *, chat: bool) -> str | None:
    """Why a generation request's body must not be forwarded, or None."""
    if not body:
        return None  # nothing to parse; the engine says what it needs
    if isinstance(payload, _MalformedJSONError):
        why = f": {payload}" if str(payload) else ""
        return f"the body must be one JSON object (strict JSON: UTF-8, no NaN or Infinity){why}"
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
