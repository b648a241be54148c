"""Write kvguard's Grafana dashboards: kvguard-overview.json and kvguard-fleet.json.

The JSON files are what Grafana loads; this script and its modules (panels.py,
overview.py, fleet.py) are where they are edited. After a change run

    .venv/bin/python dashboards/grafana/generate.py

and commit the JSON with it. ``--check`` writes nothing and exits 1 when a JSON file
differs from what the modules produce (tests/test_dashboards.py runs it), so an edit
made in the Grafana UI must be carried back into the modules.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fleet import fleet
from overview import overview

HERE = Path(__file__).resolve().parent


def rendered() -> dict[Path, str]:
    """Each dashboard file and the text it should hold."""
    models = {"kvguard-overview.json": overview(), "kvguard-fleet.json": fleet()}
    return {
        HERE / name: json.dumps(model, indent=2, ensure_ascii=False) + "\n"
        for name, model in models.items()
    }


def main(argv: list[str] | None = None) -> int:
    """Write the dashboards, or with ``--check`` report those out of date (exit 1)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; write nothing")
    args = parser.parse_args(argv)
    stale = []
    for path, text in rendered().items():
        if path.exists() and path.read_text(encoding="utf-8") == text:
            continue
        stale.append(path.name)
        if not args.check:
            path.write_text(text, encoding="utf-8")
    if args.check and stale:
        sys.stderr.write(f"out of date (run dashboards/grafana/generate.py): {stale}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
