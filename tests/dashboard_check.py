"""The Grafana dashboard deploy/grafana/edl-agent.json as Grafana reads it, and a real Prometheus
that runs its queries against an agent (and a restarter) labelled as in production.

Used by tests/test_grafana_dashboard.py (the agent, no Kubernetes) and
tests/cluster/test_grafana_dashboard.py (the agent and `edl-agent restarter` on a real API
server). The scrape configuration is built from deploy/daemonset/service-monitors.yaml and the
Services it selects, the way the Prometheus Operator turns a ServiceMonitor into one: a change
of job or label there changes the series the dashboard is tested against.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from edl_agent.sim import inject
from edl_agent.sim.profile import load_profile
from edl_agent.sim.tree import build_tree
from tests.kubelet_standin import KubeletStandIn
from tests.podresources_standin import PodResourcesStandIn
from tests.prometheus_runner import Prometheus, free_port, get, wait_until_serving
from tests.waiting import WaitTimeout, wait_for, wait_until

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "edl-agent.json"
DAEMONSET = REPO / "deploy" / "daemonset"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

NODE = "gpu-node-a"
"""The node the simulated agent runs on, as Prometheus labels it (and `$node` selects)."""
AGENT_POD = "edl-agent-x7k2p"
"""The agent's pod, as service discovery would name it (its target label is dropped)."""
GPU = "nvidia.com/gpu"
HOLDERS = {
    ("training", "resnet-worker-0"): {"trainer": (0, 1)},
    ("training", "resnet-worker-1"): {"trainer": (2, 3)},
}
"""Pods holding GPUs (by index), as kubelet's pod-resources API would list them."""
UNHEALTHY_GPU, XID = 3, 48  # a double-bit ECC error: Unhealthy until 300 s quiet

# What Grafana puts in for its built-in variables: a window with a few 1 s scrapes in it.
BUILT_IN = {"__rate_interval": "30s", "__interval": "15s", "__range": "5m"}
VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
METRIC = re.compile(r"\b(edl_[a-z0-9_]+|up)\b(?!\s*\()")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    duplicates = sorted({key for key in keys if keys.count(key) > 1})
    if duplicates:
        msg = f"duplicate keys {duplicates}"
        raise ValueError(msg)
    return dict(pairs)


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    """The dashboard; a key given twice (which json.loads would silently merge) is an error."""
    dashboard: dict[str, Any] = json.loads(path.read_text(), object_pairs_hook=_no_duplicate_keys)
    return dashboard


def all_panels(dashboard: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows included, and the panels a collapsed row keeps inside it."""
    found: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def variables(dashboard: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


@dataclass(frozen=True)
class Query:
    panel: str
    ref: str
    expr: str
    """As the dashboard has it, variables and all."""
    promql: str
    """With the variables put in as Grafana would."""

    @property
    def metrics(self) -> set[str]:
        """The metric names it reads (`up` included)."""
        return set(METRIC.findall(self.promql))

    @property
    def of_restarter(self) -> bool:
        return any(name.startswith("edl_restarter_") for name in self.metrics) or (
            "$restarter_job" in self.expr
        )

    def __str__(self) -> str:
        return f"{self.panel!r} {self.ref}: {self.promql}"


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """`expr` with `$name`, `${name}`, `${name:format}` and `[[name]]` replaced; KeyError names
    a variable that `values` does not have."""

    def value(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group is not None)
        if name not in values:
            msg = f"unknown variable ${name} in {expr!r}"
            raise KeyError(msg)
        return values[name]

    return VARIABLE.sub(value, expr)


def variable_values(dashboard: Mapping[str, Any], node: str = NODE) -> dict[str, str]:
    """Each variable's value as a viewer would have it: constants as the dashboard sets them,
    `node` selecting `node`, Grafana's built-in ones a window of a few scrapes."""
    values = dict(BUILT_IN)
    for name, variable in variables(dashboard).items():
        if variable["type"] == "constant":
            values[name] = variable["query"]
        elif name == "node":
            values[name] = node
        elif variable["type"] == "datasource":
            values[name] = "prometheus"
    return values


def queries(dashboard: Mapping[str, Any], node: str = NODE) -> list[Query]:
    values = variable_values(dashboard, node)
    return [
        Query(panel["title"], target["refId"], target["expr"], substitute(target["expr"], values))
        for panel in all_panels(dashboard)
        for target in panel.get("targets", [])
    ]


# --- Prometheus, configured as the Prometheus Operator configures it ----------------------------


def _label_name(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


def _documents(directory: Path) -> list[dict[str, Any]]:
    return [
        doc
        for path in sorted(directory.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if isinstance(doc, dict)
    ]


def _relabel(rule: Mapping[str, Any]) -> dict[str, Any]:
    """A ServiceMonitor relabeling (camelCase) as a Prometheus relabel_config."""
    keys = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    return {keys.get(key, key): value for key, value in rule.items()}


def scrape_configs(
    targets: Mapping[str, Iterable[tuple[str, str, str]]], directory: Path = DAEMONSET
) -> list[dict[str, Any]]:
    """Prometheus scrape configs for the ServiceMonitors in `directory`: `targets` maps a
    ServiceMonitor's name to its endpoints, each (pod, node, host:port). Each target gets the
    meta labels Kubernetes service discovery would give it, then the operator's relabelling
    (namespace, service, pod, container, endpoint, job from `jobLabel`) and the monitor's own."""
    documents = _documents(directory)
    monitors = {d["metadata"]["name"]: d for d in documents if d["kind"] == "ServiceMonitor"}
    services = [d for d in documents if d["kind"] == "Service"]
    configs = []
    for name, endpoints in targets.items():
        monitor = monitors[name]
        namespace = monitor["metadata"]["namespace"]
        selector = monitor["spec"]["selector"]["matchLabels"]
        [service] = [
            s
            for s in services
            if s["metadata"]["namespace"] == namespace
            and selector.items() <= s["metadata"].get("labels", {}).items()
        ]
        [endpoint] = monitor["spec"]["endpoints"]
        service_labels = {
            f"__meta_kubernetes_service_label_{_label_name(k)}": v
            for k, v in service["metadata"]["labels"].items()
        }
        job_label = monitor["spec"].get("jobLabel")
        job_rule: dict[str, Any] = (
            {
                "source_labels": [f"__meta_kubernetes_service_label_{_label_name(job_label)}"],
                "target_label": "job",
            }
            if job_label
            else {"target_label": "job", "replacement": service["metadata"]["name"]}
        )
        configs.append(
            {
                "job_name": f"serviceMonitor/{namespace}/{name}/0",
                "metrics_path": endpoint.get("path", "/metrics"),
                "static_configs": [
                    {
                        "targets": [address],
                        "labels": {
                            **service_labels,
                            "__meta_kubernetes_namespace": namespace,
                            "__meta_kubernetes_service_name": service["metadata"]["name"],
                            "__meta_kubernetes_pod_name": pod,
                            "__meta_kubernetes_pod_container_name": service["metadata"]["name"],
                            "__meta_kubernetes_pod_node_name": node,
                        },
                    }
                    for pod, node, address in endpoints
                ],
                "relabel_configs": [
                    *(
                        {"source_labels": [f"__meta_kubernetes_{meta}"], "target_label": label}
                        for meta, label in (
                            ("namespace", "namespace"),
                            ("service_name", "service"),
                            ("pod_name", "pod"),
                            ("pod_container_name", "container"),
                        )
                    ),
                    {"target_label": "endpoint", "replacement": endpoint["port"]},
                    job_rule,
                    *(_relabel(rule) for rule in endpoint.get("relabelings", [])),
                ],
            }
        )
    return configs


def _ready(prometheus: Prometheus) -> bool:
    try:
        return get(f"{prometheus.api}/-/ready")[0] == 200
    except OSError:
        return False  # not listening yet


def instant(prometheus: Prometheus, promql: str) -> list[dict[str, Any]]:
    """The query's series now; fails the test on a query Prometheus refuses (a typo, a
    many-to-many join), rather than taking it for an empty answer."""
    status, body, _ = get(f"{prometheus.api}/api/v1/query?query={urllib.parse.quote(promql)}")
    if status != 200:
        pytest.fail(f"Prometheus refused {promql!r} ({status}): {body.decode(errors='replace')}")
    result: list[dict[str, Any]] = json.loads(body)["data"]["result"]
    return result


def label_values(prometheus: Prometheus, label: str, match: str) -> list[str]:
    """What Grafana's `label_values(match, label)` lists."""
    url = (
        f"{prometheus.api}/api/v1/label/{label}/values?{urllib.parse.urlencode({'match[]': match})}"
    )
    status, body, _ = get(url)
    assert status == 200, body
    values: list[str] = json.loads(body)["data"]
    return values


def wait_for_series(
    prometheus: Prometheus, checked: Iterable[Query], timeout: float = 30
) -> dict[Query, list[dict[str, Any]]]:
    """Each query's series once every query has at least one, and every metric it reads has
    series of its own (so that `... or vector(0)` cannot hide a renamed metric); fails naming
    those still without after `timeout`."""
    checked = list(checked)
    names = sorted({name for query in checked for name in query.metrics})
    wait_until(lambda: _ready(prometheus), what="Prometheus to serve", timeout=60, poll=0.2)

    def look() -> tuple[dict[Query, list[dict[str, Any]]], list[str], list[str]]:
        answers = {query: instant(prometheus, query.promql) for query in checked}
        absent = [name for name in names if not instant(prometheus, f"count({name})")]
        empty = [str(query) for query, series in answers.items() if not series]
        return answers, absent, empty

    try:
        answers, _, _ = wait_for(
            "every query and metric to have series",
            look,
            lambda found: not found[1] and not found[2],
            timeout=timeout,
            poll=0.5,
        )
    except WaitTimeout:
        _, absent, empty = look()
        pytest.fail(
            f"after {timeout:.0f}s, metrics without series: {absent}; "
            "queries without series:\n  " + "\n  ".join(empty),
            pytrace=False,
        )
    return answers


# --- a simulated agent --------------------------------------------------------------------------


class SimulatedAgent:
    """`edl-agent run` as a process on a simulated dgx-h100, registered with a kubelet stand-in
    and attributing GPUs to pods through a pod-resources stand-in (`HOLDERS`)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.tree = directory / "node"
        self.kubelet = KubeletStandIn(directory / "kubelet")
        self.pod_resources = PodResourcesStandIn(directory / "pod-resources" / "kubelet.sock")
        self.address = f"127.0.0.1:{free_port()}"
        self.log = directory / "agent.log"
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> SimulatedAgent:
        build_tree(load_profile("dgx-h100"), self.tree)
        self.kubelet.start()
        self.pod_resources.start()
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable, "-m", "edl_agent.cli", "run", "--host-root", str(self.tree),
                    "--kubelet-dir", str(self.kubelet.directory), "--metrics-addr", self.address,
                    "--log-format", "json",
                    "--set", f"pod_resources_socket={self.pod_resources.socket}",
                    "--set", "health.remediation.enabled=true",
                    # Served both ways, so that the DRA panel has series too.
                    "--set", "nvidia.serve=both",
                    "--set", f"dra.plugins_registry_dir={self.directory / 'registry'}",
                    "--set", f"dra.cdi_dir={self.directory / 'cdi'}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            self.kubelet.wait_registered({GPU}, timeout=60)
            wait_until_serving(f"http://{self.address}")
            ids = self.gpu_ids()
            self.pod_resources.assign(
                {
                    pod: {
                        container: {GPU: [ids[index] for index in indexes]}
                        for container, indexes in containers.items()
                    }
                    for pod, containers in HOLDERS.items()
                }
            )
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=20)
        self.pod_resources.stop()
        self.kubelet.stop()

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.returncode

    def exposition(self) -> str:
        status, body, _ = get(f"http://{self.address}/metrics")
        assert status == 200, body
        return body.decode()

    def gpu_ids(self) -> dict[int, str]:
        """GPU index → device id, as the agent exports them."""
        return {
            int(sample.labels["index"]): sample.labels["device_id"]
            for family in text_string_to_metric_families(self.exposition())
            if family.name == "edl_device_healthy"
            for sample in family.samples
        }

    def provoke_faults(self) -> None:
        """What the fault panels show: an XID that takes a held GPU down, and a part of the
        agent failing. For the latter kubelet's device-plugin directory is taken by a file: the
        agent's plugin step raises (counted, retried) until it is a directory again; then the
        agent serves its plugin again and registers anew, as after a kubelet restart."""
        inject.inject_xid(self.tree, UNHEALTHY_GPU, XID)
        wait_until(
            lambda: f'index="{UNHEALTHY_GPU}",xid="{XID}"' in self.exposition(),
            what="the XID counted",
            timeout=60,
            poll=0.2,
        )
        registered = len(self.kubelet.registrations)
        self.kubelet.stop()

        def taken_by_a_file() -> bool:
            # The agent makes the directory again when it sees it gone, maybe before the file
            # is written: then remove it once more.
            shutil.rmtree(self.kubelet.directory, ignore_errors=True)
            try:
                self.kubelet.directory.write_text("not a directory\n")
            except IsADirectoryError:
                return False
            return True

        wait_until(taken_by_a_file, what="kubelet's directory taken by a file", timeout=30)
        wait_until(
            lambda: 'edl_agent_step_failures_total{step="plugins"}' in self.exposition(),
            what="the agent's plugin step to fail",
            timeout=60,
            poll=0.2,
        )
        self.kubelet.directory.unlink()
        self.kubelet.directory.mkdir()
        self.kubelet.start()
        self.kubelet.wait_registered({GPU}, after=registered, timeout=30)
