"""Make docs/images/dashboards/*.png: every dashboard row drawn from a short simulated run.

Everything runs on 127.0.0.1 and stops by itself (about 2 minutes in all):

- two ``kvguard run`` sidecars in supervisor mode, each starting its own simulated vLLM
  (``kvguard sim-engine``, an 8B model's budget on 20 GiB: an ~9,000-token KV pool) and
  with ``[model]`` set, so the budget panels have figures:
  ``engine-a`` with its admission proxy live, taking the demo's burst (``kvguard
  demo``: the ``mixed`` pattern at 256 connections) through the proxy;
  ``engine-b`` in ``--dry-run`` without a proxy, taking a ``long_context`` burst
  straight at the engine (as tests/test_alerting.py does), so its engine preempts;
- a real Prometheus (the Debian package, as the tests use) scraping both every 2 s;
- ``kvguard loadgen`` for the traffic: 10 s calm, then 80 s of bursts.

70 s into the bursts, render.py draws both dashboards from that Prometheus over the
run so far (the Overview for ``engine-a``, the Fleet for both; "now" is under load)
into docs/images/dashboards/, and ``pictures.json`` beside them records the kvguard
commit, the settings and what each picture showed. Run it from the repository root
after a dashboard change (tests/test_dashboard_pictures.py fails until the pictures
show every row and panel), and update the commit quoted in docs/monitoring.md:

    .venv/bin/python dashboards/grafana/pictures.py

Needs ``prometheus`` (scripts/install-system.sh) and matplotlib (the ``test`` extra).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib
from render import (
    DASHBOARDS,
    DPI,
    Prometheus,
    QueryError,
    RowPicture,
    TimeRange,
    dashboard_name,
    render_dashboard,
    save,
)

import kvguard
from kvguard.runtime.inprocess import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
OUT = ROOT / "docs" / "images" / "dashboards"
RECORD = "pictures.json"
COMMAND = "python dashboards/grafana/pictures.py"
KVGUARD = [sys.executable, "-m", "kvguard.cli.main"]
JOB = "kvguard"
# Faster than the docs' 5 s, as a short run needs, but not 1 s: a scrape must answer
# within its interval, and on a busy 2-core machine kvguard's /metrics, serving 256
# proxied connections on the same event loop, sometimes took longer (gaps in the lines).
SCRAPE_S = 2.0
STEP_S = 1.0
IDLE_S = 10.0  # calm before the bursts: the pictures start at rest
BURST_S = 80.0
# The range ends this long into the bursts, while they still run: the panels that show
# "now" (stats, tables, bar gauges) then show pressure rather than the calm after.
RANGE_END_S = 70.0
READY_S = 60.0  # for the engines to start and Prometheus to scrape both sidecars
STOP_S = 10.0
# The engine and the budget kvguard computes for it: the same model, memory and flags,
# so the budget's KV capacity and the engine's reported one reconcile.
MODEL = "qwen3-8b"
GPU_MEMORY = "20GiB"
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 64
MAX_NUM_BATCHED_TOKENS = 2048
SEED = 1


@dataclasses.dataclass(frozen=True)
class Sidecar:
    """One kvguard and its engine, and the burst it takes."""

    instance: str  # the instance label Prometheus gives it (a name, not a port)
    story: str
    proxy: bool
    dry_run: bool
    pattern: str
    concurrency: int
    token_time_s: float | None = None  # the simulator's per-token step time; None: its default


SIDECARS = (
    Sidecar(
        "engine-a",
        "admission proxy live; the demo's burst (mixed, 256 connections) through the proxy",
        proxy=True,
        dry_run=False,
        pattern="mixed",
        concurrency=256,
    ),
    Sidecar(
        "engine-b",
        "dry-run, no proxy; a long_context burst (16 connections) straight at the engine",
        proxy=False,
        dry_run=True,
        pattern="long_context",
        concurrency=16,
        token_time_s=0.002,  # a ramp over ~20 s, as in tests/test_alerting.py
    ),
)


class Processes:
    """Started processes, each logging to a file; stopped (TERM, then KILL) at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.files = contextlib.ExitStack()

    def start(self, name: str, argv: Sequence[str]) -> subprocess.Popen[bytes]:
        """Start ``argv``, its output in ``<logs>/<name>.log``."""
        log = self.files.enter_context((self.logs / f"{name}.log").open("wb"))
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)  # noqa: S603
        self.procs[name] = proc
        return proc

    def stop(self) -> None:
        """TERM every process (kvguard stops the engine it started), KILL the slow ones."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + STOP_S
        for proc in self.procs.values():
            finished(proc, deadline)
        self.files.close()

    def tail(self, name: str, lines: int = 15) -> str:
        """The end of one process's log, for an error message."""
        path = self.logs / f"{name}.log"
        text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def sidecar_config(sidecar: Sidecar, engine: int, api: int, proxy: int) -> str:
    """The sidecar's kvguard.toml."""
    text = f"""
[engine]
url = "http://127.0.0.1:{engine}"
kind = "vllm"

[model]
config = "{MODEL}"
max_model_len = {MAX_MODEL_LEN}
max_num_seqs = {MAX_NUM_SEQS}
max_num_batched_tokens = {MAX_NUM_BATCHED_TOKENS}

[gpu]
memory = "{GPU_MEMORY}"  # no NVIDIA driver here: the budget's GPU size

[poll]
interval_s = 0.5
min_interval_s = 0.1
timeout_s = 1.0

[server]
listen = "127.0.0.1:{api}"

[log]
level = "warning"
format = "json"
"""
    if sidecar.proxy:
        text += f'\n[proxy]\nenabled = true\nlisten = "127.0.0.1:{proxy}"\n'
    return text


def engine_command(sidecar: Sidecar, port: int) -> list[str]:
    """The simulated engine kvguard starts and supervises."""
    command = [
        *KVGUARD, "sim-engine", "--port", str(port), "--model", MODEL,
        "--gpu-memory", GPU_MEMORY, "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-seqs", str(MAX_NUM_SEQS),
        "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS), "--seed", str(SEED),
    ]  # fmt: skip
    if sidecar.token_time_s is not None:
        command += ["--token-time", str(sidecar.token_time_s)]
    return command


def prometheus_config(targets: dict[str, int]) -> str:
    """Scrape each sidecar's /metrics, its instance label a readable name."""
    lines = [
        f"global:\n  scrape_interval: {SCRAPE_S:g}s\n  evaluation_interval: {SCRAPE_S:g}s",
        f"scrape_configs:\n  - job_name: {JOB}\n    static_configs:",
    ]
    for instance, port in targets.items():
        lines.append(
            f"      - targets: ['127.0.0.1:{port}']\n        labels: {{instance: {instance}}}"
        )
    return "\n".join(lines) + "\n"


def wait_ready(prom: Prometheus, procs: Processes, deadline: float) -> None:
    """Until Prometheus sees every sidecar's engine up, or fail saying what is missing."""
    want = {sidecar.instance for sidecar in SIDECARS}
    seen: set[str] = set()
    while time.monotonic() < deadline:
        for name, proc in procs.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}):\n{procs.tail(name)}")
        with contextlib.suppress(QueryError):
            up = prom.query(f'kvguard_engine_up{{job="{JOB}"}} == 1')
            seen = {series["metric"].get("instance", "") for series in up}
            if want <= seen:
                return
        time.sleep(0.5)
    raise RuntimeError(f"not ready in {READY_S:g} s: engines up {sorted(seen)} of {sorted(want)}")


def load(procs: Processes, sidecar: Sidecar, url: str, report: Path) -> subprocess.Popen[bytes]:
    """``kvguard loadgen`` with the sidecar's burst."""
    return procs.start(
        f"loadgen-{sidecar.instance}",
        [
            *KVGUARD, "loadgen", "--url", url, "--pattern", sidecar.pattern,
            "--duration", f"{BURST_S:g}", "--concurrency", str(sidecar.concurrency),
            "--seed", str(SEED), "--max-requests", "5000",
            "--max-context", str(MAX_MODEL_LEN), "--json", str(report),
        ],
    )  # fmt: skip


def git_commit() -> tuple[str, bool]:
    """The checkout's commit, and whether the working tree differs from it."""
    git = shutil.which("git") or "git"
    head = subprocess.run(  # noqa: S603 - a fixed git command
        [git, "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    status = subprocess.run(  # noqa: S603
        [git, "status", "--porcelain", "--untracked-files=no"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return head, bool(status.strip())


def prometheus_version(binary: str) -> str:
    """``2.45.3+ds`` from ``prometheus --version``."""
    out = subprocess.run(  # noqa: S603 - the prometheus binary found on PATH
        [binary, "--version"], capture_output=True, text=True, check=False
    )
    words = (out.stdout or out.stderr).split()
    return words[2] if len(words) > 2 and words[1] == "version" else "unknown"


def summary(report: Path) -> dict[str, Any]:
    """The load report's headline counts (empty when the load wrote none)."""
    if not report.exists():
        return {}
    data = json.loads(report.read_text(encoding="utf-8"))
    keys = ("sent", "completed", "shed", "failed", "unfinished", "preemptions", "kv_usage_peak")
    return {key: data.get(key) for key in keys}


def run(out_dir: Path) -> int:
    """The whole run; 0 when the pictures are written and every query answered."""
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        sys.stderr.write("pictures.py: prometheus not installed (scripts/install-system.sh)\n")
        return 1
    commit, dirty = git_commit()
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvguard-pictures-") as tmp:
        procs = Processes(Path(tmp))
        try:
            pictures, rng, traffic, host = simulate(procs, Path(tmp), prometheus, commit)
        finally:
            procs.stop()
    for old in out_dir.glob("*.png"):
        old.unlink()  # a renamed row must not leave its old picture behind
    metadata = {"Source": f"kvguard commit {commit}", "Description": f"made by {COMMAND}"}
    written = save(pictures, out_dir, metadata)
    record = {
        "made_by": COMMAND,
        "what": "matplotlib drawings of each dashboard row from the dashboard JSON's own"
        " queries, answered by a real Prometheus that scraped kvguard during a short"
        " simulated run; not Grafana screenshots",
        "kvguard_commit": commit,
        "uncommitted_changes": dirty,
        "kvguard_version": kvguard.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "prometheus_version": prometheus_version(prometheus),
        "matplotlib_version": matplotlib.__version__,
        "settings": settings(rng),
        "traffic": traffic,
        "host": host,
        "pictures": [
            {
                "file": picture.filename,
                "dashboard": picture.dashboard,
                "row": picture.row,
                "panels": [p.title for p in picture.panels],
                "no_data": [p.title for p in picture.panels if not p.has_data],
                "query_errors": [e for p in picture.panels for e in p.errors],
            }
            for picture in pictures
        ],
    }
    (out_dir / RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    for path in written:
        sys.stdout.write(f"{_shown(path)}  {path.stat().st_size // 1024} KiB\n")
    took = time.monotonic() - began
    sys.stdout.write(f"{_shown(out_dir / RECORD)}; {took:.0f} s in all\n")
    errors = [e for p in pictures for panel in p.panels for e in panel.errors]
    if errors:
        sys.stderr.write(f"pictures.py: queries failed: {errors}\n")
        return 1
    return 0


def simulate(
    procs: Processes, work: Path, prometheus: str, commit: str
) -> tuple[list[RowPicture], TimeRange, dict[str, Any], dict[str, Any]]:
    """Start the sidecars and Prometheus, run the traffic, draw.

    The pictures, their range, the load's outcome, and how busy the machine was (a
    busy one shows in the kvguard health row: event-loop lag, slow scrapes).
    """
    urls, targets = {}, {}
    for sidecar in SIDECARS:
        engine, api, proxy = free_port(), free_port(), free_port()
        config = work / f"{sidecar.instance}.toml"
        config.write_text(sidecar_config(sidecar, engine, api, proxy), encoding="utf-8")
        flags = ["--dry-run"] if sidecar.dry_run else []
        argv = [*KVGUARD, "run", "--config", str(config), *flags, "--"]
        procs.start(sidecar.instance, [*argv, *engine_command(sidecar, engine)])
        urls[sidecar.instance] = f"http://127.0.0.1:{proxy if sidecar.proxy else engine}"
        targets[sidecar.instance] = api
    prom_port = free_port()
    (work / "prometheus.yml").write_text(prometheus_config(targets), encoding="utf-8")
    procs.start(
        "prometheus",
        [
            prometheus,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            "--log.level=warn",
        ],
    )
    prom = Prometheus(f"http://127.0.0.1:{prom_port}")
    wait_ready(prom, procs, time.monotonic() + READY_S)
    host = {"cpus": os.cpu_count(), "load_1m_at_start": round(os.getloadavg()[0], 2)}
    start = time.time()
    sys.stderr.write(f"pictures.py: ready; {IDLE_S:g} s calm, then {BURST_S:g} s of bursts\n")
    time.sleep(IDLE_S)
    loads = {
        s.instance: load(procs, s, urls[s.instance], work / f"{s.instance}.json") for s in SIDECARS
    }
    deadline = time.monotonic() + BURST_S + 60
    time.sleep(RANGE_END_S)
    rng = TimeRange(start, time.time(), STEP_S)
    host["load_1m_at_range_end"] = round(os.getloadavg()[0], 2)
    sys.stderr.write(f"pictures.py: drawing the {rng.end - rng.start:.0f} s so far\n")
    pictures = draw(prom, rng, commit)  # the rest of the bursts runs meanwhile
    for name, proc in loads.items():
        if not finished(proc, deadline):
            sys.stderr.write(f"pictures.py: the load on {name} overran; cut off\n")
    traffic = {s.instance: summary(work / f"{s.instance}.json") for s in SIDECARS}
    return pictures, rng, traffic, host


def finished(proc: subprocess.Popen[bytes], deadline: float) -> bool:
    """Wait for ``proc`` until ``deadline`` (monotonic); killed and False when it overran."""
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False
    return True


def settings(rng: TimeRange) -> dict[str, Any]:
    """What the run was: for pictures.json."""
    return {
        "scrape_interval_s": SCRAPE_S,
        "step_s": STEP_S,
        "rate_interval_s": max(STEP_S + SCRAPE_S, 4 * SCRAPE_S),
        "range_s": round(rng.end - rng.start),
        "calm_before_s": IDLE_S,
        "burst_s": BURST_S,
        "range_ends_into_burst_s": RANGE_END_S,
        "dpi": DPI,
        "engine": {
            "simulator": "kvguard sim-engine (vllm flavor), supervised by kvguard run",
            "model": MODEL,
            "gpu_memory": GPU_MEMORY,
            "max_model_len": MAX_MODEL_LEN,
            "max_num_seqs": MAX_NUM_SEQS,
            "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
            "seed": SEED,
        },
        "sidecars": [dataclasses.asdict(sidecar) for sidecar in SIDECARS],
        "variables": {
            "overview": {"job": JOB, "instance": SIDECARS[0].instance},
            "fleet": {"job": JOB, "instance": "all"},
        },
    }


def _shown(path: Path) -> str:
    """``path`` from the repository root when it is inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def draw(prom: Prometheus, rng: TimeRange, commit: str) -> list[RowPicture]:
    """Both dashboards over ``rng``: the Overview of engine-a, the Fleet of both."""
    pictures = []
    for path in DASHBOARDS:
        name = dashboard_name(path)
        variables = {"job": JOB}
        if name == "overview":
            variables["instance"] = SIDECARS[0].instance
        note = (
            f"Drawn by matplotlib from {path.name}'s queries (not Grafana), over a"
            f" {rng.end - rng.start:.0f} s simulated run scraped by Prometheus every"
            f" {SCRAPE_S:g} s; x: minutes:seconds into the run; kvguard {commit[:12]}"
        )
        dashboard = json.loads(path.read_text(encoding="utf-8"))
        pictures += render_dashboard(
            dashboard, name, prom, rng, scrape_interval_s=SCRAPE_S, variables=variables, note=note
        )
    return pictures


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments and make the pictures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=OUT, help="directory (default docs/images/dashboards)"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    return run(args.out.resolve())


if __name__ == "__main__":
    sys.exit(main())
