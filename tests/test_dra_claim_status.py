"""What a prepared claim's `status.devices` says of its devices (dra/claim_status.py's pure
part); the writing itself is proven against kube-apiserver and kubelet in
tests/cluster/test_dra_kubelet.py and test_deploy.py."""

from __future__ import annotations

from edl_agent.dra.checkpoint import PreparedClaim, PreparedDevice
from edl_agent.dra.claim_status import (
    GONE_MESSAGE,
    HEALTHY,
    READY,
    UNHEALTHY,
    desired_entries,
    entry_key,
    field_manager,
    since_of,
)

DRIVER = "gpu.nvidia.edl.io"
T0, T1 = "2026-11-27T04:00:00Z", "2026-11-27T04:05:00Z"


def device(name: str, share: str | None = None) -> PreparedDevice:
    return PreparedDevice(
        requests=("gpus",), pool="node-a", device=name, cdi_ids=(), share_id=share
    )


def claim(*devices: PreparedDevice) -> PreparedClaim:
    return PreparedClaim(uid="u1", namespace="ml", name="c", driver=DRIVER, devices=devices)


def ready(entry: dict[str, object]) -> dict[str, str]:
    [condition] = entry["conditions"]  # type: ignore[misc]
    assert condition["type"] == READY
    return dict(condition)


def test_each_device_gets_a_ready_condition_from_its_health() -> None:
    entries = desired_entries(
        claim(device("gpu-0"), device("gpu-1")),
        {"gpu-0": (True, ""), "gpu-1": (False, "XID 48: double-bit ECC error")},
        {},
        T0,
    )
    assert [(e["driver"], e["pool"], e["device"]) for e in entries] == [
        (DRIVER, "node-a", "gpu-0"),
        (DRIVER, "node-a", "gpu-1"),
    ]
    good, bad = ready(entries[0]), ready(entries[1])
    assert (good["status"], good["reason"], good["lastTransitionTime"]) == ("True", HEALTHY, T0)
    assert (bad["status"], bad["reason"]) == ("False", UNHEALTHY)
    assert bad["message"] == "XID 48: double-bit ECC error"
    assert "shareID" not in entries[0]


def test_transition_time_moves_only_when_the_status_changes() -> None:
    first = desired_entries(claim(device("gpu-0")), {"gpu-0": (True, "")}, {}, T0)
    since = since_of(first, DRIVER)
    assert since == {entry_key(DRIVER, device("gpu-0")): ("True", T0)}

    same = desired_entries(claim(device("gpu-0")), {"gpu-0": (True, "")}, since, T1)
    assert same == first, "nothing changed: nothing to write"

    turned = desired_entries(claim(device("gpu-0")), {"gpu-0": (False, "XID 79")}, since, T1)
    assert (ready(turned[0])["status"], ready(turned[0])["lastTransitionTime"]) == ("False", T1)


def test_a_device_gone_from_the_node_is_not_ready() -> None:
    [entry] = desired_entries(claim(device("gpu-3")), {}, {}, T0)
    assert (ready(entry)["status"], ready(entry)["message"]) == ("False", GONE_MESSAGE)


def test_shares_are_entries_of_their_own_and_repeats_are_one() -> None:
    entries = desired_entries(
        claim(device("gpu-0", "s1"), device("gpu-0", "s2"), device("gpu-0", "s1")),
        {"gpu-0": (True, "")},
        {},
        T0,
    )
    assert [e.get("shareID") for e in entries] == ["s1", "s2"]


def test_since_reads_only_the_driver_s_own_entries() -> None:
    theirs = {
        "driver": "gpu.nvidia.com",
        "pool": "node-a",
        "device": "gpu-0",
        "conditions": [{"type": READY, "status": "False", "lastTransitionTime": T0}],
    }
    ours = desired_entries(claim(device("gpu-0")), {"gpu-0": (True, "")}, {}, T1)
    assert since_of([theirs, *ours], DRIVER) == {
        ("gpu.nvidia.edl.io", "node-a", "gpu-0", ""): ("True", T1)
    }


def test_a_long_reason_is_cut_to_what_the_api_accepts() -> None:
    [entry] = desired_entries(claim(device("gpu-0")), {"gpu-0": (False, "x" * 5000)}, {}, T0)
    assert len(ready(entry)["message"]) == 1024


def test_the_field_manager_is_the_driver_s() -> None:
    assert field_manager(DRIVER) == "edl-agent/gpu.nvidia.edl.io"
