"""The runtime install: scripts/install-service.sh into a scratch root, the unit verified there.

An operator's install is not the development one (.venv, editable, test and lint tools):
``pip install .`` into /opt/kvguard, the unit whose ExecStart runs it, the example config.
The script installs under ``--root DIR`` here, and ``systemd-analyze verify`` checks the
unit as installed, ExecStart's binary (the one installed under DIR) included. The
Dockerfile is linted (no registry is reachable here to build it).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "install-service.sh"
HADOLINT = Path(sys.executable).parent / "hadolint"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """scripts/install-service.sh --root DIR, once for the module; DIR."""
    root = tmp_path_factory.mktemp("root")
    done = subprocess.run(
        [str(SCRIPT), "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "HOME": str(root)},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return root


@pytest.mark.slow  # a virtual environment and a pip install: the second stage
def test_the_runtime_install_runs_kvguard_without_test_or_lint_tools(installed):
    """/opt/kvguard/bin/kvguard works; pytest, ruff and mypy are not in that environment."""
    venv = installed / "opt" / "kvguard"
    version = subprocess.run(
        [str(venv / "bin" / "kvguard"), "--version"], capture_output=True, text=True, check=True
    )
    assert version.stdout.startswith("kvguard ")
    for tool in ("pytest", "ruff", "mypy", "hadolint"):
        assert not (venv / "bin" / tool).exists(), tool
    config = installed / "etc" / "kvguard" / "kvguard.toml"
    assert config.read_text() == (ROOT / "systemd" / "kvguard.toml").read_text()


@pytest.mark.slow  # a virtual environment and a pip install: the second stage
def test_the_installed_unit_passes_systemd_analyze_verify(installed, tmp_path):
    """The unit as installed, ExecStart's /opt/kvguard/bin/kvguard found under the root."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip(
            "systemd-analyze not installed: scripts/install-system.sh runs apt-get install systemd"
        )
    unit = installed / "etc" / "systemd" / "system" / "kvguard.service"
    text = unit.read_text()
    assert "ExecStart=/opt/kvguard/bin/kvguard run" in text
    # verify looks for ExecStart's binary on this system (its --root wants a whole system
    # image): the unit as installed, its one path moved under the scratch root.
    moved = tmp_path / "kvguard.service"
    moved.write_text(text.replace("/opt/kvguard/", f"{installed}/opt/kvguard/"))
    result = subprocess.run(
        [analyze, "verify", "--man=no", str(moved)], capture_output=True, text=True, check=False
    )
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0, output
    assert output == "", output


def test_the_dockerfile_passes_hadolint():
    """deploy/Dockerfile: a pinned base, pinned pip packages, no cache; hadolint says nothing."""
    if not HADOLINT.exists():
        pytest.skip(f"hadolint is not in this environment ({HADOLINT}): scripts/install.sh")
    result = subprocess.run(
        [str(HADOLINT), "--no-color", str(ROOT / "deploy" / "Dockerfile")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    first_from = next(
        line
        for line in (ROOT / "deploy" / "Dockerfile").read_text().splitlines()
        if line.startswith("ARG PYTHON_IMAGE=")
    )
    assert first_from.count(".") >= 2, first_from  # python:3.11.N: a patch release, pinned
