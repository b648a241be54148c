"""Write a configuration's tables as TOML (the standard library reads TOML, it does not write it).

Only what a kvguard config holds: tables of strings, booleans, numbers, lists of them and
nested tables. Pure: text in, text out.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def dumps(tables: Mapping[str, Mapping[str, object]], header: str = "") -> str:
    """``tables`` (``{"engine": {"url": …}, "policy": {"high": {…}}}``) as a TOML document.

    ``header`` lines are written first, each as a comment.
    """
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for name, body in tables.items():
        _table(lines, _key(name), body)
    return "\n".join(lines).strip("\n") + "\n"


def _table(lines: list[str], path: str, body: Mapping[str, object]) -> None:
    if lines:
        lines.append("")
    lines.append(f"[{path}]")
    nested = {k: v for k, v in body.items() if isinstance(v, Mapping)}
    for key, value in body.items():
        if key not in nested:
            lines.append(f"{_key(key)} = {_value(value)}")
    for key, value in nested.items():
        _table(lines, f"{path}.{_key(key)}", value)


def _key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key)


def _value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON's escapes are TOML's basic-string escapes
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"a config value TOML cannot hold: {value!r}")
