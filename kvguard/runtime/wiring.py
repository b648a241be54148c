"""Putting the asynchronous actuators together for one daemon, from its config.

``kvguard run`` calls :func:`attach_actuators` once the proxy (if any) is up: the
engine's admin client and the fp8 switch are built when the engine's kind is known
(the first tick that reads it), with the restart mode of ``[reconfigure]``:
``supervisor`` (kvguard owns the engine: ``kvguard run -- <command>``), ``systemd``
(a drop-in and ``systemctl restart``) or ``command`` (your argv), and the drain
through the proxy when it is in the path, else through the engine's pause endpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvguard.actuators.dispatch import Actuators
from kvguard.actuators.drain import EnginePauseDrain, ProxyDrain
from kvguard.actuators.engine_admin import EngineAdmin
from kvguard.actuators.engine_flags import supports_fp8
from kvguard.actuators.reconfigure import (
    CommandRestarter,
    Drain,
    Reconfigurer,
    ReconfigureTimes,
    Restarter,
    SupervisorRestarter,
    SystemdRestarter,
)
from kvguard.actuators.state import EnginePauseRecord, StateFile
from kvguard.actuators.supervisor import Supervisor
from kvguard.config.settings import Config
from kvguard.core.snapshot import EngineStats
from kvguard.errors import KvguardError

if TYPE_CHECKING:
    from kvguard.runtime.daemon import Daemon


def restart_mode(config: Config, *, supervised: bool) -> str:
    """The effective ``[reconfigure] mode``: ``auto`` is supervisor with a command, else off.

    ``supervised``: kvguard was given the engine's command (``kvguard run -- …``).
    """
    mode = config.reconfigure.mode
    if mode == "auto":
        return "supervisor" if supervised else "off"
    if mode == "supervisor" and not supervised:
        raise KvguardError(
            '[reconfigure] mode = "supervisor" needs the engine command:'
            " kvguard run --config FILE -- <engine command...>"
        )
    return mode


def attach_actuators(
    daemon: Daemon, *, supervisor: Supervisor | None = None, state: StateFile | None = None
) -> Actuators:
    """Build the daemon's actuators and hand the ladder their ``launch``.

    ``state`` is where a pause of the engine is recorded so that a kvguard killed while
    it holds the engine paused resumes it when it starts again (default: the state
    file the environment chooses, :func:`kvguard.actuators.state.state_dir`).
    """
    config = daemon.config
    mode = restart_mode(config, supervised=supervisor is not None)
    engine = config.engine
    token = engine.token.reveal() if engine.token is not None else None
    record = EnginePauseRecord(state or StateFile.from_environment(), engine.url)

    async def engine_stats() -> EngineStats | None:
        return await daemon.probes.engine.sample()

    def build(kind: str) -> tuple[EngineAdmin | None, Reconfigurer | None]:
        admin = EngineAdmin(
            engine.url,
            kind,
            token=token,
            timeout_s=engine.admin_timeout_s,
            retries=engine.admin_attempts,
            on_pause_change=record.mark,
        )
        restarter = _restarter(config, mode, kind, supervisor)
        if restarter is None or not supports_fp8(kind):
            return admin, None
        drain: Drain = (
            ProxyDrain(daemon.proxy, daemon.mitigations)
            if daemon.proxy is not None
            else EnginePauseDrain(admin, engine_stats)
        )
        reconfigure = config.reconfigure
        return admin, Reconfigurer(
            restarter,
            drain,
            engine_stats=engine_stats,
            times=ReconfigureTimes(reconfigure.drain_timeout_s, reconfigure.start_timeout_s),
            on_event=daemon.notify,
        )

    actuators = Actuators(
        build,
        on_fp8=lambda on: daemon.brain.fp8_result(fp8_on=on),
        shed_by_pause=engine.shed_by_pause,
        proxy_in_path=daemon.proxy is not None,
        on_event=daemon.notify,
        pause_record=record,
    )
    actuators.mode = mode
    daemon.actuators = actuators
    daemon.supervisor = supervisor
    daemon.mitigations.launch = actuators.launch
    return actuators


def _restarter(
    config: Config, mode: str, kind: str, supervisor: Supervisor | None
) -> Restarter | None:
    reconfigure = config.reconfigure
    if mode == "supervisor" and supervisor is not None:
        return SupervisorRestarter(supervisor, kind)
    if mode == "systemd" and reconfigure.systemd_unit:
        return SystemdRestarter(
            reconfigure.systemd_unit,
            kind,
            dropin_dir=reconfigure.systemd_dropin_dir,
            systemctl=reconfigure.systemctl,
            timeout_s=reconfigure.command_timeout_s,
        )
    if mode == "command" and reconfigure.command:
        return CommandRestarter(reconfigure.command, kind, timeout_s=reconfigure.command_timeout_s)
    return None
