"""The Grafana dashboard (docs/grafana/trio-pd.json) queries only metrics a live router exports.

Every PromQL expression of the dashboard (panel targets, nested rows included, and the template
variables' queries) is tokenized; its metric names and the labels it filters or groups by are
checked against the `/metrics` text of a real router that served the traffic making the series
appear: a plain request, a stream, a prefill failure, a client disconnect, admission queueing.
A family that has not been touched yet (no sample) still prints `# TYPE`, which is accepted for
the families listed in TYPE_ONLY; their labels are checked against the label names the router
declares for them (`declared_labels`), so a panel filtering or grouping such a family by a
label it does not have fails as well. One misspelled letter anywhere is reported.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import httpx2
import pytest
import trio
from prometheus_client.metrics import MetricWrapperBase

from tests.conftest import start_cluster, start_engine
from tests.ops.serve import start_serve
from tests.router.helpers import generate_body
from trio_pd.edge.router import Router
from trio_pd.observe.metrics import FleetCollector

DASHBOARD_PATH = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "trio-pd.json"
ROWS = ["Traffic", "Failures and containment", "Fleet", "Admission", "Operations"]

# Series that are not in a router's /metrics: `up` is written by Prometheus for every target.
PROMETHEUS_SERIES = {"up"}
# Labels Prometheus adds to every scraped series (the dashboard filters on them).
TARGET_LABELS = {"job", "instance"}

# Families that exist only in `--workers N` mode, checked by the test that runs one: the
# supervising parent's restart counter.
MULTIPROCESS_ONLY = {"trio_pd_process_restarts_total"}

# Families the traffic below cannot make appear: nothing in the router increments them yet, or
# only an unexpected crash (background restarts) or a membership source (--membership-file or
# --workers N) would. Their `# TYPE` line is enough.
TYPE_ONLY = {
    "trio_pd_panic_selections_total",  # only when every breaker of a role is open
    "trio_pd_membership_errors_total",
    "trio_pd_background_restarts_total",
    "trio_pd_membership_source_up",
}


# -- the dashboard ----------------------------------------------------------------------------


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD_PATH.read_text())


def iter_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels (collapsed rows keep theirs inside) included."""
    for panel in panels:
        yield panel
        yield from iter_panels(panel.get("panels", []))


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every target expression and every query variable."""
    found = []
    for panel in iter_panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            if target.get("expr"):
                found.append((f"panel {panel.get('title')!r} {target['refId']}", target["expr"]))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable["query"]
        query = query.get("query", "") if isinstance(query, dict) else query
        found.append((f"variable {variable['name']!r}", query))
    return found


# -- PromQL: a small tokenizer ----------------------------------------------------------------

TOKEN = re.compile(
    r"""
      (?P<space>\s+)
    | (?P<comment>\#[^\n]*)
    | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
    | (?P<variable>\$\{[^}]*\}|\$\w+|\[\[[^\]]*\]\])
    | (?P<range>\[[^\[\]]*\])
    | (?P<duration>(?:\d+(?:ms|[smhdwy]))+(?![\w.]))
    | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
    | (?P<ident>[A-Za-z_:][\w:]*)
    | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^<>=,(){}@])
    """,
    re.VERBOSE,
)
# Words that take a parenthesized list of label names.
LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
# Aggregation operators may be followed by `by (...)` instead of their argument's parenthesis.
AGGREGATIONS = {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk",
    "topk", "quantile", "limitk", "limit_ratio",
}  # fmt: skip
KEYWORDS = {"bool", "and", "or", "unless", "offset", "inf", "nan", "atan2"}


def tokenize(expr: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    while pos < len(expr):
        match = TOKEN.match(expr, pos)
        if match is None:
            raise ValueError(f"cannot tokenize {expr[pos:]!r} in {expr!r}")
        pos = match.end()
        kind = match.lastgroup or ""
        if kind not in ("space", "comment"):
            tokens.append((kind, match.group()))
    return tokens


@attrs.define
class Query:
    metrics: set[str] = attrs.Factory(set)
    # metric -> label names of the matchers written right after it
    selector_labels: dict[str, set[str]] = attrs.Factory(dict)
    # label names of by/without/on/ignoring/group_* lists
    grouping_labels: set[str] = attrs.Factory(set)


def parse_promql(expr: str) -> Query:
    """The metric names of a PromQL expression, and the label names it relies on.

    Identifiers are metric names unless they call a function (`rate(`), are an aggregation or
    a keyword, or stand in a label position (inside `{...}`, or in a `by (...)`-like list).
    `{__name__="x"}` names metric x. Grafana's `label_values(expr, label)` is accepted too.
    """
    query = Query()
    grafana = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", expr, re.DOTALL)
    if grafana:
        inner = parse_promql(grafana.group(1))
        inner.grouping_labels.add(grafana.group(2))
        return inner
    tokens = tokenize(expr)
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if kind == "ident" and text.lower() in LABEL_LISTS:
            i += 1
            if following == "(":
                i += 1
                while tokens[i][1] != ")":
                    if tokens[i][0] == "ident":
                        query.grouping_labels.add(tokens[i][1])
                    i += 1
                i += 1
            continue
        if kind == "ident" and following != "(" and text.lower() not in AGGREGATIONS | KEYWORDS:
            i = _selector(tokens, i + 1, text, query)
            continue
        if text == "{":  # a selector without a metric name in front
            i = _selector(tokens, i, None, query)
            continue
        i += 1
    return query


def _selector(tokens: list[tuple[str, str]], i: int, metric: str | None, query: Query) -> int:
    """Read the optional `{label op "value", ...}` at i; returns the index after it."""
    labels: set[str] = set()
    if i < len(tokens) and tokens[i][1] == "{":
        i += 1
        while tokens[i][1] != "}":
            kind, text = tokens[i]
            if kind == "ident":
                op, value = tokens[i + 1][1], tokens[i + 2]
                if text == "__name__":
                    if op != "=" or value[0] != "string":
                        raise ValueError('only __name__="..." is supported')
                    metric = value[1][1:-1]
                else:
                    labels.add(text)
                i += 3
            else:
                i += 1  # a comma
        i += 1
    if metric is None:
        raise ValueError("a selector without a metric name")
    query.metrics.add(metric)
    query.selector_labels.setdefault(metric, set()).update(labels)
    return i


# -- the exposition text ----------------------------------------------------------------------

SAMPLE = re.compile(r"([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s")
LABEL = re.compile(r'([A-Za-z_]\w*)="(?:\\.|[^"\\])*"')
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
}


@attrs.define
class Exposition:
    # family -> type, from `# TYPE` (a counter's family is written with `_total` in the text
    # format, without it in OpenMetrics: both are understood)
    types: dict[str, str]
    samples: dict[str, set[str]]  # sample name -> label names seen on it

    @classmethod
    def parse(cls, text: str) -> Exposition:
        types: dict[str, str] = {}
        samples: dict[str, set[str]] = {}
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, family, kind = line.split(maxsplit=3)
                types[family] = kind
            elif line and not line.startswith("#"):
                match = SAMPLE.match(line)
                assert match, line
                labels = samples.setdefault(match.group(1), set())
                labels.update(LABEL.findall(match.group(2) or ""))
        return cls(types, samples)

    def type_only(self, name: str) -> str | None:
        """The family (its name without a counter's `_total`) when `name` is a series of a
        family that has a `# TYPE` line but no sample yet, else None."""
        for family, kind in self.types.items():
            base = family.removesuffix("_total") if kind == "counter" else family
            names = [base + suffix for suffix in SUFFIXES.get(kind, ("",))]
            if name in names and not any(n in self.samples for n in names):
                return base
        return None


@attrs.define
class Report:
    missing: dict[str, str] = attrs.Factory(dict)  # name -> where it is queried
    type_only: set[str] = attrs.Factory(set)
    with_samples: set[str] = attrs.Factory(set)
    bad_labels: list[str] = attrs.Factory(list)


def check(
    queries: list[tuple[str, str]],
    text: str,
    skip: frozenset[str] = frozenset(),
    declared: Mapping[str, set[str]] | None = None,
) -> Report:
    """Which metric names of `queries` the exposition `text` has, and labels it lacks.

    A family with no sample yet is checked against `declared` (family -> label names, as the
    router declares them): its labels must be there as well."""
    exposition = Exposition.parse(text)
    declared = declared or {}
    report = Report()
    for where, expr in queries:
        query = parse_promql(expr)
        known_labels = set(TARGET_LABELS)
        unknown = False  # a name whose labels nobody knows: grouping cannot be checked
        for name in sorted(query.metrics - PROMETHEUS_SERIES - skip):
            family = None
            if name in exposition.samples:
                report.with_samples.add(name)
                have = exposition.samples[name]
            elif (family := exposition.type_only(name)) is not None:
                report.type_only.add(name)
                if family not in declared:
                    report.bad_labels.append(f"{where}: no declared labels for {family}")
                    unknown = True
                    continue
                have = declared[family] | ({"le"} if name.endswith("_bucket") else set())
            else:
                report.missing.setdefault(name, where)
                unknown = True
                continue
            known_labels |= have
            for label in sorted(query.selector_labels[name] - have - TARGET_LABELS):
                report.bad_labels.append(f"{where}: {name} has no label {label!r}")
        if not unknown and query.metrics - PROMETHEUS_SERIES - skip:
            for label in sorted(query.grouping_labels - known_labels):
                report.bad_labels.append(f"{where}: no metric of it has label {label!r}")
    return report


def declared_labels(router: Router) -> dict[str, set[str]]:
    """Family name (a counter's without `_total`) -> the label names the router declares for
    it, sampled or not: prometheus-client keeps them on each metric (`_labelnames`, there since
    its first releases), the scrape-time gauges on each family they yield."""
    found: dict[str, set[str]] = {}
    for value in vars(router.metrics).values():
        if isinstance(value, MetricWrapperBase):
            found[value._name] = set(value._labelnames)
    for family in FleetCollector(router.fleet, router.pool, lambda: 0).collect():
        found[family.name] = set(family._labelnames)
    return found


# -- offline tests: the parser, and that the checker can fail ----------------------------------


def test_the_tokenizer_finds_metric_names_and_labels_only() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (le, role) (rate(trio_pd_leg_teardown_seconds_bucket"
        '{job=~"$job", role="decode", note="trio_pd_not_a_metric"}[$__rate_interval]))) '
        "/ on (role) group_left (url) max without (pid) (trio_pd_worker_healthy offset 5m) "
        '> bool 1e3 or {__name__="trio_pd_by_name"}[5m:1m] or sum(up) by (instance)'
    )
    query = parse_promql(expr)
    assert query.metrics == {
        "trio_pd_leg_teardown_seconds_bucket", "trio_pd_worker_healthy", "trio_pd_by_name", "up",
    }  # fmt: skip
    assert query.selector_labels["trio_pd_leg_teardown_seconds_bucket"] == {"job", "role", "note"}
    assert query.grouping_labels == {"le", "role", "url", "pid", "instance"}
    variable = parse_promql('label_values(trio_pd_requests_total{job=~"$job"}, instance)')
    assert variable.metrics == {"trio_pd_requests_total"}
    assert variable.grouping_labels == {"instance"}
    with pytest.raises(ValueError):
        tokenize("rate(x[5m]) ? 1")


def test_a_misspelled_name_or_label_is_reported() -> None:
    text = "\n".join([
        "# HELP trio_pd_requests_total Client requests.",
        "# TYPE trio_pd_requests_total counter",
        'trio_pd_requests_total{path="/generate",status="200"} 1.0',
        "# TYPE trio_pd_requests_created gauge",
        'trio_pd_requests_created{path="/generate",status="200"} 1.7e9',
        "# TYPE trio_pd_aborts_total counter",
        "# TYPE trio_pd_leg_teardown_seconds histogram",
        "",
    ])  # fmt: skip
    queries = [
        ("a", 'sum by (status) (rate(trio_pd_requests_total{path="/generate"}[5m]))'),
        ("b", "rate(trio_pd_aborts_total[5m]) + rate(trio_pd_leg_teardown_seconds_count[5m])"),
        ("c", "rate(trio_pd_request_total[5m])"),  # misspelled
        ("d", "rate(trio_pd_requests[5m])"),  # the family's name: not a series of a counter
        ("e", "rate(trio_pd_aborts[5m])"),
        ("f", 'sum by (kind) (rate(trio_pd_requests_total{paht="/generate"}[5m]))'),
        # families with no sample yet: their declared labels are checked too
        ("g", 'sum by (role, result) (rate(trio_pd_aborts_total{result="sent"}[5m]))'),
        ("h", 'sum by (rol) (rate(trio_pd_aborts_total{reslt="sent"}[5m]))'),
        ("i", "sum by (le, role) (rate(trio_pd_leg_teardown_seconds_bucket[5m]))"),
    ]
    declared = {"trio_pd_aborts": {"role", "result"}, "trio_pd_leg_teardown_seconds": {"role"}}
    report = check(queries, text, declared=declared)
    assert report.with_samples == {"trio_pd_requests_total"}
    assert report.type_only == {
        "trio_pd_aborts_total", "trio_pd_leg_teardown_seconds_count",
        "trio_pd_leg_teardown_seconds_bucket",
    }  # fmt: skip
    assert report.missing == {
        "trio_pd_request_total": "c", "trio_pd_requests": "d", "trio_pd_aborts": "e",
    }  # fmt: skip
    assert report.bad_labels == [
        "f: trio_pd_requests_total has no label 'paht'",
        "f: no metric of it has label 'kind'",
        "h: trio_pd_aborts_total has no label 'reslt'",
        "h: no metric of it has label 'rol'",
    ]
    # Without the declared labels a family with no sample cannot pass unchecked.
    undeclared = check(queries[6:7], text).bad_labels
    assert undeclared == ["g: no declared labels for trio_pd_aborts"]


def test_the_dashboard_is_well_formed() -> None:
    dashboard = load_dashboard()
    assert dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = list(iter_panels(dashboard["panels"]))
    assert [p["title"] for p in panels if p["type"] == "row"] == ROWS
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel.get("description"), panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            expr = target["expr"]
            assert "$job" in expr and "$instance" in expr, (panel["title"], expr)
            # counters and histograms are only ever read through rate()/increase()
            for name in parse_promql(expr).metrics:
                if name.endswith(("_total", "_bucket", "_count", "_sum")):
                    assert re.search(rf"(rate|increase)\({name}\b", expr), (panel["title"], name)
            # quantiles of histograms aggregated over instances by their buckets
            assert expr.count("histogram_quantile(") == expr.count(", sum by (le"), expr


# -- live routers -----------------------------------------------------------------------------


async def drive_every_series(client: httpx2.AsyncClient, decode_events: Any) -> None:
    """Traffic through a router with one concurrent slot and a queue of one."""
    # A plain request, a stream (time to first token, chunk gaps, events relayed).
    assert (await client.post("/generate", json=generate_body())).status_code == 200
    async with client.stream("POST", "/generate", json=generate_body(stream=True)) as response:
        assert response.status_code == 200
        await response.aread()
    # A prefill that fails: leg failure, the decode cancelled (prefill_failed), its teardown.
    body = generate_body(stream=True, sim_fault="prefill:500@50")
    assert (await client.post("/generate", json=body)).status_code == 502
    # A client that leaves mid-stream: 499, both legs cancelled (client_gone).
    body = generate_body(stream=True, max_new_tokens=200)
    async with client.stream("POST", "/generate", json=body) as response:
        rid = response.headers["x-request-id"]
        async for _ in response.aiter_lines():
            break
    await decode_events.wait_for("connection_closed", timeout=10, rid=rid)
    # Admission: one request runs, one waits in line (admitted later), one finds the line full.
    statuses: dict[str, int] = {}

    async def send(name: str) -> None:
        body = generate_body(max_new_tokens=30)
        response = await client.post("/generate", json=body, headers={"x-request-id": name})
        statuses[name] = response.status_code

    async with trio.open_nursery() as burst:
        burst.start_soon(send, "running")
        await decode_events.wait_for("request_start", timeout=10, rid="running")
        burst.start_soon(send, "queued")
        await trio.sleep(0.1)  # in line
        burst.start_soon(send, "rejected")
    assert statuses == {"running": 200, "queued": 200, "rejected": 429}


async def test_every_dashboard_metric_is_exported(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(
        nursery,
        max_concurrent_requests=1,
        queue_size=1,
        queue_timeout_secs=10.0,
        decode={"inter_token_ms": 10.0},
        abort_on_cancel=True,  # as in production: the aborts panel has its series
    )
    await drive_every_series(cluster.client, cluster.decode.events)
    declared = declared_labels(cluster.router)
    with trio.fail_after(10):  # the 499 is counted once the router's request task ends
        while 'status="499"' not in (text := (await cluster.client.get("/metrics")).text):
            await trio.sleep(0.05)
    await cluster.client.aclose()

    queries = dashboard_queries(load_dashboard())
    used = set().union(*(parse_promql(expr).metrics for _, expr in queries))
    assert all(name.startswith("trio_pd_") for name in used - PROMETHEUS_SERIES), used
    report = check(queries, text, skip=frozenset(MULTIPROCESS_ONLY), declared=declared)
    assert report.missing == {}
    assert report.bad_labels == []
    assert report.type_only, "the exceptions below are still needed"
    assert report.type_only <= TYPE_ONLY, report.type_only - TYPE_ONLY
    assert "trio_pd_aborts_total" in report.with_samples

    # The labels of a family with no sample are checked: a wrong one in the real dashboard's
    # query of each such family is reported.
    for name in sorted(report.type_only):
        where, expr = next((w, e) for w, e in queries if name in parse_promql(e).metrics)
        wrong = expr.replace("sum by (", "sum by (nosuch, ").replace("min by (", "min by (nosuch, ")
        assert wrong != expr, expr
        assert check([(where, wrong)], text, declared=declared).bad_labels == [
            f"{where}: no metric of it has label 'nosuch'"
        ], name
    assert used >= MULTIPROCESS_ONLY  # the exceptions are still queried, so still needed

    # The same check fails for a misspelled name in the real dashboard and the real text.
    broken = load_dashboard()
    target = next(p for p in iter_panels(broken["panels"]) if p.get("targets"))["targets"][0]
    target["expr"] = target["expr"].replace("trio_pd_requests_total", "trio_pd_request_total")
    assert "trio_pd_request_total" in target["expr"]
    assert "trio_pd_request_total" in check(dashboard_queries(broken), text).missing
    for wrong in ("trio_pd_requests", "trio_pd_leg_teardown_seconds", "trio_pd_retry_total"):
        assert wrong in check([("x", f"rate({wrong}[1m])")], text).missing


async def test_multiprocess_only_metrics_exist_with_workers(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """`trio-pd serve --workers 2`: the names the single-process router does not have."""
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    router = await start_serve([prefill], [decode], str(tmp_path / "router.log"), "--workers", "2")
    try:
        await router.wait_ready()
        async with httpx2.AsyncClient(base_url=router.url, timeout=10) as client:
            assert (await client.post("/generate", json=generate_body())).status_code == 200
            text = (await client.get("/metrics")).text
        router.signal(signal.SIGTERM)
        assert await router.wait_exit() == 0
    finally:
        await router.stop()
    # The dashboard's queries of those names, their labels included; any other names in them
    # are the single-process test's.
    queries = [
        q
        for q in dashboard_queries(load_dashboard())
        if parse_promql(q[1]).metrics & MULTIPROCESS_ONLY
    ]
    others = set().union(*(parse_promql(expr).metrics for _, expr in queries)) - MULTIPROCESS_ONLY
    report = check(queries, text, skip=frozenset(others))
    assert report.missing == {}
    assert report.bad_labels == []
    assert report.with_samples == MULTIPROCESS_ONLY
