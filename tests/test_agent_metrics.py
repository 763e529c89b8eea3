"""`edl-agent run` as a process on a simulated node, scraped by a real Prometheus: an injected
fault shows in PromQL, /metrics passes promtool, /readyz follows the NVML monitor."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from edl_agent.sim import inject
from edl_agent.sim.profile import load_profile
from edl_agent.sim.tree import build_tree
from tests.kubelet_standin import KubeletStandIn
from tests.prometheus_runner import (
    free_port,
    get,
    need,
    running_prometheus,
    wait_until_serving,
)
from tests.waiting import wait_until


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """An agent process on a simulated dgx-h100; yields (tree, metrics base URL)."""
    tree = tmp_path / "node"
    build_tree(load_profile("dgx-h100"), tree)
    kubelet = KubeletStandIn(tmp_path / "kubelet")
    kubelet.start()
    address = f"127.0.0.1:{free_port()}"
    log = (tmp_path / "agent.log").open("w")
    process = subprocess.Popen(
        [
            sys.executable, "-m", "edl_agent.cli", "run", "--host-root", str(tree),
            "--kubelet-dir", str(kubelet.directory), "--metrics-addr", address,
            "--log-format", "json", "--set", "health.nvml_retry_seconds=0.2",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        kubelet.wait_registered({"nvidia.com/gpu"}, timeout=60)
        wait_until_serving(f"http://{address}")
        yield tree, f"http://{address}"
    finally:
        process.terminate()
        process.wait(timeout=20)
        log.close()
        kubelet.stop()
    assert process.returncode == 0, (tmp_path / "agent.log").read_text()


def test_prometheus_sees_an_injected_xid(agent: tuple[Path, str], tmp_path: Path) -> None:
    tree, url = agent
    with running_prometheus([url.removeprefix("http://")], tmp_path) as prometheus:
        wait_until(
            lambda: prometheus.value('edl_device_healthy{index="3"}') == "1",
            what="GPU 3 up",
            timeout=60,
            poll=0.2,
        )
        inject.inject_xid(tree, 3, 79)
        wait_until(
            lambda: prometheus.value('edl_device_healthy{index="3"}') == "0",
            what="GPU 3 down",
            timeout=60,
            poll=0.2,
        )
        wait_until(
            lambda: prometheus.value('edl_xid_errors_total{index="3",xid="79"}') == "1",
            what="XID 79 counted",
            timeout=60,
            poll=0.2,
        )
        assert prometheus.value("sum(edl_device_healthy)") == "7"
        assert prometheus.value("edl_plugin_registrations_total") == "1"


def test_metrics_pass_promtool_and_readyz_follows_nvml(agent: tuple[Path, str]) -> None:
    tree, url = agent
    promtool = need("promtool")
    wait_until(lambda: get(f"{url}/readyz")[0] == 200, what="ready", timeout=60, poll=0.2)
    inject.inject_xid(tree, 1, 13)
    status, body, _ = get(f"{url}/metrics")
    assert status == 200
    assert b"edl_device_temperature_celsius" in body
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, timeout=60, check=False
    )
    assert checked.returncode == 0, checked.stdout.decode() + checked.stderr.decode()

    inject.set_nvml_init_failure(tree, on=True)
    wait_until(
        lambda: get(f"{url}/readyz")[0] == 503,
        what="not ready while NVML fails",
        timeout=60,
        poll=0.2,
    )
    assert b"NVML" in get(f"{url}/readyz")[1]
    assert get(f"{url}/healthz")[0] == 200
    inject.set_nvml_init_failure(tree, on=False)
    wait_until(lambda: get(f"{url}/readyz")[0] == 200, what="ready again", timeout=60, poll=0.2)
