"""deploy/grafana/edl-agent.json: well-formed as Grafana reads it, its variables all defined, and
every agent panel's every query answering with series on a real Prometheus that scrapes a
simulated agent (labelled as service-monitors.yaml labels it in production) after an XID and a
failing part of the agent. The restarter's queries run in tests/cluster/test_grafana_dashboard.py
against `edl-agent restarter` on a real API server; here its metric names are checked against
the restarter's own registry."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.metrics_core import Metric

from edl_agent.health.state import Snapshot
from edl_agent.metrics.collectors import EdlCollector
from edl_agent.restarter.core.metrics import IntakeCounts, RestarterMetrics
from tests.dashboard_check import (
    AGENT_POD,
    DASHBOARD,
    DATASOURCE,
    HOLDERS,
    NODE,
    UNHEALTHY_GPU,
    XID,
    SimulatedAgent,
    all_panels,
    label_values,
    load_dashboard,
    queries,
    scrape_configs,
    substitute,
    variable_values,
    variables,
    wait_for_series,
)
from tests.prometheus_runner import running_prometheus

GRID_COLUMNS = 24
# `kubectl apply` keeps the whole ConfigMap (the JSON escaped once more) in an annotation that
# may hold 256 KiB: leave room for the escaping.
MAX_BYTES = 200_000
# Exported, and deliberately not on the dashboard: a scrape-time source failing is for the
# agent's log; it has no series until one fails. The vendor tools' cost has series only on
# nodes of vendors read through tools (Ascend, Hygon, Kunlunxin), none on the NVIDIA node this
# check runs: a panel of it could not be checked here.
NOT_SHOWN = {"edl_metrics_source_errors", "edl_vendor_tool_runs", "edl_vendor_tool_seconds"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return load_dashboard()


def panels_of(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in all_panels(dashboard) if p["type"] != "row"]


def test_the_dashboard_is_current_grafana_json(dashboard: dict[str, Any]) -> None:
    assert dashboard["schemaVersion"] >= 39
    assert dashboard["uid"] == "edl-agent"
    assert dashboard["title"]
    assert len(DASHBOARD.read_bytes()) < MAX_BYTES


def test_panel_ids_are_unique_and_every_panel_has_a_title(dashboard: dict[str, Any]) -> None:
    ids = [panel["id"] for panel in all_panels(dashboard)]
    assert all(isinstance(i, int) and i > 0 for i in ids), ids
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    titles = [panel["title"] for panel in panels_of(dashboard)]
    assert all(titles), titles
    assert len(titles) == len(set(titles)), sorted(t for t in titles if titles.count(t) > 1)
    assert all(panel.get("description") for panel in panels_of(dashboard))


def test_every_panel_and_query_reads_the_datasource_variable(dashboard: dict[str, Any]) -> None:
    for panel in panels_of(dashboard):
        assert panel.get("datasource") == DATASOURCE, panel["title"]
        assert panel.get("targets"), panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource") == DATASOURCE, (panel["title"], target["refId"])
            assert target.get("expr", "").strip(), (panel["title"], target["refId"])


def test_every_panel_has_a_place_on_the_grid_and_none_overlap(dashboard: dict[str, Any]) -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in all_panels(dashboard):
        grid = panel.get("gridPos")
        assert grid is not None, panel["title"]
        assert all(isinstance(grid.get(k), int) for k in "hwxy"), (panel["title"], grid)
        assert min(grid["w"], grid["h"]) > 0, (panel["title"], grid)
        assert min(grid["x"], grid["y"]) >= 0, (panel["title"], grid)
        assert grid["x"] + grid["w"] <= GRID_COLUMNS, (panel["title"], grid)
        for cell in itertools.product(
            range(grid["x"], grid["x"] + grid["w"]), range(grid["y"], grid["y"] + grid["h"])
        ):
            assert cell not in cells, f"{panel['title']!r} overlaps {cells[cell]!r} at {cell}"
            cells[cell] = panel["title"]


def test_the_variables_pick_a_prometheus_and_its_nodes(dashboard: dict[str, Any]) -> None:
    defined = variables(dashboard)
    datasource = defined["datasource"]
    assert (datasource["type"], datasource["query"]) == ("datasource", "prometheus")
    node = defined["node"]
    assert node["type"] == "query"
    assert node["datasource"] == DATASOURCE
    assert re.fullmatch(r"label_values\(edl_\w+\{[^}]*\}, node\)", node["query"]["query"])
    assert node["definition"] == node["query"]["query"]
    assert node["multi"]
    assert node["includeAll"]
    assert all(defined[name]["type"] == "constant" for name in ("agent_job", "restarter_job"))


def test_every_query_uses_only_variables_the_dashboard_defines(dashboard: dict[str, Any]) -> None:
    values = variable_values(dashboard)
    for query in queries(dashboard):
        assert not re.search(r"\$|\[\[", query.promql), query
    with pytest.raises(KeyError, match="nodes"):
        substitute('edl_device_healthy{node=~"$nodes"}', values)
    agent_jobs = {'job="edl-agent"' in q.promql for q in queries(dashboard) if not q.of_restarter}
    assert agent_jobs == {True}
    restarter_jobs = {
        'job="edl-restarter"' in q.promql for q in queries(dashboard) if q.of_restarter
    }
    assert restarter_jobs == {True}


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "info": ("_info",)}


def _series_names(families: Iterable[Metric]) -> dict[str, str]:
    """Series name → its family, for metric families (labelled ones without samples yet
    included): a counter `x` has `x_total`, a histogram `x_bucket`, `x_count` and `x_sum`."""
    return {
        family.name + suffix: family.name
        for family in families
        for suffix in SUFFIXES.get(family.type, ("",))
    }


def _no_snapshot() -> Snapshot:
    raise AssertionError("only the families are read, never a snapshot")


@pytest.fixture(scope="module")
def exported() -> dict[str, str]:
    """Every series name the agent's collector and the restarter's registry expose, with its
    family."""
    restarter = RestarterMetrics()
    restarter.watch_intake(IntakeCounts)
    return _series_names(EdlCollector(snapshot=_no_snapshot).describe()) | _series_names(
        restarter.registry.collect()
    )


def test_the_dashboard_reads_what_the_agent_and_the_restarter_export(
    dashboard: dict[str, Any], exported: dict[str, str]
) -> None:
    read = {name for query in queries(dashboard) for name in query.metrics} - {"up"}
    assert read - exported.keys() == set()
    # And the other way round: every family they export is shown somewhere.
    shown = {exported[name] for name in read}
    assert set(exported.values()) - NOT_SHOWN - shown == set()


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[SimulatedAgent]:
    with SimulatedAgent(tmp_path / "agent") as running:
        yield running
    assert running.returncode == 0, running.log.read_text()


def test_every_agent_query_answers_with_series(
    dashboard: dict[str, Any], agent: SimulatedAgent, tmp_path: Path
) -> None:
    values = variable_values(dashboard)
    agent_queries = [q for q in queries(dashboard) if not q.of_restarter]
    assert len(agent_queries) > 30
    agent.provoke_faults()
    configs = scrape_configs({"edl-agent": [(AGENT_POD, NODE, agent.address)]})
    with running_prometheus([], tmp_path, scrape_configs=configs) as prometheus:
        answers = wait_for_series(prometheus, agent_queries)
        variable = substitute(variables(dashboard)["node"]["query"]["query"], values)
        found = re.fullmatch(r"label_values\((.+), (\w+)\)", variable)
        assert found is not None, variable
        assert label_values(prometheus, found[2], found[1]) == [NODE]

    def series(title: str, ref: str = "A") -> list[dict[str, str]]:
        [query] = [q for q in answers if (q.panel, q.ref) == (title, ref)]
        return [s["metric"] for s in answers[query]]

    def only(title: str) -> dict[str, str]:
        [labels] = series(title)
        return labels

    # Production's labels: the agent's target labels pod/namespace/container are dropped, so
    # those of the series are the workload's.
    assert {s.get("node") for s in series("Temperature")} == {NODE}
    assert {s["job"] for s in series("Temperature")} == {"edl-agent"}
    unhealthy = [s for s in series("Unhealthy devices now") if s["index"] == str(UNHEALTHY_GPU)]
    assert [(s["namespace"], s["pod"]) for s in unhealthy] == [("training", "resnet-worker-1")]
    why = only("Why: reasons the unhealthy devices turned Unhealthy")
    assert (why["index"], why["reason"]) == (str(UNHEALTHY_GPU), f"XID{XID}")
    assert {s["xid"] for s in series("XID errors since the agents started")} == {str(XID)}
    held = {(s["namespace"], s["pod"], s["index"]) for s in series("Utilisation by pod")}
    assert held == {
        (namespace, pod, str(index))
        for (namespace, pod), containers in HOLDERS.items()
        for indexes in containers.values()
        for index in indexes
    }
    table = series("Devices and the pods holding them", "B")
    assert len(table) == 8
    assert sum("pod" in s for s in table) == 4
    assert only("Failed agent steps, and state the disk does not hold")["step"] == "plugins"
