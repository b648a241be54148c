"""Secrets in the config: the engine token, the control token, the webhook secret.

Each comes from a file named in the config (relative to the config file's folder) or
from the environment, never from the TOML itself, and is held in a :class:`Secret`,
which no log line, status page or repr shows.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

TOKEN_ENV = "KVGUARD_ENGINE_TOKEN"  # noqa: S105 - the variable's name, not a secret
CONTROL_TOKEN_ENV = "KVGUARD_CONTROL_TOKEN"  # noqa: S105 - the variable's name, not a secret
# A bearer token anyone can guess is no lock: at least this many characters.
CONTROL_TOKEN_MIN_CHARS = 16


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


def read_token(
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


def read_secret(webhook: dict[str, object], base: Path) -> tuple[Secret | None, Problem | None]:
    """The webhook signing secret from ``secret_file`` (relative to the config file)."""
    secret_file = webhook.get("secret_file")
    if not isinstance(secret_file, str):
        return None, None
    return _secret_file("webhook.secret_file", secret_file, base, one_line=False)


def read_control_token(
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
