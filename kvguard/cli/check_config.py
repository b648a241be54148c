"""``kvguard check-config``: validate a config file, every problem at once."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvguard.config import toml_out
from kvguard.config.settings import (
    exposed_secrets,
    file_form,
    hidden_settings,
    load_config,
    parse_config,
    read_tables,
)
from kvguard.errors import ConfigError, KvguardError
from kvguard.runtime.budget_keeping import budget_for

EXIT_INVALID = 1  # the config has problems (2 stays the usage error)


def register(commands: argparse._SubParsersAction[Any]) -> None:
    """Add ``kvguard check-config``."""
    check = commands.add_parser(
        "check-config",
        help="validate a config file: every problem at once, or the resolved config",
        description="Validate FILE (and the model config it names). Valid: print the resolved"
        " config, every default included, as TOML that reads back the same (--json: as JSON),"
        " exit 0. Invalid: list every problem on stderr, exit 1 (2: a usage error).",
    )
    check.add_argument("file", metavar="FILE")
    check.add_argument(
        "--json", action="store_true", help="print the resolved config as one JSON object"
    )
    check.add_argument(
        "--strict-secrets",
        action="store_true",
        help="a secret file that its group or others may read is an error (default: a warning)",
    )
    check.set_defaults(handler=run_check_config)


def run_check_config(args: argparse.Namespace) -> int:
    """Validate a config file and the model config it names; print it resolved.

    Secret files that their group or others may read are warnings on stderr (exit 0),
    or with ``--strict-secrets`` errors like any other problem (exit 1).
    """
    try:
        config = load_config(args.file, strict_secrets=args.strict_secrets)
    except ConfigError as exc:
        _print_problems(_with_model_problems(exc, args.file))
        return EXIT_INVALID
    try:
        budget_for(config, config.gpu.memory_bytes)
    except KvguardError as exc:
        problem = ("model.config", config.model.config, f"must give a usable budget ({exc})")
        _print_problems(ConfigError(config.source, [problem]))
        return EXIT_INVALID
    for exposed in exposed_secrets(config):
        field, name, allowed = exposed.problem()
        print(
            f"kvguard check-config: warning: {config.source}: {field}: {allowed}, got {name!r}",
            file=sys.stderr,
        )
    hidden = hidden_settings(config)
    if hidden:
        print(
            f"kvguard check-config: note: {', '.join(hidden)} may hold secrets: not printed;"
            f" they stay as {config.source} sets them",
            file=sys.stderr,
        )
    tables = file_form(config)
    if args.json:
        print(json.dumps(tables, indent=2))
    else:
        header = (
            f"{config.source}: OK. The resolved configuration, every default included;"
            "\nthis reads back as the same configuration."
        )
        sys.stdout.write(toml_out.dumps(tables, header))
    return 0


def _print_problems(exc: ConfigError) -> None:
    for line in exc.lines():
        print(f"kvguard check-config: error: {exc.source}: {line}", file=sys.stderr)


def _with_model_problems(exc: ConfigError, path: str) -> ConfigError:
    """``exc`` plus what is wrong with the model the file names, checked on its own.

    A bad URL must not hide a bad model: the model's tables are parsed and budgeted
    apart from the rest (skipped when they are themselves among the problems).
    """
    if any(field.startswith(("model.", "gpu.")) for field, _, _ in exc.problems):
        return exc
    try:
        data = read_tables(path)
        alone = {"engine": {"url": "http://127.0.0.1:1"}}
        alone |= {k: data[k] for k in ("model", "gpu") if isinstance(data.get(k), dict)}
        config = parse_config(alone, source=exc.source, env={})
        if config.model.config is None:
            return exc
        budget_for(config, config.gpu.memory_bytes)
    except ConfigError:
        return exc
    except KvguardError as model:
        problem = ("model.config", config.model.config, f"must give a usable budget ({model})")
        return ConfigError(exc.source, [*exc.problems, problem])
    return exc
