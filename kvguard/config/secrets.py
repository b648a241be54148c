"""Secrets in the config: the engine token, the control token, the webhook secret.

Each comes from a file named in the config (relative to the config file's folder) or
from the environment, never from the TOML itself, and is held in a :class:`Secret`,
which no log line, status page or repr shows. A secret file that its group or others
may read is found by :func:`exposed_secret_files`: a warning, or with
``--strict-secrets`` a config error.
"""

from __future__ import annotations

import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

TOKEN_ENV = "KVGUARD_ENGINE_TOKEN"  # noqa: S105 - the variable's name, not a secret
CONTROL_TOKEN_ENV = "KVGUARD_CONTROL_TOKEN"  # noqa: S105 - the variable's name, not a secret
# A bearer token anyone can guess is no lock: at least this many characters.
CONTROL_TOKEN_MIN_CHARS = 16
# An HMAC key shorter than the hash's 32-byte output can be guessed offline from one
# signed delivery; RFC 2104 asks for at least the output length.
WEBHOOK_SECRET_MIN_BYTES = 32
# The bits that let someone other than the file's owner read it.
_READABLE_BY_OTHERS = stat.S_IRGRP | stat.S_IROTH


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
    path = _resolve(name, base)
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
    secret, problem = _secret_file("webhook.secret_file", secret_file, base, one_line=False)
    if secret is None or problem is not None:
        return secret, problem
    held = len(secret.reveal().encode("utf-8"))
    if held < WEBHOOK_SECRET_MIN_BYTES:
        return None, (
            "webhook.secret_file",
            secret_file,
            f"must hold at least {WEBHOOK_SECRET_MIN_BYTES} bytes, not {held}"
            " (e.g. `openssl rand -hex 32 > FILE`, 64 characters)",
        )
    return secret, None


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


@dataclass(frozen=True)
class ExposedSecretFile:
    """A secret file that its group or others may read: the ``field`` naming it, its mode.

    ``name`` is the file as the config gives it. It is not itself a secret, so logs
    and ``kvguard check-config`` show it (``/status`` still masks the control token's).
    """

    field: str
    name: str
    mode: int

    def problem(self) -> Problem:
        """As a config problem: the field, the file, and what is allowed."""
        return (
            self.field,
            self.name,
            f"must be readable by its owner only, not mode {self.mode:04o}"
            " (`chmod 600` it, or `chmod 400`)",
        )


def exposed_secret_files(named: Mapping[str, object], base: Path) -> list[ExposedSecretFile]:
    """The files of ``named`` (field: file name, or None) that group or others may read.

    Names are relative to ``base``, as the secrets are read. A file that cannot be
    looked at is left out: reading the secret reports it.
    """
    exposed: list[ExposedSecretFile] = []
    for field_name, name in named.items():
        if not isinstance(name, str):
            continue
        try:
            mode = stat.S_IMODE(_resolve(name, base).stat().st_mode)  # follows links, as a read
        except OSError:
            continue
        if mode & _READABLE_BY_OTHERS:
            exposed.append(ExposedSecretFile(field_name, name, mode))
    return exposed


def _resolve(name: str, base: Path) -> Path:
    """File ``name``, relative to the config file's folder ``base`` unless absolute."""
    path = Path(name)
    return path if path.is_absolute() else base / path


def _printable(text: str) -> bool:
    """Whether ``text`` can travel in an HTTP header (no control characters)."""
    return all(32 <= ord(ch) != 127 for ch in text)
