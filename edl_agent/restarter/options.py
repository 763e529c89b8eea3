"""The restarter's flags, checked before it builds a client or binds a port.

A flag that can never work (an address without a port, NaN seconds, a namespace that is not a
name) stops the command with one line naming the flag, rather than surfacing later as a
traceback, as an API error retried forever, or only once a standby replica becomes leader.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

from edl_agent.address import parse_host_port
from edl_agent.errors import UsageError, shorten

# Kubernetes names: namespaces are DNS labels, most other objects DNS subdomains (RFC 1123).
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
MAX_LABEL, MAX_SUBDOMAIN = 63, 253
MAX_NODE_GRACE_SECONDS = 7 * 86400
MAX_LEASE_SECONDS = 3600.0  # client-go's default is 15 s; an hour without a leader is no election
MAX_STORM_MIN_NODES = 1_000_000
MAX_PEM_BYTES = 1024 * 1024


def check_options(args: argparse.Namespace) -> tuple[str, str]:
    """Raise UsageError naming the first flag that cannot work; the agents' ServiceAccount
    (namespace, name) otherwise. Pure: reads only `args`."""
    account = str(args.agent_service_account)
    namespace, _, name = account.partition("/")
    if not (_label(namespace) and _subdomain(name)):
        raise UsageError(f"--agent-service-account: expected NS/NAME, got {shorten(account)!r}")
    for watched in args.namespaces:
        if not _label(watched):
            raise UsageError(f"--namespace: {shorten(watched)!r} is not a namespace name")
    if not args.audience:
        raise UsageError("--audience: must not be empty")
    for flag, address in (("--listen", args.listen), ("--metrics-addr", args.metrics_addr)):
        if address:
            try:
                parse_host_port(address)
            except ValueError as exc:
                raise UsageError(f"{flag}: {exc}") from None
    if (args.tls_cert is None) != (args.tls_key is None):
        raise UsageError("--tls-cert and --tls-key: give both or neither")
    _check_numbers(args)
    if args.leader_elect:
        _check_election(args)
    return namespace, name


def _check_numbers(args: argparse.Namespace) -> None:
    _seconds("--node-grace-seconds", args.node_grace_seconds, 0, MAX_NODE_GRACE_SECONDS)
    share = args.storm_max_share
    if not (math.isfinite(share) and 0 < share <= 1):
        raise UsageError(f"--storm-max-share: expected a share > 0 and at most 1, got {share}")
    if not 0 <= args.storm_min_nodes <= MAX_STORM_MIN_NODES:
        got = shorten(str(args.storm_min_nodes))
        msg = f"--storm-min-nodes: expected 0 to {MAX_STORM_MIN_NODES}, got {got}"
        raise UsageError(msg)
    for flag in ("lease_duration_seconds", "renew_deadline_seconds", "retry_period_seconds"):
        _seconds(f"--{flag.replace('_', '-')}", getattr(args, flag), 0, MAX_LEASE_SECONDS)


def _check_election(args: argparse.Namespace) -> None:
    if not _label(args.lease_namespace):
        raise UsageError(f"--lease-namespace: {shorten(args.lease_namespace)!r} is not a name")
    if not _subdomain(args.lease_name):
        raise UsageError(f"--lease-name: {shorten(args.lease_name)!r} is not a name")
    if not (
        0 < args.retry_period_seconds < args.renew_deadline_seconds < args.lease_duration_seconds
    ):
        msg = (
            "leader election needs 0 < --retry-period-seconds < --renew-deadline-seconds "
            "< --lease-duration-seconds"
        )
        raise UsageError(msg)


def check_tls_files(cert: Path | None, key: Path | None) -> None:
    """The intake's certificate and key can be read (checked at start, not first when this
    replica becomes leader)."""
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        if path is None:
            continue
        try:
            with path.open("rb") as stream:
                head = stream.read(MAX_PEM_BYTES + 1)
        except OSError as exc:
            raise UsageError(f"{flag} {path}: {exc.strerror or exc}") from None
        if len(head) > MAX_PEM_BYTES or b"-----BEGIN " not in head:
            raise UsageError(f"{flag} {path}: not a PEM file")


def _seconds(flag: str, value: float, low: float, high: float) -> None:
    if not (math.isfinite(value) and low <= value <= high):
        raise UsageError(f"{flag}: expected seconds from {low:g} to {high:g}, got {value}")


def _label(text: str) -> bool:
    return len(text) <= MAX_LABEL and DNS_LABEL.fullmatch(text) is not None


def _subdomain(text: str) -> bool:
    return len(text) <= MAX_SUBDOMAIN and DNS_SUBDOMAIN.fullmatch(text) is not None
