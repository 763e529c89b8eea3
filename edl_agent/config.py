"""Typed settings, layered: defaults < profile defaults < YAML file < EDL_* environment < flags.

Environment variables name a key path with `__` between levels: `EDL_LOG_LEVEL=debug`,
`EDL_NVIDIA__MIG_STRATEGY=mixed`. Their values are read as YAML scalars (`true`, `3`, `[a, b]`),
so every key can be set from a pod spec. Flags use `--set nvidia.mig_strategy=mixed` the same way.
"""

from __future__ import annotations

import codecs
import dataclasses
import itertools
import re
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from edl_agent.errors import shorten
from edl_agent.typed import SchemaError, build

T = TypeVar("T")
ENV_PREFIX = "EDL_"
# The restarter's settings (`edl_agent.restarter.settings`): a process of one kind must not
# refuse to start over the other's variables (a shell or pod that sets both).
RESTARTER_ENV_PREFIX = "EDL_RESTARTER_"
ENV_PREFIXES = (ENV_PREFIX, RESTARTER_ENV_PREFIX)
RESOURCE_NAME = re.compile(
    r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
PLACEHOLDERS = ("{resource}", "{model}", "{memory}")
# A Node's name is a DNS subdomain (RFC 1123), as the API server requires.
NODE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
MAX_NODE_NAME = 253
# Time-slicing replicas and vNPU templates per device. Each replica id is a slot for one more
# process on the device, and every process holds a context in device memory (hundreds of MiB
# on current GPUs), so even an 80 GiB device can run only a few hundred at once: 1024 is well
# above anything usable. It also keeps what kubelet receives small: a ListAndWatch answer costs
# about 70 bytes per id, and kubelet's gRPC client takes at most 4 MiB in one message.
MAX_SHARES_PER_DEVICE = 1024
# Memory units smaller than this would advertise tens of thousands of ids per device (1 MiB
# units give 81,920 for an 80 GiB GPU): more than kubelet takes in one ListAndWatch message.
MIN_MEMORY_UNIT_MIB = 64
# A config file is a page of YAML; reading stops here so that a wrong path (/dev/zero, a disk
# image) is refused at once instead of filling memory.
MAX_CONFIG_BYTES = 1024 * 1024
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["auto", "json", "console"]
# Which kubelet API serves a vendor's devices: the device plugin (extended resources), Dynamic
# Resource Allocation (ResourceSlices and claims), or both during a migration.
Serve = Literal["device-plugin", "dra", "both"]


class ConfigError(Exception):
    """Bad configuration; the message names the key and the source."""


@dataclass(frozen=True)
class NvidiaSettings:
    enabled: bool = True
    """Discover NVIDIA GPUs through NVML."""
    serve: Serve = "device-plugin"
    """How kubelet gets these GPUs: `device-plugin`, `dra` (ResourceSlices and the DRA kubelet
    plugin) or `both` (a migration; no device is handed out by both, see the README)."""
    resource_name: str = "nvidia.com/gpu"
    """Resource for whole GPUs (and for MIG devices under the `single` strategy)."""
    mig_strategy: Literal["none", "single", "mixed"] = "none"
    """none: advertise whole GPUs only; single: MIG devices as `nvidia.com/gpu`; mixed: MIG
    devices as `nvidia.com/mig-<profile>` beside whole GPUs without MIG."""


@dataclass(frozen=True)
class KunlunxinSettings:
    enabled: bool = True
    """Discover Kunlunxin XPUs (`/dev/xpu*`, `xpu-smi`)."""
    serve: Serve = "device-plugin"
    """How kubelet gets these XPUs: `device-plugin`, `dra` (ResourceSlices and the DRA kubelet
    plugin) or `both` (a migration; no device is handed out by both, see the README)."""
    resource_name: str = "kunlunxin.com/xpu"
    """Resource for whole XPUs (older clusters use `baidu.com/xpu`)."""


@dataclass(frozen=True)
class HygonSettings:
    enabled: bool = True
    """Discover Hygon DCUs (DRM cards of PCI vendor 0x1d94, `hy-smi`)."""
    serve: Serve = "device-plugin"
    """How kubelet gets these DCUs: `device-plugin`, `dra` (ResourceSlices and the DRA kubelet
    plugin) or `both` (a migration; no device is handed out by both, see the README)."""
    resource_name: str = "hygon.com/dcunum"
    """Resource for whole DCUs."""


@dataclass(frozen=True)
class VnpuTemplate:
    """A fixed Ascend vNPU partition advertised as its own resource (`huawei.com/Ascend910-5c`)."""

    resource: str
    per_device: int
    aicore: int
    memory_mib: int

    def check(self) -> None:
        if not 1 <= self.per_device <= MAX_SHARES_PER_DEVICE:
            raise ValueError(f"per_device: must be between 1 and {MAX_SHARES_PER_DEVICE}")
        if self.aicore < 0 or self.memory_mib < 0:
            raise ValueError("aicore and memory_mib must not be negative")


@dataclass(frozen=True)
class AscendSettings:
    enabled: bool = True
    """Discover Huawei Ascend NPUs (`/dev/davinci*`, `npu-smi`)."""
    serve: Serve = "device-plugin"
    """How kubelet gets these NPUs: `device-plugin`, `dra` (ResourceSlices and the DRA kubelet
    plugin) or `both` (a migration; no device is handed out by both, see the README)."""
    resource_prefix: str = "huawei.com/"
    """Resources are named by chip family after this prefix: `huawei.com/Ascend910`."""
    vnpu_templates: tuple[VnpuTemplate, ...] = ()
    """vNPU partitions, each its own resource: [{resource, per_device, aicore, memory_mib}]."""


@dataclass(frozen=True)
class SharingRule:
    """How the devices of one resource are shared.

    Names may use `{resource}` (the base resource name), `{model}` (`v100`, `h100`) and `{memory}`
    (`32g`), e.g. `baidu.com/{model}_{memory}_cgpu_memory`; devices of different models then land
    in resources of their own.
    """

    resource: str
    keep_whole: bool = False
    """Advertise the whole devices too, beside the shares."""
    replicas: int = 0
    """Time-slicing: this many ids per device (`<id>::<i>`), at most 1024; 0 for none."""
    replica_resource: str = "{resource}"
    memory_unit_mib: int = 0
    """One id per this many MiB of device memory, at least 64; 0 for none."""
    memory_resource: str = "{resource}-memory"
    core_unit_percent: int = 0
    """One id per this many percent of the device's compute; 0 for none."""
    core_resource: str = "{resource}-core"

    def check(self) -> None:
        if not 0 <= self.replicas <= MAX_SHARES_PER_DEVICE:
            raise ValueError(
                f"replicas: must be between 0 and {MAX_SHARES_PER_DEVICE} (ids per device)"
            )
        if 0 < self.memory_unit_mib < MIN_MEMORY_UNIT_MIB:
            raise ValueError(f"memory_unit_mib: must be 0 (none) or at least {MIN_MEMORY_UNIT_MIB}")
        if not 0 <= self.core_unit_percent <= 100:
            raise ValueError("core_unit_percent: must be between 0 and 100")
        if self.core_unit_percent and 100 % self.core_unit_percent:
            raise ValueError("core_unit_percent: must divide 100 (1, 2, 4, 5, 10, 20, 25, 50)")
        if self.keep_whole and self.replicas and self.replica_resource == "{resource}":
            raise ValueError(
                "replica_resource: must differ from the resource when keep_whole is true"
            )
        if not (self.replicas or self.memory_unit_mib or self.core_unit_percent):
            raise ValueError("set at least one of replicas, memory_unit_mib, core_unit_percent")


@dataclass(frozen=True)
class PluginSettings:
    kubelet_dir: str = "/var/lib/kubelet/device-plugins"
    """Where kubelet.sock lives and where our per-resource plugin sockets are created."""
    nvidia_device_id_strategy: Literal["uuid", "index"] = "uuid"
    """How NVIDIA_VISIBLE_DEVICES names GPUs: by uuid, or by index (`0`, MIG `0:1`)."""
    nvidia_device_specs: bool = False
    """Also pass /dev/nvidia* nodes as DeviceSpecs (for runtimes without the NVIDIA hook)."""
    nvidia_cdi: bool = False
    """Also name CDI devices `nvidia.com/gpu=<id>` in Allocate responses."""
    cdi: bool = False
    """Also name our own CDI devices (`nvidia.edl.io/gpu=gpu-3`, `ascend.edl.io/npu=npu-0`) in
    Allocate responses, for every vendor; their specs are written to `dra.cdi_dir`."""
    slice_placement: Literal["pack", "spread"] = "pack"
    """Preferred allocation of shares: pack onto few devices, or spread over many."""
    pre_start_required: bool = False
    """Ask kubelet to call PreStartContainer (a no-op that only logs)."""
    health_poll_seconds: float = 1.0
    """How often every device's /dev nodes are checked; a missing one makes it Unhealthy."""
    rediscover_seconds: float = 60.0
    """How often the whole inventory is discovered again (also at once when /dev changes)."""

    def check(self) -> None:
        if not 0.05 <= self.health_poll_seconds <= 3600:
            raise ValueError("health_poll_seconds: must be between 0.05 and 3600")
        if not 1 <= self.rediscover_seconds <= 86400:
            raise ValueError("rediscover_seconds: must be between 1 and 86400")


def _default_reset_commands() -> dict[str, list[str]]:
    return {
        "nvidia": ["nvidia-smi", "--gpu-reset", "-i", "{index}"],
        "ascend": ["npu-smi", "set", "-t", "reset", "-i", "{index}", "-c", "0"],
    }


@dataclass(frozen=True)
class RemediationSettings:
    enabled: bool = False
    """Reset quarantined devices the agent finds idle (held by no pod). Off by default: a reset
    is an action on the node, and an operator opts in to it."""
    commands: dict[str, list[str]] = field(default_factory=_default_reset_commands)
    """The reset command per vendor, its first word a tool found under the host root and
    `{index}` the device's index. Vendors without one are never reset by the agent."""
    max_per_hour: int = 4
    """Resets per node in any hour; one device at a time."""
    max_attempts: int = 3
    """Failed resets of one device before it waits for an operator's release instead."""
    timeout_seconds: float = 300.0
    """How long one reset command may run."""
    interval_seconds: float = 30.0
    """How often idle quarantined devices are looked for."""

    def check(self) -> None:
        for vendor, command in self.commands.items():
            if vendor not in {"nvidia", "kunlunxin", "hygon", "ascend"}:
                raise ValueError(f"commands: {vendor!r} is not a vendor")
            if not command or not command[0].strip() or "/" in command[0]:
                raise ValueError(f"commands.{vendor}: the first word must be a tool name")
        if not 1 <= self.max_per_hour <= 3600:
            raise ValueError("max_per_hour: must be between 1 and 3600")
        if not 1 <= self.max_attempts <= 100:
            raise ValueError("max_attempts: must be between 1 and 100")
        if not 1 <= self.timeout_seconds <= 3600:
            raise ValueError("timeout_seconds: must be between 1 and 3600")
        if not 0.1 <= self.interval_seconds <= 3600:
            raise ValueError("interval_seconds: must be between 0.1 and 3600")


@dataclass(frozen=True)
class HealthSettings:
    xid_levels: dict[str, Literal["ignore", "warn", "device_fatal", "node_fatal"]] = field(
        default_factory=dict
    )
    """Overrides of the XID table, e.g. {"31": "device_fatal", "94": "warn"}."""
    ascend_code_levels: dict[str, Literal["ignore", "warn", "device_fatal", "node_fatal"]] = field(
        default_factory=dict
    )
    """Overrides of the Ascend fault-code table, by hex code: {"0x80E01801": "node_fatal"}."""
    xid_clears_by: dict[
        str, Literal["nothing", "condition", "quiet", "reset", "reboot", "release"]
    ] = field(default_factory=dict)
    """What ends the quarantine an XID causes, overriding the catalog's column:
    {"54": "reset", "31": "quiet"} (quiet: `quiet_seconds` without a repeat)."""
    ascend_code_clears_by: dict[
        str, Literal["nothing", "condition", "quiet", "reset", "reboot", "release"]
    ] = field(default_factory=dict)
    """The same for Ascend fault codes, by hex code: {"0x80E18402": "reset"}."""
    quiet_seconds: float = 300.0
    """A device quarantined by a fault that clears by `quiet` is healthy again after this long
    without a repeat. Severe faults never clear with time alone (see the README's lifecycle)."""
    poll_seconds: float = 1.0
    """How often vendor tools are polled for health (vendors without an event API)."""
    nvml_retry_seconds: float = 5.0
    """Wait before trying again when NVML cannot be initialised or its event loop breaks."""
    remediation: RemediationSettings = field(default_factory=RemediationSettings)
    """Resets of idle quarantined devices by the agent (opt-in)."""

    def check(self) -> None:
        from edl_agent.health.classify import (
            check_ascend_overrides,
            check_clears_by_overrides,
            check_xid_overrides,
        )

        bounds = {"quiet_seconds": 30 * 86400, "poll_seconds": 3600, "nvml_retry_seconds": 3600}
        for key, most in bounds.items():
            if not 0 < getattr(self, key) <= most:
                raise ValueError(f"{key}: must be positive and at most {most}")
        try:
            check_xid_overrides(self.xid_levels)
            check_ascend_overrides(self.ascend_code_levels)
            check_clears_by_overrides("xid_clears_by", self.xid_clears_by, ascend=False)
            check_clears_by_overrides(
                "ascend_code_clears_by", self.ascend_code_clears_by, ascend=True
            )
        except ValueError as exc:
            raise ValueError(str(exc).removeprefix("health.")) from None


@dataclass(frozen=True)
class NodeSettings:
    kubeconfig: str = ""
    """Kubeconfig file for the API server (`run --kubeconfig`); empty: $KUBECONFIG, else the
    pod's service account when in a cluster, else no API at all (labels, the condition and
    events are only logged). Under --simulate only this setting is used, never $KUBECONFIG or
    the service account, so a simulated node cannot label a real node by accident;
    ~/.kube/config is never read."""
    labels: Literal["node", "features_file", "off"] = "node"
    """node: patch labels onto the Node; features_file: write them to `features_file` for Node
    Feature Discovery instead; off: no labels (the condition and events are still written)."""
    features_file: str = "/etc/kubernetes/node-feature-discovery/features.d/edl-agent"
    """Where the `features_file` mode writes `key=value` lines (a path inside the agent's pod)."""
    resync_seconds: float = 300.0
    """How often labels and the condition are written even when nothing changed (a heartbeat
    for the condition, and repair of labels someone else removed)."""
    events_per_minute: float = 10.0
    """Event rate limit for this node (token bucket refill); more are dropped and counted."""
    event_burst: int = 10
    """Events that may be sent at once before the rate limit applies (token bucket size)."""
    event_dedupe_seconds: float = 600.0
    """An event with the same type, reason and message within this window bumps the count of
    the first one instead of creating another."""

    def check(self) -> None:
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
    state_dir: str = "/var/lib/edl-agent"
    """The agent's own state; faults wait in `<state_dir>/outbox` until the restarter
    acknowledges them (they survive agent restarts and restarter outages). With --simulate:
    inside the simulated tree."""
    restarter_address: str = ""
    """The restarter's fault intake (`host:port`, `unix:PATH`); empty: faults are only logged,
    nothing is sent and no outbox is kept."""
    token_file: str = "/var/run/secrets/edl-agent/token"  # noqa: S105 - a path, not a secret
    """A projected ServiceAccount token with audience `edl-restarter`, re-read for every call."""
    ca_file: str = ""
    """PEM CA bundle the restarter's certificate is checked against (TLS); empty: plaintext,
    allowed only to a loopback address or with `insecure`."""
    server_name: str = ""
    """The name the restarter's certificate must carry, when it is not the address's host."""
    insecure: bool = False
    """Allow plaintext to a non-loopback restarter (the token then crosses the network in
    clear)."""

    def check(self) -> None:
        from edl_agent.address import check_dial_target, is_loopback

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
    plugins_registry_dir: str = "/var/lib/kubelet/plugins_registry"
    """Kubelet's plugin-watcher directory. One socket per DRA driver is created here; it serves
    registration, the DRA plugin API and device health."""
    cdi_dir: str = "/var/run/cdi"
    """Where CDI specs for the devices (and per prepared claim) are written for the container
    runtime."""
    unhealthy_taint: Literal["NoSchedule", "NoExecute"] = "NoSchedule"
    """The taint an unhealthy device gets on its ResourceSlice: NoSchedule keeps new claims off
    it; NoExecute also evicts the pods that hold it."""
    health_timeout_seconds: int = 30
    """How long kubelet trusts a device health report; the agent repeats each report well
    within it."""

    def check(self) -> None:
        if not 5 <= self.health_timeout_seconds <= 3600:
            raise ValueError("health_timeout_seconds: must be between 5 and 3600")
        for key in ("plugins_registry_dir", "cdi_dir"):
            if not getattr(self, key).startswith("/"):
                raise ValueError(f"{key}: must be an absolute path")


@dataclass(frozen=True)
class Settings:
    node_name: str = ""
    """The Kubernetes node this agent runs on; default: $NODE_NAME, else the host's hostname."""
    host_root: str = "/"
    """Every device, sysfs file, library and vendor tool is read under this directory."""
    log_level: LogLevel = "info"
    """Least severe log level written (logs go to stderr)."""
    log_format: LogFormat = "auto"
    """auto: readable on a terminal, JSON lines otherwise."""
    nvidia: NvidiaSettings = field(default_factory=NvidiaSettings)
    kunlunxin: KunlunxinSettings = field(default_factory=KunlunxinSettings)
    hygon: HygonSettings = field(default_factory=HygonSettings)
    ascend: AscendSettings = field(default_factory=AscendSettings)
    plugin: PluginSettings = field(default_factory=PluginSettings)
    dra: DraSettings = field(default_factory=DraSettings)
    """Dynamic Resource Allocation, for vendors whose `serve` is `dra` or `both`."""
    health: HealthSettings = field(default_factory=HealthSettings)
    node: NodeSettings = field(default_factory=NodeSettings)
    """Labels, the AcceleratorHealthy condition and Events on this node's Node object."""
    metrics_addr: str = ":9400"
    """Address of /metrics, /healthz and /readyz (`:9400`, `127.0.0.1:9400`); empty: none."""
    pod_resources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    """Kubelet's pod-resources socket, to label device metrics with the pods holding them."""
    faults: FaultSettings = field(default_factory=FaultSettings)
    """Fault reports to the restarter: container exits on this node, unhealthy devices."""
    sharing: tuple[SharingRule, ...] = ()
    """Sharing rules per resource: [{resource, keep_whole, replicas, replica_resource,
    memory_unit_mib, memory_resource, core_unit_percent, core_resource}]; see README."""

    def serve(self, vendor: str) -> Serve:
        """How kubelet gets `vendor`'s devices (a Vendor value: `nvidia`, `ascend` ...)."""
        section: NvidiaSettings | KunlunxinSettings | HygonSettings | AscendSettings = getattr(
            self, vendor
        )
        return section.serve

    def check(self) -> None:
        from edl_agent.address import parse_host_port

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


# A layer of settings: where it came from (named in errors) and its nested mapping of keys.
Layer = tuple[str, Mapping[str, Any]]


def load_layers(
    root: type[T],
    *,
    file: str | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Sequence[Layer] = (),
    defaults: Sequence[Layer] = (),
    env_prefix: str = ENV_PREFIX,
) -> T:
    """`root` (a settings dataclass) from, lowest first: `defaults`, the YAML `file`, the
    `env_prefix` variables of `environ`, `overrides`. Raises ConfigError with one line naming
    the key and the layer it came from."""
    layers = [*defaults]
    if file is not None:
        layers.append((file, _read_file(file)))
    layers.append(("environment", env_layer(environ or {}, root, env_prefix)))
    layers += overrides
    merged: dict[str, Any] = {}
    source_of: dict[str, str] = {}
    try:
        for source, layer in layers:
            _check_layer(root, layer, source)
            _deep_merge(merged, layer)
            source_of.update(dict.fromkeys(_key_paths(layer), source))
        return build(root, merged)
    except SchemaError as exc:
        msg = f"{exc} (from {_source(source_of, exc.where)})"
        raise ConfigError(msg) from None
    except RecursionError:
        msg = "the settings are nested too deeply"
        raise ConfigError(msg) from None


def _key_paths(layer: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """Every dotted key path `layer` sets, mappings on the way included."""
    for key, value in layer.items():
        path = f"{prefix}{key}"
        yield path
        if isinstance(value, Mapping):
            yield from _key_paths(value, f"{path}.")


def _source(source_of: Mapping[str, str], where: str) -> str:
    """The layer that set `where` (`sharing[0].replicas`) or, failing that, its nearest parent."""
    parts = re.sub(r"\[\d+\]", "", where).split(".")
    for end in range(len(parts), 0, -1):
        source = source_of.get(".".join(parts[:end]))
        if source is not None:
            return source
    return "configuration"


def env_layer(
    environ: Mapping[str, str], root: type[Any] = Settings, prefix: str = ENV_PREFIX
) -> dict[str, Any]:
    """The `EDL_*` variables (`prefix`) as a nested mapping; `EDL_A__B=v` becomes {"a": {"b": v}}.
    A variable belongs to the longest of `ENV_PREFIXES` it starts with: the agent leaves the
    restarter's `EDL_RESTARTER_*` alone, and the restarter every other `EDL_*`."""
    layer: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(prefix) or name in NON_SETTING_ENV:
            continue
        if any(len(other) > len(prefix) and name.startswith(other) for other in ENV_PREFIXES):
            continue
        path = [part.lower() for part in name[len(prefix) :].split("__")]
        set_path(layer, path, parse_value(path, raw, name, root))
    return layer


# EDL_ variables that are not settings (caches and test switches read elsewhere).
NON_SETTING_ENV = frozenset({"EDL_CACHE_DIR", "EDL_K8S_BIN_DIR"})


def assignment(text: str, root: type[Any] = Settings) -> tuple[list[str], Any]:
    """Parse a `--set key.path=value` flag."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        msg = f"--set {text!r}: expected KEY=VALUE, e.g. log_level=debug"
        raise ConfigError(msg)
    path = key.strip().split(".")
    return path, parse_value(path, raw, f"--set {key}", root)


def parse_value(path: list[str], raw: str, origin: str, root: type[Any] = Settings) -> Any:
    """Strings stay strings where the setting is a string; everything else is a YAML scalar."""
    if _hint_at(root, path) is str:
        return raw
    if not raw.strip():
        return ""
    try:
        return load_yaml(raw)
    except YamlProblem as exc:
        key, value = shorten(".".join(path)), shorten(repr(raw))
        msg = f"{key}: cannot read value {value}: {exc} (from {origin})"
        raise ConfigError(msg) from None


class YamlProblem(ValueError):
    """YAML that cannot be read: `why` in a few words, and the `line` when the parser knows."""

    def __init__(self, why: str, line: int | None = None) -> None:
        super().__init__(why if line is None else f"line {line}: {why}")
        self.why, self.line = why, line


def load_yaml(text: str) -> Any:
    """`yaml.safe_load`, with everything it raises on bad input as a YamlProblem."""
    import yaml  # only when a settings file or a YAML value is read: not at every start

    try:
        return yaml.safe_load(text)
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow
        char = exc.character
        shown = f"U+{char:04X}" if isinstance(char, int) else repr(char)
        why = f"character {shown} at offset {exc.position}: {exc.reason}"
        raise YamlProblem(why) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise YamlProblem(problem, None if mark is None else mark.line + 1) from None
    except RecursionError:
        raise YamlProblem("nested too deeply") from None
    except ValueError as exc:
        # From the value constructors: an integer past Python's int-string conversion limit,
        # or an impossible date such as 2024-13-01.
        digits = "digits" in str(exc)
        raise YamlProblem(
            "a number of more than 4300 digits" if digits else shorten(str(exc), 100)
        ) from None


def describe_settings(root: type[Any] = Settings) -> list[tuple[str, str, str]]:
    """(key, default, help) for every setting of `root`, for the README and `--keys`."""
    rows: list[tuple[str, str, str]] = []
    _describe(root, "", rows)
    return rows


def _describe(cls: type[Any], prefix: str, rows: list[tuple[str, str, str]]) -> None:
    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            _describe(hint, f"{key}.", rows)
            continue
        default: Any = f.default
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        shown = "required" if default is dataclasses.MISSING else repr(default)
        rows.append((key, shown, docs.get(f.name, "")))


def _field_docs(cls: type[Any]) -> dict[str, str]:
    """Attribute docstrings (the string literal after a field), read from the source."""
    import ast
    import inspect

    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _hint_at(root: type[Any], path: list[str]) -> Any:
    hint: Any = root
    for part in path:
        if not (dataclasses.is_dataclass(hint) and isinstance(hint, type)):
            return None
        hints = typing.get_type_hints(hint)
        if part not in hints:
            return None
        hint = hints[part]
    return hint


def _read_file(path: str) -> Mapping[str, Any]:
    try:
        with Path(path).open("rb") as stream:
            raw = stream.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        msg = f"config file {path}: {exc.strerror or exc}"
        raise ConfigError(msg) from None
    if len(raw) > MAX_CONFIG_BYTES:
        msg = f"config file {path}: larger than {MAX_CONFIG_BYTES // 1024} KiB"
        raise ConfigError(msg)
    try:
        data = load_yaml(_decode(path, raw))
    except YamlProblem as exc:
        where = "" if exc.line is None else f" line {exc.line}"
        msg = f"config file {path}{where}: {exc.why}"
        raise ConfigError(msg) from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        msg = f"config file {path}: expected a mapping of settings at the top"
        raise ConfigError(msg)
    return data


def _decode(path: str, raw: bytes) -> str:
    """UTF-8 text (a byte-order mark allowed); anything else is refused with what it looks like."""
    if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)) or (
        len(raw) > 1 and b"\x00" in raw[:2]
    ):
        msg = f"config file {path}: UTF-16 text; save it as UTF-8"
        raise ConfigError(msg)
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        where = f"byte 0x{raw[exc.start]:02x} at offset {exc.start}"
        msg = f"config file {path}: not UTF-8 text ({where})"
        raise ConfigError(msg) from None


def _check_layer(root: type[Any], layer: Mapping[str, Any], source: str) -> None:
    known = {f.name for f in dataclasses.fields(root)}
    for key in layer:
        if key not in known:
            shown = shorten(str(key))
            msg = f"{shown}: unknown key (from {source}; known keys: {', '.join(sorted(known))})"
            raise ConfigError(msg)


def set_path(target: dict[str, Any], path: list[str], value: Any) -> None:
    """Set `value` at the nested key `path`, creating mappings on the way."""
    for part in path[:-1]:
        nested = target.setdefault(part, {})
        if not isinstance(nested, dict):
            nested = target[part] = {}
        target = nested
    target[path[-1]] = value


def _deep_merge(target: dict[str, Any], layer: Mapping[str, Any]) -> None:
    for key, value in layer.items():
        current = target.get(key)
        if isinstance(current, dict) and isinstance(value, Mapping):
            merged = dict(current)
            _deep_merge(merged, value)
            target[key] = merged
        elif isinstance(value, Mapping):
            target[key] = dict(value)
        else:
            target[key] = value
