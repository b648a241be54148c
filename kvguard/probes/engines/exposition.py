"""The shapes of Prometheus text exposition lines, shared by both ways of reading it.

:func:`~kvguard.probes.engines.base.keep_lines` (the strict path) and
:func:`~kvguard.probes.engines.wanted.parse_wanted` (the fast path) must agree on
what a plain sample, descriptor or comment line is and on which families hold the
samples an adapter reads: both take them from here.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from functools import lru_cache

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
# A label value unrolled ("[^"\\]*(\\.[^"\\]*)*"): several times faster in `re` than alternation.
LABEL = r'(?!__)[a-zA-Z_][a-zA-Z0-9_]*="[^"\\\n]*(?:\\.[^"\\\n]*)*"'
NUMBER = r"[-+]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[Ii]nf|NaN)"
SAMPLE_LINE = re.compile(
    rf"({NAME})(?:\{{(?:{LABEL}(?:,{LABEL})*)?\}})?[ \t]+{NUMBER}(?:[ \t]+-?[0-9]+)?[ \t]*"
)
DESCRIPTOR_LINE = re.compile(rf"# (?:HELP ({NAME})(?:[ \t].*)?|TYPE ({NAME})[ \t]+[a-z]+[ \t]*)")
# A comment the parser ignores: '#' alone, or '#' and blanks then anything but a
# HELP/TYPE word. The lookahead sits after ALL the blanks (no backtracking into them):
# the parser reads '#  TYPE x counter' (two blanks) as a TYPE line too.
COMMENT_LINE = re.compile(r"#(?:[ \t]+(?![ \t]|(?:HELP|TYPE)\b).*)?")
# Sample-name suffixes of one family (counter, summary, histogram, created stamp).
SUFFIXES = ("_total", "_sum", "_count", "_bucket", "_created")


def family_of(name: str) -> str:
    """The family a sample name belongs to (``x_sum`` -> ``x``)."""
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


@lru_cache(maxsize=32)
def read_names(reads: frozenset[str]) -> tuple[frozenset[str], frozenset[str]]:
    """(sample names, family names) whose lines matter to an adapter reading ``reads``.

    The sample names include each counter's name without the ``_total`` the parser
    adds to counters written without it (TGI's exporter).
    """
    samples = set(reads)
    samples.update(name[: -len("_total")] for name in reads if name.endswith("_total"))
    return frozenset(samples), frozenset({*samples, *(family_of(name) for name in samples)})


def names_for(reads: Collection[str]) -> tuple[frozenset[str], frozenset[str]]:
    """:func:`read_names` for any collection of names."""
    return read_names(reads if isinstance(reads, frozenset) else frozenset(reads))
