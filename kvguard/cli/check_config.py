"""``kvguard check-config``: validate a config file, every problem at once."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvguard.config.settings import exposed_secrets, load_config
from kvguard.errors import ConfigError, KvguardError
from kvguard.runtime.budget_keeping import budget_for


def register(commands: argparse._SubParsersAction[Any]) -> None:
    """Add ``kvguard check-config``."""
    check = commands.add_parser(
        "check-config",
        help="validate a config file: every problem at once, or the resolved config",
        description="Validate FILE (and the model config it names); exit 2 listing every problem.",
    )
    check.add_argument("file", metavar="FILE")
    check.add_argument(
        "--strict-secrets",
        action="store_true",
        help="a secret file that its group or others may read is an error (default: a warning)",
    )
    check.set_defaults(handler=run_check_config)


def run_check_config(args: argparse.Namespace) -> int:
    """Validate a config file and the model config it names.

    Secret files that their group or others may read are warnings on stderr (exit 0),
    or with ``--strict-secrets`` errors like any other problem (exit 2).
    """
    config = load_config(args.file, strict_secrets=args.strict_secrets)
    try:
        budget_for(config, config.gpu.memory_bytes)
    except KvguardError as exc:
        problem = ("model.config", config.model.config, f"must give a usable budget ({exc})")
        raise ConfigError(config.source, [problem]) from exc
    for exposed in exposed_secrets(config):
        field, name, allowed = exposed.problem()
        print(
            f"kvguard check-config: warning: {config.source}: {field}: {allowed}, got {name!r}",
            file=sys.stderr,
        )
    print(f"{config.source}: OK")
    print(json.dumps(config.redacted(), indent=2))
    return 0
