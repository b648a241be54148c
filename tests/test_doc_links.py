"""Relative links of the docs and reports: the file exists, and a ``#anchor`` names a heading.

The pages are README.md, docs/**/*.md and bench/results/**/*.md. Those under bench/results/
are the reports a partial benchmark run writes beside its figures (bench/report.py):
their plots and links resolve from there, not from docs/.

Anchors follow GitHub's rules for headings (github-slugger): the heading's text as
rendered (link targets, code ticks and emphasis marks gone), lowercased, every
character that is not a letter, digit, ``_``, ``-`` or space dropped, each space a
hyphen; the second heading with the same slug gets ``-1``, the third ``-2``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("**/*.md")),
    *sorted((ROOT / "bench" / "results").glob("**/*.md")),
]

# [text](target) or ![alt](target), the target without spaces, an optional "title" after.
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# [label]: target (a reference definition).
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_SCHEME = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*:")  # https:, mailto: ...: not a file here
_FENCE = re.compile(r"^\s{0,3}(```|~~~)")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")  # closing #s need a space


def _outside_code(text: str) -> list[tuple[int, str]]:
    """The page's lines (numbered from 1) outside fenced code blocks."""
    lines, fence = [], None
    for number, line in enumerate(text.splitlines(), start=1):
        match = _FENCE.match(line)
        if match:
            fence = None if fence == match[1] else fence or match[1]
            continue
        if fence is None:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading of this Markdown text (before de-duplication)."""
    # Odd parts are code spans, kept as they are; elsewhere links, HTML and emphasis go.
    parts = re.split(r"`+([^`]*)`+", heading)
    rendered = [part if i % 2 else _plain(part) for i, part in enumerate(parts)]
    return re.sub(r"[^\w\- ]", "", "".join(rendered).lower()).replace(" ", "-")


def _plain(text: str) -> str:
    """Markdown outside code as GitHub renders it to text: links, HTML and emphasis marks go."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    return re.sub(r"\*+|(?<!\w)_+|_+(?!\w)", "", text)  # emphasis marks, not snake_case


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, duplicates numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in _outside_code(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if match is None:
            continue
        base = slug(match[2])
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def relative_links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of each link of the page that is not a URL with a scheme."""
    found = []
    for number, raw in _outside_code(path.read_text(encoding="utf-8")):
        line = re.sub(r"(`+)(?:(?!\1).)+\1", "", raw)  # inline code: no links there
        targets = [m[1] for m in _LINK.finditer(line)]
        reference = _REFERENCE.match(line)
        if reference:
            targets.append(reference[1])
        found += [(number, t) for t in targets if not _SCHEME.match(t)]
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """``page:line: target (why)`` for each relative link that does not resolve."""
    broken = []
    for number, target in relative_links(page):
        file_part, _, anchor = target.partition("#")
        where = page if not file_part else (page.parent / file_part).resolve()
        name = f"{page.relative_to(root)}:{number}: {target}"
        if not where.exists():
            broken.append(f"{name} (no such file)")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{name} (no such heading)")
    return broken


def test_slug_follows_githubs_rules():
    """Punctuation and code ticks go, spaces become hyphens, snake_case and hyphens stay."""
    assert (
        slug("3. Policy: the ladder (`kvguard/core/policy.py`, `[policy]`)")
        == "3-policy-the-ladder-kvguardcorepolicypy-policy"
    )
    assert slug("`[proxy] fail_readiness_at`") == "proxy-fail_readiness_at"
    assert slug("The `__init__` of _this_") == "the-__init__-of-this"
    assert slug("What **kvguard** does, in [short](x.md)") == "what-kvguard-does-in-short"
    assert slug("Lead time — before it") == "lead-time--before-it"


def test_duplicate_headings_are_numbered(tmp_path):
    """The second and third heading of the same text get -1 and -2; code blocks are no headings."""
    page = tmp_path / "page.md"
    page.write_text("# Check\n## Check\n```sh\n# Check\n```\n### Check\n## Other\n")
    assert anchors(page) == {"check", "check-1", "check-2", "other"}


def test_a_dead_anchor_and_a_missing_file_are_found(tmp_path):
    """The check itself: links to a missing heading or file are reported, URLs and code are not."""
    (tmp_path / "target.md").write_text("# Real heading\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](target.md#real-heading) [ok](#here) [web](https://example.com/x.md#nope)\n"
        "# Here\n"
        "[bad](target.md#gone) [bad](missing.md) `[code](missing.md)` [bad](#there)\n"
    )
    assert broken_links(page, root=tmp_path) == [
        "page.md:3: target.md#gone (no such heading)",
        "page.md:3: missing.md (no such file)",
        "page.md:3: #there (no such heading)",
    ]


def test_a_report_beside_its_results_is_checked_and_its_old_image_links_are_dead(tmp_path):
    """The benchmark reports are among the pages, and a plot linked as if from docs/ is dead.

    The reports under bench/results/<subset>/ once linked their plots as
    ``../bench/results/NAME.png`` (right from docs/ only); from beside the plot it is
    ``NAME.png``.
    """
    reports = [p for p in PAGES if p.is_relative_to(ROOT / "bench" / "results")]
    assert reports, "no report under bench/results/ is checked"
    subset = tmp_path / "bench" / "results" / "efficacy_subset"
    subset.mkdir(parents=True)
    (subset / "efficacy_mixed.png").write_bytes(b"")
    (tmp_path / "bench" / "analysis.md").write_text("# Analysis\n")
    page = subset / "benchmarks.md"
    page.write_text(
        "[analysis.md](../bench/analysis.md) [analysis.md](../../analysis.md)\n"
        "![efficacy_mixed.png](../bench/results/efficacy_mixed.png)\n"
        "![efficacy_mixed.png](efficacy_mixed.png)\n"
    )
    assert broken_links(page, root=tmp_path) == [
        "bench/results/efficacy_subset/benchmarks.md:1: ../bench/analysis.md (no such file)",
        "bench/results/efficacy_subset/benchmarks.md:2: ../bench/results/efficacy_mixed.png"
        " (no such file)",
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    """Each relative link of the page names an existing file and, into a .md page, a heading."""
    assert broken_links(page) == []


def test_the_decision_diagram_names_what_the_code_has():
    """how-it-works.md's flowchart: the patterns, actions and settings it names are real."""
    import re  # noqa: PLC0415 - one test

    from kvguard.config.settings import _SCHEMA  # noqa: PLC0415 - the schema is private
    from kvguard.core.pattern import TRAFFIC_PATTERNS  # noqa: PLC0415
    from kvguard.core.policy import ACTION_KINDS  # noqa: PLC0415

    text = (ROOT / "docs" / "how-it-works.md").read_text()
    diagram = text.split("```mermaid", 1)[1].split("```", 1)[0]
    patterns = re.search(r'pat\["traffic pattern: ([^"]+)"\]', diagram)
    assert patterns is not None
    named = [p.strip() for p in patterns.group(1).replace("<br/>", " ").split(",")]
    assert sorted(named) == sorted(TRAFFIC_PATTERNS)
    plan = re.search(r'plan\["plan: ([^"]+)"\]', diagram)
    assert plan is not None
    actions = {a.strip() for a in plan.group(1).replace("<br/>", " ").split(",")}
    # The fp8 switch is one action both ways in the diagram (kv_fp8 and its revert).
    assert actions == set(ACTION_KINDS) - {"revert_kv_fp8"}
    keys = {key for table in _SCHEMA.values() for key in table}
    for setting in ("hold_s", "confirm_ticks", "min_interval_s"):
        assert setting in diagram
        assert setting in keys, setting
