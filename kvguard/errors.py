"""Every error kvguard raises on purpose, in one tree.

Callers catch :class:`KvguardError` (or one branch of it); foreign exceptions
(``OSError``, ``json.JSONDecodeError``, library errors) are translated into this
tree at the edge where they happen, so no caller ever needs to know which library
failed::

    KvguardError                 anything kvguard reports as a clean, one-line error
    ├── InvalidInputError        a value given to kvguard is out of range or malformed
    │                            (.field names it, .value is what was given)
    ├── ConfigError              a kvguard config file is invalid; .problems lists every
    │                            (field, value, allowed) found, not just the first
    ├── ModelConfigError         a model's config.json (or its weight index) cannot be
    │                            read, or lacks a field the budget needs (.source, .field)
    └── ProbeError               a probe could not read its source this tick (.probe);
                                 the daemon marks the data stale and keeps ticking
"""

from __future__ import annotations


class KvguardError(Exception):
    """Base of every error kvguard raises deliberately; its message is for operators."""


class InvalidInputError(KvguardError, ValueError):
    """A value given to kvguard is malformed or out of range.

    ``field`` names the input (in the words of the CLI flag or config key),
    ``value`` is what was given, and the message says what is allowed.
    """

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"{field}: {allowed}, got {value!r}")


class ModelConfigError(KvguardError):
    """A model configuration cannot be used for a budget.

    Raised for a missing or unreadable file, invalid JSON, or a config that lacks a
    field the formula needs. ``source`` is the file (or a bundled model's name),
    ``field`` the missing or bad field when there is one.
    """

    def __init__(self, message: str, *, source: str = "", field: str = "") -> None:
        self.source = source
        self.field = field
        prefix = f"{source}: " if source else ""
        super().__init__(f"{prefix}{message}")


class ConfigError(KvguardError):
    """A kvguard config file is invalid.

    ``problems`` holds every problem found, each a ``(field, value, allowed)``
    triple, so ``kvguard check-config`` can print them all at once.
    """

    def __init__(self, source: str, problems: list[tuple[str, object, str]]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: {len(problems)} problem(s): " + "; ".join(self.lines()))

    def lines(self) -> list[str]:
        """One line per problem: ``field: what is allowed, got value``."""
        return [
            f"{field}: {allowed}" + ("" if value is None else f", got {value!r}")
            for field, value, allowed in self.problems
        ]


class ProbeError(KvguardError):
    """A probe failed to read its source (unreachable, timed out, malformed answer)."""

    def __init__(self, probe: str, message: str) -> None:
        self.probe = probe
        super().__init__(f"{probe}: {message}")
