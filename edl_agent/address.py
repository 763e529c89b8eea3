"""Network addresses people write in flags and settings, checked before anything binds or dials.

One parser for every `host:port` we take: the agent's and the restarter's `--metrics-addr`, the
restarter's `--listen` and the agent's `faults.restarter_address`. Pure: strings in, a pair or a
ValueError naming the problem out (the caller adds which flag or setting it came from).
"""

from __future__ import annotations

import ipaddress
import re

from edl_agent.errors import shorten

PORT = re.compile(r"[0-9]{1,5}")
HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")
MAX_PORT = 65535
UNIX_PREFIX = "unix:"


def parse_host_port(address: str) -> tuple[str, int]:
    """`:9400` (every interface), `127.0.0.1:9400`, `localhost:9400`, `[::1]:9400` →
    (host, port); host is "" for every interface. Raises ValueError naming the problem."""
    shown = shorten(address)
    host, colon, port_text = address.strip().rpartition(":")
    if not colon:
        msg = f"{shown!r} has no port; expected [host]:port such as :9400 or 127.0.0.1:9400"
        raise ValueError(msg)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if not host:
            raise ValueError(f"{shown!r} has empty brackets for its host")
        if not re.fullmatch(r"[0-9A-Fa-f:.]+(%[A-Za-z0-9._-]+)?", host):
            raise ValueError(f"{shown!r}: {shorten(host)!r} is not an IPv6 address")
    elif ":" in host or "[" in host or "]" in host:
        raise ValueError(f"{shown!r}: write an IPv6 host in brackets, e.g. [::1]:9400")
    elif host and not HOST.fullmatch(host):
        raise ValueError(f"{shown!r}: {shorten(host)!r} is not a host name or IP address")
    if not PORT.fullmatch(port_text) or int(port_text) > MAX_PORT:
        msg = f"{shown!r}: port {shorten(port_text)!r} is not a number from 0 to {MAX_PORT}"
        raise ValueError(msg)
    return host, int(port_text)


def check_dial_target(address: str) -> None:
    """An address to connect to: `host:port` with a host and a port from 1, or `unix:PATH`.
    Raises ValueError naming the problem."""
    if address.startswith(UNIX_PREFIX):
        if not address.removeprefix(UNIX_PREFIX).strip():
            raise ValueError(f"{shorten(address)!r}: expected unix:PATH with a path")
        return
    host, port = parse_host_port(address)
    if not host or port == 0:
        msg = (
            f"{shorten(address)!r}: expected host:port with a host and a port from 1 (or unix:PATH)"
        )
        raise ValueError(msg)


def is_loopback(address: str) -> bool:
    """Whether `address` (`host:port`, `unix:PATH`, or a bare host) stays on this machine."""
    if address.startswith(UNIX_PREFIX):
        return True
    host = address.rpartition(":")[0].strip("[]") if ":" in address else address
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
