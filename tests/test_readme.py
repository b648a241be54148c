"""README.md's quick start, run as written: the simulated engine and the config it shows agree."""

from __future__ import annotations

import asyncio
import re
import shlex
import sys
from pathlib import Path

from structlog.testing import capture_logs

from kvguard.config.settings import load_config
from kvguard.runtime.budget_keeping import RECONCILIATION_TOLERANCE
from kvguard.runtime.daemon import Daemon

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
KVGUARD = str(Path(sys.executable).parent / "kvguard")


def quick_start() -> tuple[list[str], str]:
    """The quick start's ``kvguard sim-engine`` arguments and the config its ``printf`` writes."""
    engine = re.search(r"^\.venv/bin/kvguard (sim-engine --port 8000 .*?) &$", README, re.M)
    config = re.search(r"^printf '(.*)' > /tmp/kvguard\.toml$", README, re.M)
    assert engine is not None, "README: no `kvguard sim-engine --port 8000 … &` line"
    assert config is not None, "README: no `printf '…' > /tmp/kvguard.toml` line"
    return shlex.split(engine[1]), config[1].replace("\\n", "\n")


async def test_the_quick_start_config_agrees_with_its_simulated_engine(tmp_path):
    """The budget of the README's config matches the sim it starts: no reconciliation warning.

    The engine runs as the README starts it (on a free port); the config is the one its
    ``printf`` writes, pointed at that port. ``[gpu] memory`` must be the ``--gpu``
    preset's figure, or kvguard warns ``budget_reconciliation_mismatch`` out of the box.
    """
    argv, text = quick_start()
    argv[argv.index("--port") + 1] = "0"
    assert 'url = "http://127.0.0.1:8000"' in text
    proc = await asyncio.create_subprocess_exec(KVGUARD, *argv, stderr=asyncio.subprocess.PIPE)
    try:
        assert proc.stderr is not None
        line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()
        url = re.search(r" on (http://127\.0\.0\.1:\d+);", line)
        assert url is not None, line
        path = tmp_path / "kvguard.toml"
        path.write_text(text.replace("http://127.0.0.1:8000", url[1]))
        daemon = Daemon(load_config(str(path), env={}))
        try:
            with capture_logs() as logs:
                await daemon.tick()
        finally:
            await daemon.close()
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)
    rec = daemon.state.reconciliation
    assert rec is not None
    assert rec.difference_ratio is not None
    assert abs(rec.difference_ratio) <= RECONCILIATION_TOLERANCE, rec
    assert [e for e in logs if e["event"] == "budget_reconciliation_mismatch"] == []
