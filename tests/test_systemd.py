"""kvguard's sd_notify client against a real datagram socket, and its systemd unit."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from kvguard.runtime.systemd import SystemdNotifier

UNIT_FILE = Path(__file__).parent.parent / "systemd" / "kvguard.service"
INSTALLED_EXEC = "/opt/kvguard/bin/kvguard"  # where scripts/install-service.sh puts it


def receive(sock: socket.socket) -> bytes | None:
    """The next datagram waiting on ``sock``, or None when nothing was sent.

    AF_UNIX delivery is synchronous: a datagram sent before this call is already
    queued, so a non-blocking read needs no waiting.
    """
    try:
        return sock.recv(4096)
    except BlockingIOError:
        return None


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A bound AF_UNIX datagram socket standing in for systemd, and its path."""
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.setblocking(False)
        yield sock, str(path)


def test_ready_sends_ready(listener):
    """ready() sends exactly READY=1."""
    sock, path = listener
    SystemdNotifier.from_environment({"NOTIFY_SOCKET": path}).ready()
    assert receive(sock) == b"READY=1"


def test_ready_with_status_sends_both_in_one_datagram(listener):
    """ready(status) sends READY=1 and STATUS= together, so systemd sees them at once."""
    sock, path = listener
    SystemdNotifier.from_environment({"NOTIFY_SOCKET": path}).ready("watching vllm")
    assert receive(sock) == b"READY=1\nSTATUS=watching vllm"


def test_status_is_flattened_to_one_line(listener):
    """A newline in a status would start a new assignment, so it becomes a space."""
    sock, path = listener
    SystemdNotifier.from_environment({"NOTIFY_SOCKET": path}).status("level high\nshedding")
    assert receive(sock) == b"STATUS=level high shedding"


def test_stopping_sends_stopping(listener):
    """stopping() sends exactly STOPPING=1."""
    sock, path = listener
    SystemdNotifier.from_environment({"NOTIFY_SOCKET": path}).stopping()
    assert receive(sock) == b"STOPPING=1"


def test_reloading_sends_monotonic_usec_from_clock_monotonic(listener):
    """reloading() sends RELOADING=1 and a MONOTONIC_USEC read from CLOCK_MONOTONIC now."""
    sock, path = listener
    notifier = SystemdNotifier.from_environment({"NOTIFY_SOCKET": path})
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    notifier.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    datagram = receive(sock)
    assert datagram is not None
    first, second = datagram.decode().split("\n")
    assert first == "RELOADING=1"
    key, value = second.split("=")
    assert key == "MONOTONIC_USEC"
    assert before <= int(value) <= after


def test_reloading_uses_the_injected_clock(listener):
    """With a pinned clock the whole reload datagram is exact."""
    sock, path = listener
    SystemdNotifier(path, monotonic_usec=lambda: 123_456_789).reloading()
    assert receive(sock) == b"RELOADING=1\nMONOTONIC_USEC=123456789"


def test_watchdog_interval_is_half_of_watchdog_usec(listener):
    """WATCHDOG_USEC=10 s (the unit's WatchdogSec) means a ping every 5 s."""
    sock, path = listener
    notifier = SystemdNotifier.from_environment(
        {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "10000000"}
    )
    assert notifier.enabled
    assert notifier.watchdog_interval_s == 5.0
    notifier.watchdog()
    assert receive(sock) == b"WATCHDOG=1"


def test_watchdog_for_our_own_pid_is_enabled(listener):
    """WATCHDOG_PID equal to this process arms the watchdog."""
    sock, path = listener
    notifier = SystemdNotifier.from_environment(
        {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())}
    )
    assert notifier.watchdog_interval_s == 2.0
    notifier.watchdog()
    assert receive(sock) == b"WATCHDOG=1"


def test_watchdog_for_another_pid_is_disabled(listener):
    """WATCHDOG_PID of another process (we inherited it) disarms pings, not other messages."""
    sock, path = listener
    notifier = SystemdNotifier.from_environment(
        {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "10000000", "WATCHDOG_PID": str(os.getpid() + 1)}
    )
    assert notifier.enabled
    assert notifier.watchdog_interval_s is None
    notifier.watchdog()
    assert receive(sock) is None
    notifier.ready()
    assert receive(sock) == b"READY=1"


@pytest.mark.parametrize("usec", ["", "0", "ten", "-5"])
def test_missing_or_bad_watchdog_usec_disables_the_watchdog(listener, usec):
    """No usable WATCHDOG_USEC means no watchdog, and no pings."""
    sock, path = listener
    notifier = SystemdNotifier.from_environment({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": usec})
    assert notifier.watchdog_interval_s is None
    notifier.watchdog()
    assert receive(sock) is None


def test_abstract_socket_name():
    """NOTIFY_SOCKET=@name reaches the abstract socket of that name."""
    name = f"kvguard-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.setblocking(False)
        notifier = SystemdNotifier.from_environment({"NOTIFY_SOCKET": "@" + name})
        assert notifier.enabled
        notifier.ready("up")
        assert receive(sock) == b"READY=1\nSTATUS=up"


def test_without_notify_socket_everything_is_a_silent_no_op():
    """Outside systemd: disabled, no watchdog, and no call raises or logs."""
    notifier = SystemdNotifier.from_environment({"WATCHDOG_USEC": "10000000"})
    assert not notifier.enabled
    assert notifier.watchdog_interval_s is None
    with capture_logs() as logs:
        notifier.ready("up")
        notifier.status("x")
        notifier.reloading()
        notifier.watchdog()
        notifier.stopping()
    assert logs == []


def test_unsupported_notify_socket_is_logged_and_treated_as_absent():
    """A NOTIFY_SOCKET kvguard cannot use (vsock, relative path) disables it, with a log line."""
    with capture_logs() as logs:
        notifier = SystemdNotifier.from_environment({"NOTIFY_SOCKET": "vsock:2:1234"})
    assert not notifier.enabled
    assert [entry["event"] for entry in logs] == ["sd_notify_unsupported_socket"]


def test_missing_socket_does_not_raise_and_logs_once(tmp_path):
    """A socket that is gone costs one sd_notify_failed event, however many sends fail."""
    notifier = SystemdNotifier.from_environment(
        {"NOTIFY_SOCKET": str(tmp_path / "absent"), "WATCHDOG_USEC": "10000000"}
    )
    with capture_logs() as logs:
        notifier.ready()
        notifier.watchdog()
        notifier.watchdog()
        notifier.stopping()
    failures = [entry for entry in logs if entry["event"] == "sd_notify_failed"]
    assert len(failures) == 1
    assert failures[0]["log_level"] == "warning"
    assert failures[0]["notify_socket"] == str(tmp_path / "absent")
    assert failures[0]["message"] == "READY=1"


def test_failure_is_logged_again_after_a_recovery(tmp_path):
    """Once a send succeeds, the next outage is reported again."""
    path = tmp_path / "notify"
    notifier = SystemdNotifier.from_environment({"NOTIFY_SOCKET": str(path)})
    with capture_logs() as logs:
        notifier.status("a")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(str(path))
            notifier.status("b")
        path.unlink()
        notifier.status("c")
        notifier.status("d")
    assert [entry["event"] for entry in logs] == ["sd_notify_failed", "sd_notify_failed"]


def test_environment_is_left_alone(listener, monkeypatch):
    """Unlike sd_notify(unset_environment=1), kvguard unsets nothing: children may need it."""
    _, path = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "10000000")
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "10000000"}
    SystemdNotifier.from_environment(env).ready()
    SystemdNotifier.from_environment().ready()
    assert env == {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "10000000"}
    assert os.environ["NOTIFY_SOCKET"] == path
    assert os.environ["WATCHDOG_USEC"] == "10000000"


# ---------------------------------------------------------------- the unit file


def unit_settings(text: str) -> dict[str, dict[str, list[str]]]:
    """The unit's assignments by section and key (a key may repeat), comments dropped."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key, []).append(value)
    return sections


def test_unit_is_hardened_notify_service_with_watchdog():
    """The unit keeps the settings the guard relies on (docs/configuration.md, systemd; issue 4)."""
    service = unit_settings(UNIT_FILE.read_text())["Service"]
    expected = {
        "Type": "notify",
        "NotifyAccess": "main",
        "ExecStart": f"{INSTALLED_EXEC} run --config /etc/kvguard/kvguard.toml",
        "ExecReload": "/bin/kill -HUP $MAINPID",
        "WatchdogSec": "10s",
        "Restart": "always",
        "DynamicUser": "yes",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "MemoryMax": "256M",
        "OOMScoreAdjust": "-500",
        "IPAddressDeny": "any",
        "IPAddressAllow": "localhost",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
    }
    for key, value in expected.items():
        assert service.get(key) == [value], key
    assert "/dev/nvidiactl rw" in service["DeviceAllow"]
    assert "PrivateDevices" not in service  # it would hide /dev/nvidia*


def test_unit_passes_systemd_analyze_verify(tmp_path):
    """`systemd-analyze verify` accepts the unit with no warning at all.

    verify exits 0 even on unknown keys or unparsable values (it only warns), so the
    test also requires empty output. It checks that ExecStart's binary exists, so the
    copy points at this venv's kvguard instead of /opt/kvguard (tests/test_install.py
    verifies the unit as scripts/install-service.sh installs it).
    """
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip(
            "systemd-analyze not installed: the install script runs apt-get install -y systemd"
        )
    kvguard = Path(sys.executable).parent / "kvguard"
    if not kvguard.exists():
        pytest.skip(f"no kvguard script at {kvguard} to stand in for {INSTALLED_EXEC}")

    # A trivial unit first: if verify cannot run at all here, say why instead of
    # blaming our unit.
    probe = tmp_path / "kvguard-verify-probe.service"
    probe.write_text("[Service]\nType=oneshot\nExecStart=/bin/true\n")
    probe_run = subprocess.run(
        [analyze, "verify", "--man=no", str(probe)], capture_output=True, text=True, check=False
    )
    if probe_run.returncode != 0:
        output = (probe_run.stdout + probe_run.stderr).strip()
        pytest.skip(
            f"systemd-analyze verify cannot run here (exit {probe_run.returncode}): {output}"
        )

    unit = tmp_path / "kvguard.service"
    unit.write_text(UNIT_FILE.read_text().replace(INSTALLED_EXEC, str(kvguard)))
    result = subprocess.run(
        [analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert (result.stdout + result.stderr).strip() == ""
