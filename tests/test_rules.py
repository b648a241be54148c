"""The Prometheus rules pack: promtool accepts and tests it, and it keeps the conventions.

STYLE.md's conventions: `KVGuard` alert names with a severity, a summary, a description
and a runbook_url whose anchor is a heading of docs/runbook.md; recording rules named
level:metric:operation; only documented kvguard metrics; rate()/increase() on counters.

PyYAML is not a dependency, so the rules file is read by a small parser of the block
style it is written in; promtool's own rule count checks that the parser missed none.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "dashboards" / "prometheus" / "kvguard-rules.yml"
UNIT_TESTS = sorted((ROOT / "dashboards" / "prometheus" / "tests").glob("*.yml"))
RUNBOOK = ROOT / "docs" / "runbook.md"
METRICS = ROOT / "docs" / "metrics.md"
RUNBOOK_URL = "https://github.com/kvguard/kvguard/blob/main/docs/runbook.md#"
MONITORING = ROOT / "docs" / "monitoring.md"
DASHBOARD_JSON = sorted((ROOT / "dashboards" / "grafana").glob("*.json"))

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed: run scripts/install-system.sh (Debian package prometheus)",
)

# The alerts issue 8 asks for; more may follow.
REQUIRED_ALERTS = {
    "KVGuardKVCacheExhaustionPredicted",
    "KVGuardKVCachePressureHigh",
    "KVGuardPreemptionStorm",
    "KVGuardGPUMemoryHeadroomLow",
    "KVGuardSheddingLoad",
    "KVGuardEngineOOM",
    "KVGuardMitigationFailed",
    "KVGuardBudgetMismatch",
    "KVGuardProbeDown",
    "KVGuardDown",
}
SEVERITIES = {"critical", "warning", "info"}
RECORD_NAME = re.compile(r"^[a-z_]+:[a-z0-9_]+:[a-z0-9_]+$")
# A kvguard metric in PromQL, not the middle of a recorded name (level:kvguard_x:op).
KVGUARD_METRIC = re.compile(r"(?<![\w:])kvguard_[a-z0-9_]+(?![\w:])")
RECORDED_NAME = re.compile(r"(?<![\w:])[a-z_]+:[a-z0-9_]+:[a-z0-9_]+(?![\w:])")
COUNTER_FUNCTION = re.compile(r"\b(?:rate|irate|increase)\(\s*([a-zA-Z_:][\w:]*)")


@dataclass
class Rule:
    """One rule of the file: an alert or a recording rule."""

    kind: str  # "alert" or "record"
    name: str
    fields: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _scalar(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def parse_rules(text: str) -> list[Rule]:
    """The rules of a Prometheus rules file written in plain block-style YAML.

    Handles what the file uses: `- alert:`/`- record:` items, `key: value` pairs
    (quoted or not), `labels:`/`annotations:` maps, and `|`/`>-` block scalars.
    """
    lines = text.splitlines()
    rules: list[Rule] = []
    i = 0
    while i < len(lines):
        head = re.match(r"^( *)- (alert|record): *(\S+) *$", lines[i])
        i += 1
        if head is None:
            continue
        rule = Rule(head.group(2), _scalar(head.group(3)))
        rules.append(rule)
        key_indent = len(head.group(1)) + 2
        section: dict[str, str] = rule.fields
        while i < len(lines):
            line = lines[i]
            if not line.strip() or line.lstrip().startswith("#"):
                i += 1
                continue
            depth = _indent(line)
            if depth < key_indent or line.lstrip().startswith("- "):
                break
            key, _, value = line.strip().partition(":")
            value = value.strip()
            i += 1
            if depth == key_indent:
                if key in ("labels", "annotations") and not value:
                    section = rule.labels if key == "labels" else rule.annotations
                    continue
                section = rule.fields
            if value in ("|", "|-", ">", ">-"):
                block: list[str] = []
                while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > depth):
                    block.append(lines[i].strip())
                    i += 1
                joiner = "\n" if value.startswith("|") else " "
                section[key] = joiner.join(b for b in block if b).strip()
            else:
                section[key] = _scalar(value)
    return rules


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


RULE_LIST = parse_rules(RULES.read_text())
ALERTS = [r for r in RULE_LIST if r.kind == "alert"]
RECORDS = [r for r in RULE_LIST if r.kind == "record"]


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    """Run promtool from the repository root; fail the test with its output on an error."""
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done


@needs_promtool
def test_promtool_accepts_the_rules_and_the_parser_sees_them_all():
    """`promtool check rules` passes, and counts as many rules as this module parsed."""
    done = run_promtool("check", "rules", str(RULES.relative_to(ROOT)))
    found = re.search(r"SUCCESS: (\d+) rules found", done.stdout)
    assert found is not None, done.stdout
    assert int(found.group(1)) == len(RULE_LIST)


@needs_promtool
def test_promtool_unit_tests_pass():
    """Every alert fires on its symptom and stays silent on near misses (promtool test rules)."""
    assert UNIT_TESTS, "no unit tests in dashboards/prometheus/tests/"
    run_promtool("test", "rules", *(str(p.relative_to(ROOT)) for p in UNIT_TESTS))


def test_the_issue_s_alerts_are_all_there():
    """Each alert issue 8 lists exists."""
    assert {a.name for a in ALERTS} >= REQUIRED_ALERTS


def test_alerts_have_a_name_severity_and_annotations():
    """KVGuard CamelCase names, a known severity, and summary/description/runbook_url."""
    for alert in ALERTS:
        assert re.fullmatch(r"KVGuard[A-Z][A-Za-z0-9]+", alert.name), alert.name
        assert alert.labels.get("severity") in SEVERITIES, alert.name
        assert alert.fields.get("expr"), alert.name
        for key in ("summary", "description", "runbook_url"):
            assert alert.annotations.get(key), f"{alert.name} has no {key}"


def test_descriptions_name_the_instance():
    """A description says which kvguard it is about (absent() has no instance to name)."""
    for alert in ALERTS:
        if alert.fields["expr"].startswith("absent("):
            continue
        assert "{{ $labels.instance }}" in alert.annotations["description"], alert.name


def test_runbook_urls_point_at_runbook_sections():
    """Every runbook_url is the runbook's URL with the anchor of one of its headings."""
    headings = re.findall(r"^#{1,6} +(.+?) *$", RUNBOOK.read_text(), flags=re.MULTILINE)
    anchors = {github_anchor(h) for h in headings}
    for alert in ALERTS:
        url = alert.annotations["runbook_url"]
        assert url.startswith(RUNBOOK_URL), url
        anchor = url.removeprefix(RUNBOOK_URL)
        assert anchor == alert.name.lower(), url
        assert anchor in anchors, f"{url}: no such heading in docs/runbook.md"


def test_recording_rules_are_named_level_metric_operation():
    """Recorded names follow level:metric:operation, and every one an expression uses exists."""
    recorded = {r.name for r in RECORDS}
    for record in RECORDS:
        assert RECORD_NAME.fullmatch(record.name), record.name
    for rule in RULE_LIST:
        for name in RECORDED_NAME.findall(rule.fields["expr"]):
            assert name in recorded, f"{rule.name} uses {name}, which no rule records"


def test_every_kvguard_metric_used_is_documented():
    """Each kvguard_* metric in an expression appears, in backticks, in docs/metrics.md."""
    documented = set(re.findall(r"`(kvguard_[a-z0-9_]+)`", METRICS.read_text()))
    used = {m for r in RULE_LIST for m in KVGUARD_METRIC.findall(r.fields["expr"])}
    assert used
    assert used <= documented, f"not in docs/metrics.md: {sorted(used - documented)}"


def test_rate_and_increase_only_on_counters():
    """rate()/increase() read only metrics docs/metrics.md lists as counters (`_total`)."""
    types = dict(
        re.findall(r"^\| `(kvguard_[a-z0-9_]+)` \| ([a-z]+)", METRICS.read_text(), re.MULTILINE)
    )
    for rule in RULE_LIST:
        for name in COUNTER_FUNCTION.findall(rule.fields["expr"]):
            assert name.endswith("_total"), f"{rule.name}: rate/increase of {name}"
            assert types.get(name) == "counter", f"{rule.name}: {name} is not a counter"


def test_every_alert_has_a_unit_test():
    """Each alert name is evaluated by at least one promtool unit test."""
    tested = {
        name for path in UNIT_TESTS for name in re.findall(r"alertname: *(\w+)", path.read_text())
    }
    assert {a.name for a in ALERTS} <= tested


def test_every_recording_rule_has_a_unit_test():
    """Each recorded series is evaluated by a promtool expression test (its value checked)."""
    tested = {
        name
        for path in UNIT_TESTS
        for name in re.findall(
            r"^ *- expr: *([a-z_]+:[a-z0-9_]+:[a-z0-9_]+)", path.read_text(), re.M
        )
    }
    assert {r.name for r in RECORDS} <= tested


FLEET_RANKING = {
    "instance:kvguard_time_to_exhaustion_seconds:min",
    "instance:kvguard_time_to_exhaustion_seconds:bottom10",
    "instance:kvguard_headroom_bytes:bottom10",
    "instance:kvguard_gpu_memory_free:bottom10_ratio",
    "job:kvguard_time_to_exhaustion_seconds:min",
    "job:kvguard_headroom_bytes:min",
    "job:kvguard_gpu_memory_free:min_ratio",
}


def test_fleet_ranking_rules_are_there_and_rank_within_a_job():
    """Issue 12's fleet view: engines ranked by time to exhaustion and headroom, per job."""
    records = {r.name: r.fields["expr"] for r in RECORDS}
    assert set(records) >= FLEET_RANKING
    for name in FLEET_RANKING:
        if ":bottom10" in name:
            assert records[name].startswith("bottomk by (job) (10, "), name


def test_the_parser_reads_block_scalars_and_maps():
    """The small YAML reader keeps multi-line expressions and folds descriptions."""
    rules = parse_rules(
        "groups:\n"
        "  - name: g\n"
        "    rules:\n"
        "      - record: a:b:c\n"
        "        expr: sum(x)\n"
        "      - alert: KVGuardX\n"
        "        expr: |\n"
        "          x > 1\n"
        "          and y\n"
        "        for: 5s\n"
        "        labels:\n"
        "          severity: 'info'\n"
        "        annotations:\n"
        "          description: >-\n"
        "            one\n"
        "            two\n"
        '          runbook_url: "https://h/p#a"\n'
    )
    assert [(r.kind, r.name) for r in rules] == [("record", "a:b:c"), ("alert", "KVGuardX")]
    assert rules[0].fields == {"expr": "sum(x)"}
    assert rules[1].fields == {"expr": "x > 1\nand y", "for": "5s"}
    assert rules[1].labels == {"severity": "info"}
    assert rules[1].annotations == {"description": "one two", "runbook_url": "https://h/p#a"}


# ------------------------------------------------- recording rules, alerts and dashboards
RECORDING_PASSAGE = "### Recording rules"
OWN_QUERIES = "your own queries"
# A rule comment that says a dashboard (Grafana, a panel of ours) reads the series.
DASHBOARD_CLAIM = re.compile(r"dashboard|grafana", re.I)


def rule_comments(text: str) -> dict[str, str]:
    """Each recording rule's comment: the comment lines last seen above its ``- record:``.

    A comment covers the rules after it up to the next comment (two rules may share
    one). The file's header, above ``groups:``, belongs to no rule.
    """
    comments: dict[str, str] = {}
    block: list[str] = []
    in_comment = False
    body = text[text.index("\ngroups:") :]
    for line in body.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            block = block if in_comment else []
            block.append(stripped.lstrip("#").strip())
            in_comment = True
            continue
        in_comment = False
        head = re.match(r"^ *- record: *(\S+)", line)
        if head:
            comments[head[1]] = " ".join(block)
    return comments


def dashboard_queries() -> list[str]:
    """Every PromQL text of the shipped dashboards: panel targets and variable queries."""

    def walk(node: object) -> list[str]:
        if isinstance(node, dict):
            found = []
            for key, value in node.items():
                if key in ("expr", "query", "definition") and isinstance(value, str):
                    found.append(value)
                else:
                    found += walk(value)
            return found
        if isinstance(node, list):
            return [text for item in node for text in walk(item)]
        return []

    return [q for path in DASHBOARD_JSON for q in walk(json.loads(path.read_text()))]


def reads(expr: str, name: str) -> bool:
    """Whether a PromQL expression reads the recorded series ``name``."""
    return name in RECORDED_NAME.findall(expr)


def recording_passage(text: str) -> dict[str, str]:
    """docs/monitoring.md's recording-rules table: each recorded name and its "read by" cell."""
    start = text.index(RECORDING_PASSAGE)
    end = text.find("\n#", start + 1)
    rows: dict[str, str] = {}
    for line in text[start : end if end >= 0 else None].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3 or set(cells[0]) <= set("-: "):
            continue
        for name in re.findall(r"`([^`]+)`", cells[0]):
            if RECORD_NAME.match(name):
                assert name not in rows, f"{name} listed twice"
                rows[name] = cells[-1]
    return rows


def test_every_recording_rule_is_read_by_an_alert_or_documented_for_own_queries():
    """A recorded series earns its keep: an alert of the file reads it, or the docs offer it.

    docs/monitoring.md's table lists every recorded name; its "read by" cell names the
    alerts whose expressions read the series (exactly those), or says "your own
    queries". The header's promise that the dashboards query raw series holds too.
    """
    rows = recording_passage(MONITORING.read_text())
    assert set(rows) == {r.name for r in RECORDS}, "the docs' table and the rules file differ"
    for record in RECORDS:
        readers = {a.name for a in ALERTS if reads(a.fields["expr"], record.name)}
        cell = rows[record.name]
        named = set(re.findall(r"KVGuard\w+", cell))
        if readers:
            assert named == readers, (record.name, cell, readers)
        else:
            assert named == set(), (record.name, cell, "no alert reads it")
            assert cell == OWN_QUERIES, (record.name, cell)


def test_rule_comments_claim_no_dashboard_or_alert_that_does_not_read_the_rule():
    """A rule's comment says a dashboard reads it only if one does; the same for an alert.

    The file's header says the dashboards query raw series: no dashboard query may read
    a recorded series while it says so.
    """
    text = RULES.read_text()
    comments = rule_comments(text)
    assert set(comments) == {r.name for r in RECORDS}
    queries = dashboard_queries()
    assert queries, "no dashboard query found"
    used = {r.name for r in RECORDS if any(reads(q, r.name) for q in queries)}
    header = " ".join(line.lstrip("# ") for line in text[: text.index("\ngroups:")].splitlines())
    if "dashboards query the raw kvguard_* series" in header:
        assert used == set(), "the header says the dashboards query raw series"
    false_claims = [
        f"{name}: {comment}"
        for name, comment in comments.items()
        if DASHBOARD_CLAIM.search(comment) and name not in used
    ]
    assert false_claims == []
    for name, comment in comments.items():
        for alert in re.findall(r"(KVGuard\w+) reads it", comment):
            assert any(a.name == alert and reads(a.fields["expr"], name) for a in ALERTS), (
                name,
                alert,
            )


def test_the_rule_and_dashboard_readers_find_what_they_look_for(tmp_path):
    """The comment reader ties comments to the rules below them; a false claim is found."""
    text = (
        "# header: the dashboards say nothing here\n"
        "groups:\n"
        "  - name: g\n"
        "    rules:\n"
        "      # The fullest GPU: the fleet dashboard sorts on it.\n"
        "      - record: a:b:c\n"
        "        expr: min(x)\n"
        "      # Two rules, one comment,\n"
        "      # over two lines.\n"
        "      - record: a:b:d\n"
        "        expr: max(x)\n"
        "      - record: a:b:e\n"
        "        expr: sum(x)\n"
    )
    assert rule_comments(text) == {
        "a:b:c": "The fullest GPU: the fleet dashboard sorts on it.",
        "a:b:d": "Two rules, one comment, over two lines.",
        "a:b:e": "Two rules, one comment, over two lines.",
    }
    assert DASHBOARD_CLAIM.search(rule_comments(text)["a:b:c"])
    assert reads("bottomk(10, a:b:c)", "a:b:c")
    assert not reads("bottomk(10, a:b:cd)", "a:b:c")
    assert not reads("x:a:b:c", "a:b:c")
    page = tmp_path / "page.md"
    page.write_text(
        "### Recording rules: x\n\n| series | what | read by |\n|---|---|---|\n"
        "| `a:b:c`, `a:b:d` | it | `KVGuardX` |\n| `a:b:e` | it | your own queries |\n"
        "\n## Next\n| `a:b:f` | not in the passage | x |\n"
    )
    assert recording_passage(page.read_text()) == {
        "a:b:c": "`KVGuardX`",
        "a:b:d": "`KVGuardX`",
        "a:b:e": "your own queries",
    }
