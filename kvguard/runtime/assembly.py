"""The one place kvguard is put together: :func:`build_guard` builds a :class:`Guard`.

Everything that runs kvguard — ``kvguard run``, ``kvguard demo``, the in-process
helpers (:mod:`kvguard.runtime.inprocess`) and the benchmarks — builds it here, from
one validated :class:`~kvguard.config.settings.Config`: the probes, the decision step,
the admission proxy, the webhooks, the supervised engine, the asynchronous actuators
and the daemon that ticks them, then (in :meth:`Guard.start`) the HTTP servers.

The parts are built in dependency order and handed to the daemon in its
constructor. Two links close a cycle and are made here, explicitly, and nowhere
else: the mitigations in force start asynchronous actions through the actuators
(``Mitigations.connect``), and the actuators read the engine through the daemon's
current probes (a reload may replace them), through a closure over the daemon.

The actuators' restart mode comes from ``[reconfigure]``: ``supervisor`` (kvguard
owns the engine: ``kvguard run -- <command>``), ``systemd`` (a drop-in and
``systemctl restart``) or ``command`` (your argv); the fp8 switch drains through the
proxy when it is in the path, else through the engine's pause endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, fields
from typing import Any

import structlog
from aiohttp import web

from kvguard.actuators.dispatch import Actuators
from kvguard.actuators.drain import EnginePauseDrain, ProxyDrain
from kvguard.actuators.engine_admin import EngineAdmin
from kvguard.actuators.engine_flags import supports_fp8
from kvguard.actuators.mitigations import Mitigations
from kvguard.actuators.proxy import AdmissionProxy, ProxySettings
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
from kvguard.actuators.webhook import Webhooks, WebhookSettings
from kvguard.api.app import build_app
from kvguard.config.settings import Config, ProxyConfig
from kvguard.core.budget import BudgetReport
from kvguard.core.snapshot import EngineStats, Snapshot
from kvguard.errors import KvguardError
from kvguard.runtime.budget_keeping import budget_for
from kvguard.runtime.daemon import Daemon
from kvguard.runtime.decision import Brain
from kvguard.runtime.probing import Probes

log = structlog.get_logger("kvguard.server")


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


@dataclass(frozen=True)
class ClientLimits:
    """How long kvguard's HTTP servers wait on their clients ([proxy]'s, for both servers).

    ``header_timeout_s``: a new connection must send a whole request head within it
    (a silent one, or one trickling its head, is closed). ``keepalive_s``: an idle
    connection is closed after it; the head of a later request on it must come
    within it too. ``shutdown_grace_s``: when kvguard stops, requests still being
    served get this long to end, then are cancelled.
    """

    header_timeout_s: float = 5.0
    keepalive_s: float = 75.0
    shutdown_grace_s: float = 5.0

    @classmethod
    def of(cls, proxy: ProxyConfig) -> ClientLimits:
        """The limits ``[proxy]`` sets."""
        return cls(proxy.client_header_timeout_s, proxy.client_keepalive_s, proxy.shutdown_grace_s)


class HeadDeadline:
    """Closes connections that have not sent a whole request head ``timeout_s`` after opening.

    aiohttp bounds a kept-alive connection's wait for its next request
    (``keepalive_timeout``), but not a new connection's wait for its first (or, in
    its newest releases, only by that same timeout): one that sends nothing, or
    trickles its head, stays open as long as it likes. A middleware marks each
    connection that got a request to its handler; a sweep every ``timeout_s / 5``
    closes those that are older than ``timeout_s`` and never did. Only aiohttp's
    public surface is used (``Server.connections``, ``request.protocol``,
    ``force_close``).
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._first_seen: dict[object, float] = {}  # connection -> when a sweep first saw it
        self._served: set[object] = set()  # connections that got a request
        self._task: asyncio.Task[None] | None = None

    @web.middleware
    async def mark(
        self,
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        """The request's head is complete: its connection is no longer watched."""
        self._served.add(request.protocol)
        return await handler(request)

    def watch(self, runner: web.AppRunner) -> None:
        """Start sweeping ``runner``'s connections (stopped by :meth:`stop`)."""
        self._task = asyncio.ensure_future(self._sweep(runner))

    async def stop(self, _: web.Application | None = None) -> None:
        """Stop sweeping (the app's cleanup)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _sweep(self, runner: web.AppRunner) -> None:
        while True:
            await asyncio.sleep(self.timeout_s / 5)
            try:
                self._close_late(runner)
            except Exception as exc:  # noqa: BLE001 - the sweep must outlive a surprise
                log.warning("head_deadline_sweep_failed", error=repr(exc)[:200])

    def _close_late(self, runner: web.AppRunner) -> None:
        server = runner.server
        if server is not None:
            now = asyncio.get_running_loop().time()
            connections = server.connections
            alive = set(connections)
            # Forget connections that are gone: these maps must not grow without end.
            self._served &= alive
            self._first_seen = {c: t for c, t in self._first_seen.items() if c in alive}
            for connection in connections:
                if connection in self._served:
                    continue
                if now - self._first_seen.setdefault(connection, now) >= self.timeout_s:
                    self._first_seen.pop(connection)
                    connection.force_close()


async def listen(
    app: web.Application,
    address: str,
    *,
    cancel: bool = False,
    limits: ClientLimits = ClientLimits(),
) -> web.AppRunner:
    """Serve ``app`` on ``HOST:PORT`` (port 0: one the OS picks); a busy port is one clear error.

    ``cancel``: a client that leaves cancels its handler (the proxy's setting: that
    closes the upstream connection, which makes the engine abort the request).
    ``limits``: how long clients may take (:class:`ClientLimits`); without them a
    silent connection stayed open for good and a request with an unfinished body held
    kvguard's exit for aiohttp's 60 s.
    """
    heads = HeadDeadline(limits.header_timeout_s)
    app.middlewares.insert(0, heads.mark)  # first: every request marks its connection
    app.on_cleanup.append(heads.stop)
    runner = web.AppRunner(
        app,
        access_log=None,
        handler_cancellation=cancel,
        keepalive_timeout=limits.keepalive_s,
        shutdown_timeout=limits.shutdown_grace_s,
    )
    await runner.setup()
    host, _, port = address.rpartition(":")
    try:
        await web.TCPSite(runner, host.strip("[]"), int(port)).start()
    except OSError as exc:
        await runner.cleanup()
        raise KvguardError(f"cannot listen on {address}: {exc.strerror}") from exc
    heads.watch(runner)
    return runner


def bound_url(runner: web.AppRunner) -> str:
    """``http://HOST:PORT`` of the first address ``runner`` listens on (after port 0)."""
    host, port = runner.addresses[0][:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def make_webhooks(config: Config) -> Webhooks:
    """The webhook sender for ``[webhook]``."""
    hook = config.webhook
    return Webhooks(
        WebhookSettings(
            urls=hook.urls,
            timeout_s=hook.timeout_s,
            retries=hook.retries,
            secret=hook.secret.reveal() if hook.secret is not None else None,
        )
    )


def make_proxy(
    config: Config,
    mitigations: Mitigations,
    budget: BudgetReport | None,
    *,
    engine_kind: Callable[[], str | None] | None = None,
) -> AdmissionProxy:
    """The admission proxy for ``config``, acting on ``mitigations``.

    ``budget`` gives the KV bytes per token (what ``/status`` reports the proxy's
    accounted requests in); without one the proxy counts tokens only.
    ``engine_kind`` says the engine's kind (configured or detected, None while
    unknown): the proxy forwards that engine's routes (every engine's while unknown).
    """
    proxy = config.proxy
    # [proxy] declares each of the proxy's settings under the same name (and more: enabled).
    declared = {spec.name for spec in fields(proxy)}
    values: dict[str, Any] = {
        spec.name: getattr(proxy, spec.name)
        for spec in fields(ProxySettings)
        if spec.name in declared
    }
    values["upstream"] = proxy.upstream or config.engine.url
    settings = ProxySettings(**values)
    per_token = budget.budget.kv_bytes_per_token_per_gpu if budget is not None else None
    return AdmissionProxy(settings, mitigations, bytes_per_token=per_token, engine_kind=engine_kind)


EventSink = Callable[[str, dict[str, Any]], None]


def build_actuators(
    config: Config,
    *,
    engine_stats: Callable[[], Awaitable[EngineStats | None]],
    on_fp8: Callable[[bool], None],
    on_event: EventSink,
    mitigations: Mitigations,
    proxy: AdmissionProxy | None = None,
    supervisor: Supervisor | None = None,
    state: StateFile | None = None,
) -> Actuators:
    """The asynchronous actuators: the engine's admin client and the fp8 switch.

    Both are built when the engine's kind is known (the first tick that reads it).
    ``state`` is where a pause of the engine is recorded so that a kvguard killed while
    it holds the engine paused resumes it when it starts again (default: the state
    file the environment chooses, :func:`kvguard.actuators.state.state_dir`).
    """
    mode = restart_mode(config, supervised=supervisor is not None)
    engine = config.engine
    token = engine.token.reveal() if engine.token is not None else None
    record = EnginePauseRecord(state or StateFile.from_environment(), engine.url)

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
            ProxyDrain(proxy, mitigations)
            if proxy is not None
            else EnginePauseDrain(admin, engine_stats)
        )
        reconfigure = config.reconfigure
        return admin, Reconfigurer(
            restarter,
            drain,
            engine_stats=engine_stats,
            times=ReconfigureTimes(reconfigure.drain_timeout_s, reconfigure.start_timeout_s),
            on_event=on_event,
            on_restarting=lambda seconds: mitigations.engine_restarting("reconfigure", seconds),
        )

    actuators = Actuators(
        build,
        on_fp8=on_fp8,
        shed_by_pause=engine.shed_by_pause,
        proxy_in_path=proxy is not None,
        on_event=on_event,
        pause_record=record,
    )
    actuators.mode = mode
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


@dataclass
class Guard:
    """kvguard for one engine, built by :func:`build_guard`: start it, run it, close it.

    ``api``: kvguard's HTTP API app (None when not served); ``runners``: the HTTP
    servers :meth:`start` opened, API first; ``proxy_url``: where the admission
    proxy listens once started (None without a proxy).
    """

    daemon: Daemon
    api: web.Application | None = None
    runners: list[web.AppRunner] = field(default_factory=list)
    proxy_url: str | None = None
    stop_event: asyncio.Event = field(default_factory=asyncio.Event)
    loop_task: asyncio.Future[None] | None = None

    @property
    def config(self) -> Config:
        """The daemon's config (it changes on reload)."""
        return self.daemon.config

    @property
    def proxy(self) -> AdmissionProxy | None:
        """The admission proxy, when ``[proxy] enabled``."""
        return self.daemon.proxy

    async def start(self, *, proxy_listen: str | None = None) -> Guard:
        """Open the HTTP API and the proxy, start the webhooks and the engine.

        ``proxy_listen``: where the proxy listens instead of ``[proxy] listen``
        (``127.0.0.1:0``: a port the OS picks, read back in :attr:`proxy_url`).
        A failure (a busy port, an engine that cannot start) closes what was started
        and raises :class:`KvguardError`: nothing is left running.
        """
        daemon = self.daemon
        try:
            # [proxy]'s client limits hold for kvguard's API too: one place to tune them.
            limits = ClientLimits.of(daemon.config.proxy)
            if self.api is not None:
                api = await listen(self.api, daemon.config.server.listen, limits=limits)
                self.runners.append(api)
            if daemon.proxy is not None:
                address = proxy_listen or daemon.config.proxy.listen
                runner = await listen(daemon.proxy.app(), address, cancel=True, limits=limits)
                self.runners.append(runner)
                self.proxy_url = bound_url(runner)
            if daemon.webhooks is not None:
                await daemon.webhooks.start()
            if daemon.supervisor is not None:
                await daemon.supervisor.start()
        except KvguardError:
            await self.close()
            raise
        return self

    async def run(
        self, *, after_tick: Callable[[Snapshot], Awaitable[None] | None] | None = None
    ) -> None:
        """Tick until :meth:`stop` (the daemon's loop)."""
        await self.daemon.run(self.stop_event, after_tick=after_tick)

    def run_in_background(
        self, after_tick: Callable[[Snapshot], Awaitable[None] | None] | None = None
    ) -> asyncio.Future[None]:
        """Start the tick loop as a task (:meth:`close` stops and awaits it)."""
        self.loop_task = asyncio.ensure_future(self.run(after_tick=after_tick))
        return self.loop_task

    def stop(self) -> None:
        """Let the current tick finish, then end the loop."""
        self.stop_event.set()

    async def close(self) -> None:
        """Stop in the order that loses nothing: actions (the engine resumed), servers, engine.

        The loop stops first; the engine is stopped last and whatever failed before:
        it must never outlive kvguard. An exception that ended the background loop
        (:meth:`run_in_background`) is raised once everything is closed.
        """
        daemon = self.daemon
        self.stop_event.set()
        loop_error: BaseException | None = None
        try:
            try:
                if self.loop_task is not None:
                    (result,) = await asyncio.gather(self.loop_task, return_exceptions=True)
                    loop_error = result if isinstance(result, Exception) else None
                if daemon.actuators is not None:
                    await daemon.actuators.close()
            finally:
                for runner in reversed(self.runners):
                    await runner.cleanup()
                self.runners.clear()
                await daemon.close()
                if daemon.webhooks is not None:
                    await daemon.webhooks.close()
        finally:
            if daemon.supervisor is not None:
                await daemon.supervisor.stop()
        if loop_error is not None:  # after the cleanup: a loop that died is not hidden
            raise loop_error


def build_guard(
    config: Config,
    *,
    dry_run: bool = False,
    probes: Probes | None = None,
    engine_command: list[str] | None = None,
    serve_api: bool = True,
    engine_actions: bool = True,
    state: StateFile | None = None,
) -> Guard:
    """Build everything ``config`` asks for; nothing is started (see :meth:`Guard.start`).

    ``dry_run``: decide and report, enforce nothing (or ``[policy] dry_run``).
    ``probes``: instead of the probes ``config`` describes (tests, the in-process
    helpers). ``engine_command``: supervisor mode, kvguard starts this engine.
    ``serve_api``: build kvguard's HTTP API on ``[server] listen``. ``engine_actions``:
    build the asynchronous actuators (engine admin, fp8 switch); without them those
    actions are decided and reported but not applied. ``state``: where a pause of the
    engine is recorded (default: the environment's state file).
    Raises :class:`KvguardError` for a config that cannot run (a restart mode without
    its command, an unusable model config).
    """
    supervised = bool(engine_command)
    restart_mode(config, supervised=supervised)  # a bad mode fails before anything is built
    dry_run = dry_run or config.dry_run
    probes = probes or Probes.from_config(config, engine_command)
    webhooks = make_webhooks(config) if config.webhook.urls else None

    def notify(event: str, fields: dict[str, Any]) -> None:
        if webhooks is not None:
            webhooks.notify(event, **fields)

    mitigations = Mitigations()
    brain = Brain(config, dry_run=dry_run, mitigations=mitigations, on_event=notify)
    budget = budget_for(config, config.gpu.memory_bytes)
    proxy = None
    if config.proxy.enabled:
        # The daemon's current engine probe (built below; a reload may replace it)
        # knows the kind: as configured, or as detected on the first tick.
        proxy = make_proxy(
            config, mitigations, budget, engine_kind=lambda: daemon.probes.engine.kind
        )
    supervisor = None
    if engine_command:

        async def engine_healthy() -> bool:
            # The daemon's current engine probe, as the fp8 switch's health wait reads it.
            try:
                return (await daemon.probes.engine.sample()).up
            except KvguardError:
                return False

        supervisor = Supervisor(
            engine_command,
            stop_timeout_s=config.reconfigure.stop_timeout_s,
            backoff_s=config.reconfigure.crash_backoff_s,
            on_event=notify,
            # A crash restart: the proxy's 502s carry Retry-After until the engine is up.
            on_restarting=lambda seconds: mitigations.engine_restarting("crash", seconds),
            healthy=engine_healthy,
        )
    actuators = None
    if engine_actions:

        async def engine_stats() -> EngineStats | None:
            # The daemon's current engine probe: a reload may have replaced it.
            return await daemon.probes.engine.sample()

        actuators = build_actuators(
            config,
            engine_stats=engine_stats,
            on_fp8=lambda on: brain.fp8_result(fp8_on=on),
            on_event=notify,
            mitigations=mitigations,
            proxy=proxy,
            supervisor=supervisor,
            state=state,
        )
        mitigations.connect(launch=actuators.launch)
    daemon = Daemon(
        config,
        probes=probes,
        dry_run=dry_run,
        brain=brain,
        budget=budget,
        proxy=proxy,
        actuators=actuators,
        supervisor=supervisor,
        webhooks=webhooks,
    )
    return Guard(daemon, api=build_app(daemon) if serve_api else None)
