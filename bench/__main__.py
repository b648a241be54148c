"""``python -m bench``: run the benchmarks and regenerate docs/benchmarks.md.

    python -m bench efficacy [--patterns …] [--traces FILE …] [--speed F …] [--modes …]
                             [--policies …] [--seeds N] [--pattern-s S] [--out-dir DIR]
    python -m bench all [--quick] [--results DIR] [--docs FILE]
    python -m bench docs [--results DIR] [--docs FILE]

``efficacy`` runs protection efficacy on the simulator (bench/efficacy.py) as its flags
say and rewrites the page from that one run (``docs/benchmarks.md`` for the default
``--out-dir``, ``DIR/benchmarks.md`` otherwise, so a partial run never overwrites the
published page). ``all`` runs the whole efficacy matrix, the same on a real vLLM for CPU where
``scripts/real-engines.sh install vllm`` put it (bench/efficacy_vllm.py), then overhead
(bench/overhead.py), and writes the page; ``--quick`` is a smoke test of a few minutes
that writes to ``bench/results/quick/`` and its own page there. ``docs`` only rewrites the
page from the results already written. The commentary on the figures is kept by hand in
``bench/analysis.md`` and included in the published page.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench import efficacy, efficacy_vllm, overhead, report
from kvguard.api.logs import configure_logging

RESULTS = Path("bench/results")
DOCS = Path("docs/benchmarks.md")
ANALYSIS = Path(__file__).resolve().parent / "analysis.md"
QUICK = efficacy.Plan(
    workloads=(
        efficacy.pattern_workload("bursty_short"),
        efficacy.pattern_workload("long_context"),
    ),
    seeds=1,
    static_sweep=(8, 32),
    setup=efficacy.Setup(pattern_s=5.0, warmup_s=2.0, grace_s=3.0),
)


def _real_vllm(results: Path) -> None:
    """The efficacy comparison on a real vLLM for CPU, when scripts/real-engines.sh installed it."""
    from tests.real.vllm_engine import INSTALL_HINT, READY  # noqa: PLC0415 - optional part

    if not READY.is_file():
        print(f"skipping the real-vLLM efficacy runs: vLLM (CPU) is not installed: {INSTALL_HINT}")  # noqa: T201
        return
    efficacy_vllm.run(out_dir=results)


def _page(results: Path, docs: Path | None = None) -> Path:
    published = results.resolve() == RESULTS.resolve()
    docs = docs or (DOCS if published else results / "benchmarks.md")
    notes = ANALYSIS.read_text() if ANALYSIS.exists() and published else ""
    return report.write(results, docs, notes)


def _efficacy(argv: list[str]) -> None:
    args = efficacy.parser().parse_args(argv)
    plan = efficacy.plan_from(args)
    minutes = efficacy.estimate_s(plan) / 60
    print(  # noqa: T201 - what the run is about to cost
        f"bench efficacy: {len(plan.traffic_runs())} traffic runs, about {minutes:.0f} min",
        flush=True,
    )
    efficacy.run(plan, args.out_dir)
    print(f"wrote {args.out_dir / 'efficacy.json'} and {_page(args.out_dir)}")  # noqa: T201


def main() -> None:
    """Parse the command line and run what it asks for."""
    configure_logging("error", "json")  # thousands of shed lines would bury the progress
    if sys.argv[1:2] == ["efficacy"]:
        _efficacy(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("efficacy", "all", "docs"))
    parser.add_argument("--quick", action="store_true", help="a smoke test of a few minutes")
    parser.add_argument("--results", type=Path, default=None, help="where results are written")
    parser.add_argument("--docs", type=Path, default=None, help="the page to write")
    args = parser.parse_args()
    results = args.results or (RESULTS / "quick" if args.quick else RESULTS)
    if args.command == "all":
        plan = QUICK if args.quick else efficacy.plan_from(efficacy.parser().parse_args([]))
        efficacy.run(plan, results)
        if not args.quick:
            _real_vllm(results)
        overhead.run(quick=args.quick, out=results / "overhead.json")
    print(f"wrote {_page(results, args.docs)}")  # noqa: T201 - where the page went


if __name__ == "__main__":
    main()
