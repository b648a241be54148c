"""A dynamic-KV load for the GPU check: sequences whose KV cache grows token by token.

:class:`KvLoad` admits "sequences" and grows each one's KV cache a token at a time,
at a controlled rate, the way engines that allocate per active sequence do (HF
transformers servers, multi-model hosts: docs/how-it-works.md, "What goes wrong").
Storage comes in blocks of ``block_tokens`` tokens, each a tensor of shape
``[layers, 2 (K and V), kv_heads, block_tokens, head_dim]`` in the model's dtype,
so one token costs ``2 x layers x kv_heads x head_dim x dtype_bytes`` — for
Llama-3.1-8B in bf16, 2 x 32 x 8 x 128 x 2 = 131,072 bytes. The shape is read from
the model's ``config.json`` here, on purpose without kvguard's budget code, so the
check compares kvguard's figure with an independent one.

The memory comes from a :class:`Backend`: :class:`TorchBackend` on a real GPU
(``torch.cuda``), or the driver's wrapper around
:class:`kvguard.testing.SimulatedAllocator` in fake mode.

Run as a program (``python -m bench.gpu_load``), it is the real-GPU load that
``bench/gpu_check.py`` starts: it prints JSON lines on stdout (``ready``, ``go``,
``sample`` every 0.25 s, then ``oom`` or ``deadline``, then ``released``), waits for
a ``go`` line on stdin before it allocates anything, and stops at the first
``torch.cuda.OutOfMemoryError``. Times are ``time.monotonic()``, which on Linux is one
clock for every process of the machine, so the driver can line them up with its own.
It never changes a GPU setting; it only allocates and frees memory.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

# config.json's torch_dtype -> bytes per element.
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
SAMPLE_INTERVAL_S = 0.25
STEP_S = 0.01  # how often the load catches up with its rate
GO_WAIT_S = 120.0  # the driver says go within this, or the load gives up


class LoadError(Exception):
    """A load that cannot run as asked (bad model config, bad settings)."""


@dataclass(frozen=True)
class KvShape:
    """The KV cache geometry of one model: what one token costs."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    source: str = ""

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the cache's dtype."""
        return DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_config(cls, path: str | Path) -> KvShape:
        """The shape in a Hugging Face ``config.json`` (a file or the folder holding one).

        Standard and grouped-query attention only: MLA, sliding-window and hybrid
        models cost per token what kvguard's budget knows, but this load does not
        model them, and says so.
        """
        file = Path(path)
        if file.is_dir():
            file = file / "config.json"
        try:
            config = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            raise LoadError(f"model config {file}: cannot read it: {exc}") from exc
        if not isinstance(config, dict):
            raise LoadError(f"model config {file}: not a JSON object")
        for unsupported in ("kv_lora_rank", "layer_types", "sliding_window_pattern"):
            if config.get(unsupported) is not None:
                raise LoadError(
                    f"model config {file}: has {unsupported!r}; the load models standard"
                    " and grouped-query attention only (pick e.g. llama-3.1-8b)"
                )
        try:
            heads = int(config["num_attention_heads"])
            layers = int(config["num_hidden_layers"])
            kv_heads = int(config.get("num_key_value_heads") or heads)
            head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        except (KeyError, TypeError, ValueError) as exc:
            raise LoadError(f"model config {file}: missing or bad field {exc}") from exc
        dtype = str(config.get("torch_dtype") or "bfloat16")
        if dtype not in DTYPE_BYTES:
            raise LoadError(
                f"model config {file}: torch_dtype {dtype!r}; allowed: {sorted(DTYPE_BYTES)}"
            )
        return cls(layers, kv_heads, head_dim, dtype, str(file))


class Backend(Protocol):
    """Where the load's memory comes from."""

    def allocate_block(self, shape: KvShape, block_tokens: int) -> object:
        """One block of KV storage; raises the backend's out-of-memory error when full."""
        ...

    def allocated_bytes(self) -> int:
        """Bytes held by live allocations (``torch.cuda.memory_allocated``)."""
        ...

    def reserved_bytes(self) -> int:
        """Bytes the allocator holds from the GPU (``torch.cuda.memory_reserved``)."""
        ...

    def is_oom(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the backend's out-of-memory error."""
        ...

    def release(self, blocks: list[object]) -> None:
        """Free ``blocks`` and give the cached memory back to the GPU."""
        ...


@dataclass
class Sequence:
    """One admitted sequence: its tokens and the blocks holding their KV."""

    tokens: int = 0
    blocks: list[object] = field(default_factory=list)


class KvLoad:
    """Sequences whose KV grows token by token at ``tokens_per_s``, until memory runs out.

    Up to ``concurrency`` sequences grow at once, round robin, one token each turn;
    one that reaches ``max_seq_tokens`` stops growing and keeps its cache (as a
    prefix cache would), and a new sequence is admitted in its place, so memory only
    grows. :meth:`advance` catches up with the rate; it lets the backend's
    out-of-memory error through, after which :attr:`tokens` is what was stored.
    """

    def __init__(
        self,
        backend: Backend,
        shape: KvShape,
        *,
        tokens_per_s: float,
        block_tokens: int = 16,
        concurrency: int = 32,
        max_seq_tokens: int = 8192,
    ) -> None:
        if tokens_per_s <= 0:
            raise LoadError(f"tokens_per_s: a positive rate, got {tokens_per_s}")
        if block_tokens < 1:
            raise LoadError(f"block_tokens: 1 or more, got {block_tokens}")
        if concurrency < 1:
            raise LoadError(f"concurrency: 1 or more, got {concurrency}")
        if max_seq_tokens < 1:
            raise LoadError(f"max_seq_tokens: 1 or more, got {max_seq_tokens}")
        self.backend = backend
        self.shape = shape
        self.tokens_per_s = tokens_per_s
        self.block_tokens = block_tokens
        self.concurrency = concurrency
        self.max_seq_tokens = max_seq_tokens
        self.tokens = 0
        self.blocks = 0
        self.sequences_admitted = 0
        self._active: deque[Sequence] = deque()
        self._done: list[Sequence] = []

    def advance(self, elapsed_s: float) -> None:
        """Grow until ``tokens_per_s x elapsed_s`` tokens are stored."""
        target = int(self.tokens_per_s * elapsed_s)
        while self.tokens < target:
            self._grow_one()

    def _grow_one(self) -> None:
        while len(self._active) < self.concurrency:
            self._active.append(Sequence())
            self.sequences_admitted += 1
        seq = self._active[0]
        if seq.tokens % self.block_tokens == 0:
            # A raise here leaves everything as it was: the token was not stored.
            seq.blocks.append(self.backend.allocate_block(self.shape, self.block_tokens))
            self.blocks += 1
        self._active.popleft()
        seq.tokens += 1
        self.tokens += 1
        if seq.tokens >= self.max_seq_tokens:
            self._done.append(seq)
        else:
            self._active.append(seq)

    @property
    def token_capacity(self) -> int:
        """Tokens the allocated blocks can hold (partly filled blocks count whole)."""
        return self.blocks * self.block_tokens

    def release(self) -> None:
        """Free every block."""
        blocks = [b for seq in (*self._done, *self._active) for b in seq.blocks]
        self._done.clear()
        self._active.clear()
        self.backend.release(blocks)

    def sample(self, t: float) -> dict[str, Any]:
        """One ``sample`` record: the load's state and its allocator's figures at ``t``."""
        return {
            "event": "sample",
            "t": t,
            "tokens": self.tokens,
            "blocks": self.blocks,
            "sequences": self.sequences_admitted,
            "allocated_bytes": self.backend.allocated_bytes(),
            "reserved_bytes": self.backend.reserved_bytes(),
        }


class TorchBackend:
    """Blocks as ``torch.zeros`` tensors on one CUDA device (imports torch when built)."""

    def __init__(self, device_index: int) -> None:
        import torch  # type: ignore[import-not-found]  # noqa: PLC0415 - real GPU only

        self.torch = torch
        self.device = torch.device("cuda", device_index)
        torch.cuda.set_device(self.device)
        # A tiny tensor creates the CUDA context, so NVML lists this process from now on.
        self._anchor = torch.zeros(1, device=self.device)

    def allocate_block(self, shape: KvShape, block_tokens: int) -> object:
        """One zero-filled block (written, so its pages are really in use)."""
        dtype = getattr(self.torch, shape.dtype)
        return self.torch.zeros(
            (shape.layers, 2, shape.kv_heads, block_tokens, shape.head_dim),
            dtype=dtype,
            device=self.device,
        )

    def allocated_bytes(self) -> int:
        """``torch.cuda.memory_allocated`` of the device."""
        return int(self.torch.cuda.memory_allocated(self.device))

    def reserved_bytes(self) -> int:
        """``torch.cuda.memory_reserved`` of the device."""
        return int(self.torch.cuda.memory_reserved(self.device))

    def free_bytes(self) -> int:
        """Free memory on the device as the driver reports it (``cudaMemGetInfo``)."""
        free, _total = self.torch.cuda.mem_get_info(self.device)
        return int(free)

    def is_oom(self, exc: BaseException) -> bool:
        """``torch.cuda.OutOfMemoryError``."""
        return isinstance(exc, self.torch.cuda.OutOfMemoryError)

    def release(self, blocks: list[object]) -> None:
        """Drop the blocks and empty PyTorch's cache."""
        blocks.clear()
        self.torch.cuda.synchronize(self.device)
        self.torch.cuda.empty_cache()


def run_until_oom(
    load: KvLoad,
    *,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    emit: Callable[[dict[str, Any]], None],
    max_s: float,
) -> dict[str, Any]:
    """Drive ``load`` in real time from now until out of memory or ``max_s``; the last event."""
    go = clock()
    next_sample = go
    while True:
        now = clock()
        if now >= next_sample:
            emit(load.sample(now))
            next_sample = now + SAMPLE_INTERVAL_S
        if now - go > max_s:
            return {"event": "deadline", "t": now, **_totals(load)}
        try:
            load.advance(now - go)
        except Exception as exc:
            if not load.backend.is_oom(exc):
                raise
            at = clock()
            emit(load.sample(at))
            return {"event": "oom", "t": at, "error": str(exc).splitlines()[0], **_totals(load)}
        sleep(STEP_S)


def _totals(load: KvLoad) -> dict[str, Any]:
    return {
        "tokens": load.tokens,
        "blocks": load.blocks,
        "token_capacity": load.token_capacity,
        "allocated_bytes": load.backend.allocated_bytes(),
        "reserved_bytes": load.backend.reserved_bytes(),
    }


def _emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def _wait_for_go(timeout_s: float) -> bool:
    """True once the driver writes ``go`` on stdin; False on timeout or EOF."""
    ready, _, _ = select.select([sys.stdin], [], [], timeout_s)
    return bool(ready) and sys.stdin.readline().strip() == "go"


def main(argv: list[str] | None = None) -> int:
    """The real-GPU load as a program (see the module docstring); exit 0 after an OOM."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-config", required=True, help="config.json or its folder")
    parser.add_argument("--device", type=int, default=0, help="CUDA device index")
    parser.add_argument(
        "--fill-s", type=float, default=90.0, help="fill the free memory in about this long"
    )
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-seq-tokens", type=int, default=8192)
    parser.add_argument("--max-s", type=float, default=240.0, help="give up after this long")
    args = parser.parse_args(argv)
    shape = KvShape.from_config(args.model_config)
    backend = TorchBackend(args.device)
    free = backend.free_bytes()
    _emit(
        {
            "event": "ready",
            "t": time.monotonic(),
            "pid": os.getpid(),
            "free_bytes": free,
            "bytes_per_token": shape.bytes_per_token,
            "reserved_bytes": backend.reserved_bytes(),
        }
    )
    if not _wait_for_go(GO_WAIT_S):
        _emit({"event": "no_go", "t": time.monotonic()})
        return 3
    tokens_per_s = free / shape.bytes_per_token / args.fill_s
    load = KvLoad(
        backend,
        shape,
        tokens_per_s=tokens_per_s,
        block_tokens=args.block_tokens,
        concurrency=args.concurrency,
        max_seq_tokens=args.max_seq_tokens,
    )
    _emit({"event": "go", "t": time.monotonic(), "tokens_per_s": tokens_per_s})
    try:
        last = run_until_oom(
            load, clock=time.monotonic, sleep=time.sleep, emit=_emit, max_s=args.max_s
        )
        _emit(last)
    finally:
        load.release()
        _emit({"event": "released", "t": time.monotonic(), **_totals(load)})
    return 0 if last["event"] == "oom" else 4


if __name__ == "__main__":
    sys.exit(main())
