"""The layering holds (docs/architecture.md): import-linter's contracts in pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(*args: str) -> subprocess.CompletedProcess[str]:
    """Run lint-imports in the repository root (no cache: the tree under test is read)."""
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_every_layering_contract_is_kept():
    """lint-imports passes: cli > runtime > api > actuators|probes > config > core, and the rest."""
    result = lint_imports()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 kept, 0 broken" in result.stdout


def test_a_broken_contract_fails(tmp_path):
    """The tool does see imports: forbidding one the commands really make fails the run."""
    config = tmp_path / "contracts.toml"
    config.write_text(
        '[tool.importlinter]\nroot_package = "kvguard"\n\n'
        "[[tool.importlinter.contracts]]\n"
        'name = "cli without runtime (false on purpose)"\n'
        'type = "forbidden"\n'
        'source_modules = ["kvguard.cli"]\n'
        'forbidden_modules = ["kvguard.runtime"]\n'
    )
    result = lint_imports(str(config))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "kvguard.cli" in result.stdout
    assert "BROKEN" in result.stdout
