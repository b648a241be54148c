"""``kvguard run``: the guard, built by the assembly, served until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import Any

import structlog

from kvguard.api.logs import configure_logging
from kvguard.cli.check_config import checked_config, print_problems
from kvguard.config.settings import Config, exposed_secrets, load_config
from kvguard.core.snapshot import Snapshot
from kvguard.errors import ConfigError, KvguardError
from kvguard.runtime.assembly import build_guard, restart_mode
from kvguard.runtime.daemon import Daemon
from kvguard.runtime.event_loop import choose_loop
from kvguard.runtime.event_loop import run as run_on_loop
from kvguard.runtime.systemd import SystemdNotifier

log = structlog.get_logger("kvguard.run")
# An invalid config (as check-config's exit 1) or a failure to start or run; 2 is usage.
EXIT_FAILED = 1


def register(commands: argparse._SubParsersAction[Any]) -> None:
    """Add ``kvguard run``."""
    run = commands.add_parser(
        "run",
        help="watch an engine and its GPUs: snapshot per tick, budget, /metrics, /status",
        description="Run the kvguard daemon with the config from --config or $KVGUARD_CONFIG."
        " Exit 0: stopped by SIGTERM or SIGINT; 1: the config is invalid (every problem"
        " listed, as check-config lists them), or kvguard failed to start or stopped on an"
        " error (its address taken, say); 2: a usage error (a bad flag, no config named,"
        ' [reconfigure] mode = "supervisor" without an engine command after --).',
    )
    run.add_argument("--config", metavar="FILE", help="TOML config (default: $KVGUARD_CONFIG)")
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="decide, count and report every action; block or change nothing",
    )
    run.add_argument(
        "--strict-secrets",
        action="store_true",
        help="refuse a config whose secret files (engine token, control token, webhook"
        " secret) their group or others may read, at start and on reload (default: warn)",
    )
    run.add_argument(
        "engine_command",
        nargs=argparse.REMAINDER,
        metavar="-- ENGINE COMMAND",
        help="supervisor mode: start this engine command (after --), restart it on a crash"
        " and for the fp8 switch, stop it with kvguard",
    )
    run.set_defaults(handler=run_daemon)


def run_daemon(args: argparse.Namespace) -> int:
    """Load the config and serve until SIGTERM/SIGINT.

    Exit 0 when stopped by a signal; ``EXIT_FAILED`` (1) for an invalid config (every
    problem on stderr, as ``kvguard check-config`` prints them) or a failure to start
    or run; usage errors (no config named, a supervisor mode without the engine
    command) raise, for the command's exit 2.
    """
    try:
        config = checked_config(args.config, strict_secrets=args.strict_secrets)
    except ConfigError as exc:  # no config named at all raises a usage error instead
        print_problems("run", exc)
        return EXIT_FAILED
    command = list(args.engine_command or ())
    if command[:1] == ["--"]:
        command = command[1:]
    restart_mode(config, supervised=bool(command))  # a mode without its command: usage
    configure_logging(config.log.level, config.log.format)
    warn_exposed_secrets(config)
    loop = choose_loop()
    try:
        return run_on_loop(
            serve(
                config,
                config_path=config.source,
                dry_run=args.dry_run,
                engine_command=command or None,
                strict_secrets=args.strict_secrets,
                event_loop=loop,
            ),
            loop,
        )
    except ConfigError as exc:
        print_problems("run", exc)
    except KvguardError as exc:
        print(f"kvguard run: error: {exc}", file=sys.stderr)
    return EXIT_FAILED


def warn_exposed_secrets(config: Config) -> None:
    """Log ``secret_file_exposed`` for each secret file its group or others may read."""
    for exposed in exposed_secrets(config):
        # The file's name and mode only: never its contents.
        log.warning(
            "secret_file_exposed",
            field=exposed.field,
            path=exposed.name,
            mode=f"{exposed.mode:04o}",
            hint="chmod 600 it; kvguard run --strict-secrets refuses such files",
        )


async def serve(
    config: Config,
    *,
    config_path: str | None,
    dry_run: bool = False,
    engine_command: list[str] | None = None,
    strict_secrets: bool = False,
    event_loop: str = "asyncio",
) -> int:
    """The guard (:func:`~kvguard.runtime.assembly.build_guard`), until SIGTERM/SIGINT.

    SIGHUP reloads ``config_path`` (with ``strict_secrets``, refusing a new config
    whose secret files others may read); SIGTERM/SIGINT stop everything, the engine
    last. ``event_loop``: the loop this runs on, as the ``started`` event reports it.
    """
    notifier = SystemdNotifier.from_environment()
    guard = build_guard(config, dry_run=dry_run, engine_command=engine_command)
    await guard.start()
    daemon = guard.daemon
    watchdog = notifier.watchdog_interval_s
    slowest_tick = config.poll.interval_s + config.poll.timeout_s
    if watchdog is not None and slowest_tick >= watchdog:
        # Pings ride on ticks; a tick slower than the ping interval gets kvguard killed.
        log.warning(
            "watchdog_interval_too_short",
            ping_interval_s=watchdog,
            slowest_tick_s=slowest_tick,
            hint="raise WatchdogSec= or lower poll.interval_s + poll.timeout_s",
        )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, guard.stop)
    if config_path:
        loop.add_signal_handler(
            signal.SIGHUP, lambda: _reload(daemon, config_path, notifier, strict_secrets)
        )
    started = False

    def after_tick(_: Snapshot) -> None:
        nonlocal started
        if not started:
            started = True
            notifier.ready(f"watching {daemon.config.engine.url}")
            log.info(
                "started",
                listen=config.server.listen,
                proxy=config.proxy.listen if config.proxy.enabled else None,
                engine=config.engine.url,
                dry_run=daemon.dry_run,
                event_loop=event_loop,
            )
        notifier.watchdog()

    try:
        await guard.run(after_tick=after_tick)
    finally:
        notifier.stopping()
        await guard.close()
        log.info("stopped")
    return 0


def _reload(
    daemon: Daemon, path: str, notifier: SystemdNotifier, strict_secrets: bool = False
) -> None:
    notifier.reloading()
    try:
        new = load_config(path, strict_secrets=strict_secrets)
        daemon.reload(new)
        configure_logging(new.log.level, new.log.format)  # [log] applies on reload too
        warn_exposed_secrets(new)
    except KvguardError as exc:
        problems = exc.lines() if isinstance(exc, ConfigError) else [str(exc)]
        log.error(  # noqa: TRY400 - the problems are the message; a traceback would bury them
            "config_reload_rejected", source=path, problems=problems, kept=daemon.config.source
        )
    finally:
        notifier.ready()
