"""The agent's settings: typed, validated, layered by `edl_agent.settings_loader` (defaults <
profile defaults < YAML file < EDL_* environment < flags).

Environment variables name a key path with `__` between levels: `EDL_LOG_LEVEL=debug`,
`EDL_NVIDIA__MIG_STRATEGY=mixed`; flags use `--set nvidia.mig_strategy=mixed` the same way. The
sections discovery reads (vendors, sharing) live in `edl_agent.devices.settings`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from edl_agent.address import check_dial_target, is_loopback, parse_host_port
from edl_agent.devices.settings import (
    AscendSettings,
    HygonSettings,
    KunlunxinSettings,
    NvidiaSettings,
    Serve,
    SharingRule,
)
from edl_agent.errors import shorten
from edl_agent.fault_codes import check_code_keys
from edl_agent.health_settings import DegradedSettings, RemediationSettings
from edl_agent.settings_loader import LogFormat, LogLevel, load_layers, section, setting

RESOURCE_NAME = re.compile(
    r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
PLACEHOLDERS = ("{resource}", "{model}", "{memory}")
# A Node's name is a DNS subdomain (RFC 1123), as the API server requires.
NODE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
MAX_NODE_NAME = 253


@dataclass(frozen=True)
class PluginSettings:
    kubelet_dir: str = setting(
        "/var/lib/kubelet/device-plugins",
        "Where kubelet.sock lives and where our per-resource plugin sockets are created.",
    )
    nvidia_device_id_strategy: Literal["uuid", "index"] = setting(
        "uuid", "How NVIDIA_VISIBLE_DEVICES names GPUs: by uuid, or by index (`0`, MIG `0:1`)."
    )
    nvidia_device_specs: bool = setting(
        False, "Also pass /dev/nvidia* nodes as DeviceSpecs (for runtimes without the NVIDIA hook)."
    )
    nvidia_cdi: bool = setting(
        False, "Also name CDI devices `nvidia.com/gpu=<id>` in Allocate responses."
    )
    cdi: bool = setting(
        False,
        "Also name our own CDI devices (`nvidia.edl.io/gpu=gpu-3`, `ascend.edl.io/npu=npu-0`) "
        "in Allocate responses, for every vendor; their specs are written to `dra.cdi_dir`.",
    )
    slice_placement: Literal["pack", "spread"] = setting(
        "pack", "Preferred allocation of shares: pack onto few devices, or spread over many."
    )
    pre_start_required: bool = setting(
        False, "Ask kubelet to call PreStartContainer (a no-op that only logs)."
    )
    health_poll_seconds: float = setting(
        1.0,
        "How often every device's /dev nodes are checked where their directory cannot be "
        "watched (elsewhere: on each change, and every 60 s); a missing one makes it Unhealthy.",
    )
    rediscover_seconds: float = setting(
        60.0, "How often the whole inventory is discovered again (also at once when /dev changes)."
    )

    def check(self) -> None:
        if not 0.05 <= self.health_poll_seconds <= 3600:
            raise ValueError("health_poll_seconds: must be between 0.05 and 3600")
        if not 1 <= self.rediscover_seconds <= 86400:
            raise ValueError("rediscover_seconds: must be between 1 and 86400")


POLLED_VENDORS = frozenset({"kunlunxin", "hygon", "ascend"})  # Vendor values read by polls


@dataclass(frozen=True)
class HealthSettings:
    xid_levels: dict[str, Literal["ignore", "warn", "degraded", "device_fatal", "node_fatal"]] = (
        section(
            dict,
            'Overrides of the XID table, e.g. {"31": "device_fatal", "94": "warn"} (levels: '
            "ignore, warn, degraded, device_fatal, node_fatal).",
        )
    )
    ascend_code_levels: dict[
        str, Literal["ignore", "warn", "degraded", "device_fatal", "node_fatal"]
    ] = section(
        dict,
        'Overrides of the Ascend fault-code table, by hex code: {"0x80E01801": "node_fatal"}.',
    )
    xid_clears_by: dict[
        str, Literal["nothing", "condition", "quiet", "reset", "reboot", "release"]
    ] = section(
        dict,
        'What ends the quarantine an XID causes, overriding the catalog\'s column: {"54": '
        '"reset", "31": "quiet"} (quiet: `quiet_seconds` without a repeat).',
    )
    ascend_code_clears_by: dict[
        str, Literal["nothing", "condition", "quiet", "reset", "reboot", "release"]
    ] = section(dict, 'The same for Ascend fault codes, by hex code: {"0x80E18402": "reset"}.')
    quiet_seconds: float = setting(
        300.0,
        "A device quarantined by a fault that clears by `quiet` is healthy again after this "
        "long without a repeat. Severe faults never clear with time alone (see the README's "
        "lifecycle).",
    )
    poll_seconds: float = setting(
        1.0,
        "How often Kunlunxin, Hygon and Ascend devices are polled for health, through their "
        "library where the node has it, else their tool (Ascend faults also arrive as events).",
    )
    vendor_poll_seconds: dict[str, float] = section(
        dict,
        'A poll period of its own for some polled vendors, by name: {"kunlunxin": 5} reads '
        "Kunlunxin's `xpu-smi` every 5 s (12 runs a minute instead of 60); the others keep "
        "`poll_seconds`.",
    )
    nvml_retry_seconds: float = setting(
        5.0, "Wait before trying again when NVML cannot be initialised or its event loop breaks."
    )
    nvml_wait_seconds: float = setting(
        5.0,
        "Longest single wait for an NVML event. NVML's wait cannot be interrupted, so the event "
        "loop sees a stop only between waits: stopping the agent may take this long. Shorter "
        "waits wake an idle agent more often; events are seen at once either way.",
    )
    tool_timeout_seconds: float = setting(
        5.0,
        "How long one run of a vendor tool (`npu-smi`, `hy-smi`, `xpu-smi`) in a health poll may "
        "take: a hung tool must not stall the poll for long; a healthy one answers well within it.",
    )
    shadow: bool = setting(
        False,
        "Shadow mode, for a trial before the agent acts: health is found and reported as usual "
        "(labels, the node condition, Events, metrics, faults for the restarter), but no device "
        "is withdrawn for it: kubelet, DRA and Volcano keep seeing every device healthy, and "
        "no device is reset (`remediation`).",
    )
    remediation: RemediationSettings = section(
        RemediationSettings, "Resets of idle quarantined devices by the agent (opt-in)."
    )
    degraded: DegradedSettings = section(
        DegradedSettings,
        "Warnings read from NVIDIA GPUs that make one Degraded: it keeps serving its pods and "
        "takes no new one, and a policy may move them off it gracefully.",
    )

    def poll_seconds_of(self, vendor: str) -> float:
        """The poll period of `vendor` (a Vendor value)."""
        return self.vendor_poll_seconds.get(vendor, self.poll_seconds)

    def check(self) -> None:
        bounds = {
            "quiet_seconds": 30 * 86400,
            "poll_seconds": 3600,
            "nvml_retry_seconds": 3600,
            "nvml_wait_seconds": 60,
            "tool_timeout_seconds": 600,
        }
        for key, most in bounds.items():
            if not 0 < getattr(self, key) <= most:
                raise ValueError(f"{key}: must be positive and at most {most}")
        for vendor, seconds in self.vendor_poll_seconds.items():
            if vendor not in POLLED_VENDORS:
                known = ", ".join(sorted(POLLED_VENDORS))
                raise ValueError(f"vendor_poll_seconds: {vendor!r} is not one of {known}")
            if not 0 < seconds <= bounds["poll_seconds"]:
                msg = f"vendor_poll_seconds.{vendor}: must be positive and at most 3600"
                raise ValueError(msg)
        check_code_keys("xid_levels", self.xid_levels, ascend=False)
        check_code_keys("ascend_code_levels", self.ascend_code_levels, ascend=True)
        check_code_keys("xid_clears_by", self.xid_clears_by, ascend=False)
        check_code_keys("ascend_code_clears_by", self.ascend_code_clears_by, ascend=True)


@dataclass(frozen=True)
class NodeSettings:
    kubeconfig: str = setting(
        "",
        "Kubeconfig file for the API server (`run --kubeconfig`); empty: $KUBECONFIG, else "
        "the pod's service account when in a cluster, else no API at all (labels, the "
        "condition and events are only logged). Under --simulate only this setting is used, "
        "never $KUBECONFIG or the service account, so a simulated node cannot label a real "
        "node by accident; ~/.kube/config is never read.",
    )
    labels: Literal["node", "features_file", "off"] = setting(
        "node",
        "node: patch labels onto the Node; features_file: write them to `features_file` for "
        "Node Feature Discovery instead; off: no labels (the condition and events are still "
        "written).",
    )
    features_file: str = setting(
        "/etc/kubernetes/node-feature-discovery/features.d/edl-agent",
        "Where the `features_file` mode writes `key=value` lines (a path inside the agent's pod).",
    )
    resync_seconds: float = setting(
        300.0,
        "How often labels and the condition are written even when nothing changed (a "
        "heartbeat for the condition, and repair of labels someone else removed).",
    )
    events_per_minute: float = setting(
        10.0, "Event rate limit for this node (token bucket refill); more are dropped and counted."
    )
    event_burst: int = setting(
        10, "Events that may be sent at once before the rate limit applies (token bucket size)."
    )
    event_dedupe_seconds: float = setting(
        600.0,
        "An event with the same type, reason and message within this window bumps the count "
        "of the first one instead of creating another.",
    )
    volcano_device_info: bool = setting(
        False,
        "Also keep the ConfigMap kube-system/mindx-dl-deviceinfo-<node> that Volcano's Ascend "
        "scheduling reads (Ascend NPUs' health in MindCluster's format), in place of Huawei's "
        "device plugin. Needs the opt-in access in deploy/volcano.",
    )
    api_connect_timeout_seconds: float = setting(
        5.0, "How long the agent's API client waits to connect to the API server."
    )
    api_read_timeout_seconds: float = setting(
        30.0,
        "How long the agent's API client waits for an answer to a request (a watch waits for "
        "its own timeout and 30 s more).",
    )

    def check(self) -> None:
        for key in ("api_connect_timeout_seconds", "api_read_timeout_seconds"):
            if not 0 < getattr(self, key) <= 600:
                raise ValueError(f"{key}: must be positive and at most 600")
        if not 10 <= self.resync_seconds <= 86400:
            raise ValueError("resync_seconds: must be between 10 and 86400")
        if not 0 < self.events_per_minute <= 60000:
            raise ValueError("events_per_minute: must be positive and at most 60000")
        if not 1 <= self.event_burst <= 10000:
            raise ValueError("event_burst: must be between 1 and 10000")
        # The API server keeps events for an hour by default; a day is beyond any use.
        if not 0 <= self.event_dedupe_seconds <= 86400:
            raise ValueError("event_dedupe_seconds: must be between 0 and 86400")
        if self.labels == "features_file" and not self.features_file:
            raise ValueError("features_file: must be set when labels is features_file")


@dataclass(frozen=True)
class FaultSettings:
    state_dir: str = setting(
        "/var/lib/edl-agent",
        "The agent's own state; faults wait in `<state_dir>/outbox` until the restarter "
        "acknowledges them (they survive agent restarts and restarter outages). With "
        "--simulate: inside the simulated tree.",
    )
    restarter_address: str = setting(
        "",
        "The restarter's fault intake (`host:port`, `unix:PATH`); empty: faults are only "
        "logged, nothing is sent and no outbox is kept.",
    )
    token_file: str = setting(
        "/var/run/secrets/edl-agent/token",
        "A projected ServiceAccount token with audience `edl-restarter`, re-read for every call.",
    )
    ca_file: str = setting(
        "",
        "PEM CA bundle the restarter's certificate is checked against (TLS); empty: "
        "plaintext, allowed only to a loopback address or with `insecure`.",
    )
    server_name: str = setting(
        "", "The name the restarter's certificate must carry, when it is not the address's host."
    )
    insecure: bool = setting(
        False,
        "Allow plaintext to a non-loopback restarter (the token then crosses the network in "
        "clear).",
    )
    batch_size: int = setting(100, "Faults sent to the restarter in one call, at most.")
    call_timeout_seconds: float = setting(10.0, "How long one call to the restarter may take.")
    backoff_initial_seconds: float = setting(
        0.5, "Wait before the first retry after a failed call; it doubles with every failure."
    )
    backoff_max_seconds: float = setting(
        5.0,
        "The longest wait between retries: after an outage of the restarter, faults go within "
        "about this long of its return.",
    )
    retry_later_seconds: float = setting(
        1.0, "Wait before faults the restarter asked to be sent again later go again."
    )

    def check(self) -> None:
        if not 1 <= self.batch_size <= 10000:
            raise ValueError("batch_size: must be between 1 and 10000")
        for key in ("call_timeout_seconds", "backoff_initial_seconds", "retry_later_seconds"):
            if not 0 < getattr(self, key) <= 3600:
                raise ValueError(f"{key}: must be positive and at most 3600")
        if not self.backoff_initial_seconds <= self.backoff_max_seconds <= 86400:
            raise ValueError(
                "backoff_max_seconds: must be at least backoff_initial_seconds and at most 86400"
            )
        if not self.restarter_address:
            return
        try:
            check_dial_target(self.restarter_address)
        except ValueError as exc:
            raise ValueError(f"restarter_address: {exc}") from None
        if not self.state_dir:
            raise ValueError("state_dir: must be set when restarter_address is")
        if not self.ca_file and not self.insecure and not is_loopback(self.restarter_address):
            raise ValueError(
                f"ca_file: must be set to send to {self.restarter_address} (or set insecure "
                "to allow the token to cross the network in plaintext)"
            )


@dataclass(frozen=True)
class DraSettings:
    plugins_registry_dir: str = setting(
        "/var/lib/kubelet/plugins_registry",
        "Kubelet's plugin-watcher directory. One socket per DRA driver is created here; it "
        "serves registration, the DRA plugin API and device health.",
    )
    cdi_dir: str = setting(
        "/var/run/cdi",
        "Where CDI specs for the devices (and per prepared claim) are written for the "
        "container runtime.",
    )
    unhealthy_taint: Literal["NoSchedule", "NoExecute"] = setting(
        "NoSchedule",
        "The taint an unhealthy device gets on its ResourceSlice: NoSchedule keeps new claims "
        "off it; NoExecute also evicts the pods that hold it.",
    )
    degraded_taint: Literal["NoSchedule", "None"] = setting(
        "NoSchedule",
        "The taint a degraded device (a fault is coming; its pods keep running) gets on its "
        "ResourceSlice: `NoSchedule` keeps new claims off it; `None` only shows it.",
    )
    health_timeout_seconds: int = setting(
        30,
        "How long kubelet trusts a device health report; the agent repeats each report well "
        "within it.",
    )

    def check(self) -> None:
        if not 5 <= self.health_timeout_seconds <= 3600:
            raise ValueError("health_timeout_seconds: must be between 5 and 3600")
        for key in ("plugins_registry_dir", "cdi_dir"):
            if not getattr(self, key).startswith("/"):
                raise ValueError(f"{key}: must be an absolute path")


@dataclass(frozen=True)
class Settings:
    node_name: str = setting(
        "", "The Kubernetes node this agent runs on; default: $NODE_NAME, else the host's hostname."
    )
    host_root: str = setting(
        "/", "Every device, sysfs file, library and vendor tool is read under this directory."
    )
    log_level: LogLevel = setting("info", "Least severe log level written (logs go to stderr).")
    log_format: LogFormat = setting("auto", "auto: readable on a terminal, JSON lines otherwise.")
    nvidia: NvidiaSettings = field(default_factory=NvidiaSettings)
    kunlunxin: KunlunxinSettings = field(default_factory=KunlunxinSettings)
    hygon: HygonSettings = field(default_factory=HygonSettings)
    ascend: AscendSettings = field(default_factory=AscendSettings)
    plugin: PluginSettings = field(default_factory=PluginSettings)
    dra: DraSettings = section(
        DraSettings, "Dynamic Resource Allocation, for vendors whose `serve` is `dra` or `both`."
    )
    health: HealthSettings = field(default_factory=HealthSettings)
    node: NodeSettings = section(
        NodeSettings,
        "Labels, the AcceleratorHealthy condition and Events on this node's Node object.",
    )
    metrics_addr: str = setting(
        ":9400",
        "Address of /metrics, /healthz and /readyz (`:9400`, `127.0.0.1:9400`); empty: none.",
    )
    pod_resources_socket: str = setting(
        "/var/lib/kubelet/pod-resources/kubelet.sock",
        "Kubelet's pod-resources socket, to label device metrics with the pods holding them.",
    )
    faults: FaultSettings = section(
        FaultSettings,
        "Fault reports to the restarter: container exits on this node, unhealthy devices.",
    )
    sharing: tuple[SharingRule, ...] = setting(
        (),
        "Sharing rules per resource: [{resource, keep_whole, replicas, replica_resource, "
        "memory_unit_mib, memory_resource, core_unit_percent, core_resource}]; see README.",
    )

    def serve(self, vendor: str) -> Serve:
        """How kubelet gets `vendor`'s devices (a Vendor value: `nvidia`, `ascend` ...)."""
        section: NvidiaSettings | KunlunxinSettings | HygonSettings | AscendSettings = getattr(
            self, vendor
        )
        return section.serve

    def check(self) -> None:
        if self.node_name and not (
            len(self.node_name) <= MAX_NODE_NAME and NODE_NAME.match(self.node_name)
        ):
            raise ValueError(
                f"node_name: {shorten(self.node_name)!r} is not a Kubernetes node name "
                "(lower-case letters, digits, '-' and '.')"
            )
        if self.metrics_addr:
            try:
                parse_host_port(self.metrics_addr)
            except ValueError as exc:
                raise ValueError(f"metrics_addr: {exc}") from None
        names = [
            ("nvidia.resource_name", self.nvidia.resource_name),
            ("kunlunxin.resource_name", self.kunlunxin.resource_name),
            ("hygon.resource_name", self.hygon.resource_name),
        ]
        names += [
            (f"ascend.vnpu_templates[{i}].resource", t.resource)
            for i, t in enumerate(self.ascend.vnpu_templates)
        ]
        for i, rule in enumerate(self.sharing):
            names += [
                (f"sharing[{i}].resource", rule.resource),
                (f"sharing[{i}].replica_resource", rule.replica_resource),
                (f"sharing[{i}].memory_resource", rule.memory_resource),
                (f"sharing[{i}].core_resource", rule.core_resource),
            ]
        for key, name in names:
            probe = name.replace("{resource}", "example.com/x")
            for placeholder in PLACEHOLDERS:
                probe = probe.replace(placeholder, "x")
            if not RESOURCE_NAME.match(probe):
                raise ValueError(f"{key}: {name!r} is not a valid extended resource name")


def load_settings(
    *,
    file: str | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> Settings:
    """Merge the layers and validate; raises ConfigError with one line naming key and source."""
    return load_layers(
        Settings,
        file=file,
        environ=environ,
        overrides=[("command line", overrides or {})],
        defaults=[("profile defaults", defaults)] if defaults else [],
    )
