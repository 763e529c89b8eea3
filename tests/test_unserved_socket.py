"""A resource whose socket cannot be served: /readyz says so (503) instead of ok, the failure is
logged when it starts, not once a round, and serving resumes once the way is clear."""

from __future__ import annotations

import http.client
import signal
import subprocess
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.kubelet_standin import KubeletStandIn
from tests.prometheus_runner import free_port
from tests.waiting import wait_for

TIMEOUT = 60.0


def readyz(port: int) -> tuple[int, str]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", "/readyz")
        response = connection.getresponse()
        return response.status, response.read().decode()
    except OSError:
        return 0, ""
    finally:
        connection.close()


def failures(port: int) -> float:
    """edl_agent_step_failures_total{step="plugins"} on the agent's /metrics (0 before any)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    finally:
        connection.close()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "edl_agent_step_failures_total" and sample.labels == {
                "step": "plugins"
            }:
                return float(sample.value)
    return 0.0


def test_a_socket_that_cannot_be_bound_is_not_ready_and_logged_once(tmp_path: Path) -> None:
    kubelet = KubeletStandIn(tmp_path / "kubelet")
    kubelet.start()
    blocker = kubelet.directory / "edl-nvidia.com_gpu.sock"
    blocker.mkdir()  # a directory where the socket goes: every bind fails
    (blocker / "keep").write_text("")
    port = free_port()
    log = tmp_path / "agent.log"
    argv = [
        sys.executable, "-m", "edl_agent.cli", "run", "--simulate", "dgx-h100",
        "--kubelet-dir", str(kubelet.directory), "--metrics-addr", f"127.0.0.1:{port}",
        "--log-format", "json", "--state-dir", str(tmp_path / "state"),
    ]  # fmt: skip
    with log.open("w") as err:
        agent = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)
    try:
        status, body = wait_for(
            "/readyz to answer", lambda: readyz(port), lambda answer: answer[0] != 0, TIMEOUT
        )
        wait_for(
            "three failed plugin rounds",
            lambda: failures(port),
            lambda count: count >= 3,
            TIMEOUT,
        )
        status, body = readyz(port)
        assert (status, body.strip()) == (503, "no socket served for nvidia.com/gpu")

        (blocker / "keep").unlink()
        blocker.rmdir()  # the way is clear: the next round serves and registers

        kubelet.wait_registered({"nvidia.com/gpu"}, timeout=TIMEOUT)
        wait_for("/readyz ok", lambda: readyz(port), lambda answer: answer[0] == 200, TIMEOUT)
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        kubelet.stop()
    text = log.read_text()
    assert agent.returncode == 0
    assert text.count('"event": "agent step failed"') == 1  # once, with its traceback
    assert '"event": "agent step works again"' in text
