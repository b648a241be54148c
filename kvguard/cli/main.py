"""The ``kvguard`` command.

Exit codes: 0 success; 1 what a command reports as failed (``check-config`` and ``run``:
an invalid config; ``probe``, ``status``: nothing could be read); 2 bad input (one line on
stderr says which input and why); 3 ``budget --check`` found a budget that does not fit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import NoReturn

from kvguard import __version__
from kvguard.api.budget_report import budget_to_dict, render_budget, weights_dtype
from kvguard.cli import check_config, from_vllm_log, probe, run, status
from kvguard.cli import loadgen as loadgen_cli
from kvguard.cli import sim_engine as engine_cli
from kvguard.cli.demo import add_demo_parser
from kvguard.config.model_files import bundled_models, load_model_files, merged_config
from kvguard.core.budget import (
    DEFAULT_BLOCK_SIZE,
    budget_inputs_from,
    plan_budget,
)
from kvguard.core.engine_rules import CURRENT_VLLM, SAMPLERS, speculative_layers
from kvguard.core.gpus import GPU_PRESETS, gpu_preset
from kvguard.core.units import KV_DTYPES, format_bytes, parse_bytes, parse_count
from kvguard.errors import ConfigError, InvalidInputError, KvguardError

EXIT_OK = 0
EXIT_INVALID_CONFIG = 1  # a config file that does not parse or validate
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
        help="config.json, a directory holding it, a bundled model name, or a Hugging Face"
        " id (ORG/NAME) already in the local Hugging Face cache",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    p.add_argument(
        "--max-model-len",
        metavar="N",
        help="context length per sequence, e.g. 32768, 32k (32,000) or 32K (32,768), read"
        " as vLLM reads it (default: the model's)",
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
        "--gpu-memory",
        metavar="SIZE",
        help="memory per GPU as the runtime reports it, e.g. 79.19GiB, 80Gi, 81559MiB;"
        " G/Gi/GiB = 1024**3, GB/g = 1000**3",
    )
    mem.add_argument(
        "--gpu",
        metavar="NAME",
        help=f"GPU preset (case, spaces and a leading NVIDIA ignored): {presets}",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        metavar="F",
        help="fraction of GPU memory the engine may use (default: vLLM's own for"
        " --engine-version: 0.92 from 0.20, 0.9 before)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        metavar="N",
        help="tokens per forward pass, sizes the activation peak; 8192, 8k or 8K as for"
        " --max-model-len (default: vLLM's for the GPU: 8192 from 70 GiB, not A100s,"
        " else 2048)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        metavar="N",
        help="sequences per step, sizes the sampler's profile (default: vLLM's for the GPU:"
        " 1024 from 70 GiB, not A100s, else 256)",
    )
    p.add_argument(
        "--engine-version",
        metavar="X.Y",
        help="vLLM version whose memory rules to follow (default: the current one,"
        f" {CURRENT_VLLM[0]}.{CURRENT_VLLM[1]}); 0.7 and older are the V0 engine",
    )
    spec = p.add_mutually_exclusive_group()
    spec.add_argument(
        "--speculative-config",
        metavar="JSON",
        help='vLLM\'s --speculative-config, e.g. \'{"method": "eagle3", "model": "...",'
        " \"num_speculative_tokens\": 3}': its drafter's KV layers share the pool",
    )
    spec.add_argument(
        "--speculative-layers",
        type=int,
        default=0,
        metavar="N",
        help="N extra attention layers with the target's KV shape (EAGLE/MTP heads)",
    )
    p.add_argument(
        "--hf-overrides",
        metavar="JSON",
        help="vLLM's --hf-overrides: fields merged into the model's config, e.g."
        ' \'{"rope_scaling": {"rope_type": "yarn", "factor": 4.0,'
        ' "original_max_position_embeddings": 32768}}\' to serve past its context limit',
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="as vLLM's flag: no CUDA graphs, so none are taken from the pool",
    )
    p.add_argument(
        "--sampler",
        choices=SAMPLERS,
        help="vLLM's top-k/top-p path, which sizes the sampler's profile: its start-up log"
        " says ('Using FlashInfer for top-p & top-k sampling'); default: the release's own"
        " (pytorch before 0.17, triton to 0.20, flashinfer after)",
    )
    p.add_argument(
        "--from-vllm-log",
        metavar="FILE",
        help="read a vLLM start-up log: compare kvguard's prediction with what vLLM"
        " measured, then answer the other flags as what-ifs from the measured figures",
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
        "--kv-cache-memory-bytes",
        metavar="SIZE",
        help="fixed KV pool per GPU, as vLLM's flag (24G = 24 GiB, as vLLM reads it)",
    )
    p.add_argument(
        "--activation-bytes",
        metavar="SIZE",
        help="activation peak per GPU (overrides the estimate)",
    )
    p.add_argument(
        "--overhead-bytes",
        metavar="SIZE",
        help="memory outside weights, activations and the pool per GPU: non-torch memory"
        " and CUDA graphs (overrides the estimate)",
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


def _count(text: object, flag: str) -> int | None:
    return None if text is None else parse_count(str(text), flag)


def _max_model_len(text: str | None) -> int | None:
    """``--max-model-len``: None (the model's limit) or a count as vLLM reads it."""
    if text is None:
        return None
    if text.strip().lower() in ("auto", "-1"):
        # vLLM's "auto" fits the context to the memory it finds; kvguard reports that
        # length as "Max context" rather than taking it as an input.
        raise InvalidInputError(
            "--max-model-len",
            text,
            "must be a token count: vLLM's auto (fit to memory) is what the"
            " 'Max context' line reports; omit the flag for the model's own limit",
        )
    return parse_count(text, "--max-model-len")


def _run_budget(args: argparse.Namespace) -> int:
    memory: int | None
    if args.gpu is not None:
        preset = gpu_preset(args.gpu)
        memory, gpu = preset.memory_bytes, preset.name
    else:
        memory = _size(args.gpu_memory, "--gpu-memory")
        gpu = "custom" if memory is not None else "default (80 GiB)"
    files = load_model_files(args.model)
    if args.hf_overrides is not None:
        overrides = _json_arg(args.hf_overrides, "--hf-overrides")
        if not isinstance(overrides, dict):
            raise InvalidInputError("--hf-overrides", args.hf_overrides, "must be a JSON object")
        files = replace(files, config=merged_config(files.config, overrides))
    speculative = args.speculative_layers
    notes: tuple[str, ...] = ()
    if args.speculative_config is not None:
        drafter = speculative_layers(
            _json_arg(args.speculative_config, "--speculative-config"), files.config
        )
        speculative, notes = drafter.layers, (f"speculative decoding: {drafter.source}",)
    inputs = budget_inputs_from(
        args,
        gpu_name=gpu if args.gpu is not None else None,
        speculative_layers=speculative,
        max_model_len=_max_model_len(args.max_model_len),
        max_num_batched_tokens=_count(args.max_num_batched_tokens, "--max-num-batched-tokens"),
        gpu_memory_bytes=memory,
        weights_bytes=_size(args.weights_bytes, "--weights-bytes"),
        kv_cache_memory_bytes=_size(args.kv_cache_memory_bytes, "--kv-cache-memory-bytes"),
        activation_bytes=_size(args.activation_bytes, "--activation-bytes"),
        overhead_bytes=_size(args.overhead_bytes, "--overhead-bytes"),
    )
    if args.from_vllm_log is not None:
        return from_vllm_log.run(args, files, inputs, gpu, notes)
    report = plan_budget(
        files.config,
        inputs,
        index_total_size=files.index_total_size,
        source=files.source,
        notes=notes,
    )
    weights = weights_dtype(files.config, report.budget.model)
    if args.json:
        data = budget_to_dict(report, files.source, gpu, name=files.name, weights=weights)
        print(json.dumps(data, indent=2))
    else:
        print(render_budget(report, files.source, gpu, name=files.name, weights=weights))
    if args.check and not report.budget.fits:
        short = format_bytes(-report.budget.headroom_bytes_per_gpu)
        print(f"kvguard budget: does not fit (short by {short} per GPU)", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return EXIT_OK


def _json_arg(text: str, flag: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInputError(flag, text, f"must be JSON ({exc.msg})") from None


def _command_parser(
    parser: argparse.ArgumentParser, command: str | None
) -> argparse.ArgumentParser:
    """The parser of ``command`` (``kvguard run``'s), else ``parser`` itself."""
    # argparse keeps its subparsers only in this private list.
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]  # type: ignore[no-any-return]
    return parser


def _flag(field: str) -> str:
    if field.startswith("-"):
        return field
    return _FLAG_OF_FIELD.get(field, "--" + field.replace("_", "-"))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvguard`` command line; returns the process exit code."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # Said by the command's own parser, whose --help lists its flags: where every
        # stray word came after the command's name (`kvguard --bogus run` is kvguard's).
        words = list(sys.argv[1:] if argv is None else argv)
        before = words[: words.index(args.command)] if args.command in words else words
        owner = parser if any(word in before for word in extra) else None
        (owner or _command_parser(parser, args.command)).error(
            f"unrecognized arguments: {' '.join(extra)}"
        )
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
        # A config that cannot be used is invalid input, not a usage error (as `run`
        # and `check-config` answer): 1.
        for line in exc.lines():
            print(f"kvguard {args.command}: error: {exc.source}: {line}", file=sys.stderr)
        return EXIT_INVALID_CONFIG
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
