"""The running guard: the loop, the decision step, assembly, and the process around them."""
