"""Start-up order: kubelet gets the devices before the agent loads what registration does not need
(its Kubernetes API client, prometheus_client); the kubernetes package is never loaded for a
kubeconfig our own client serves."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from tests.kubelet_standin import KubeletStandIn
from tests.waiting import wait_until

REGISTERED = '"event": "registered with kubelet"'
KUBERNETES = re.compile(r"^import time:.*\|\s+kubernetes(\.\S+)?$")
API_CLIENT = re.compile(r"^import time:.*\|\s+edl_agent\.kube_rest$")
PROMETHEUS = re.compile(r"^import time:.*\|\s+prometheus_client(\.\S+)?$")


RUNNING = '"event": "agent running"'  # logged once everything has started


def run_agent(tmp_path: Path, *extra: str) -> list[str]:
    """stderr lines of `edl-agent run --simulate dgx-h100` with import timing on, stopped by
    SIGTERM once it registered and said that everything runs."""
    kubelet = KubeletStandIn(tmp_path / "kubelet")
    kubelet.start()
    argv = [
        sys.executable, "-m", "edl_agent.cli", "run", "--simulate", "dgx-h100",
        "--kubelet-dir", str(kubelet.directory), "--log-format", "json",
        "--metrics-addr", "127.0.0.1:0", "--state-dir", str(tmp_path / "state"), *extra,
    ]  # fmt: skip
    log = tmp_path / "agent.log"  # a file, not a pipe: the import timings fill a pipe's buffer
    with log.open("w") as err:
        agent = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"},
        )
    try:
        kubelet.wait_registered({"nvidia.com/gpu"}, timeout=60)
        wait_until(
            lambda: RUNNING in log.read_text() or agent.poll() is not None,
            timeout=60,
            what="the agent to say it runs",
            poll=0.05,
        )
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        kubelet.stop()
    lines = log.read_text().splitlines()
    assert agent.returncode == 0, "\n".join(lines[-30:])
    return lines


def first(lines: list[str], match: re.Pattern[str] | str) -> int | None:
    """The number of the first line that matches (a pattern) or contains (a string) `match`."""
    for number, line in enumerate(lines):
        found = match.search(line) is not None if isinstance(match, re.Pattern) else match in line
        if found:
            return number
    return None


def test_registered_before_the_api_client_and_metrics_are_loaded(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(  # a server nobody answers on: the publisher only retries
        "apiVersion: v1\nkind: Config\ncurrent-context: ctx\n"
        "contexts: [{name: ctx, context: {cluster: c1, user: u}}]\n"
        "clusters: [{name: c1, cluster: {server: 'http://127.0.0.1:9'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
    )
    lines = run_agent(tmp_path, "--kubeconfig", str(kubeconfig))
    registered = first(lines, REGISTERED)
    api_client = first(lines, API_CLIENT)
    prometheus = first(lines, PROMETHEUS)
    assert registered is not None
    assert api_client is not None, "a kubeconfig was given: the client is loaded after"
    assert prometheus is not None, "metrics are served after"
    assert registered < api_client
    assert registered < prometheus
    assert first(lines, KUBERNETES) is None, "a token kubeconfig needs no kubernetes package"


def test_no_credentials_no_kubernetes_client(tmp_path: Path) -> None:
    lines = run_agent(tmp_path)
    assert first(lines, REGISTERED) is not None
    assert first(lines, KUBERNETES) is None
    assert first(lines, PROMETHEUS) is not None
