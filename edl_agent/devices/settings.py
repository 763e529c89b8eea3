"""The settings discovery and resource naming read: one section per vendor and the sharing rules.

Sections of the agent's settings (`edl_agent.config.Settings`, keys `nvidia`, `kunlunxin`,
`hygon`, `ascend`, `sharing`); `DeviceSettings` names what of the whole this package reads, so
that devices never depend on the rest of the agent's configuration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from edl_agent.settings_loader import setting

# Time-slicing replicas and vNPU templates per device. Each replica id is a slot for one more
# process on the device, and every process holds a context in device memory (hundreds of MiB
# on current GPUs), so even an 80 GiB device can run only a few hundred at once: 1024 is well
# above anything usable. It also keeps what kubelet receives small: a ListAndWatch answer costs
# about 70 bytes per id, and kubelet's gRPC client takes at most 4 MiB in one message.
MAX_SHARES_PER_DEVICE = 1024
# Memory units smaller than this would advertise tens of thousands of ids per device (1 MiB
# units give 81,920 for an 80 GiB GPU): more than kubelet takes in one ListAndWatch message.
MIN_MEMORY_UNIT_MIB = 64
# Which kubelet API serves a vendor's devices: the device plugin (extended resources), Dynamic
# Resource Allocation (ResourceSlices and claims), or both during a migration.
Serve = Literal["device-plugin", "dra", "both"]


@dataclass(frozen=True)
class NvidiaSettings:
    enabled: bool = setting(True, "Discover NVIDIA GPUs through NVML.")
    serve: Serve = setting(
        "device-plugin",
        "How kubelet gets these GPUs: `device-plugin`, `dra` (ResourceSlices and the DRA "
        "kubelet plugin) or `both` (a migration; no device is handed out by both, see the "
        "README).",
    )
    resource_name: str = setting(
        "nvidia.com/gpu",
        "Resource for whole GPUs (and for MIG devices under the `single` strategy).",
    )
    mig_strategy: Literal["none", "single", "mixed"] = setting(
        "none",
        "none: advertise whole GPUs only; single: MIG devices as `nvidia.com/gpu`; mixed: MIG "
        "devices as `nvidia.com/mig-<profile>` beside whole GPUs without MIG.",
    )


@dataclass(frozen=True)
class KunlunxinSettings:
    enabled: bool = setting(True, "Discover Kunlunxin XPUs (`/dev/xpu*`, `xpu-smi`).")
    serve: Serve = setting(
        "device-plugin",
        "How kubelet gets these XPUs: `device-plugin`, `dra` (ResourceSlices and the DRA "
        "kubelet plugin) or `both` (a migration; no device is handed out by both, see the "
        "README).",
    )
    resource_name: str = setting(
        "kunlunxin.com/xpu", "Resource for whole XPUs (older clusters use `baidu.com/xpu`)."
    )


@dataclass(frozen=True)
class HygonSettings:
    enabled: bool = setting(True, "Discover Hygon DCUs (DRM cards of PCI vendor 0x1d94, `hy-smi`).")
    serve: Serve = setting(
        "device-plugin",
        "How kubelet gets these DCUs: `device-plugin`, `dra` (ResourceSlices and the DRA "
        "kubelet plugin) or `both` (a migration; no device is handed out by both, see the "
        "README).",
    )
    resource_name: str = setting("hygon.com/dcunum", "Resource for whole DCUs.")


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
    enabled: bool = setting(True, "Discover Huawei Ascend NPUs (`/dev/davinci*`, `npu-smi`).")
    serve: Serve = setting(
        "device-plugin",
        "How kubelet gets these NPUs: `device-plugin`, `dra` (ResourceSlices and the DRA "
        "kubelet plugin) or `both` (a migration; no device is handed out by both, see the "
        "README).",
    )
    resource_prefix: str = setting(
        "huawei.com/",
        "Resources are named by chip family after this prefix: `huawei.com/Ascend910`.",
    )
    vnpu_templates: tuple[VnpuTemplate, ...] = setting(
        (), "vNPU partitions, each its own resource: [{resource, per_device, aicore, memory_mib}]."
    )


@dataclass(frozen=True)
class SharingRule:
    """How the devices of one resource are shared.

    Names may use `{resource}` (the base resource name), `{model}` (`v100`, `h100`) and `{memory}`
    (`32g`), e.g. `baidu.com/{model}_{memory}_cgpu_memory`; devices of different models then land
    in resources of their own.
    """

    resource: str
    keep_whole: bool = setting(False, "Advertise the whole devices too, beside the shares.")
    replicas: int = setting(
        0, "Time-slicing: this many ids per device (`<id>::<i>`), at most 1024; 0 for none."
    )
    replica_resource: str = "{resource}"
    memory_unit_mib: int = setting(
        0, "One id per this many MiB of device memory, at least 64; 0 for none."
    )
    memory_resource: str = "{resource}-memory"
    core_unit_percent: int = setting(
        0, "One id per this many percent of the device's compute; 0 for none."
    )
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


class DeviceSettings(Protocol):
    """What discovery and resource naming read of the agent's settings (`config.Settings` has
    it): the host root, the node's name, the vendor sections and the sharing rules."""

    @property
    def host_root(self) -> str: ...
    @property
    def node_name(self) -> str: ...
    @property
    def nvidia(self) -> NvidiaSettings: ...
    @property
    def kunlunxin(self) -> KunlunxinSettings: ...
    @property
    def hygon(self) -> HygonSettings: ...
    @property
    def ascend(self) -> AscendSettings: ...
    @property
    def sharing(self) -> tuple[SharingRule, ...]: ...

    def serve(self, vendor: str) -> Serve:
        """How kubelet gets `vendor`'s devices (a Vendor value: `nvidia`, `ascend` ...)."""
        ...
