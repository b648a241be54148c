"""Reproducible benchmarks; each writes its numbers to bench/results/ (see docs)."""
