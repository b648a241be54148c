"""The pure core imports no I/O, clock or event loop (DESIGN.md section 3)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvguard.core

BANNED = {"asyncio", "aiohttp", "pynvml", "psutil", "time", "socket", "subprocess", "os", "pathlib"}


def imported_roots(path: Path) -> set[str]:
    """Top-level module names a source file imports."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_model_package_imports_nothing_that_does_io():
    """No module under kvguard/core/ imports a banned module."""
    files = sorted(Path(kvguard.core.__file__).parent.rglob("*.py"))
    assert files, "kvguard/core/ has no modules"
    offenders = {
        str(f.name): imported_roots(f) & BANNED for f in files if imported_roots(f) & BANNED
    }
    assert offenders == {}


def test_checker_sees_banned_imports(tmp_path):
    """The check itself catches `import time` and `from asyncio import x`."""
    sample = tmp_path / "sample.py"
    sample.write_text("import time\nfrom asyncio import sleep\nfrom . import sibling\n")
    assert imported_roots(sample) & BANNED == {"time", "asyncio"}
