"""kvguard: keep LLM inference servers from running out of GPU memory.

kvguard budgets VRAM explicitly (weights, worst-case KV cache, activations,
overhead), watches the engine's KV cache and the GPU, forecasts headroom and acts
before the out-of-memory failure. See docs/index.md.
"""

__version__ = "0.1.0.dev0"
