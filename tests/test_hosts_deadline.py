"""`edl-agent hosts` answers a launcher in bounded time: an API server that trickles its answer
(each byte in time for the per-read timeout, the whole never) ends the run at `--timeout`, exit 1
with one line on stderr, as any other API server that cannot be asked."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest


class _Trickling(ThreadingHTTPServer):
    daemon_threads = False  # server_close() joins the handlers: none is left behind

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _TrickleHandler)
        self.stop = threading.Event()
        self.asked: list[str] = []


class _TrickleHandler(BaseHTTPRequestHandler):
    server: _Trickling
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.server.asked.append(self.path)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "1000000")
        self.end_headers()
        self.wfile.write(b'{"items": [')
        try:
            while not self.server.stop.wait(0.2):  # a byte now and then, far inside 10 s
                self.wfile.write(b" ")
                self.wfile.flush()
        except OSError:
            self.close_connection = True  # the client has gone

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


@pytest.fixture
def trickling() -> Iterator[_Trickling]:
    server = _Trickling()
    serving = threading.Thread(target=server.serve_forever, args=(0.05,), name="trickle")
    serving.start()
    yield server
    server.stop.set()
    server.shutdown()
    serving.join()
    server.server_close()


def kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: c, cluster: {{server: '{server}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    return path


def hosts(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edl_agent.cli", "hosts", *args],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
        check=False,
        timeout=60,
    )


def test_an_api_server_that_trickles_its_answer_ends_the_run_at_the_deadline(
    trickling: _Trickling, tmp_path: Path
) -> None:
    config = kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{trickling.server_port}")
    started = time.monotonic()
    done = hosts("-l", "job-name=x", "-n", "ml", "--kubeconfig", str(config), "--timeout", "2")
    took = time.monotonic() - started

    assert trickling.asked == ["/api/v1/namespaces/ml/pods?labelSelector=job-name%3Dx"]
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    assert done.stderr == (
        "edl-agent: error: no full answer from the API server within 2 s (--timeout)\n"
    )
    assert took < 20  # the deadline ended it, not the 60 s of this call or the trickle's end


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan", "inf"])
def test_a_timeout_that_is_no_positive_number_is_bad_input(value: str) -> None:
    done = hosts("-l", "a=b", "--timeout", value)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert f"argument --timeout: {value!r} is not a positive number of seconds" in done.stderr


def test_help_names_the_deadline() -> None:
    text = " ".join(hosts("--help").stdout.split())
    assert "--timeout SECONDS" in text
    assert "give up after this long in all" in text
    assert "(default 30)" in text
