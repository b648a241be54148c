"""A fast path for reading a few families out of a large, well-formed exposition.

A real vLLM page is 50-200 KB (histograms, one series per data-parallel engine,
LoRA labels) of which an adapter reads a few dozen samples. :func:`keep_lines`
(kvguard/probes/engines/base.py) checks every line of the page against the shapes
it may drop and hands the rest to ``prometheus_client``'s parser, whose per-character
label parsing is slow on vLLM's ``cache_config_info`` (dozens of labels per engine),
at every tick (docs/benchmarks.md, "Scrape cost", has the figures).

:func:`parse_wanted` does the same job several times faster in the common
case: it finds the families by their ``# HELP``/``# TYPE`` lines (one ``str.find``
per descriptor, not a regex per line), skips the families nobody reads without
looking inside them, and parses the wanted ones with strict regular expressions,
giving exactly the samples ``prometheus_client`` gives (names, counters' ``_total``,
label unescaping, int or float values). With a :class:`FamilyCache` (one per probe), a
wanted family whose lines are the same as at the last scrape is not parsed again: its
samples from then are reused (``cache_config_info``, dozens of labels per engine, never
changes; on an idle engine nothing does). It answers None — and the caller takes the
strict path, whose behaviour on bad input is unchanged — whenever the page is not
plainly exposition: no trailing newline (a cut body), text before the first family,
any line of a wanted family or of the last family that is not plainly a descriptor
or a sample, a sample that does not belong to its family. Skipped families are not
validated: a malformed line inside a family kvguard does not read, with well-formed
families after it, no longer fails the probe.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from kvguard.probes.engines.exposition import COMMENT_LINE, LABEL, NAME, NUMBER, names_for

Labels = dict[str, str]
Series = list[tuple[Labels, float]]

_ONE_LABEL = re.compile(r'(?!__)([a-zA-Z_][a-zA-Z0-9_]*)="([^"\\\n]*(?:\\.[^"\\\n]*)*)"(?:,|$)')
# A sample line as exposition.SAMPLE_LINE, its parts named.
_SAMPLE = re.compile(
    rf"(?P<name>{NAME})(?:\{{(?P<labels>(?:{LABEL}(?:,{LABEL})*)?)\}})?"
    rf"[ \t]+(?P<value>{NUMBER})(?:[ \t]+-?[0-9]+)?[ \t]*"
)
_NAME_RE = re.compile(NAME)
_ESCAPES = re.compile(r'\\[\\n"]')
_UNESCAPED = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}
# The sample names each family type allows, as prometheus_client's parser has them.
_ALLOWED_SUFFIXES = {
    "counter": ("",),
    "gauge": ("",),
    "summary": ("_count", "_sum", ""),
    "histogram": ("_count", "_sum", "_bucket"),
}
_TYPES = frozenset({"counter", "gauge", "summary", "histogram", "untyped"})


class FamilyCache:
    """The wanted families of one engine's last scrape: their lines and their samples.

    Owned by one probe (one engine, one set of names read). Only the families read at
    the last scrape are kept, so it holds a few KB whatever the engine exports.
    """

    def __init__(self) -> None:
        self._reads: frozenset[str] | None = None
        self._families: dict[tuple[str, int], tuple[str, list[tuple[str, Labels, float]]]] = {}

    def parsed(
        self, reads: frozenset[str], blocks: dict[tuple[str, int], str]
    ) -> dict[tuple[str, int], list[tuple[str, Labels, float]] | None]:
        """Each block's samples (None: not plain exposition); unchanged blocks reused."""
        if reads != self._reads:
            self._reads, self._families = reads, {}
        out: dict[tuple[str, int], list[tuple[str, Labels, float]] | None] = {}
        kept: dict[tuple[str, int], tuple[str, list[tuple[str, Labels, float]]]] = {}
        for key, block in blocks.items():
            last = self._families.get(key)
            if last is not None and last[0] == block:
                samples: list[tuple[str, Labels, float]] | None = last[1]
            else:
                samples = _parse_family(key[0], block, reads)
            out[key] = samples
            if samples is not None:
                kept[key] = (block, samples)
        self._families = kept
        return out


def parse_wanted(
    text: str, reads: Collection[str], cache: FamilyCache | None = None
) -> dict[str, Series] | None:
    """The samples of ``reads`` in ``text`` (name -> [(labels, value)]), or None.

    None means "take the strict path": the text is not plainly exposition here.
    ``cache`` (the probe's own) skips parsing the wanted families that did not change
    since its last scrape; the result is the same with or without it.
    """
    if not text.endswith("\n"):
        return None
    wanted = reads if isinstance(reads, frozenset) else frozenset(reads)
    _, families = names_for(wanted)
    blocks = _family_blocks(text)
    if not blocks or not _only_comments(text[: blocks[0][1]]):
        return None
    last_name, last_start, last_end = blocks[-1]
    if last_name not in families and _parse_family(last_name, text[last_start:last_end]) is None:
        return None  # the last family is only checked: a cut body ends there
    # Wanted families in page order, keyed by (name, index): a name may come twice.
    read = {
        (name, index): text[start:end]
        for index, (name, start, end) in enumerate(blocks)
        if name in families
    }
    if cache is None:
        parsed = {key: _parse_family(key[0], block, wanted) for key, block in read.items()}
    else:
        parsed = cache.parsed(wanted, read)
    by_name: dict[str, Series] = {}
    for samples in parsed.values():
        if samples is None:
            return None
        for sample_name, labels, value in samples:
            if sample_name in wanted:
                by_name.setdefault(sample_name, []).append((labels, value))
    return by_name


def _only_comments(text: str) -> bool:
    """Whether ``text`` holds nothing but blank lines and comments the parser ignores."""
    return all(not line or COMMENT_LINE.fullmatch(line) for line in text.split("\n"))


def _family_blocks(text: str) -> list[tuple[str, int, int]]:
    """(family name, start, end) of each run of lines under one HELP/TYPE name.

    Only lines that start with ``# `` are looked at (one ``str.find`` each); a
    family runs from its first descriptor to the next descriptor of another name.
    """
    blocks: list[tuple[str, int, int]] = []
    current: str | None = None
    start = 0
    pos = 0 if text.startswith("# ") else _next_comment(text, 0)
    while pos >= 0:
        end = text.find("\n", pos)  # the text ends with a newline: always found
        if text.startswith(("# HELP ", "# TYPE "), pos):
            blank = text.find(" ", pos + 7, end)
            name = text[pos + 7 : blank if blank >= 0 else end]
            if name != current:
                if current is not None:
                    blocks.append((current, start, pos))
                current, start = name, pos
        pos = _next_comment(text, end)
    if current is not None:
        blocks.append((current, start, len(text)))
    return blocks


def _next_comment(text: str, at: int) -> int:
    """Where the next line starting with ``# `` begins, from ``at``; -1 when none."""
    found = text.find("\n# ", at)
    return found + 1 if found >= 0 else -1


def _parse_family(
    name: str, block: str, wanted: frozenset[str] | None = None
) -> list[tuple[str, Labels, float]] | None:
    """The samples of one family's lines, named as prometheus_client names them.

    With ``wanted``, only samples of those names are parsed (and checked); the
    others (a histogram's buckets) are only checked to belong to the family.
    """
    if not _NAME_RE.fullmatch(name):
        return None
    kind = "untyped"
    allowed: tuple[str, ...] = (name,)
    out: list[tuple[str, Labels, float]] = []
    help_line, type_line = f"# HELP {name}", f"# TYPE {name}"
    for line in block.split("\n"):
        if not line:
            continue
        if line[0] == "#":
            if line.startswith(help_line) and line[len(help_line) : len(help_line) + 1] in (
                "",
                " ",
                "\t",
            ):
                continue
            if line.startswith(type_line) and line[len(type_line) : len(type_line) + 1] in (
                " ",
                "\t",
            ):
                kind = line[len(type_line) :].strip()
                if kind not in _TYPES:
                    return None
                allowed = tuple(name + s for s in _ALLOWED_SUFFIXES.get(kind, ("",)))
                continue
            if COMMENT_LINE.fullmatch(line):
                continue  # a comment the parser ignores
            return None  # not plainly a descriptor of this family: strict path
        brace, blank = line.find("{"), line.find(" ")
        written = line[: brace if 0 <= brace < blank or blank < 0 else blank]
        if written not in allowed:
            return None
        sample_name = written
        if kind == "counter" and not name.endswith("_total"):
            sample_name += "_total"  # prometheus_client's OpenMetrics naming of counters
        if wanted is not None and sample_name not in wanted:
            continue
        sample = _SAMPLE.fullmatch(line)
        if sample is None or sample.group("name") != written:
            return None
        out.append((sample_name, _labels(sample.group("labels")), _value(sample.group("value"))))
    return out


def _labels(text: str | None) -> Labels:
    if not text:
        return {}
    labels: Labels = {}
    for match in _ONE_LABEL.finditer(text):
        value = match.group(2)
        if "\\" in value:
            value = _ESCAPES.sub(lambda m: _UNESCAPED[m.group(0)], value)
        labels[match.group(1)] = value
    return labels


def _value(text: str) -> float:
    # As prometheus_client: an int where the text is one, else a float (no exception
    # thrown and caught per sample: most values of a real page are floats).
    if text.lstrip("+-").isdigit():
        return int(text)
    return float(text)
