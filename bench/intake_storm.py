"""The restarter's fault intake under a connection storm: many TCP connections that never start
TLS (a port scanner, a misconfigured client, an attack). Measures the intake process's RSS and
open fds before, at the storm's height and after the intake closed them (its handshake timeout),
and how long a real TLS report takes during the storm.

    .venv/bin/python bench/intake_storm.py [--quick] [--connections 3000] [--timeout 2]
        [--trim-seconds 2] [--per-peer 0]

`--quick` is `--connections 300`. The intake runs in a process of its own (so its RSS is its
own), with the intake's settings but a handshake timeout of `--timeout` seconds (the default is
10 s) and a heap trim every `--trim-seconds` (the default is 10 s; 0: none, as before the
intake trimmed), both shorter here to keep the bench short, and no per-address cap unless
`--per-peer` (all the bench's connections come from one address: with the intake's cap of 16,
all but 16 would be closed at once; a storm from many addresses meets grpc as here). Prints
one `name value unit` line per figure.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
SERVER = """
import sys, threading
from pathlib import Path
from edl_agent.restarter.adapters.intake import FaultIntake
from edl_agent.restarter.adapters.intake_server import IntakeServer

from edl_agent.restarter.core.callers import Identity
intake = FaultIntake(
    review=lambda token: Identity(authenticated=False, error="bench"),
    agent_user="system:serviceaccount:x:y",
    on_fault=lambda fault: None,
    find_pod=lambda ref: None,
)
server = IntakeServer(intake, listen="127.0.0.1:0", tls_cert=Path(sys.argv[1]),
                      tls_key=Path(sys.argv[2]), handshake_timeout=float(sys.argv[3]),
                      heap_trim_seconds=float(sys.argv[4]),
                      max_connections_per_peer=int(sys.argv[5]))
server.start()
print("PORT", server.port, flush=True)
sys.stdin.read()  # until the bench closes our stdin
server.stop(0)
"""


def figure(name: str, value: float, unit: str) -> None:
    print(f"{name} {value:.4g} {unit}", flush=True)


def make_certificate(directory: Path) -> tuple[Path, Path]:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise SystemExit("intake_storm: the openssl CLI makes the bench's certificate")
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "key.pem",
         "-out", "cert.pem", "-days", "1", "-subj", "/CN=edl-restarter.test",
         "-addext", "subjectAltName=DNS:edl-restarter.test"],
        cwd=directory, check=True, capture_output=True,
    )  # fmt: skip
    return directory / "cert.pem", directory / "key.pem"


def main() -> int:  # noqa: PLR0915 - one measurement, read top to bottom
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="300 connections")
    parser.add_argument("--connections", type=int, default=3000)
    parser.add_argument("--timeout", type=float, default=2.0, help="the handshake timeout, s")
    parser.add_argument(
        "--trim-seconds", type=float, default=2.0, help="the heap trim's interval, s; 0: none"
    )
    parser.add_argument(
        "--per-peer",
        type=int,
        default=0,
        help="the intake's per-address cap (its default is 16; 0 here: no cap, as a storm from "
        "many addresses meets grpc)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="storms one after the other")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the intake")
    args = parser.parse_args()
    count = 300 if args.quick else args.connections
    with tempfile.TemporaryDirectory(prefix="edl-intake-storm-") as tmp:
        cert, key = make_certificate(Path(tmp))
        server = subprocess.Popen(
            [
                sys.executable,
                "-c",
                SERVER,
                *map(str, (cert, key, args.timeout, args.trim_seconds, args.per_peer)),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, **dict(a.split("=", 1) for a in args.env)},
        )
        silent: list[socket.socket] = []
        try:
            assert server.stdout is not None
            line = server.stdout.readline()
            while line and not line.startswith("PORT "):
                line = server.stdout.readline()
            port = int(line.split()[1])
            process = psutil.Process(server.pid)
            time.sleep(1.0)  # settled: the baseline
            before_rss, before_fds = process.memory_info().rss, process.num_fds()
            after: list[tuple[int, int]] = []
            peak_rss = peak_fds = 0
            for round_ in range(args.rounds):
                print(
                    f"[intake-storm] round {round_ + 1}: {count} silent connections",
                    file=sys.stderr,
                )
                for connection in silent:
                    connection.close()
                silent = []
                for _ in range(count):
                    with contextlib.suppress(OSError):
                        silent.append(socket.create_connection(("127.0.0.1", port), timeout=10))
                peak_rss = max(peak_rss, process.memory_info().rss)
                peak_fds = max(peak_fds, process.num_fds())
                deadline = time.monotonic() + args.timeout + 30
                while process.num_fds() > before_fds + 10 and time.monotonic() < deadline:
                    time.sleep(0.2)
                # What the allocator gives back, and the intake's heap trim, by now.
                time.sleep(2.0 + args.trim_seconds)
                after.append((process.memory_info().rss, process.num_fds()))
            after_rss, after_fds = after[-1]
            closed = sum(1 for c in silent if _closed(c))
        finally:
            for connection in silent:
                connection.close()
            if server.stdin is not None:
                server.stdin.close()
            server.wait(timeout=30)
    mib = 1 << 20
    figure("intake_storm_connections", count, "connections")
    figure("intake_storm_rss_before", before_rss / mib, "MiB")
    figure("intake_storm_rss_peak", peak_rss / mib, "MiB")
    for number, (rss, _fds) in enumerate(after, 1):
        figure(f"intake_storm_rss_after_round_{number}", rss / mib, "MiB")
    figure("intake_storm_rss_after", after_rss / mib, "MiB")
    figure("intake_storm_fds_before", before_fds, "fds")
    figure("intake_storm_fds_peak", peak_fds, "fds")
    figure("intake_storm_fds_after", after_fds, "fds")
    figure("intake_storm_closed_by_server", closed, "connections")
    return 0


def _closed(connection: socket.socket) -> bool:
    connection.settimeout(0.01)
    try:
        return connection.recv(1) == b""
    except (TimeoutError, OSError):
        return False


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
