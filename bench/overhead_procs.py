"""Processes of the overhead benchmark: start, wait for, meter and stop them.

Every process listens on 127.0.0.1, logs to a file in the run's temporary directory
(a pipe nobody reads would fill and stall it), and is stopped by the benchmark:
SIGTERM (SIGQUIT for nginx), then SIGKILL after ``STOP_TIMEOUT_S``.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from kvguard.runtime.inprocess import free_port

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
KVGUARD = str(Path(sys.executable).parent / "kvguard")
# Debian puts nginx in /usr/sbin, which is not on an ordinary user's PATH.
NGINX = shutil.which("nginx", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin"]))
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
MiB = 1024 * 1024


class BenchProcessError(RuntimeError):
    """A process of the benchmark did not start; the message quotes its log."""


@dataclass
class Proc:
    """A started process, its log file and (once known) its URL."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    url: str = ""
    stop_signal: int = signal.SIGTERM

    def tail(self, chars: int = 2000) -> str:
        """The end of its log, for error messages."""
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-chars:]
        return ""

    def stop(self) -> int | None:
        """Stop it (its signal, then SIGKILL); its exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(self.stop_signal)
            try:
                self.popen.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(STOP_TIMEOUT_S)
        return self.popen.returncode


def spawn(name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> Proc:
    """Start ``argv`` in the repository root, stdout and stderr to ``log``.

    ``env``: variables set on top of this process's environment.
    """
    with log.open("wb") as out:
        popen = subprocess.Popen(  # noqa: S603 - our own programs, argv without a shell
            argv,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env} if env else None,
        )
    return Proc(name, popen, log)


def wait_for_log(proc: Proc, pattern: str, timeout_s: float = START_TIMEOUT_S) -> re.Match[str]:
    """The first match of ``pattern`` in the process's log; fails if it exits or times out."""
    regex = re.compile(pattern)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = regex.search(proc.tail(1 << 20))
        if match:
            return match
        if proc.popen.poll() is not None:
            raise BenchProcessError(f"{proc.name} exited {proc.popen.returncode}: {proc.tail()}")
        time.sleep(0.05)
    raise BenchProcessError(f"{proc.name}: no {pattern!r} in {timeout_s:g} s: {proc.tail()}")


def http_get(url: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    """GET a URL on 127.0.0.1: status and body; (-1, b"") when nothing answers."""
    match = re.fullmatch(r"http://127\.0\.0\.1:(\d+)(/.*)", url)
    if match is None:
        raise ValueError(f"only http://127.0.0.1 URLs, not {url!r}")
    conn = http.client.HTTPConnection("127.0.0.1", int(match.group(1)), timeout=timeout_s)
    try:
        conn.request("GET", match.group(2))
        response = conn.getresponse()
        return response.status, response.read()
    except OSError:
        return -1, b""
    finally:
        conn.close()


def wait_http(proc: Proc, url: str, timeout_s: float = START_TIMEOUT_S) -> None:
    """Return once ``url`` answers 200; fails if the process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if http_get(url)[0] == 200:
            return
        if proc.popen.poll() is not None:
            raise BenchProcessError(f"{proc.name} exited {proc.popen.returncode}: {proc.tail()}")
        time.sleep(0.05)
    raise BenchProcessError(f"{proc.name}: {url} did not answer 200 in {timeout_s:g} s")


def start_stub(tmp: Path, name: str = "stub", metrics: Sequence[Path] = ()) -> Proc:
    """The fast stub upstream (bench/overhead_stub.py) on a free port.

    ``metrics``: the exposition pages its ``/metrics`` answers in turn (default: an idle vLLM's).
    """
    argv = [PYTHON, "-m", "bench.overhead_stub", "--port", "0"]
    if metrics:
        argv += ["--metrics", *map(str, metrics)]
    proc = spawn(name, argv, tmp / f"{name}.log")
    proc.url = wait_for_log(proc, r"listening on (http://127\.0\.0\.1:\d+)").group(1)
    return proc


@dataclass
class KvguardRun:
    """A ``kvguard run`` process: its API and (when enabled) proxy addresses."""

    proc: Proc
    api: str
    proxy: str | None


def spawn_kvguard(
    tmp: Path,
    name: str,
    engine_url: str,
    *,
    interval_s: float,
    proxy: bool,
    env: dict[str, str] | None = None,
    fixed_rate: bool = False,
) -> KvguardRun:
    """Start ``kvguard run --config F`` watching ``engine_url`` (see :func:`wait_kvguard`).

    ``env``: on top of this environment (``KVGUARD_EVENT_LOOP``: the loop it runs on).
    ``fixed_rate``: ``min_interval_s`` = ``interval_s``, so it polls at that rate even
    where the engine's page says its pool is full (else it polls faster, as in life).
    """
    api = f"127.0.0.1:{free_port()}"
    lines = [
        f'[engine]\nurl = "{engine_url}"\n',
        f'[server]\nlisten = "{api}"\n',
        # min_interval_s (fast polling near exhaustion) may not exceed interval_s.
        f"[poll]\ninterval_s = {interval_s}\n"
        f"min_interval_s = {interval_s if fixed_rate else min(interval_s, 0.1)}\n",
        '[log]\nformat = "json"\n',
    ]
    proxy_address = None
    if proxy:
        proxy_address = f"127.0.0.1:{free_port()}"
        lines.append(f'[proxy]\nenabled = true\nlisten = "{proxy_address}"\n')
    config = tmp / f"{name}.toml"
    config.write_text("".join(lines))
    proc = spawn(name, [KVGUARD, "run", "--config", str(config)], tmp / f"{name}.log", env)
    proc.url = f"http://{api}"
    return KvguardRun(proc, proc.url, f"http://{proxy_address}" if proxy_address else None)


def wait_kvguard(run: KvguardRun) -> KvguardRun:
    """Return once the daemon has ticked (its ``started`` event) and /healthz answers."""
    wait_for_log(run.proc, r'"event": ?"started"')
    wait_http(run.proc, f"{run.api}/healthz")
    return run


def start_floor(tmp: Path, upstream_url: str) -> Proc:
    """The bare aiohttp pass-through (bench/overhead_floor.py) in front of ``upstream_url``."""
    argv = [PYTHON, "-m", "bench.overhead_floor", "--upstream", upstream_url, "--port", "0"]
    proc = spawn("floor", argv, tmp / "floor.log")
    proc.url = wait_for_log(proc, r"listening on (http://127\.0\.0\.1:\d+)").group(1)
    return proc


def start_kvguard(
    tmp: Path,
    name: str,
    engine_url: str,
    *,
    interval_s: float,
    proxy: bool,
    env: dict[str, str] | None = None,
) -> KvguardRun:
    """``kvguard run --config F`` watching ``engine_url``; returns once its loop ticks."""
    return wait_kvguard(
        spawn_kvguard(tmp, name, engine_url, interval_s=interval_s, proxy=proxy, env=env)
    )


def event_loop_of(run: KvguardRun) -> str | None:
    """The event loop a started ``kvguard run`` reports (its ``started`` event)."""
    for line in run.proc.tail(1 << 20).splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "started":
            loop = event.get("event_loop")
            return str(loop) if loop is not None else None
    return None


NGINX_MAIN = """\
worker_processes 1;
pid {dir}/nginx.pid;
{user}
events {{
    worker_connections 1024;
}}
http {{
    access_log off;
    client_body_temp_path {dir}/client_body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;

{site}
}}
"""
# A plain reverse proxy: the reference for what a proxy costs.
NGINX_PLAIN_SITE = """\
upstream stub {
    server UPSTREAM;
    keepalive 64;
}
server {
    listen LISTEN;
    location / {
        proxy_pass http://stub;
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_buffering off;
    }
}
"""
INTEGRATIONS = ROOT / "docs" / "integrations.md"
# What the documented site listens on and proxies to; replaced by the benchmark's.
DOCS_ADDRESSES = {"listen 8080;": "listen LISTEN;", "127.0.0.1:8000": "UPSTREAM"}
DOCS_KVGUARD = "127.0.0.1:9108"


def admission_site() -> str:
    """The nginx ``auth_request`` site docs/integrations.md shows (tests/test_nginx.py runs it).

    Read from the docs, so the benchmark measures what users copy. The engine's
    ``keepalive`` is raised to the plain site's 64: both nginx paths keep the same
    connections to the stub, and differ only by the check.
    """
    text = INTEGRATIONS.read_text()
    start = text.index("```nginx\n") + len("```nginx\n")
    site = text[start : text.index("```", start)]
    for shown, placeholder in DOCS_ADDRESSES.items():
        site = site.replace(shown, placeholder)
    site = site.replace("keepalive 16;", "keepalive 64;", 1)
    return site.replace(DOCS_KVGUARD, "KVGUARD")


def nginx_version() -> str | None:
    """``nginx -v`` (e.g. ``nginx/1.22.1``), or None without nginx."""
    if NGINX is None:
        return None
    done = subprocess.run(  # noqa: S603 - a fixed argv
        [NGINX, "-v"], capture_output=True, text=True, check=False, timeout=10
    )
    match = re.search(r"nginx/\S+", done.stderr + done.stdout)
    return match.group(0) if match else None


def start_nginx(
    tmp: Path, upstream_url: str, *, kvguard_api: str | None = None, name: str = "nginx"
) -> Proc:
    """Start nginx as a reverse proxy to ``upstream_url``: one worker, all paths in ``tmp``.

    With ``kvguard_api``, the documented ``auth_request`` site asking that kvguard's
    ``/admission`` before each completion (:func:`admission_site`); else a plain proxy.
    """
    if NGINX is None:
        raise BenchProcessError("nginx not installed (scripts/install-system.sh installs it)")
    prefix = tmp / name
    prefix.mkdir(exist_ok=True)
    listen = f"127.0.0.1:{free_port()}"
    # As root, nginx would switch its worker to `nobody`, which cannot read a private
    # temporary directory; run it as ourselves (the directive is ignored when not root).
    user = "user root;" if os.geteuid() == 0 else ""
    site = NGINX_PLAIN_SITE if kvguard_api is None else admission_site()
    site = site.replace("UPSTREAM", upstream_url.removeprefix("http://")).replace("LISTEN", listen)
    if kvguard_api is not None:
        site = site.replace("KVGUARD", kvguard_api.removeprefix("http://"))
    (prefix / "nginx.conf").write_text(NGINX_MAIN.format(dir=prefix, user=user, site=site))
    argv = [NGINX, "-p", str(prefix), "-c", str(prefix / "nginx.conf")]
    argv += ["-e", str(prefix / "error.log"), "-g", "daemon off;"]
    proc = spawn(name, argv, tmp / f"{name}.log")
    proc.stop_signal = signal.SIGQUIT  # graceful: let the worker finish
    proc.url = f"http://{listen}"
    wait_http(proc, f"{proc.url}/health")
    return proc


@dataclass
class Meter:
    """CPU seconds and resident memory of a process and its children over a window."""

    proc: Proc
    cpu_start_s: float = 0.0
    started_at: float = 0.0
    rss_samples: list[int] = field(default_factory=list)

    def _family(self) -> list[psutil.Process]:
        root = psutil.Process(self.proc.popen.pid)
        return [root, *root.children(recursive=True)]

    def cpu_s(self) -> float:
        """User + system CPU seconds so far (the process and its children)."""
        total = 0.0
        for p in self._family():
            with contextlib.suppress(psutil.Error):
                times = p.cpu_times()
                total += times.user + times.system
        return total

    def rss(self) -> int:
        """Resident bytes now (the process and its children)."""
        total = 0
        for p in self._family():
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
        return total

    def start(self) -> None:
        """Open the window."""
        self.cpu_start_s = self.cpu_s()
        self.started_at = time.monotonic()
        self.rss_samples = [self.rss()]

    def sample(self) -> None:
        """Record the resident memory now."""
        self.rss_samples.append(self.rss())

    def stop(self) -> dict[str, float]:
        """Close the window: CPU seconds per wall second, and RSS (last and peak) in MiB."""
        wall = time.monotonic() - self.started_at
        cpu = self.cpu_s() - self.cpu_start_s
        self.sample()
        return {
            "wall_s": round(wall, 3),
            "cpu_s": round(cpu, 4),
            "cpu_s_per_wall_s": round(cpu / wall, 5) if wall > 0 else 0.0,
            "rss_mib": round(self.rss_samples[-1] / MiB, 2),
            "rss_peak_mib": round(max(self.rss_samples) / MiB, 2),
        }
