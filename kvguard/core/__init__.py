"""The pure core of kvguard: value types and decisions, with no I/O.

Nothing in this package touches the network, the file system, the GPU, the clock
or an event loop (ruff's TID251 rule enforces the imports). Adapters elsewhere
translate the outside world into these types.
"""
