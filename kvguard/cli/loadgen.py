"""``kvguard loadgen``: drive an OpenAI-compatible endpoint with a traffic pattern or a trace."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

from kvguard.errors import InvalidInputError
from kvguard.sim.loadgen import LoadConfig, run_load
from kvguard.sim.loadgen_client import OUTPUT_LENGTHS
from kvguard.sim.loadgen_report import LoadReport
from kvguard.sim.trace import TRACE_HEADERS
from kvguard.sim.traffic import DEFAULT_MAX_CONTEXT, PATTERNS, PRIORITIES, PriorityShares

_DEFAULTS = LoadConfig(url="http://127.0.0.1:8000")
_SHARES_EXAMPLE = "critical=0.1,standard=0.6,sheddable=0.3"
EXIT_INTERRUPTED = 130  # the shell convention for a run ended by SIGINT

# LoadConfig reports its own field names; the operator typed these flags.
_FLAG_OF_FIELD = {
    "url": "--url",
    "pattern": "--pattern",
    "duration_s": "--duration",
    "max_requests": "--max-requests",
    "concurrency": "--concurrency",
    "scale": "--scale",
    "max_context": "--max-context",
    "endpoint": "--endpoint",
    "slo_ttft_s": "--slo-ttft",
    "slo_e2e_s": "--slo-e2e",
    "slo_tpot_s": "--slo-tpot",
    "client_max_tokens": "--client-max-tokens",
    "output_length": "--output-length",
    "retries": "--retries",
    "retry_cap_s": "--retry-cap",
    "trace": "--trace",
    "trace_format": "--trace-format",
    "speed": "--speed",
    "start_s": "--start-s",
    "request_timeout_s": "--request-timeout",
    "priority_header": "--priority-header",
    "model": "--model",
    "priority_shares": "--priority-shares",
    **dict.fromkeys(PRIORITIES, "--priority-shares"),
}


def register(commands: argparse._SubParsersAction[Any]) -> None:
    """Add the ``loadgen`` subcommand."""
    patterns = "; ".join(f"{name}: {text}" for name, text in PATTERNS.items())
    p = commands.add_parser(
        "loadgen",
        help="drive an OpenAI-compatible endpoint with a traffic pattern or a trace (bounded)",
        description=(
            "Send a seeded traffic pattern, or replay a recorded trace, to an OpenAI-compatible"
            " server until --duration or --max-requests, then report SLO attainment per"
            " priority class, latency percentiles, goodput, shed, refused and failed requests,"
            " tokens and the engine's preemptions."
        ),
        epilog=(
            f"Patterns: {patterns}. Traces: the Azure LLM inference trace (header"
            f" {','.join(TRACE_HEADERS['azure'])}; Patel et al., Splitwise, ISCA 2024;"
            f" CC-BY 4.0) or BurstGPT ({','.join(TRACE_HEADERS['burstgpt'])})."
        ),
    )
    p.add_argument(
        "--url", required=True, help="base URL of the server, e.g. http://127.0.0.1:8000"
    )
    _add_traffic(p)
    _add_client(p)
    _add_slo(p)
    p.add_argument(
        "--json", metavar="OUT", help="write the full report as JSON to OUT ('-' for stdout)"
    )
    p.add_argument("--model", metavar="NAME", help="model name (default: first of GET /v1/models)")
    p.set_defaults(handler=run_loadgen)


def _add_traffic(p: argparse.ArgumentParser) -> None:
    """What is sent: a pattern or a trace, how much, how big, for whom."""
    source = p.add_mutually_exclusive_group()
    # No default here: argparse tells "--pattern steady --trace F" from "--trace F" only
    # when the pattern's default is not a string equal to what was typed.
    source.add_argument(
        "--pattern",
        choices=tuple(PATTERNS),
        help=f"traffic pattern (default {_DEFAULTS.pattern})",
    )
    source.add_argument(
        "--trace",
        metavar="FILE",
        help="replay the trace FILE at its recorded arrival times instead of a pattern",
    )
    p.add_argument(
        "--trace-format",
        choices=tuple(TRACE_HEADERS),
        help="format of --trace (default: told by its header)",
    )
    p.add_argument(
        "--speed",
        type=float,
        default=_DEFAULTS.speed,
        metavar="F",
        help="replay the trace F times faster (F=4: offsets divided by 4; default 1)",
    )
    p.add_argument(
        "--start-s",
        type=float,
        default=_DEFAULTS.start_s,
        metavar="S",
        help="skip the trace's first S recorded seconds and start there (default 0)",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=_DEFAULTS.duration_s,
        metavar="S",
        help=f"stop sending after S seconds (default {_DEFAULTS.duration_s:g})",
    )
    p.add_argument(
        "--max-requests",
        type=int,
        default=_DEFAULTS.max_requests,
        metavar="N",
        help=f"stop sending after N requests (default {_DEFAULTS.max_requests})",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the pattern, the prompts and the trace's priority classes (default 0)",
    )
    p.add_argument(
        "--scale",
        type=float,
        default=_DEFAULTS.scale,
        metavar="F",
        help="multiply every token size by F, e.g. 0.01 for a tiny pool (default 1)",
    )
    p.add_argument(
        "--max-context",
        type=int,
        default=DEFAULT_MAX_CONTEXT,
        metavar="N",
        help="cap prompt + answer of each request, and prompt + max_tokens, at N tokens"
        f" (default {DEFAULT_MAX_CONTEXT})",
    )
    p.add_argument(
        "--priority-shares",
        default=_SHARES_EXAMPLE,
        metavar="SHARES",
        help=f"mix of priority classes, sent in the priority header (default {_SHARES_EXAMPLE})",
    )


def _add_client(p: argparse.ArgumentParser) -> None:
    """How the client sends: endpoint, streaming, max_tokens, retries, limits."""
    p.add_argument(
        "--concurrency",
        type=int,
        default=_DEFAULTS.concurrency,
        metavar="C",
        help=f"the client's connection limit: requests in flight at most"
        f" (default {_DEFAULTS.concurrency})",
    )
    p.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default=_DEFAULTS.endpoint,
        help="/v1/completions or /v1/chat/completions (default completions)",
    )
    p.add_argument(
        "--no-stream",
        action="store_true",
        help="ask for whole answers (no TTFT is measured; good when e2e <= --slo-ttft +"
        " --slo-tpot x (tokens - 1))",
    )
    p.add_argument(
        "--client-max-tokens",
        default=str(_DEFAULTS.client_max_tokens),
        metavar="N|trace",
        help="max_tokens every request asks for, capped at the context left after the prompt;"
        " 'trace' asks for exactly the true length (default"
        f" {_DEFAULTS.client_max_tokens})",
    )
    p.add_argument(
        "--output-length",
        choices=OUTPUT_LENGTHS,
        default=_DEFAULTS.output_length,
        help="how the engine learns each answer's true length: sim-field (the simulator's"
        " kvguard_sim_output_tokens), ignore-eos (max_tokens = true length, ignore_eos, for"
        " vLLM), auto (sim-field on kvguard's simulator, else ignore-eos; default)",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=_DEFAULTS.retries,
        metavar="N",
        help="retry a 429/503 carrying Retry-After up to N times (default 0)",
    )
    p.add_argument(
        "--retry-cap",
        type=float,
        default=_DEFAULTS.retry_cap_s,
        metavar="S",
        help=f"wait at most S seconds before a retry (default {_DEFAULTS.retry_cap_s:g})",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=_DEFAULTS.request_timeout_s,
        metavar="S",
        help=f"give up on one request after S seconds (default {_DEFAULTS.request_timeout_s:g})",
    )
    p.add_argument(
        "--priority-header",
        default=_DEFAULTS.priority_header,
        metavar="NAME",
        help=f"header carrying the priority class (default {_DEFAULTS.priority_header})",
    )


def _add_slo(p: argparse.ArgumentParser) -> None:
    """What a good request meets."""
    p.add_argument(
        "--slo-ttft",
        type=float,
        default=_DEFAULTS.slo_ttft_s,
        metavar="S",
        help=f"time-to-first-token SLO of a good request (default {_DEFAULTS.slo_ttft_s:g} s)",
    )
    p.add_argument(
        "--slo-tpot",
        type=float,
        default=_DEFAULTS.slo_tpot_s,
        metavar="S",
        help=f"mean time per output token SLO of a good request"
        f" (default {_DEFAULTS.slo_tpot_s:g} s)",
    )
    p.add_argument(
        "--slo-e2e",
        type=float,
        default=_DEFAULTS.slo_e2e_s,
        metavar="S",
        help="end-to-end latency a good request must also stay within (default: no bound)",
    )


def parse_client_max_tokens(text: str) -> int | None:
    """``--client-max-tokens``: a whole number of tokens, or ``trace`` (None)."""
    if text.strip() == "trace":
        return None
    try:
        return int(text)
    except ValueError:
        raise InvalidInputError(
            "--client-max-tokens", text, "must be an integer >= 1, or trace"
        ) from None


def parse_priority_shares(text: str) -> PriorityShares:
    """Parse ``critical=0.1,standard=0.6,sheddable=0.3``; a class left out gets 0."""
    allowed = f"must be NAME=SHARE pairs of {', '.join(PRIORITIES)}, like {_SHARES_EXAMPLE}"
    shares: dict[str, float] = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in PRIORITIES or name in shares:
            raise InvalidInputError("--priority-shares", text, allowed)
        try:
            share = float(value)
        except ValueError:
            raise InvalidInputError("--priority-shares", text, allowed) from None
        if not math.isfinite(share) or share < 0:
            raise InvalidInputError("--priority-shares", text, "each share must be a number >= 0")
        shares[name] = share
    if sum(shares.values()) <= 0:
        raise InvalidInputError("--priority-shares", text, "the shares must sum to more than 0")
    return PriorityShares(**{name: shares.get(name, 0.0) for name in PRIORITIES})


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    """The run's :class:`LoadConfig`; a bad flag raises :class:`InvalidInputError` naming it."""
    try:
        return LoadConfig(
            url=args.url,
            pattern=args.pattern if args.pattern is not None else _DEFAULTS.pattern,
            duration_s=args.duration,
            max_requests=args.max_requests,
            concurrency=args.concurrency,
            seed=args.seed,
            priority_shares=parse_priority_shares(args.priority_shares),
            scale=args.scale,
            max_context=args.max_context,
            endpoint=args.endpoint,
            stream=not args.no_stream,
            slo_ttft_s=args.slo_ttft,
            slo_e2e_s=args.slo_e2e,
            request_timeout_s=args.request_timeout,
            priority_header=args.priority_header,
            model=args.model,
            slo_tpot_s=args.slo_tpot,
            client_max_tokens=parse_client_max_tokens(args.client_max_tokens),
            output_length=args.output_length,
            retries=args.retries,
            retry_cap_s=args.retry_cap,
            trace=args.trace,
            trace_format=args.trace_format,
            speed=args.speed,
            start_s=args.start_s,
        )
    except InvalidInputError as exc:
        _reraise_as_flag(exc)


def _reraise_as_flag(exc: InvalidInputError) -> NoReturn:
    """Raise ``exc`` again, naming the operator's flag instead of LoadConfig's field."""
    flagged = _as_flag(exc)
    if flagged is exc:
        raise exc
    raise flagged from exc


def _as_flag(exc: InvalidInputError) -> InvalidInputError:
    """``exc`` naming the operator's flag instead of LoadConfig's field."""
    flag = _FLAG_OF_FIELD.get(exc.field, exc.field)
    if flag == exc.field:
        return exc  # already a flag (a trace file's error keeps its file and line)
    return InvalidInputError(flag, exc.value, exc.allowed)


def _check_output(out: str | None) -> None:
    # Checked before the run, so a typo in a path does not cost a whole run.
    if out is None or out == "-":
        return
    path = Path(out)
    if path.is_dir() or not path.parent.is_dir():
        raise InvalidInputError("--json", out, "must be a file in an existing directory, or -")


def write_json(report: LoadReport, out: str) -> None:
    """Write the report as JSON to the file ``out``, or to stdout for ``-``."""
    text = json.dumps(report.as_dict(), indent=2) + "\n"
    if out == "-":
        sys.stdout.write(text)
        return
    try:
        Path(out).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise InvalidInputError("--json", out, f"must be writable ({exc.strerror})") from exc


def run_loadgen(args: argparse.Namespace) -> int:
    """Run the load and print the report; 0 even when requests failed or were shed."""
    config = config_from_args(args)
    _check_output(args.json)

    async def main() -> tuple[LoadReport, bool]:
        # Ctrl-C ends the run early but still reports what was sent.
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGINT, stop.set)
        except (ValueError, RuntimeError, NotImplementedError):
            # Not the main thread (an embedding program): it keeps its own handling.
            return await run_load(config), False
        try:
            return await run_load(config, stop=stop), stop.is_set()
        finally:
            loop.remove_signal_handler(signal.SIGINT)

    try:
        report, interrupted = asyncio.run(main())
    except InvalidInputError as exc:
        # A malformed trace or a server that lists no model: found before any request.
        _reraise_as_flag(exc)
    if interrupted:
        sys.stderr.write("loadgen: interrupted; the report covers what was sent\n")
    if args.json != "-":
        sys.stdout.write(report.render() + "\n")
    if args.json is not None:
        write_json(report, args.json)
    return EXIT_INTERRUPTED if interrupted else 0
