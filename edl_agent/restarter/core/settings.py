"""The restarter's settings: typed and layered by `edl_agent.settings_loader`, as the agent's are.

Lowest first: the defaults below, the pod's own downward-API variables (`POD_NAMESPACE`,
`POD_NAME`), a YAML file (`--config`), `EDL_RESTARTER_*` environment variables
(`EDL_RESTARTER_STORM__MAX_SHARE=0.2`; the agent's `EDL_*` are not read) and the command line
(`--set storm.max_share=0.2`, then the named flags such as `--storm-max-share`). A value that
can never work (an address without a port, NaN seconds, a namespace that is not a name) stops
the command with one line naming the key and where it came from, rather than surfacing later as
a traceback, as an API error retried forever, or only once a standby replica becomes leader.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from edl_agent.address import parse_host_port
from edl_agent.errors import shorten
from edl_agent.settings_loader import (
    RESTARTER_ENV_PREFIX,
    Layer,
    LogFormat,
    LogLevel,
    load_layers,
    section,
    setting,
)

# Kubernetes names: namespaces are DNS labels, most other objects DNS subdomains (RFC 1123).
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
MAX_LABEL, MAX_SUBDOMAIN = 63, 253
# The name part of a label key (after the optional `prefix/`).
LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
MAX_NODE_GRACE_SECONDS = 7 * 86400
MAX_LEASE_SECONDS = 3600.0  # client-go's default is 15 s; an hour without a leader is no election
MAX_STORM_MIN_NODES = 1_000_000
MAX_COUNT = 1_000_000
MAX_TUNING_SECONDS = 86400.0
# `controller` settings kept so that a file or a flag that sets them still loads; they do nothing.
OBSOLETE = ("tick_seconds", "node_grace_tick_seconds")

# Labels that a controller or tool stamps on one particular pod. A replacement is a bare pod of
# its own (a controller-owned pod is only deleted, for its owner to recreate), so it must not
# claim that identity. The policies' own labels (`job-name`, `replica-type`, `replica-index` in
# the README's example) are kept: a replacement without them would fall out of its job.
DEFAULT_DROP_LABELS = (
    # A ReplicaSet's selector includes it: a bare pod carrying it is adopted by the ReplicaSet,
    # which counts it as one of its replicas and may delete it.
    "pod-template-hash",
    # The StatefulSet or DaemonSet revision the pod was made from; a bare pod has none.
    "controller-revision-hash",
    # A StatefulSet pod's identity (per-pod Services select it) and ordinal: a copy would be a
    # second pod answering as that member.
    "statefulset.kubernetes.io/pod-name",
    "apps.kubernetes.io/pod-index",
    # A Job's selector (new and legacy name): a bare pod carrying it would be adopted by the Job
    # and counted among its completions and failures.
    "batch.kubernetes.io/controller-uid",
    "controller-uid",
    # Written only by the Job controller, on the pods of that Job (and the index of an indexed
    # Job's pod): a replacement the Job does not own is not one of them. The legacy `job-name`
    # stays: it is also the label policies commonly name as their `jobLabel`.
    "batch.kubernetes.io/job-name",
    "batch.kubernetes.io/job-completion-index",
    # The restarter's leader label (`leader.LEADER_LABEL`), which the intake Service selects: a
    # copy would route agents' fault reports to a pod that is no restarter.
    "edl.io/restarter-leader",
)


@dataclass(frozen=True)
class IntakeSettings:
    listen: str = setting(
        ":8443", "The fault intake's address (`--listen`, `host:port`); empty: no intake."
    )
    audience: str = setting(
        "edl-restarter", "The audience the agents' tokens must be issued for (`--audience`)."
    )
    agent_service_account: str = setting(
        "edl-system/edl-agent",
        "`NS/NAME` of the ServiceAccount the agents report as (`--agent-service-account`); "
        "the intake takes faults from its tokens only.",
    )
    tls_cert: str = setting(
        "",
        "The intake's TLS certificate, a PEM file (`--tls-cert`); empty with `tls_key`: plaintext.",
    )
    tls_key: str = setting("", "The intake's TLS key, a PEM file (`--tls-key`).")
    max_connections: int = setting(
        8192,
        "Connections the intake holds at most (each agent keeps one; one idle for "
        "`idle_timeout_seconds` is closed); more are refused at once. Each costs about 50 KiB "
        "(measured with 5,000 agents): give the restarter memory for as many as it holds.",
    )
    max_connections_per_peer: int = setting(
        0,
        "Connections the intake holds at most from one address (an agent keeps one; its pod's "
        "address, or its node's where traffic is SNATed); more are closed at once. 0 (the "
        "default): no cap and no relay; the NetworkPolicy keeps other clients out. Where the "
        "network plugin does not enforce NetworkPolicy, a cap such as 16 stops one client from "
        "taking `max_connections` from every agent, at a cost: a relay thread in front of grpc "
        "counts the connections and passes every TLS byte through (bench/README: the fleet).",
    )
    workers: int = setting(
        64,
        "Calls the intake works on at once. Each waits until its faults are recorded (the "
        "policy's status written), so this bounds how many faults of a burst reach the "
        "deciders together; a waiting call holds a thread, no CPU. The calls beyond it wait "
        "in grpc's queue until their deadline.",
    )
    max_calls_per_connection: int = setting(
        16,
        "Calls one connection may have open at once (HTTP/2 streams; an agent sends one at a "
        "time): one client cannot take every worker over a single connection.",
    )
    handshake_timeout_seconds: float = setting(
        10.0,
        "A connection that has not finished its TLS (or HTTP/2) handshake by then is closed.",
    )
    idle_timeout_seconds: float = setting(
        300.0,
        "A connection without a call for this long is closed (the agent reconnects when it has "
        "something to send).",
    )

    @property
    def agent_account(self) -> tuple[str, str]:
        """The agents' ServiceAccount as (namespace, name)."""
        namespace, _, name = self.agent_service_account.partition("/")
        return namespace, name

    def check(self) -> None:
        namespace, name = self.agent_account
        if not (is_label(namespace) and is_subdomain(name)):
            shown = shorten(self.agent_service_account)
            raise ValueError(f"agent_service_account: expected NS/NAME, got {shown!r}")
        if not self.audience:
            raise ValueError("audience: must not be empty")
        check_address("listen", self.listen)
        if self.tls_cert and not self.tls_key:
            raise ValueError("tls_key: must be set with tls_cert (give both or neither)")
        if self.tls_key and not self.tls_cert:
            raise ValueError("tls_cert: must be set with tls_key (give both or neither)")
        if not 1 <= self.max_connections <= 1_000_000:
            raise ValueError("max_connections: expected 1 to 1000000")
        if not 0 <= self.max_connections_per_peer <= self.max_connections:
            raise ValueError(
                "max_connections_per_peer: expected 0 (no cap) to max_connections "
                f"({self.max_connections})"
            )
        if not 1 <= self.workers <= 1024:
            raise ValueError("workers: expected 1 to 1024")
        if not 1 <= self.max_calls_per_connection <= 1024:
            raise ValueError("max_calls_per_connection: expected 1 to 1024")
        for key in ("handshake_timeout_seconds", "idle_timeout_seconds"):
            if not 0 < getattr(self, key) <= 86400:
                raise ValueError(f"{key}: must be positive and at most 86400")


@dataclass(frozen=True)
class ElectionSettings:
    enabled: bool = setting(
        True,
        "Act only while holding the Lease (`--leader-elect`, `--no-leader-elect` for a single "
        "replica, which acts at once).",
    )
    lease_namespace: str = setting(
        "edl-system",
        "The Lease's namespace (`--lease-namespace`); default: the pod's own ($POD_NAMESPACE) "
        "when set, else edl-system.",
    )
    lease_name: str = setting("edl-restarter", "The Lease's name (`--lease-name`).")
    identity: str = setting(
        "",
        "This replica's name in the Lease (`--identity`); default: the pod's name "
        "($POD_NAME), else `<hostname>-<random>`.",
    )
    lease_duration_seconds: float = setting(
        15.0, "A standby takes over after the Lease stood still this long."
    )
    renew_deadline_seconds: float = setting(
        10.0, "The leader gives up (exits 1) when it could not renew for this long."
    )
    retry_period_seconds: float = setting(2.0, "How often the Lease is read and renewed.")

    def check(self) -> None:
        for key in ("lease_duration_seconds", "renew_deadline_seconds", "retry_period_seconds"):
            check_seconds(key, getattr(self, key), MAX_LEASE_SECONDS)
        if not self.enabled:
            return
        if not is_label(self.lease_namespace):
            raise ValueError(f"lease_namespace: {shorten(self.lease_namespace)!r} is not a name")
        if not is_subdomain(self.lease_name):
            raise ValueError(f"lease_name: {shorten(self.lease_name)!r} is not a name")
        if not (
            0
            < self.retry_period_seconds
            < self.renew_deadline_seconds
            < self.lease_duration_seconds
        ):
            msg = (
                "leader election needs 0 < retry_period_seconds < renew_deadline_seconds "
                "< lease_duration_seconds"
            )
            raise ValueError(msg)


@dataclass(frozen=True)
class StormSettings:
    max_share: float = setting(
        0.1,
        "Node-failure restarts are held while more than this share of the nodes is NotReady, "
        "and at least `min_nodes` are (`--storm-max-share`; 1 turns the guard off).",
    )
    min_nodes: int = setting(
        3, "The fewest NotReady nodes that make a storm (`--storm-min-nodes`)."
    )

    def check(self) -> None:
        if not 0 < self.max_share <= 1:
            msg = f"max_share: expected a share > 0 and at most 1, got {self.max_share}"
            raise ValueError(msg)
        if not 0 <= self.min_nodes <= MAX_STORM_MIN_NODES:
            msg = f"min_nodes: expected 0 to {MAX_STORM_MIN_NODES}, got {self.min_nodes}"
            raise ValueError(msg)


@dataclass(frozen=True)
class ReplacementSettings:
    drop_labels: tuple[str, ...] = setting(
        DEFAULT_DROP_LABELS,
        "Labels of a failed bare pod its replacement does not get: exact keys, or prefixes "
        "ending in `*` (`example.com/*`). The default drops what controllers stamp on one "
        "specific pod (`pod-template-hash`, the StatefulSet's and the Job's own labels) and "
        "the restarter's leader label; see the README. Setting it replaces the whole list.",
    )

    def check(self) -> None:
        for i, entry in enumerate(self.drop_labels):
            problem = label_pattern_problem(entry)
            if problem:
                raise ValueError(f"drop_labels[{i}]: {shorten(entry)!r} {problem}")


@dataclass(frozen=True)
class ControllerSettings:
    workers: int = setting(
        16,
        "Decider parts: the faults of one policy are decided in order by one of them, "
        "different policies in parallel.",
    )
    batch: int = setting(512, "The most pods one decider decides together (one status write).")
    decide_attempts: int = setting(
        5, "Tries to record a batch's decisions when the policy keeps changing under it."
    )
    sync_timeout_seconds: float = setting(
        300.0, "How long the dispatcher waits for the watches to list before deciding anyway."
    )
    tick_seconds: float = setting(
        0.2,
        "No longer used (accepted, checked, ignored): the dispatcher runs a round when a fault "
        "comes, a node changes or something falls due (a backoff, `check_every_seconds`), "
        "never on a tick.",
    )
    check_every_seconds: float = setting(
        2.0,
        "How often recorded restarts are looked at again (carried out again, tidied), while "
        "some policy has any pending.",
    )
    resume_after_seconds: float = setting(
        10.0,
        "A recorded restart whose pods are still there this long after it was decided is "
        "carried out again (its replacement failed, or the replica that decided it died "
        "mid-way).",
    )
    tidy_after_seconds: float = setting(
        60.0,
        "Finished pending restarts leave the status with the policy's next decision; a policy "
        "without one for this long gets a write of its own for them.",
    )
    retry_initial_seconds: float = setting(
        1.0, "First wait before a watcher's fault that could not be recorded is tried again."
    )
    retry_max_seconds: float = setting(30.0, "Longest wait between such tries.")
    keep_templates: int = setting(
        4096, "Templates of gone pods kept in memory (the policies' status holds them too)."
    )
    node_grace_tick_seconds: float = setting(
        0.5,
        "No longer used (accepted, checked, ignored): a NotReady node's pods fault the moment "
        "its `node_grace_seconds` ends, never on a tick.",
    )
    part_backoff_seconds: float = setting(
        0.5, "First wait before a part that died (a watch, a decider) is run again; doubles."
    )
    part_backoff_max_seconds: float = setting(
        30.0, "Longest wait before a part that died is run again."
    )

    def obsolete(self) -> list[str]:
        """The settings given that no longer do anything (to say so in the log)."""
        defaults = ControllerSettings()
        return [key for key in OBSOLETE if getattr(self, key) != getattr(defaults, key)]

    def check(self) -> None:
        for key in ("workers", "batch", "decide_attempts", "keep_templates"):
            value = getattr(self, key)
            if not 1 <= value <= MAX_COUNT:
                raise ValueError(f"{key}: expected 1 to {MAX_COUNT}, got {value}")
        for key in (
            "sync_timeout_seconds",
            "tick_seconds",
            "check_every_seconds",
            "resume_after_seconds",
            "tidy_after_seconds",
            "retry_initial_seconds",
            "retry_max_seconds",
            "node_grace_tick_seconds",
            "part_backoff_seconds",
            "part_backoff_max_seconds",
        ):
            value = getattr(self, key)
            if not 0 < value <= MAX_TUNING_SECONDS:
                msg = f"{key}: expected seconds > 0 and at most {MAX_TUNING_SECONDS:g}, got {value}"
                raise ValueError(msg)


@dataclass(frozen=True)
class RestarterSettings:
    kubeconfig: str = setting(
        "",
        "Kubeconfig file for the API server (`--kubeconfig`); empty: $KUBECONFIG, else the "
        "pod's service account in a cluster.",
    )
    namespaces: tuple[str, ...] = setting(
        (),
        "Watch pods and policies in these namespaces only (`--namespace`, repeatable); empty: "
        "all namespaces.",
    )
    node_grace_seconds: float = setting(
        40.0, "How long a node is NotReady before its pods fault (`--node-grace-seconds`)."
    )
    metrics_addr: str = setting(
        ":9401", "Address of /metrics, /healthz and /readyz (`--metrics-addr`); empty: none."
    )
    log_level: LogLevel = setting("info", "Least severe log level written (logs go to stderr).")
    log_format: LogFormat = setting("auto", "auto: readable on a terminal, JSON lines otherwise.")
    intake: IntakeSettings = section(
        IntakeSettings, "The authenticated gRPC intake of the agents' fault reports."
    )
    election: ElectionSettings = section(
        ElectionSettings, "Leader election through a Lease: several replicas run, one acts."
    )
    storm: StormSettings = section(
        StormSettings, "The storm guard: node-failure restarts wait while many nodes fail at once."
    )
    replacement: ReplacementSettings = section(
        ReplacementSettings, "The pod made in place of a failed bare pod."
    )
    controller: ControllerSettings = section(
        ControllerSettings,
        "The controller's inner tunables (rounds, retries, parallelism); the defaults suit.",
    )
    pod_name: str = setting(
        "",
        "This restarter's own pod ($POD_NAME, from the downward API); with `pod_namespace` "
        "the leader labels it `edl.io/restarter-leader=true` for the intake Service.",
    )
    pod_namespace: str = setting(
        "", "This restarter's own namespace ($POD_NAMESPACE, from the downward API)."
    )

    def check(self) -> None:
        for i, watched in enumerate(self.namespaces):
            if not is_label(watched):
                raise ValueError(f"namespaces[{i}]: {shorten(watched)!r} is not a namespace name")
        check_seconds("node_grace_seconds", self.node_grace_seconds, MAX_NODE_GRACE_SECONDS)
        check_address("metrics_addr", self.metrics_addr)


def load_restarter_settings(
    *,
    file: str | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Sequence[Layer] = (),
) -> RestarterSettings:
    """The layers merged and checked (ConfigError naming key and source); `environ`: the
    process's environment when None, read for `EDL_RESTARTER_*`, `POD_NAMESPACE` and
    `POD_NAME`."""
    env = os.environ if environ is None else environ
    return load_layers(
        RestarterSettings,
        file=file,
        environ=env,
        overrides=overrides,
        defaults=downward_api(env),
        env_prefix=RESTARTER_ENV_PREFIX,
    )


def downward_api(environ: Mapping[str, str]) -> list[Layer]:
    """The pod's namespace and name (set from the downward API in the Deployment): who this
    replica is, and so the defaults of the Lease's namespace and this replica's identity."""
    layers: list[Layer] = []
    namespace, name = environ.get("POD_NAMESPACE"), environ.get("POD_NAME")
    if namespace:
        layers.append(
            (
                "$POD_NAMESPACE",
                {"pod_namespace": namespace, "election": {"lease_namespace": namespace}},
            )
        )
    if name:
        layers.append(("$POD_NAME", {"pod_name": name, "election": {"identity": name}}))
    return layers


def label_dropped(key: str, patterns: Iterable[str]) -> bool:
    """Whether label `key` matches one of `patterns` (exact keys, or prefixes ending in `*`)."""
    return any(key.startswith(p[:-1]) if p.endswith("*") else key == p for p in patterns)


def label_pattern_problem(entry: str) -> str:
    """What is wrong with a drop-list entry (a label key, or a prefix of one ending in `*`);
    empty when nothing is."""
    if entry == "*":
        return "would drop every label, the ones the policy selects the replacement by too"
    key = f"{entry[:-1]}x" if entry.endswith("*") else entry
    prefix, slash, name = key.rpartition("/")
    if (slash and not is_subdomain(prefix)) or not (
        len(name) <= MAX_LABEL and LABEL_NAME.fullmatch(name)
    ):
        return "is not a label key (or a prefix of one ending in *)"
    return ""


def check_address(key: str, address: str) -> None:
    if address:
        try:
            parse_host_port(address)
        except ValueError as exc:
            raise ValueError(f"{key}: {exc}") from None


def check_seconds(key: str, value: float, most: float) -> None:
    if not (math.isfinite(value) and 0 <= value <= most):
        raise ValueError(f"{key}: expected seconds from 0 to {most:g}, got {value}")


def is_label(text: str) -> bool:
    return len(text) <= MAX_LABEL and DNS_LABEL.fullmatch(text) is not None


def is_subdomain(text: str) -> bool:
    return len(text) <= MAX_SUBDOMAIN and DNS_SUBDOMAIN.fullmatch(text) is not None
