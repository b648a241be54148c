"""The ``kvguard`` command.

Exit codes: 0 success; 2 bad input (one line on stderr says which input and why);
3 ``budget --check`` found a budget that does not fit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from kvguard import __version__
from kvguard.api.budget_report import budget_to_dict, render_budget
from kvguard.cli import check_config, probe, run, status
from kvguard.cli import loadgen as loadgen_cli
from kvguard.cli import sim_engine as engine_cli
from kvguard.cli.demo import add_demo_parser
from kvguard.config.model_files import bundled_models, load_model_files
from kvguard.core.budget import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    budget_inputs_from,
    plan_budget,
)
from kvguard.core.gpus import GPU_PRESETS, gpu_preset
from kvguard.core.units import KV_DTYPES, format_bytes, parse_bytes
from kvguard.errors import ConfigError, InvalidInputError, KvguardError

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_DOES_NOT_FIT = 3
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for `yes | head`

# Input fields whose CLI flag is not simply the field name with dashes.
_FLAG_OF_FIELD = {"gpu_memory_bytes": "--gpu-memory"}


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line, without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The full ``kvguard`` argument parser, one subparser per subcommand."""
    parser = _Parser(
        prog="kvguard",
        description="Keep LLM inference servers from running out of GPU memory.",
    )
    parser.add_argument("--version", action="version", version=f"kvguard {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    add_demo_parser(commands)
    _add_budget(commands)
    for command in (run, probe, status, check_config):
        command.register(commands)
    engine_cli.register(commands)
    loadgen_cli.register(commands)
    return parser


def _add_budget(commands: argparse._SubParsersAction[_Parser]) -> None:
    presets = ", ".join(p.name for p in GPU_PRESETS)
    p = commands.add_parser(
        "budget",
        help="VRAM budget of serving a model: weights, KV cache, activations, headroom",
        description=(
            "Budget the GPU memory of serving MODEL: weights, the worst-case KV cache for the"
            " given context length and concurrency, activations and overhead, and what fits."
        ),
        epilog=f"Bundled models (usable as MODEL): {', '.join(bundled_models())}.",
    )
    p.add_argument(
        "model",
        metavar="MODEL",
        help="config.json, a directory holding it, or a bundled model name",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    p.add_argument(
        "--max-model-len", type=int, help="context length per sequence (default: the model's)"
    )
    p.add_argument(
        "--concurrency", type=int, default=1, help="full-length sequences held at once (default 1)"
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        metavar="DTYPE",
        help=f"KV cache data type: {', '.join(KV_DTYPES)} (default auto = model dtype)",
    )
    mem = p.add_mutually_exclusive_group()
    mem.add_argument(
        "--gpu-memory", metavar="SIZE", help="memory per GPU, e.g. 80GiB, 80GB, 81559MiB"
    )
    mem.add_argument("--gpu", metavar="NAME", help=f"GPU preset: {presets}")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=DEFAULT_GPU_MEMORY_UTILIZATION,
        metavar="F",
        help="fraction of GPU memory the engine may use"
        f" (default {DEFAULT_GPU_MEMORY_UTILIZATION})",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help="tokens per forward pass, sizes the activation peak"
        f" (default {DEFAULT_MAX_NUM_BATCHED_TOKENS})",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=DEFAULT_MAX_NUM_SEQS,
        help=f"sequences per step, sizes the sampler logits (default {DEFAULT_MAX_NUM_SEQS})",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help="KV block size in tokens (default 16)",
    )
    p.add_argument(
        "--weights-bytes",
        metavar="SIZE",
        help="weight size of the whole model (overrides index and estimate)",
    )
    p.add_argument(
        "--kv-cache-memory-bytes", metavar="SIZE", help="fixed KV pool per GPU, as vLLM's flag"
    )
    p.add_argument(
        "--activation-bytes",
        metavar="SIZE",
        help="activation peak per GPU (overrides the estimate)",
    )
    p.add_argument(
        "--overhead-bytes",
        metavar="SIZE",
        help="framework overhead per GPU (overrides the default)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument(
        "--check",
        action="store_true",
        help=f"exit {EXIT_DOES_NOT_FIT} when the budget does not fit",
    )
    p.set_defaults(handler=_run_budget)


def _size(text: str | None, flag: str) -> int | None:
    return None if text is None else parse_bytes(text, flag)


def _run_budget(args: argparse.Namespace) -> int:
    memory: int | None
    if args.gpu is not None:
        preset = gpu_preset(args.gpu)
        memory, gpu = preset.memory_bytes, preset.name
    else:
        memory = _size(args.gpu_memory, "--gpu-memory")
        gpu = "custom" if memory is not None else "default (80 GiB)"
    inputs = budget_inputs_from(
        args,
        gpu_memory_bytes=memory,
        weights_bytes=_size(args.weights_bytes, "--weights-bytes"),
        kv_cache_memory_bytes=_size(args.kv_cache_memory_bytes, "--kv-cache-memory-bytes"),
        activation_bytes=_size(args.activation_bytes, "--activation-bytes"),
        overhead_bytes=_size(args.overhead_bytes, "--overhead-bytes"),
    )
    files = load_model_files(args.model)
    report = plan_budget(
        files.config, inputs, index_total_size=files.index_total_size, source=files.source
    )
    if args.json:
        print(json.dumps(budget_to_dict(report, files.source, gpu), indent=2))
    else:
        print(render_budget(report, files.source, gpu))
    if args.check and not report.budget.fits:
        short = format_bytes(-report.budget.headroom_bytes_per_gpu)
        print(f"kvguard budget: does not fit (short by {short} per GPU)", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return EXIT_OK


def _flag(field: str) -> str:
    if field.startswith("-"):
        return field
    return _FLAG_OF_FIELD.get(field, "--" + field.replace("_", "-"))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvguard`` command line; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        code = int(args.handler(args))
        sys.stdout.flush()  # inside the try: a reader that went away is seen here
    except BrokenPipeError:
        # `kvguard probe --json | head`: the reader has what it wanted. Stop quietly,
        # with stdout pointed at /dev/null so the flush at exit cannot fail again.
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except InvalidInputError as exc:
        print(
            f"kvguard {args.command}: error: {_flag(exc.field)}: {exc.allowed}, got {exc.value!r}",
            file=sys.stderr,
        )
    except ConfigError as exc:
        for line in exc.lines():
            print(f"kvguard {args.command}: error: {exc.source}: {line}", file=sys.stderr)
    except KvguardError as exc:
        print(f"kvguard {args.command}: error: {exc}", file=sys.stderr)
    else:
        return code
    return EXIT_BAD_INPUT


def _silence_stdout() -> None:
    """Point stdout at /dev/null (its reader is gone): nothing more to write, no error."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real file descriptor (an embedding program)
        pass


if __name__ == "__main__":
    sys.exit(main())
