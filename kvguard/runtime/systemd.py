"""Tell systemd how kvguard is doing: the ``sd_notify`` datagram protocol, no dependency.

Under ``Type=notify`` systemd hands the service an ``AF_UNIX`` datagram socket in
``NOTIFY_SOCKET`` and reads newline-separated ``KEY=value`` assignments from it:
``READY=1`` once kvguard serves, ``WATCHDOG=1`` at least every ``WatchdogSec``,
``RELOADING=1`` / ``STOPPING=1`` around a SIGHUP reload and a shutdown, and a
free-text ``STATUS=`` that ``systemctl status`` shows. The protocol is small and
stable (see ``sd_notify(3)``), so kvguard speaks it itself rather than pulling in a
binding.

Outside systemd (a terminal, a container, a test) ``NOTIFY_SOCKET`` is unset and
every method is a no-op. A notification that cannot be sent is logged once and
otherwise ignored: a guard daemon must never die because its supervisor hiccuped.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping

import structlog

__all__ = ["SystemdNotifier"]


def _monotonic_usec() -> int:
    """CLOCK_MONOTONIC in microseconds: the clock systemd compares ``MONOTONIC_USEC`` with."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def _socket_address(notify_socket: str) -> str | None:
    """The ``sendto`` address for a ``NOTIFY_SOCKET`` value, or None if kvguard cannot use it.

    A leading ``@`` names a Linux abstract socket, whose real name starts with a NUL
    byte. Other forms systemd may use (``vsock:``, relative paths) are not for us.
    """
    if notify_socket.startswith("@") and len(notify_socket) > 1:
        return "\0" + notify_socket[1:]
    if notify_socket.startswith("/"):
        return notify_socket
    return None


def _watchdog_usec(env: Mapping[str, str], pid: int) -> int | None:
    """The watchdog period in µs if systemd armed it for this very process, else None."""
    raw_usec = env.get("WATCHDOG_USEC", "")
    raw_pid = env.get("WATCHDOG_PID", "")
    # The variables are inherited by children (an engine kvguard supervises, say);
    # WATCHDOG_PID says which process systemd actually expects the pings from.
    if raw_pid and (not raw_pid.isdigit() or int(raw_pid) != pid):
        return None
    if not raw_usec.isdigit() or int(raw_usec) == 0:
        return None
    return int(raw_usec)


def _one_line(text: str) -> str:
    """``text`` with line breaks flattened: a newline would start a new assignment."""
    return " ".join(text.splitlines())


class SystemdNotifier:
    """Sends readiness, reload, stop, status and watchdog notifications to systemd.

    Build it with :meth:`from_environment`. ``address`` is the ``sendto`` address
    (a path, or an abstract name starting with NUL) or None when not under systemd;
    ``watchdog_usec`` the period systemd expects pings within, or None when the
    watchdog is off; ``monotonic_usec`` reads CLOCK_MONOTONIC in µs (injectable so
    tests can pin ``MONOTONIC_USEC``).
    """

    def __init__(
        self,
        address: str | None,
        watchdog_usec: int | None = None,
        *,
        monotonic_usec: Callable[[], int] = _monotonic_usec,
    ) -> None:
        self._address = address
        self._watchdog_usec = watchdog_usec if address is not None else None
        self._monotonic_usec = monotonic_usec
        # Logged once per outage: the watchdog pings every few seconds and a dead
        # socket would otherwise flood the journal with the same line.
        self._failure_logged = False

    @classmethod
    def from_environment(cls, env: Mapping[str, str] = os.environ) -> SystemdNotifier:
        """A notifier for what systemd put in ``env``; a no-op one when not under systemd.

        Reads ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID`` and changes
        nothing in the environment. An unusable ``NOTIFY_SOCKET`` (not a path, not
        ``@abstract``) is logged and treated as absent.
        """
        raw_socket = env.get("NOTIFY_SOCKET", "")
        if not raw_socket:
            return cls(None)
        address = _socket_address(raw_socket)
        if address is None:
            structlog.get_logger("kvguard.systemd").warning(
                "sd_notify_unsupported_socket",
                notify_socket=raw_socket,
                reason="only filesystem paths and @abstract names are supported",
            )
            return cls(None)
        return cls(address, _watchdog_usec(env, os.getpid()))

    @property
    def enabled(self) -> bool:
        """True when running under systemd's notify protocol (``NOTIFY_SOCKET`` usable)."""
        return self._address is not None

    @property
    def watchdog_interval_s(self) -> float | None:
        """How often to call :meth:`watchdog`, in seconds: half of ``WatchdogSec``.

        Half, as ``sd_watchdog_enabled(3)`` advises, so one late tick does not get
        kvguard killed. None when systemd expects no pings from this process.
        """
        if self._watchdog_usec is None:
            return None
        return self._watchdog_usec / 2 / 1_000_000

    def ready(self, status: str | None = None) -> None:
        """Tell systemd that start-up (or a reload) finished and kvguard serves."""
        lines = ["READY=1"]
        if status is not None:
            lines.append(f"STATUS={_one_line(status)}")
        self._send(lines)

    def reloading(self) -> None:
        """Tell systemd a configuration reload started; follow with :meth:`ready`.

        ``MONOTONIC_USEC`` lets systemd ≥ 253 (``Type=notify-reload``) match this
        message to the reload it asked for; older versions ignore it.
        """
        self._send(["RELOADING=1", f"MONOTONIC_USEC={self._monotonic_usec()}"])

    def stopping(self) -> None:
        """Tell systemd that kvguard is shutting down on purpose."""
        self._send(["STOPPING=1"])

    def status(self, text: str) -> None:
        """Set the one-line status ``systemctl status kvguard`` shows."""
        self._send([f"STATUS={_one_line(text)}"])

    def watchdog(self) -> None:
        """Ping the watchdog; only when systemd armed it for this process."""
        if self._watchdog_usec is not None:
            self._send(["WATCHDOG=1"])

    def _send(self, lines: list[str]) -> None:
        """Send one datagram of assignments; swallow and log (once) any failure."""
        if self._address is None:
            return
        payload = "\n".join(lines).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                # Called from the event loop: a full receive queue on systemd's side
                # must cost one lost message (EAGAIN), not a stalled tick.
                sock.setblocking(False)
                sock.sendto(payload, self._address)
        except OSError as exc:
            if not self._failure_logged:
                self._failure_logged = True
                structlog.get_logger("kvguard.systemd").warning(
                    "sd_notify_failed",
                    notify_socket=self._printable_address(),
                    message=lines[0],
                    error=str(exc),
                )
            return
        self._failure_logged = False

    def _printable_address(self) -> str:
        """The socket as ``NOTIFY_SOCKET`` spells it (``@`` for abstract), for logs."""
        address = self._address or ""
        return "@" + address[1:] if address.startswith("\0") else address
