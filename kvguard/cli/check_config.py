"""``kvguard check-config``: validate a config file, every problem at once."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

from kvguard.config import toml_out
from kvguard.config.model_files import ModelFiles, WeightIndexError, load_model_files
from kvguard.config.settings import (
    Config,
    ModelConfig,
    exposed_secrets,
    file_form,
    hidden_settings,
    load_config,
    parse_config,
    read_tables,
)
from kvguard.core.budget import budget_inputs_from, plan_budget
from kvguard.errors import ConfigError, InvalidInputError, KvguardError

EXIT_INVALID = 1  # the config has problems (2 stays the usage error)
MODEL_DEFAULTS = ModelConfig()
Problem = tuple[str, object, str]  # (field, value, what is allowed), as ConfigError holds them
_MISSING = object()  # getattr's default: a field name that is no [model] setting


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
        config = checked_config(args.file, strict_secrets=args.strict_secrets)
    except ConfigError as exc:
        print_problems("check-config", exc)
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
            f" they stay as {config.source} sets them (copy them from there for the output"
            " to read back as the same configuration)",
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
        if hidden:
            # Left out, they read back as their defaults (no webhooks, no restart
            # command): say so where the output is, not only on stderr.
            header = (
                f"{config.source}: OK. The resolved configuration, every default included,"
                f"\nbut for {', '.join(hidden)}: left out (they may hold secrets). It reads"
                f"\nback as the same configuration once they are copied from {config.source}."
            )
        sys.stdout.write(toml_out.dumps(tables, header))
    return 0


def checked_config(path: str | None, *, strict_secrets: bool = False) -> Config:
    """The config at ``path`` (else ``$KVGUARD_CONFIG``), checked as ``check-config`` checks it.

    Raises :class:`ConfigError` listing every problem at once: the file's, and those of
    budgeting the model it names (``kvguard run`` refuses the same configs).
    """
    try:
        config = load_config(path, strict_secrets=strict_secrets)
    except ConfigError as exc:
        raise _with_model_problems(exc, exc.source) from None
    budget_problems = _budget_problems(config)
    if budget_problems:
        raise ConfigError(config.source, budget_problems)
    return config


def print_problems(command: str, exc: ConfigError) -> None:
    """One line per problem on stderr: ``kvguard COMMAND: error: FILE: field: …``."""
    for line in exc.lines():
        print(f"kvguard {command}: error: {exc.source}: {line}", file=sys.stderr)


def _with_model_problems(exc: ConfigError, path: str) -> ConfigError:
    """``exc`` plus what is wrong with the model the file names, checked on its own.

    A bad URL, or a bad ``[model]`` / ``[gpu]`` value, must not hide a bad model: the
    file's ``[model]`` and ``[gpu]`` tables are parsed and budgeted apart from the rest,
    without the keys already among the problems (skipped when ``model.config`` is).
    """
    bad = {field for field, _, _ in exc.problems}
    if "model" in bad or "model.config" in bad:
        return exc  # no model to check, or its name is itself the problem
    try:
        data = read_tables(path)
        alone: dict[str, object] = {"engine": {"url": "http://127.0.0.1:1"}}
        for section in ("model", "gpu"):
            table = data.get(section)
            if isinstance(table, dict) and section not in bad:
                alone[section] = {k: v for k, v in table.items() if not _named(bad, section, k)}
        config = parse_config(alone, source=exc.source, env={})
    except ConfigError:
        return exc
    return ConfigError(exc.source, [*exc.problems, *_budget_problems(config)])


def _named(fields: set[str], section: str, key: object) -> bool:
    """Whether ``section.key`` (or an item of it, ``gpu.indices[1]``) is among ``fields``."""
    name = f"{section}.{key}"
    return any(f == name or f.startswith((f"{name}[", f"{name}.")) for f in fields)


def _budget_problems(config: Config) -> list[Problem]:
    """Every problem budgeting ``config``'s ``[model]`` finds, not only the first.

    The budget stops at its first error; one that names a ``[model]`` key the file set
    (``tp`` that does not divide the heads, a ``max_model_len`` past the model's
    context) is reported against that key, which is then put back to its default and
    the budget tried again, so a bad ``tp`` does not hide a bad ``max_model_len``. A bad
    weight index is reported and the settings still checked against ``config.json``.
    The same steps as :func:`kvguard.runtime.budget_keeping.budget_for`.
    """
    name = config.model.config
    if name is None:
        return []
    problems: list[Problem] = []
    try:
        try:
            files = load_model_files(name)
        except WeightIndexError as exc:
            problems.append(("model.config", name, f"must give a usable budget ({exc})"))
            files = load_model_files(name, weight_index=False)
    except KvguardError as exc:
        return [("model.config", name, f"must give a usable budget ({exc})")]
    model = config.model
    while (error := _plan_error(model, config.gpu.memory_bytes, files)) is not None:
        if not isinstance(error, InvalidInputError) or not _set_by_file(model, error.field):
            # From config.json itself, or a setting left at its default: the model's fault.
            problems.append(("model.config", name, f"must give a usable budget ({error})"))
            break
        allowed = f"{error.allowed} (model.config = {name!r})"
        problems.append((f"model.{error.field}", error.value, allowed))
        model = replace(model, **{error.field: getattr(MODEL_DEFAULTS, error.field)})
    return problems


def _set_by_file(model: ModelConfig, field: str) -> bool:
    """Whether ``field`` is a ``[model]`` setting (not the model's name) set off its default."""
    default = getattr(MODEL_DEFAULTS, field, _MISSING)
    return field != "config" and default is not _MISSING and getattr(model, field) != default


def _plan_error(
    model: ModelConfig, gpu_memory_bytes: int | None, files: ModelFiles
) -> KvguardError | None:
    """What budgeting ``model`` from ``files`` as the daemon would raises (None: it works)."""
    try:
        inputs = budget_inputs_from(model, gpu_memory_bytes=gpu_memory_bytes)
        plan_budget(
            files.config, inputs, index_total_size=files.index_total_size, source=files.source
        )
    except KvguardError as exc:
        return exc
    return None
