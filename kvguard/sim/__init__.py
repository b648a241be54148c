"""The simulated inference engine and traffic generator.

``kvguard sim-engine`` behaves like a vLLM (or SGLang, or llama.cpp) server from
the outside, driven by a paged KV-cache model, so kvguard can be tested, shown and
benchmarked without a GPU. ``kvguard loadgen`` drives any OpenAI-compatible
endpoint with the traffic patterns that cause KV-cache exhaustion.
"""
