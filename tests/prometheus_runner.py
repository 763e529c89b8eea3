"""A real Prometheus (Debian's `prometheus` package) for tests: started on a free loopback port
with a temporary config and storage, scraping given targets every second, queried over its API."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.waiting import wait_until


def need(tool: str) -> str:
    """The tool's path; fails (never skips) when it is missing: CI installs it."""
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} is not installed: apt-get install prometheus (scripts/test-deps does)")
    return path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    request = urllib.request.Request(url, headers=headers or {})  # noqa: S310 - loopback only
    try:
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, error.read(), dict(error.headers)


def wait_until_serving(base_url: str, timeout: float = 60) -> None:
    """Until the agent's /healthz answers: kubelet is served first, metrics right after."""

    def answers() -> bool:
        try:
            return get(f"{base_url}/healthz")[0] == 200
        except OSError:  # not listening yet (urllib's URLError is an OSError)
            return False

    wait_until(answers, what=f"{base_url} serving", timeout=timeout, poll=0.2)


class Prometheus:
    def __init__(self, process: subprocess.Popen[bytes], api: str, log: Path) -> None:
        self.process = process
        self.api = api
        self.log = log

    def query(self, promql: str) -> list[dict[str, Any]]:
        if self.process.poll() is not None:
            pytest.fail(f"prometheus exited {self.process.returncode}: {self.log.read_text()}")
        url = f"{self.api}/api/v1/query?query={urllib.parse.quote(promql)}"
        try:
            status, body, _ = get(url)
        except OSError:
            return []  # not listening yet
        if status != 200:
            return []
        result: list[dict[str, Any]] = json.loads(body)["data"]["result"]
        return result

    def value(self, promql: str) -> str | None:
        """The value of a query with exactly one result, else None."""
        result = self.query(promql)
        return str(result[0]["value"][1]) if len(result) == 1 else None


@contextlib.contextmanager
def running_prometheus(
    targets: list[str],
    workdir: Path,
    job: str = "edl",
    *,
    scrape_configs: list[dict[str, Any]] | None = None,
) -> Iterator[Prometheus]:
    """Prometheus scraping `targets` (host:port on loopback) every second until the block ends;
    `scrape_configs` (Prometheus's own, for labels and relabelling) replace `targets` and `job`."""
    prometheus = need("prometheus")
    if scrape_configs is None:
        scrape_configs = [{"job_name": job, "static_configs": [{"targets": targets}]}]
    config = workdir / "prometheus.yml"
    config.write_text(
        json.dumps(  # JSON is YAML
            {
                "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
                "scrape_configs": scrape_configs,
            }
        )
    )
    api = f"http://127.0.0.1:{free_port()}"
    log = workdir / "prometheus.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                prometheus,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address={api[7:]}",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield Prometheus(process, api, log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
