"""Parsers for config values: each checks one value and says what is allowed.

A parser takes the dotted field name and the raw TOML value, and returns the
parsed value or raises :class:`~kvguard.errors.InvalidInputError` naming the field,
the value and what is allowed (so every problem can be collected and shown at once).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping
from urllib.parse import SplitResult, urlsplit

from kvguard.core.units import parse_bytes
from kvguard.errors import InvalidInputError

Parser = Callable[[str, object], object]
# The proxy's request classes, most important first.
PRIORITIES = ("critical", "standard", "sheddable")


def integer(minimum: int, maximum: int = 2**31) -> Parser:
    """An integer in [minimum, maximum]."""

    def parse(name: str, value: object) -> object:
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            raise InvalidInputError(
                name, value, f"must be an integer from {minimum} to {maximum:,}"
            )
        return value

    return parse


def number(low: float, high: float, *, low_open: bool = True) -> Parser:
    """A number in (low, high] (or [low, high] when not ``low_open``)."""

    def parse(name: str, value: object) -> object:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
            if (low < number if low_open else low <= number) and number <= high:
                return number
        bracket = "(" if low_open else "["
        raise InvalidInputError(name, value, f"must be a number in {bracket}{low:g}, {high:g}]")

    return parse


def choice(options: tuple[str, ...]) -> Parser:
    """One of ``options``, case-insensitive (returned lower-case)."""

    def parse(name: str, value: object) -> object:
        if not isinstance(value, str) or value.strip().lower() not in options:
            raise InvalidInputError(name, value, f"must be one of {', '.join(options)}")
        return value.strip().lower()

    return parse


def text(name: str, value: object) -> object:
    """A non-empty string (stripped)."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidInputError(name, value, "must be a non-empty string")
    return value.strip()


def size(name: str, value: object) -> object:
    """A byte size: "80GiB", "80GB", "81559MiB" or a positive integer."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidInputError(name, value, 'must be a size like "80GiB" or a byte count')
    size = value if isinstance(value, int) else parse_bytes(value, name)
    if size <= 0:
        raise InvalidInputError(name, value, "must be a size > 0")
    return size


def _http_url(name: str, value: object, allowed: str, *, shown: object) -> SplitResult:
    """``value`` split as an http(s) URL with a host; errors show ``shown``, not the value."""
    if not isinstance(value, str):
        raise InvalidInputError(name, value, allowed)
    try:
        parts = urlsplit(value.strip())  # raises ValueError for an unclosed "[" (IPv6)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError as exc:
        raise InvalidInputError(name, shown, allowed) from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidInputError(name, shown, allowed)
    return parts


def url(name: str, value: object) -> object:
    """An http(s) URL with a host and no query, fragment or credentials."""
    allowed = "must be an http(s) URL with a host, e.g. http://127.0.0.1:8000"
    parts = _http_url(name, value, allowed, shown=value)
    if parts.query or parts.fragment:
        raise InvalidInputError(name, value, allowed)
    if parts.username or parts.password:
        # A URL ends up in logs and /status; credentials belong in token_file.
        raise InvalidInputError(name, "<redacted>", "must not hold credentials (use token_file)")
    return str(value).strip().rstrip("/")


def webhook_url(name: str, value: object) -> object:
    """An http(s) URL with a host; a query may carry the receiver's token (never shown)."""
    allowed = "must be an http(s) URL with a host, e.g. https://hooks.example.com/kvguard"
    # The value may hold a token: errors name the field, not the value.
    _http_url(name, value, allowed, shown="<redacted>")
    return str(value).strip()


def boolean(name: str, value: object) -> object:
    """True or false."""
    if not isinstance(value, bool):
        raise InvalidInputError(name, value, "must be true or false")
    return value


def key_map(name: str, value: object) -> object:
    """A table of API key to priority class; errors never show the key."""
    allowed = "must be a table of API key = " + " | ".join(f'"{p}"' for p in PRIORITIES)
    if not isinstance(value, Mapping):
        raise InvalidInputError(name, "<redacted>", allowed)
    for key, priority in value.items():
        if priority not in PRIORITIES:
            # The key is a secret: name the class, never the key.
            raise InvalidInputError(f"{name}.<key>", priority, allowed)
        if not str(key).strip():
            raise InvalidInputError(name, "<empty key>", allowed)
    return {str(k): str(v) for k, v in value.items()}


def path_in_url(name: str, value: object) -> object:
    """A URL path starting with "/"."""
    if not isinstance(value, str) or not value.startswith("/"):
        raise InvalidInputError(name, value, 'must be a path starting with "/"')
    return value


def path_prefix(name: str, value: object) -> object:
    """A URL path prefix for the proxy's path rules: "/", "/v1", "/slots"."""
    allowed = 'must be a path like "/v1" (starts with "/", no query, no "." or ".." segments)'
    if (
        not isinstance(value, str)
        or not value.startswith("/")
        or any(ch in value for ch in "?#%\\")
        or not all(32 < ord(ch) < 127 for ch in value)
        or any(part in (".", "..") for part in value.split("/"))
    ):
        raise InvalidInputError(name, value, allowed)
    return value.rstrip("/") or "/"


# The methods the proxy forwards; a blocked path may name one of them.
PATH_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def blocked_path(name: str, value: object) -> object:
    """A path prefix the proxy refuses: "/slots" (every method) or "POST /props" (one)."""
    if isinstance(value, str) and " " in value:
        method, _, prefix = value.partition(" ")
        if method not in PATH_METHODS:
            raise InvalidInputError(
                name,
                value,
                f'must be a path like "/slots", or a method ({", ".join(PATH_METHODS)}),'
                ' one space and a path, like "POST /props"',
            )
        return f"{method} {path_prefix(name, prefix)}"
    return path_prefix(name, value)


def listen(name: str, value: object) -> object:
    """A "HOST:PORT" listen address."""
    allowed = 'must be "HOST:PORT", e.g. "127.0.0.1:9108"'
    if not isinstance(value, str) or ":" not in value:
        raise InvalidInputError(name, value, allowed)
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidInputError(name, value, allowed)
    return value


WILDCARD_HOSTS = ("0.0.0.0", "::", "*")  # noqa: S104 - names, not a bind


def same_listen(first: str, second: str) -> bool:
    """Whether two "HOST:PORT" listen addresses would take the same socket.

    The same port on the same host, or on any host where either is a wildcard (it
    takes every address); ``localhost`` is 127.0.0.1.
    """
    (host_a, port_a), (host_b, port_b) = (_host_and_port(a) for a in (first, second))
    if port_a != port_b:
        return False
    return host_a == host_b or host_a in WILDCARD_HOSTS or host_b in WILDCARD_HOSTS


def _host_and_port(address: str) -> tuple[str, str]:
    host, _, port = address.rpartition(":")
    host = host.strip("[]").lower()
    return ("127.0.0.1" if host == "localhost" else host), port


def list_of(item: Parser) -> Parser:
    """A list whose items each pass ``item`` (returned as a tuple)."""

    def parse(name: str, value: object) -> object:
        if not isinstance(value, list):
            raise InvalidInputError(name, value, "must be a list")
        return tuple(item(f"{name}[{i}]", v) for i, v in enumerate(value))

    return parse


def argv(name: str, value: object) -> object:
    """A command as a list of strings (no shell: each item is one argument)."""
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(item, str) and item for item in value)
    ):
        raise InvalidInputError(
            name, value, "must be a non-empty list of strings, one per argument (no shell)"
        )
    return tuple(value)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or name from a listen setting) is this machine only."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name that may resolve anywhere: treat it as reachable
