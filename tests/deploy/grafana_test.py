#!/usr/bin/env python3
"""Checks deploy/grafana/gpufeed.json against the metrics gpufeedd exports (metrics.txt).

    grafana_test.py dashboard DASHBOARD.json   structure, metric names, label names, variables
    grafana_test.py promql DASHBOARD.json      every query parses (promtool); exit 77 without it

Exit 0 when all holds, 1 with one line per problem, 77 (ctest's skip) when promtool is absent.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, Iterator, List, Set, Tuple

import metrics_contract

# Labels Prometheus adds to every scraped series (`job` is not among them: with honor_labels,
# as deploy/k8s/podmonitor.yaml sets, only the per-consumer series carry a `job`, their own).
TARGET_LABELS = {"instance"}
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range", "__interval_ms"}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
IDENT = re.compile(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b")
LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)\s*$", re.S)
VARIABLE = re.compile(r"\$(?:\{([a-zA-Z_][a-zA-Z0-9_]*)(?::[a-z]+)?\}|([a-zA-Z_][a-zA-Z0-9_]*))")
# PromQL words that are not metric names.
PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "topk", "bottomk", "quantile", "stddev", "stdvar",
    "group", "count_values", "by", "without", "on", "ignoring", "group_left", "group_right",
    "and", "or", "unless", "bool", "offset", "rate", "irate", "increase", "delta", "idelta",
    "histogram_quantile", "clamp_min", "clamp_max", "clamp", "abs", "vector", "scalar",
    "label_replace", "label_join", "time", "avg_over_time", "max_over_time", "min_over_time",
    "sum_over_time", "last_over_time", "resets", "changes", "absent", "sort", "sort_desc", "le",
}


def queries(dashboard: dict) -> Iterator[Tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield f"panel {panel.get('title')!r} target {target.get('refId')}", target["expr"]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            match = LABEL_VALUES.match(var["query"])
            # The metric selector of label_values(SELECTOR, LABEL) is PromQL.
            yield f"variable {var['name']}", match.group(1) if match else var["query"]


def panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def check_query(where: str, expr: str, series: Dict[str, metrics_contract.Family]) -> List[str]:
    problems = []
    used: Set[metrics_contract.Family] = set()
    buckets = False
    matcher_labels: List[Tuple[str, str]] = []
    for name, body in SELECTOR.findall(expr):
        if name not in series:
            problems.append(f"{where}: selects {name!r}, not a gpufeedd metric (metrics.txt)")
            continue
        used.add(series[name])
        buckets |= name.endswith("_bucket")
        for label in MATCHER.findall(body):
            if label not in series[name].labels | TARGET_LABELS:
                problems.append(f"{where}: {name} has no label {label!r} "
                                f"(it has {sorted(series[name].labels | TARGET_LABELS)})")
            elif label in series[name].optional:
                problems.append(f"{where}: {name}'s label {label!r} is there only with "
                                "metrics_job_labels (off by default): the panel would be empty")
            matcher_labels.append((name, label))
    bare = STRING.sub('""', SELECTOR.sub(lambda m: m.group(1), expr))
    for word in IDENT.findall(bare):
        if word in series:
            used.add(series[word])
            buckets |= word.endswith("_bucket")
        elif word.startswith("gpufeed_"):
            problems.append(f"{where}: {word!r} is not a gpufeedd metric (metrics.txt)")
    if not used:
        problems.append(f"{where}: queries no gpufeedd metric")
    # Without the opt-in labels (metrics_job_labels is off by default).
    known = (set().union(*(f.labels - f.optional for f in used)) | TARGET_LABELS
             | ({"le"} if buckets else set()))
    for group in GROUPING.findall(bare):
        labels = [s.strip() for s in group.split(",") if s.strip()]
        for label in labels:
            if label not in known:
                problems.append(f"{where}: groups by {label!r}, a label none of "
                                f"{sorted(f.name for f in used)} has")
        if "histogram_quantile" in bare and "le" not in labels:
            problems.append(f"{where}: histogram_quantile over an aggregation without 'le'")
    return problems


def check_dashboard(path: pathlib.Path) -> List[str]:
    try:
        dashboard = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        return [f"{path}: not valid JSON: {e}"]
    families = metrics_contract.load()
    series = metrics_contract.by_series_name(families)
    problems = []
    for key in ("title", "uid", "panels", "templating", "schemaVersion"):
        if key not in dashboard:
            problems.append(f"dashboard has no {key!r}")
    if problems:
        return problems

    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    ds = variables.get("datasource", {})
    if ds.get("type") != "datasource" or ds.get("query") != "prometheus":
        problems.append("no datasource variable of type datasource for prometheus")
    for name in ("instance", "job", "rank"):
        if variables.get(name, {}).get("type") != "query":
            problems.append(f"no query variable {name!r}")

    ids = [p.get("id") for p in panels(dashboard)]
    if len(ids) != len(set(ids)) or None in ids:
        problems.append(f"panel ids are missing or repeated: {ids}")
    for panel in panels(dashboard):
        grid = panel.get("gridPos", {})
        if not grid or grid["x"] < 0 or grid["x"] + grid["w"] > 24:
            problems.append(f"panel {panel.get('title')!r}: gridPos {grid} outside 24 columns")
        if panel["type"] == "row":
            continue
        if panel.get("datasource") != DATASOURCE:
            problems.append(f"panel {panel['title']!r}: datasource is not the $datasource variable")
        if not panel.get("targets"):
            problems.append(f"panel {panel['title']!r} has no query")
        for target in panel.get("targets", []):
            if target.get("datasource") != DATASOURCE:
                problems.append(f"panel {panel['title']!r} target {target.get('refId')}: "
                                "datasource is not the $datasource variable")
    for var in variables.values():
        if var["type"] == "query" and var.get("datasource") != DATASOURCE:
            problems.append(f"variable {var['name']}: datasource is not the $datasource variable")
        if var["type"] == "query" and var.get("definition", var["query"]) != var["query"]:
            problems.append(f"variable {var['name']}: definition and query differ")

    used_series: Set[str] = set()
    for where, expr in queries(dashboard):
        problems += check_query(where, expr, series)
        used_series |= {w for w in IDENT.findall(expr) if w in series}
        for braced, plain in VARIABLE.findall(expr):
            name = braced or plain
            if name not in variables and name not in GRAFANA_BUILTINS:
                problems.append(f"{where}: uses ${name}, which the dashboard does not define")
    for var in variables.values():
        match = LABEL_VALUES.match(var.get("query", "")) if var["type"] == "query" else None
        if match:
            names = [n for n in SELECTOR.findall(match.group(1))] or [(match.group(1).strip(), "")]
            family = series.get(names[0][0])
            if family and match.group(2) not in (family.labels - family.optional) | TARGET_LABELS:
                problems.append(f"variable {var['name']}: {family.name} has no label "
                                f"{match.group(2)!r}")
    # The headline: the data stall share is rate(wait) / rate(wall) per job and rank.
    stall = [e for _, e in queries(dashboard) if "gpufeed_consumer_wait_seconds_total" in e
             and "gpufeed_consumer_wall_seconds_total" in e]
    if not stall:
        problems.append("no panel shows the data stall share (consumer wait / wall)")
    unused = {f.name for f in families.values() if not f.series_names() & used_series}
    if unused:
        problems.append(f"metrics no panel shows: {sorted(unused)}")
    return problems


def check_promql(path: pathlib.Path) -> Tuple[int, List[str]]:
    promtool = shutil.which("promtool")
    if promtool is None:
        print("SKIP: promtool not found (Debian package prometheus); PromQL syntax not checked")
        return 77, []
    dashboard = json.loads(path.read_text(encoding="utf-8"))
    rules = []
    for i, (where, expr) in enumerate(queries(dashboard)):
        concrete = expr.replace("$__rate_interval", "1m")
        concrete = VARIABLE.sub(".*", concrete)
        rules.append({"record": f"dashboard_query_{i}", "expr": concrete,
                      "labels": {"where": where}})
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        # promtool reads YAML, of which JSON is a subset.
        json.dump({"groups": [{"name": "dashboard", "rules": rules}]}, f)
    try:
        run = subprocess.run([promtool, "check", "rules", f.name], capture_output=True, text=True)
    finally:
        pathlib.Path(f.name).unlink()
    if run.returncode != 0:
        return 1, [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    print(f"promtool parsed {len(rules)} queries")
    return 0, []


def main(argv: List[str]) -> int:
    if len(argv) != 3 or argv[1] not in ("dashboard", "promql"):
        print(__doc__, file=sys.stderr)
        return 2
    path = pathlib.Path(argv[2])
    if argv[1] == "promql":
        code, problems = check_promql(path)
    else:
        problems = check_dashboard(path)
        code = 1 if problems else 0
    for p in problems:
        print("FAIL:", p)
    if code == 0:
        print(f"ok: {argv[1]} {path}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
