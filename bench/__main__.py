"""``python -m bench``: run the benchmarks and regenerate docs/benchmarks.md.

    python -m bench all [--quick] [--results DIR] [--docs FILE]
    python -m bench docs [--results DIR] [--docs FILE]

``all`` runs protection efficacy on the simulator (bench/efficacy.py) and, where
``scripts/real-engines.sh install vllm`` put it, on a real vLLM for CPU
(bench/efficacy_vllm.py), then overhead (bench/overhead.py), and writes the page.
``--quick`` is a smoke test of a few minutes (no real vLLM): it writes to
``bench/results/quick/`` and its own page there, so the published figures stay as they
are. ``docs`` only rewrites the page from the results already written. The commentary
on the figures (why a target is missed) is kept by hand in ``bench/analysis.md`` and
included in the page.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import efficacy, efficacy_vllm, overhead, report
from kvguard.api.logs import configure_logging

RESULTS = Path("bench/results")
DOCS = Path("docs/benchmarks.md")
ANALYSIS = Path(__file__).resolve().parent / "analysis.md"


def _real_vllm(results: Path) -> None:
    """The efficacy comparison on a real vLLM for CPU, when scripts/real-engines.sh installed it."""
    from tests.real.vllm_engine import INSTALL_HINT, READY  # noqa: PLC0415 - optional part

    if not READY.is_file():
        print(f"skipping the real-vLLM efficacy runs: vLLM (CPU) is not installed: {INSTALL_HINT}")  # noqa: T201
        return
    efficacy_vllm.run(out_dir=results)


def main() -> None:
    """Parse the command line and run what it asks for."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("all", "docs"))
    parser.add_argument("--quick", action="store_true", help="a smoke test of a few minutes")
    parser.add_argument("--results", type=Path, default=None, help="where results are written")
    parser.add_argument("--docs", type=Path, default=None, help="the page to write")
    args = parser.parse_args()
    results = args.results or (RESULTS / "quick" if args.quick else RESULTS)
    docs = args.docs or (results / "benchmarks.md" if args.quick else DOCS)
    configure_logging("error", "json")  # thousands of shed lines would bury the progress
    if args.command == "all":
        efficacy.run(quick=args.quick, out_dir=results)
        if not args.quick:
            _real_vllm(results)
        overhead.run(quick=args.quick, out=results / "overhead.json")
    notes = ANALYSIS.read_text() if ANALYSIS.exists() and not args.quick else ""
    page = report.write(results, docs, notes)
    print(f"wrote {page}")  # noqa: T201 - where the page went


if __name__ == "__main__":
    main()
