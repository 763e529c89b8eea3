"""Bad input, to the node agent's commands and to the restarter alike, stops the command with exit
status 2 and exactly one line on stderr, `edl-agent: error: ...`: never a traceback, never a
loop that retries what cannot work.

Cases that could start something long (`run`, `restarter`, `--simulate`) run the installed entry
point (`.venv/bin/edl-agent`) as subprocesses, in parallel, each with a timeout, so that a hang
or a retry loop fails the case. The others (`discover` and `config` on an empty node, and
`restarter config`, which fail while reading their settings) call `main()` in this process: the
same code, without an interpreter's start-up for each. Nothing touches the host: files live in a
temporary directory, a node is an empty directory or a `--simulate` profile, and no case reaches
an API server.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from edl_agent.cli import main

EDL_AGENT = str(Path(sys.executable).with_name("edl-agent"))
TIMEOUT_SECONDS = 60
PREFIX = "edl-agent: error: "
HUGE = "9" * 5000  # past Python's 4300-digit int-string conversion limit
BIG = "9" * 4000  # readable, but far past any 64-bit setting
DEEP_LIST = "[" * 10000 + "]" * 10000
DEEP_MAP = "{a: " * 10000 + "1" + "}" * 10000
KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


@dataclass(frozen=True)
class Case:
    """`argv` after `edl-agent`, with `{d}` for the prepared directory and `{port}` for a port
    that is in use; `message`: what the one line must say."""

    id: str
    argv: tuple[str, ...]
    message: str
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def in_process(self) -> bool:
        """Fails while reading its settings, whatever happens: safe to run in this process."""
        return (
            self.argv[:1] in (("discover",), ("config",))
            or self.argv[:2] == ("restarter", "config")
        ) and "--simulate" not in self.argv


def node(*argv: str, message: str, env: Mapping[str, str] | None = None, id: str) -> Case:
    return Case(id, argv, message, env or {})


# The agent's commands on an empty node (no devices: nothing to discover, nothing to wait for).
RUN = ("run", "--host-root", "{d}/empty", "--kubelet-dir", "{d}/kubelet", "--metrics-addr", "")
DISCOVER = ("discover", "--host-root", "{d}/empty")
SIM = ("--simulate", "dgx-h100", "--log-level", "error")
RESTARTER = ("restarter", "--kubeconfig", "{d}/kubeconfig")

AGENT_CASES = [
    # Integers past Python's int-string conversion limit, from each source.
    node(
        *DISCOVER,
        "--config",
        "{d}/huge-int.yaml",
        id="huge-int-file",
        message="config file {d}/huge-int.yaml: a number of more than 4300 digits",
    ),
    node(
        *DISCOVER,
        "--set",
        f"node.event_burst={HUGE}",
        id="huge-int-set",
        message="node.event_burst: cannot read value '9999",
    ),
    node(
        *DISCOVER,
        env={"EDL_NODE__EVENT_BURST": HUGE},
        id="huge-int-env",
        message="a number of more than 4300 digits (from EDL_NODE__EVENT_BURST)",
    ),
    node(
        *DISCOVER,
        "--set",
        f"plugin.rediscover_seconds={HUGE}",
        id="huge-float-set",
        message="plugin.rediscover_seconds: cannot read value",
    ),
    node(
        *DISCOVER,
        "--set",
        f"node.event_burst={BIG}",
        id="big-int",
        message="node.event_burst: an integer of about 4000 digits is out of range",
    ),
    node(
        *DISCOVER,
        "--set",
        f"health.quiet_seconds={BIG}",
        id="big-int-as-float",
        message="health.quiet_seconds: expected a finite number, got an integer of about 4000",
    ),
    node(
        *DISCOVER,
        "--set",
        "nvidia.resource_name=" + "x" * 5000,
        id="long-string",
        message="nvidia.resource_name: 'xxxx",
    ),
    node(*DISCOVER, "--set", "x" * 5000 + "=1", id="long-key", message="xxxx...: unknown key"),
    # Deep nesting.
    node(
        *DISCOVER,
        "--config",
        "{d}/deep-list.yaml",
        id="deep-list-file",
        message="config file {d}/deep-list.yaml: nested too deeply",
    ),
    node(
        *DISCOVER,
        "--config",
        "{d}/deep-map.yaml",
        id="deep-map-file",
        message="config file {d}/deep-map.yaml: nested too deeply",
    ),
    node(
        *DISCOVER,
        "--set",
        f"sharing={DEEP_LIST}",
        id="deep-set",
        message="sharing: cannot read value '[[[[",
    ),
    node(
        *DISCOVER,
        env={"EDL_HEALTH__XID_LEVELS": DEEP_MAP},
        id="deep-env",
        message="nested too deeply (from EDL_HEALTH__XID_LEVELS)",
    ),
    # Config files that are not UTF-8 YAML text.
    node(
        *DISCOVER,
        "--config",
        "{d}/utf16-bom.yaml",
        id="utf16-bom",
        message="config file {d}/utf16-bom.yaml: UTF-16 text; save it as UTF-8",
    ),
    node(
        *DISCOVER,
        "--config",
        "{d}/utf16le.yaml",
        id="utf16-no-bom",
        message="config file {d}/utf16le.yaml: UTF-16 text",
    ),
    node(
        *DISCOVER,
        "--config",
        "{d}/latin1.yaml",
        id="latin1",
        message="config file {d}/latin1.yaml: not UTF-8 text (byte 0xe9 at offset 14)",
    ),
    node(
        *DISCOVER,
        "--config",
        "{d}/control.yaml",
        id="control-char",
        message="config file {d}/control.yaml: character U+0007 at offset 12: special characters",
    ),
    node(
        *DISCOVER,
        "--config",
        "{d}/big.yaml",
        id="config-too-big",
        message="config file {d}/big.yaml: larger than 1024 KiB",
    ),
    node(
        *DISCOVER,
        "--config",
        "/dev/zero",
        id="config-dev-zero",
        message="config file /dev/zero: larger than 1024 KiB",
    ),
    node(
        *DISCOVER,
        "--config",
        "{d}/empty",
        id="config-directory",
        message="config file {d}/empty: Is a directory",
    ),
    node(
        *DISCOVER,
        "--config",
        "{d}/list.yaml",
        id="config-a-list",
        message="expected a mapping of settings at the top",
    ),
    node(
        *DISCOVER,
        "--config",
        "{d}/bad-date.yaml",
        id="config-bad-date",
        message="config file {d}/bad-date.yaml: month must be in 1..12",
    ),
    # Non-finite and out-of-range numbers.
    node(
        *DISCOVER,
        "--set",
        "health.quiet_seconds=.nan",
        id="nan-quiet",
        message="health.quiet_seconds: expected a finite number, got float nan",
    ),
    node(
        *DISCOVER,
        env={"EDL_HEALTH__POLL_SECONDS": ".inf"},
        id="inf-poll",
        message="health.poll_seconds: expected a finite number, got float inf",
    ),
    node(
        *DISCOVER,
        "--set",
        "health.nvml_retry_seconds=1e400",
        id="overflowing-float",
        message="health.nvml_retry_seconds: expected a finite number",
    ),
    node(
        *DISCOVER,
        "--config",
        "{d}/nan-events.yaml",
        id="nan-events-file",
        message="node.events_per_minute: expected a finite number, got float nan (from {d}/",
    ),
    node(
        *DISCOVER,
        "--set",
        "node.event_dedupe_seconds=.nan",
        id="nan-dedupe",
        message="node.event_dedupe_seconds: expected a finite number",
    ),
    node(
        *DISCOVER,
        "--set",
        "node.event_dedupe_seconds=-1",
        id="negative-dedupe",
        message="node.event_dedupe_seconds: must be between 0 and 86400",
    ),
    node(
        *DISCOVER,
        "--set",
        "node.events_per_minute=-5",
        id="negative-events",
        message="node.events_per_minute: must be positive",
    ),
    node(
        *DISCOVER,
        "--set",
        "node.event_burst=1000000",
        id="huge-burst",
        message="node.event_burst: must be between 1 and 10000",
    ),
    node(
        *DISCOVER,
        "--set",
        "health.quiet_seconds=0",
        id="zero-quiet",
        message="health.quiet_seconds: must be positive",
    ),
    node(
        *DISCOVER,
        "--set",
        "health.quiet_seconds=1e12",
        id="endless-quiet",
        message="health.quiet_seconds: must be positive and at most 2592000",
    ),
    node(
        *DISCOVER,
        "--set",
        "plugin.health_poll_seconds=.nan",
        id="nan-presence-poll",
        message="plugin.health_poll_seconds: expected a finite number",
    ),
    # Shares that would flood memory and kubelet.
    node(
        *DISCOVER,
        "--set",
        "sharing=[{resource: nvidia.com/gpu, replicas: 10000000}]",
        id="replicas-huge",
        message="sharing[0].replicas: must be between 0 and 1024",
    ),
    node(
        *DISCOVER,
        "--set",
        "sharing=[{resource: nvidia.com/gpu, replicas: -1}]",
        id="replicas-negative",
        message="sharing[0].replicas: must be between 0 and 1024",
    ),
    node(
        *DISCOVER,
        "--set",
        "sharing=[{resource: nvidia.com/gpu, memory_unit_mib: 1}]",
        id="memory-unit-tiny",
        message="sharing[0].memory_unit_mib: must be 0 (none) or at least 64",
    ),
    node(
        *DISCOVER,
        "--set",
        "sharing=[{resource: nvidia.com/gpu, core_unit_percent: 1000}]",
        id="core-unit-huge",
        message="sharing[0].core_unit_percent: must be between 0 and 100",
    ),
    node(
        *DISCOVER,
        "--set",
        "ascend.vnpu_templates=[{resource: huawei.com/Ascend910-5c, "
        "per_device: 10000000, aicore: 5, memory_mib: 16384}]",
        id="vnpu-huge",
        message="ascend.vnpu_templates[0].per_device: must be between 1 and 1024",
    ),
    # Words and names.
    node(
        *DISCOVER,
        "--set",
        "node.labels=maybe",
        id="labels-unknown",
        message="node.labels: expected one of node, features_file, off, got 'maybe'",
    ),
    node(
        *DISCOVER,
        "--node-name",
        "Not A Node",
        id="node-name",
        message="node_name: 'Not A Node' is not a Kubernetes node name",
    ),
    node(*DISCOVER, "--set", "novalue", id="set-without-value", message="expected KEY=VALUE"),
    node(
        "discover",
        "--simulate",
        "dgx-h999",
        id="unknown-profile",
        message="unknown profile 'dgx-h999'",
    ),
    node(
        "run",
        *SIM,
        "--set",
        "health.quiet_seconds=.nan",
        id="simulated-nan",
        message="health.quiet_seconds: expected a finite number",
    ),
    node(
        "config",
        "--set",
        "node.event_burst=.nan",
        id="config-command",
        message="node.event_burst: expected an integer, got float nan",
    ),
    # Addresses.
    node(
        *RUN[:-2],
        "--metrics-addr",
        "nonsense",
        id="metrics-addr-nonsense",
        message="metrics_addr: 'nonsense' has no port",
    ),
    node(
        *RUN[:-2],
        "--metrics-addr",
        ":99999",
        id="metrics-addr-port",
        message="metrics_addr: ':99999': port '99999' is not a number from 0 to 65535",
    ),
    node(
        *RUN[:-2],
        "--metrics-addr",
        ":\u00b2",
        id="metrics-addr-superscript",
        message="is not a number from 0 to 65535",
    ),
    node(
        *RUN[:-2],
        "--metrics-addr",
        "no such host:9400",
        id="metrics-addr-host",
        message="'no such host' is not a host name or IP address",
    ),
    node(
        *RUN,
        "--restarter-address",
        "nonsense",
        id="restarter-address",
        message="faults.restarter_address: 'nonsense' has no port",
    ),
    node(
        *RUN,
        "--restarter-address",
        "127.0.0.1:0",
        id="restarter-address-port-0",
        message="faults.restarter_address: '127.0.0.1:0': expected host:port with a host",
    ),
    node(
        *RUN,
        "--restarter-address",
        "unix:",
        id="restarter-address-unix",
        message="expected unix:PATH with a path",
    ),
    node(
        *RUN[:-2],
        "--metrics-addr",
        "127.0.0.1:{port}",
        "--log-level",
        "error",
        id="metrics-addr-in-use",
        message="metrics_addr 127.0.0.1:{port}: Address already in use",
    ),
    # Directories and files that can never work.
    node(
        *DISCOVER[:-1],
        "{d}/afile",
        id="host-root-file",
        message="host root {d}/afile: not a directory",
    ),
    node(
        *DISCOVER[:-1],
        "{d}/missing",
        id="host-root-missing",
        message="host root {d}/missing: not a directory",
    ),
    node(
        *RUN[:3],
        "--kubelet-dir",
        "{d}/afile",
        id="kubelet-dir-file",
        message="plugin.kubelet_dir {d}/afile: not a directory",
    ),
    node(
        *RUN[:3],
        "--kubelet-dir",
        "{d}/afile/plugins",
        id="kubelet-dir-under-file",
        message="plugin.kubelet_dir {d}/afile/plugins: Not a directory",
    ),
    node(
        *RUN[:3],
        "--kubelet-dir",
        "/k" * 60,
        id="kubelet-dir-too-long",
        message="too long for unix sockets",
    ),
    node(
        "run",
        *SIM,
        "--kubelet-dir",
        "{d}/afile",
        id="simulated-kubelet-dir-file",
        message="plugin.kubelet_dir {d}/afile: not a directory",
    ),
    node(
        *RUN,
        "--state-dir",
        "{d}/afile",
        id="state-dir-file",
        message="faults.state_dir {d}/afile: not a directory",
    ),
    node(
        *RUN,
        "--state-dir",
        "{d}/afile",
        "--restarter-address",
        "127.0.0.1:9443",
        id="state-dir-file-used",
        message="faults.state_dir {d}/afile: not a directory",
    ),
    node(
        *RUN,
        "--set",
        "pod_resources_socket={d}/afile/kubelet.sock",
        id="pod-resources-dir",
        message="pod_resources_socket {d}/afile/kubelet.sock: {d}/afile is not a directory",
    ),
    node(
        *RUN,
        "--set",
        "pod_resources_socket={d}/empty",
        id="pod-resources-is-dir",
        message="pod_resources_socket {d}/empty: is a directory",
    ),
    node(
        *RUN,
        "--set",
        "pod_resources_socket=" + "/p" * 60,
        id="pod-resources-too-long",
        message="longer than a unix socket path may be",
    ),
    node(
        *RUN,
        "--set",
        "node.labels=features_file",
        "--set",
        "node.features_file={d}/afile/features",
        id="features-file-dir",
        message="node.features_file {d}/afile/features: {d}/afile is not a directory",
    ),
    node(
        *RUN,
        "--restarter-address",
        "10.0.0.1:8443",
        "--set",
        "faults.ca_file={d}/missing",
        id="ca-file-missing",
        message="faults.ca_file {d}/missing: No such file or directory",
    ),
    # Kubeconfig.
    node(
        *RUN,
        "--kubeconfig",
        "{d}/missing",
        id="kubeconfig-missing",
        message="node.kubeconfig: {d}/missing does not exist",
    ),
    node(
        *RUN,
        "--kubeconfig",
        "{d}/empty",
        id="kubeconfig-directory",
        message="node.kubeconfig: {d}/empty is not a file",
    ),
    node(
        *RUN,
        "--kubeconfig",
        "{d}/broken-kubeconfig",
        id="kubeconfig-broken",
        message="node.kubeconfig: cannot use {d}/broken-kubeconfig",
    ),
    node(
        *RUN,
        env={"KUBECONFIG": "{d}/missing"},
        id="env-kubeconfig-missing",
        message="$KUBECONFIG: {d}/missing does not exist",
    ),
    node(
        *RUN,
        env={"KUBECONFIG": "{d}/broken-kubeconfig"},
        id="env-kubeconfig-broken",
        message="$KUBECONFIG: cannot use {d}/broken-kubeconfig",
    ),
    # argparse's own mistakes are one line too.
    node(
        "discover",
        "--format",
        "xml",
        id="argparse-choice",
        message="argument --format: invalid choice: 'xml'",
    ),
    node("run", "--bogus", id="argparse-unknown", message="unrecognized arguments: --bogus"),
    node(id="argparse-no-command", message="the following arguments are required: COMMAND"),
    node(
        "simulate",
        "inject",
        "{d}/empty",
        "--device",
        "x",
        "--xid",
        "79",
        id="inject-device",
        message="--device: 'x' is neither a device index nor a GPU uuid (GPU-...)",
    ),
]

RESTARTER_CASES = [
    node(
        *RESTARTER,
        "--metrics-addr",
        "nonsense",
        id="r-metrics-addr",
        message="metrics_addr: 'nonsense' has no port; expected [host]:port",
    ),
    node(
        *RESTARTER,
        "--metrics-addr",
        ":99999",
        id="r-metrics-addr-port",
        message="metrics_addr: ':99999': port '99999' is not a number from 0 to 65535",
    ),
    node(
        *RESTARTER,
        "--listen",
        "nonsense",
        id="r-listen",
        message="intake.listen: 'nonsense' has no port",
    ),
    node(
        *RESTARTER,
        "--listen",
        "[::1:8443",
        id="r-listen-bracket",
        message="intake.listen: '[::1:8443': write an IPv6 host in brackets",
    ),
    node(
        *RESTARTER,
        "--listen",
        "1.2.3.4:-1",
        id="r-listen-negative-port",
        message="intake.listen: '1.2.3.4:-1': port '-1' is not a number",
    ),
    node(
        *RESTARTER,
        "--node-grace-seconds",
        "nan",
        id="r-grace-nan",
        message="node_grace_seconds: expected a finite number, got float nan (from --node-grace-s",
    ),
    node(
        *RESTARTER,
        "--node-grace-seconds",
        "inf",
        id="r-grace-inf",
        message="node_grace_seconds: expected a finite number, got float inf",
    ),
    node(
        *RESTARTER,
        "--node-grace-seconds",
        "-5",
        id="r-grace-negative",
        message="node_grace_seconds: expected seconds from 0 to 604800, got -5.0",
    ),
    node(
        *RESTARTER,
        "--storm-max-share",
        "nan",
        id="r-share-nan",
        message="storm.max_share: expected a finite number, got float nan",
    ),
    node(
        *RESTARTER,
        "--storm-max-share",
        "2",
        id="r-share-above-1",
        message="storm.max_share: expected a share > 0 and at most 1",
    ),
    node(
        *RESTARTER,
        "--storm-max-share",
        "0",
        id="r-share-zero",
        message="storm.max_share: expected a share > 0",
    ),
    node(
        *RESTARTER,
        "--storm-min-nodes",
        "-1",
        id="r-min-nodes-negative",
        message="storm.min_nodes: expected 0 to 1000000, got -1 (from --storm-min-nodes)",
    ),
    node(
        *RESTARTER,
        "--storm-min-nodes",
        HUGE,
        id="r-min-nodes-huge",
        message="argument --storm-min-nodes: invalid int value: '9999",
    ),
    node(
        *RESTARTER,
        "--storm-min-nodes",
        BIG,
        id="r-min-nodes-big",
        message="storm.min_nodes: an integer of about 4000 digits is out of range",
    ),
    node(
        *RESTARTER,
        "--lease-duration-seconds",
        "inf",
        id="r-lease-inf",
        message="election.lease_duration_seconds: expected a finite number, got float inf",
    ),
    node(
        *RESTARTER,
        "--retry-period-seconds",
        "nan",
        id="r-retry-nan",
        message="election.retry_period_seconds: expected a finite number, got float nan",
    ),
    node(
        *RESTARTER,
        "--renew-deadline-seconds",
        "20",
        id="r-election-order",
        message="election: leader election needs 0 < retry_period_seconds < renew_deadline_seconds",
    ),
    node(
        *RESTARTER,
        "--namespace",
        "Not_A_Namespace",
        id="r-namespace",
        message="namespaces[0]: 'Not_A_Namespace' is not a namespace name (from --namespace)",
    ),
    node(
        *RESTARTER,
        "--agent-service-account",
        "edl-agent",
        id="r-service-account",
        message="intake.agent_service_account: expected NS/NAME, got 'edl-agent'",
    ),
    node(
        *RESTARTER,
        "--lease-name",
        "",
        id="r-lease-name",
        message="election.lease_name: '' is not a name (from --lease-name)",
    ),
    node(
        *RESTARTER, "--audience", "", id="r-audience", message="intake.audience: must not be empty"
    ),
    node(
        *RESTARTER,
        "--tls-cert",
        "{d}/afile",
        id="r-tls-half",
        message="intake.tls_key: must be set with tls_cert (give both or neither) (from --tls-c",
    ),
    node(
        *RESTARTER,
        "--tls-cert",
        "{d}/missing",
        "--tls-key",
        "{d}/missing",
        id="r-tls-missing",
        message="intake.tls_cert {d}/missing: No such file or directory",
    ),
    node(
        *RESTARTER,
        "--tls-cert",
        "{d}/afile",
        "--tls-key",
        "{d}/afile",
        id="r-tls-not-pem",
        message="intake.tls_cert {d}/afile: not a PEM file",
    ),
    node(
        "restarter",
        "--kubeconfig",
        "{d}/missing",
        id="r-kubeconfig-missing",
        message="error: kubeconfig: {d}/missing does not exist",
    ),
    node(
        "restarter",
        "--kubeconfig",
        "{d}/broken-kubeconfig",
        id="r-kubeconfig-broken",
        message="error: kubeconfig: cannot use {d}/broken-kubeconfig",
    ),
    node(
        "restarter",
        "--kubeconfig",
        "{d}/huge-int.yaml",
        id="r-kubeconfig-huge-int",
        message="error: kubeconfig: cannot use {d}/huge-int.yaml",
    ),
    node(
        "restarter",
        env={"KUBECONFIG": "{d}/missing"},
        id="r-env-kubeconfig-missing",
        message="$KUBECONFIG: {d}/missing does not exist",
    ),
    node(
        "restarter",
        env={"KUBECONFIG": "{d}/broken-kubeconfig"},
        id="r-env-kubeconfig-broken",
        message="$KUBECONFIG: cannot use {d}/broken-kubeconfig",
    ),
    node(
        "restarter",
        id="r-no-credentials",
        message="no Kubernetes credentials: pass --kubeconfig, set $KUBECONFIG or run in a cluster",
    ),
    # $KUBECONFIG is read (this one works); what stops the command is the port in use.
    node(
        "restarter",
        "--listen",
        "",
        "--no-leader-elect",
        "--metrics-addr",
        "127.0.0.1:{port}",
        env={"KUBECONFIG": "{d}/kubeconfig"},
        id="r-env-kubeconfig-then-port-in-use",
        message="metrics_addr 127.0.0.1:{port}: Address already in use",
    ),
    node(
        "restarter",
        "--log-level",
        "loud",
        id="r-argparse-choice",
        message="argument --log-level: invalid choice: 'loud'",
    ),
    node(
        "restarter",
        "--storm-min-nodes",
        "x",
        id="r-argparse-int",
        message="argument --storm-min-nodes: invalid int value: 'x' (see edl-agent restarter",
    ),
    # The restarter's settings from every layer, each error naming its source.
    node(
        *RESTARTER,
        "--config",
        "{d}/restarter.yaml",
        id="r-file",
        message="storm.min_nodes: expected 0 to 1000000, got -3 (from {d}/restarter.yaml)",
    ),
    node(
        "restarter",
        "config",
        "--config",
        "{d}/list.yaml",
        id="r-config-file-list",
        message="config file {d}/list.yaml: expected a mapping of settings at the top",
    ),
    node(
        "restarter",
        "config",
        env={"EDL_RESTARTER_ELECTION__LEASE_NAME": "Bad Name"},
        id="r-config-env",
        message="election.lease_name: 'Bad Name' is not a name (from environment)",
    ),
    node(
        "restarter",
        "config",
        env={"POD_NAMESPACE": "Not_A_NS"},
        id="r-config-pod-namespace",
        message="election.lease_namespace: 'Not_A_NS' is not a name (from $POD_NAMESPACE)",
    ),
    node(
        "restarter",
        "config",
        "--set",
        "replacement.drop_labels=[example.com/a/b]",
        id="r-config-drop-label",
        message="replacement.drop_labels[0]: 'example.com/a/b' is not a label key",
    ),
    node(
        "restarter",
        "config",
        "--set",
        "intake=3",
        id="r-config-set-group",
        message="intake: expected a mapping, got int 3 (from --set)",
    ),
    node(
        "restarter",
        "config",
        "--set",
        "colour=red",
        id="r-config-unknown-key",
        message="colour: unknown key (from --set; known keys: controller, election, intake",
    ),
]

CASES = AGENT_CASES + RESTARTER_CASES


def prepare(directory: Path) -> None:
    (directory / "empty").mkdir()
    (directory / "afile").write_text("a regular file\n")
    (directory / "huge-int.yaml").write_text(f"node:\n  event_burst: {HUGE}\n")
    (directory / "deep-list.yaml").write_text(f"sharing: {DEEP_LIST}\n")
    (directory / "deep-map.yaml").write_text(f"health: {DEEP_MAP}\n")
    (directory / "utf16-bom.yaml").write_bytes("log_level: debug\n".encode("utf-16"))
    (directory / "utf16le.yaml").write_bytes("log_level: debug\n".encode("utf-16-le"))
    (directory / "latin1.yaml").write_bytes("node_name: caf\xe9\n".encode("latin-1"))
    (directory / "control.yaml").write_bytes(b"node_name: a\x07b\n")
    (directory / "big.yaml").write_text("# padding\n" * 120_000)
    (directory / "list.yaml").write_text("- log_level\n")
    (directory / "bad-date.yaml").write_text("health:\n  quiet_seconds: 2024-13-01\n")
    (directory / "nan-events.yaml").write_text("node:\n  events_per_minute: .nan\n")
    (directory / "kubeconfig").write_text(KUBECONFIG)
    (directory / "restarter.yaml").write_text("storm:\n  min_nodes: -3\n")
    (directory / "broken-kubeconfig").write_text("apiVersion: v1\nkind: Config\n")


DROP_ENV = frozenset(
    {
        "KUBECONFIG",
        "KUBERNETES_SERVICE_HOST",
        "KUBERNETES_SERVICE_PORT",
        "NODE_NAME",
        "POD_NAME",
        "POD_NAMESPACE",
    }
)


def dropped(key: str) -> bool:
    """Environment that configures edl-agent or names a cluster (the cache dir may stay)."""
    return key in DROP_ENV or (key.startswith("EDL_") and key != "EDL_CACHE_DIR")


def clean_environment() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if not dropped(key)}


@dataclass(frozen=True)
class Outcome:
    returncode: int | None  # None: still running at the timeout (killed)
    stderr: str


def filler(directory: Path, port: int) -> Callable[[str], str]:
    def fill(text: str) -> str:
        return text.replace("{d}", str(directory)).replace("{port}", str(port))

    return fill


def run_subprocess(case: Case, directory: Path, port: int) -> Outcome:
    fill = filler(directory, port)
    env = {**clean_environment(), **{k: fill(v) for k, v in case.env.items()}}
    try:
        done = subprocess.run(
            [EDL_AGENT, *(fill(a) for a in case.argv)],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=TIMEOUT_SECONDS,
            check=False,
            env=env,
            cwd=directory,
        )
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else ""
        return Outcome(None, stderr)
    return Outcome(done.returncode, done.stderr)


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    made = tmp_path_factory.mktemp("bad-input")
    prepare(made)
    return made


@pytest.fixture(scope="module")
def subprocess_outcomes(directory: Path) -> dict[str, Outcome]:
    """The outcome of every case run as a subprocess, all run in parallel (each is a fresh
    interpreter: most of its time is start-up), with a port held busy for those that need one."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with ThreadPoolExecutor(max_workers=8) as pool:
            futures = {
                c.id: pool.submit(run_subprocess, c, directory, port)
                for c in CASES
                if not c.in_process
            }
            results = {key: future.result() for key, future in futures.items()}
    return {
        key: Outcome(
            outcome.returncode,
            outcome.stderr.replace(str(directory), "{d}").replace(str(port), "{port}"),
        )
        for key, outcome in results.items()
    }


def run_in_process(
    case: Case,
    directory: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> Outcome:
    fill = filler(directory, 0)
    for key in [k for k in os.environ if dropped(k)]:
        monkeypatch.delenv(key)
    for key, value in case.env.items():
        monkeypatch.setenv(key, fill(value))
    monkeypatch.chdir(directory)
    capsys.readouterr()
    try:
        code: int | str | None = main([fill(a) for a in case.argv])
    except SystemExit as exc:  # argparse's own mistakes
        code = exc.code
    stderr = capsys.readouterr().err
    return Outcome(code if isinstance(code, int) else 1, stderr.replace(str(directory), "{d}"))


def test_case_ids_are_unique() -> None:
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_exit_2(
    case: Case,
    directory: Path,
    subprocess_outcomes: dict[str, Outcome],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if case.in_process:
        outcome = run_in_process(case, directory, monkeypatch, capsys)
    else:
        outcome = subprocess_outcomes[case.id]
    assert outcome.returncode is not None, f"still running after {TIMEOUT_SECONDS} s"
    assert "Traceback" not in outcome.stderr, outcome.stderr[-3000:]
    lines = outcome.stderr.splitlines()
    assert len(lines) == 1, outcome.stderr[-3000:]
    assert outcome.returncode == 2, outcome.stderr
    assert lines[0].startswith(PREFIX)
    assert case.message in lines[0]


def test_a_documented_word_yaml_reads_as_a_bool_means_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`node.labels: off` is documented; YAML 1.1 reads an unquoted off as false. It means
    `off` from a file, the environment and --set alike."""
    config = tmp_path / "edl.yaml"
    config.write_text("node:\n  labels: off\n")
    for key in [k for k in os.environ if dropped(k)]:
        monkeypatch.delenv(key)
    for argv, env in (
        (["--config", str(config)], {}),
        ([], {"EDL_NODE__LABELS": "off"}),
        (["--set", "node.labels=off"], {}),
        (["--set", "node.labels=Off"], {}),
    ):
        with monkeypatch.context() as scoped:
            for key, value in env.items():
                scoped.setenv(key, value)
            assert main(["config", "--host-root", str(tmp_path), "--format", "json", *argv]) == 0
        assert '"labels": "off"' in capsys.readouterr().out
