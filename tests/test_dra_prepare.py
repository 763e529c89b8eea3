"""What a DRA claim gets on this node (edl_agent.dra.prepare) and what survives a restart
(edl_agent.dra.checkpoint): claims shaped like the API server's ResourceClaims, CDI specs and the
checkpoint written to real files."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator, Mapping, MutableMapping
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from edl_agent.devices import names
from edl_agent.devices.model import Device, Health, Vendor
from edl_agent.dra.checkpoint import PreparedClaim, PreparedClaims, PreparedDevice
from edl_agent.dra.prepare import (
    ClaimRef,
    Grant,
    Preparer,
    consumed_capacity,
    parse_quantity,
)

NODE = "node-a"
DRIVER = names.driver_name(Vendor.NVIDIA)
GPU_CDI = names.cdi_kind(Vendor.NVIDIA)


def gpu(index: int, health: Health = Health.HEALTHY) -> Device:
    return Device(
        vendor=Vendor.NVIDIA,
        kind="gpu",
        index=index,
        id=f"GPU-{index:04d}",
        product="NVIDIA H100 80GB HBM3",
        memory_mib=81559,
        device_nodes=(f"/dev/nvidia{index}",),
        health=health,
    )


def result(
    device: str,
    *,
    request: str = "gpu",
    driver: str = DRIVER,
    pool: str = NODE,
    share_id: str | None = None,
    consumed: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """One `status.allocation.devices.results` entry as the API server serves it."""
    entry: dict[str, Any] = {"request": request, "driver": driver, "pool": pool, "device": device}
    if share_id is not None:
        entry["shareID"] = share_id
    if consumed:
        entry["consumedCapacity"] = dict(consumed)
    return entry


def resource_claim(
    uid: str,
    results: list[dict[str, Any]] | None,
    *,
    namespace: str = "team-a",
    name: str = "train",
) -> dict[str, Any]:
    """A ResourceClaim (resource.k8s.io/v1) as a GET from the API server returns it; `results`
    None: not allocated yet."""
    claim: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid,
            "resourceVersion": "48213",
            "generation": 1,
            "creationTimestamp": "2025-06-01T10:00:00Z",
        },
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": DRIVER,
                            "allocationMode": "ExactCount",
                            "count": 1,
                            "capacity": {"requests": {"memory": "4Gi", "cores": "25"}},
                        },
                    }
                ]
            }
        },
        "status": {},
    }
    if results is not None:
        claim["status"] = {
            "allocation": {
                "devices": {"results": results},
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [NODE]}
                            ]
                        }
                    ]
                },
                "allocationTimestamp": "2025-06-01T10:00:01Z",
            },
            "reservedFor": [{"resource": "pods", "name": "trainer-0", "uid": f"pod-{uid}"}],
        }
    return claim


class ClaimApi:
    """ResourceClaims by namespace and name, read the way the agent's API client reads them."""

    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.reads = 0

    def add(self, claim: dict[str, Any]) -> ClaimRef:
        meta = claim["metadata"]
        self.claims[(meta["namespace"], meta["name"])] = claim
        return ClaimRef(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])

    def read(self, namespace: str, name: str) -> dict[str, Any]:
        self.reads += 1
        try:
            return json.loads(json.dumps(self.claims[(namespace, name)]))  # type: ignore[no-any-return]
        except KeyError:
            raise LookupError(f'resourceclaims.resource.k8s.io "{name}" not found') from None


class FileClaimCdi:
    """Claim CDI specs as files in a directory, one per claim."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.writes = 0

    def path(self, claim_uid: str) -> Path:
        return self.directory / f"{names.claim_cdi_name(claim_uid)}.json"

    def write(self, claim_uid: str, grants: list[Grant]) -> str:
        self.writes += 1
        self.directory.mkdir(parents=True, exist_ok=True)
        spec = {
            "cdiVersion": "0.6.0",
            "kind": names.CLAIM_CDI_KIND,
            "devices": [
                {
                    "name": names.claim_cdi_name(claim_uid),
                    "containerEdits": {
                        "env": [f"EDL_DEVICES={','.join(g.device_name for g in grants)}"]
                        + [
                            f"EDL_{g.device_name.upper().replace('-', '_')}_{key.upper()}={value}"
                            for g in grants
                            for key, value in sorted(g.consumed_capacity.items())
                        ]
                    },
                }
            ],
        }
        self.path(claim_uid).write_text(json.dumps(spec), encoding="utf-8")
        return f"{names.CLAIM_CDI_KIND}={names.claim_cdi_name(claim_uid)}"

    def remove(self, claim_uid: str) -> None:
        self.path(claim_uid).unlink(missing_ok=True)


@dataclasses.dataclass
class Node:
    """A node's DRA side for one driver, over a state directory and a CDI directory."""

    root: Path
    api: ClaimApi
    devices: dict[str, tuple[Vendor, Device]]
    unavailable: dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.cdi = FileClaimCdi(self.root / "cdi")
        self.checkpoint = PreparedClaims(self.root / "state")
        self.preparer = self.new_preparer()

    def new_preparer(self) -> Preparer:
        return Preparer(
            driver=DRIVER,
            pool=NODE,
            read_claim=self.api.read,
            devices=lambda: dict(self.devices),
            checkpoint=self.checkpoint,
            claim_cdi=self.cdi,
            is_available=self.unavailable.get,
        )

    def restart(self) -> None:
        """What an agent restart keeps: the state and CDI directories, nothing in memory."""
        self.checkpoint = PreparedClaims(self.root / "state")
        self.preparer = self.new_preparer()


def gpus(count: int) -> dict[str, tuple[Vendor, Device]]:
    return {f"gpu-{i}": (Vendor.NVIDIA, gpu(i)) for i in range(count)}


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(root=tmp_path, api=ClaimApi(), devices=gpus(4))


def prepare_one(node: Node, claim: ClaimRef) -> tuple[tuple[PreparedDevice, ...], str | None]:
    answer = node.preparer.prepare([claim])[claim.uid]
    return answer.devices, answer.error


def claim_cdi_id(uid: str) -> str:
    return f"{names.CLAIM_CDI_KIND}={names.claim_cdi_name(uid)}"


# --- quantities -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("25", Fraction(25)),
        ("0", Fraction(0)),
        ("4Gi", Fraction(4 * 2**30)),
        ("4096Mi", Fraction(4096 * 2**20)),
        (".5Ki", Fraction(512)),
        ("1.5G", Fraction(1_500_000_000)),
        ("250m", Fraction(1, 4)),
        ("1e3", Fraction(1000)),
        ("2E-3", Fraction(2, 1000)),
        ("3E", Fraction(3 * 10**18)),
        ("+7k", Fraction(7000)),
    ],
)
def test_quantities_are_read_exactly(text: str, value: Fraction) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "Gi", "4GiB", "-1", "4 Gi", "1e99", "four", "1.2.3"])
def test_unreadable_quantities_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"not a quantity|out of range"):
        parse_quantity(text)


def test_consumed_memory_is_counted_in_mib_and_rounded_up() -> None:
    assert consumed_capacity({"memory": "4Gi", "cores": "25"}) == {"memory": 4096, "cores": 25}
    assert consumed_capacity({"memory": "4096Mi"}) == {"memory": 4096}
    assert consumed_capacity({"memory": "1G"}) == {"memory": 954}  # 953.67 MiB
    assert consumed_capacity({"cores": "12500m"}) == {"cores": 13}


# --- prepare ----------------------------------------------------------------------------------


def test_prepare_answers_our_devices_with_static_and_claim_cdi_ids(node: Node) -> None:
    claim = node.api.add(
        resource_claim(
            "uid-1",
            [
                result(
                    "gpu-1",
                    request="gpu/large",
                    share_id="share-7",
                    consumed={"memory": "4Gi", "cores": "25"},
                ),
                result("gpu-2", request="other"),
                result("gpu-3", driver="npu.ascend.edl.io"),
                result("gpu-0", pool="node-b"),
            ],
        )
    )
    devices, error = prepare_one(node, claim)
    assert error is None
    assert devices == (
        PreparedDevice(
            requests=("gpu",),
            pool=NODE,
            device="gpu-1",
            cdi_ids=(f"{GPU_CDI}=gpu-1", claim_cdi_id("uid-1")),
            share_id="share-7",
            consumed={"memory": 4096, "cores": 25},
        ),
        PreparedDevice(
            requests=("other",),
            pool=NODE,
            device="gpu-2",
            cdi_ids=(f"{GPU_CDI}=gpu-2",),  # the claim spec is named once, with the first device
        ),
    )
    spec = json.loads(node.cdi.path("uid-1").read_text(encoding="utf-8"))
    assert spec["devices"][0]["containerEdits"]["env"] == [
        "EDL_DEVICES=gpu-1,gpu-2",
        "EDL_GPU_1_CORES=25",
        "EDL_GPU_1_MEMORY=4096",
    ]
    recorded = node.checkpoint.get(DRIVER, "uid-1")
    assert recorded == PreparedClaim(
        uid="uid-1", namespace="team-a", name="train", driver=DRIVER, devices=devices
    )
    assert node.preparer.held() == {"gpu-1": frozenset({"uid-1"}), "gpu-2": frozenset({"uid-1"})}


def test_a_prepared_claim_is_answered_again_without_reading_the_api(node: Node) -> None:
    claim = node.api.add(resource_claim("uid-1", [result("gpu-0")]))
    first = prepare_one(node, claim)
    del node.api.claims[("team-a", "train")]  # the API server is away now
    node.devices.clear()  # and so is the device
    assert prepare_one(node, claim) == first
    assert node.api.reads == 1
    assert node.cdi.writes == 1


def test_a_restart_keeps_prepared_claims_and_unprepare_still_works(node: Node) -> None:
    claim = node.api.add(resource_claim("uid-1", [result("gpu-0")]))
    first = prepare_one(node, claim)
    node.restart()
    assert prepare_one(node, claim) == first
    assert node.api.reads == 1
    assert node.cdi.writes == 1
    assert node.preparer.held() == {"gpu-0": frozenset({"uid-1"})}
    assert node.preparer.unprepare([claim]) == {"uid-1": None}
    node.restart()
    assert node.checkpoint.claims() == ()
    assert not node.cdi.path("uid-1").exists()


def test_concurrent_prepares_of_one_claim_write_it_once(node: Node) -> None:
    claim = node.api.add(resource_claim("uid-1", [result("gpu-0")]))
    start = threading.Barrier(4)
    answers: list[object] = []

    def prepare() -> None:
        start.wait()
        answers.append(prepare_one(node, claim))

    threads = [threading.Thread(target=prepare) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert len(answers) == 4
    assert len(set(map(repr, answers))) == 1
    assert node.cdi.writes == 1


def test_a_device_another_claim_holds_exclusively_is_refused(node: Node) -> None:
    first = node.api.add(resource_claim("uid-1", [result("gpu-1")], name="first"))
    second = node.api.add(resource_claim("uid-2", [result("gpu-1")], name="second"))
    assert prepare_one(node, first)[1] is None
    devices, error = prepare_one(node, second)
    assert (devices, error) == ((), "device gpu-1: held by prepared claim uid-1")
    assert [c.uid for c in node.checkpoint.claims(DRIVER)] == ["uid-1"]
    assert not node.cdi.path("uid-2").exists()
    node.preparer.unprepare([first])
    assert prepare_one(node, second)[1] is None  # free again


def test_a_claim_kubelet_names_without_namespace_name_or_uid_is_refused_quietly(
    node: Node,
) -> None:
    empty = ClaimRef(namespace="", name="", uid="")
    with capture_logs() as logs:
        assert prepare_one(node, empty) == (
            (),
            "kubelet named a claim without its namespace, name, uid",
        )
        assert node.preparer.unprepare([ClaimRef("team-a", "", "uid-9")]) == {
            "uid-9": "kubelet named a claim without its name"
        }
    assert node.api.reads == 0
    assert {entry["log_level"] for entry in logs} == {"warning"}
    assert not any("exc_info" in entry for entry in logs)


def test_a_claim_naming_a_device_twice_is_refused(node: Node) -> None:
    twice = node.api.add(resource_claim("uid-1", [result("gpu-3"), result("gpu-3")]))
    assert prepare_one(node, twice) == ((), "device gpu-3: named twice in the claim")
    assert node.checkpoint.claims(DRIVER) == ()


@pytest.mark.parametrize(
    ("first", "second", "refused"),
    [
        ({"share_id": "s-1"}, {"share_id": "s-2"}, None),  # two shares of consumable capacity
        ({"share_id": "s-1"}, {}, "device gpu-2: held by prepared claim uid-1"),
        ({}, {"share_id": "s-2"}, "device gpu-2: held by prepared claim uid-1"),
        ({"admin": True}, {"admin": True}, None),
        ({"admin": True}, {}, "device gpu-2: held by prepared claim uid-1"),
    ],
)
def test_a_device_is_shared_only_where_both_allocations_share_it(
    node: Node, first: dict[str, Any], second: dict[str, Any], refused: str | None
) -> None:
    def entry(uid: str, how: dict[str, Any]) -> dict[str, Any]:
        found = result("gpu-2", share_id=how.get("share_id"))
        if how.get("admin"):
            found["adminAccess"] = True
        return resource_claim(uid, [found], name=uid)

    assert prepare_one(node, node.api.add(entry("uid-1", first)))[1] is None
    assert prepare_one(node, node.api.add(entry("uid-2", second)))[1] == refused
    # What a restarted agent reads back decides the same.
    node.preparer.unprepare([ClaimRef("uid-2", "uid-2", "uid-2")])
    node.checkpoint = PreparedClaims(node.root / "state")
    node.preparer = node.new_preparer()
    assert prepare_one(node, node.api.add(entry("uid-3", second)))[1] == refused


def test_concurrent_prepares_of_overlapping_claims_give_the_device_once(node: Node) -> None:
    claims = [
        node.api.add(resource_claim(f"uid-{i}", [result("gpu-1")], name=f"c{i}")) for i in range(20)
    ]
    start = threading.Barrier(len(claims))
    answers: dict[str, str | None] = {}

    def prepare(claim: ClaimRef) -> None:
        start.wait()
        answers[claim.uid] = prepare_one(node, claim)[1]

    threads = [threading.Thread(target=prepare, args=(claim,)) for claim in claims]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    winners = [uid for uid, error in answers.items() if error is None]
    assert len(answers) == 20
    assert len(winners) == 1
    assert [c.uid for c in PreparedClaims(node.root / "state").claims(DRIVER)] == winners


def test_refusals_name_the_reason_and_leave_other_claims_alone(node: Node) -> None:
    node.devices["gpu-2"] = (Vendor.NVIDIA, gpu(2, Health.UNHEALTHY))
    node.unavailable["gpu-3"] = "held by the device plugin for pod team-b/infer-0"
    good = node.api.add(resource_claim("uid-good", [result("gpu-0")], name="good"))
    replaced = node.api.add(resource_claim("uid-new", [result("gpu-1")], name="replaced"))
    replaced = dataclasses.replace(replaced, uid="uid-old")
    pending = node.api.add(resource_claim("uid-pending", None, name="pending"))
    elsewhere = node.api.add(
        resource_claim("uid-away", [result("gpu-1", pool="node-b")], name="away")
    )
    missing_device = node.api.add(resource_claim("uid-gone", [result("gpu-9")], name="gone"))
    unhealthy = node.api.add(resource_claim("uid-sick", [result("gpu-2")], name="sick"))
    held = node.api.add(resource_claim("uid-held", [result("gpu-3")], name="held"))
    deleted = ClaimRef(namespace="team-a", name="deleted", uid="uid-deleted")
    broken = node.api.add(resource_claim("uid-broken", [{"driver": DRIVER}], name="broken"))
    bad_quantity = node.api.add(
        resource_claim(
            "uid-qty", [result("gpu-1", consumed={"memory": "lots"})], name="bad-quantity"
        )
    )
    claims = [
        good,
        replaced,
        pending,
        elsewhere,
        missing_device,
        unhealthy,
        held,
        deleted,
        broken,
        bad_quantity,
    ]
    answers = node.preparer.prepare(claims)
    errors = {uid: answer.error for uid, answer in answers.items()}
    assert errors["uid-good"] is None
    assert answers["uid-good"].devices[0].device == "gpu-0"
    expected = {
        "uid-old": "has uid uid-new, not uid-old",
        "uid-pending": "not allocated",
        "uid-away": f"no device of {DRIVER} in pool {NODE}",
        "uid-gone": "device gpu-9: not on this node",
        "uid-sick": "device gpu-2: unhealthy",
        "uid-held": "device gpu-3: held by the device plugin for pod team-b/infer-0",
        "uid-deleted": (
            "reading ResourceClaim team-a/deleted: "
            'resourceclaims.resource.k8s.io "deleted" not found'
        ),
        "uid-broken": "malformed ResourceClaim",
        "uid-qty": "consumed capacity memory: 'lots' is not a quantity",
    }
    for uid, text in expected.items():
        assert text in (errors[uid] or ""), uid
        assert answers[uid].devices == ()
    assert [c.uid for c in node.checkpoint.claims()] == ["uid-good"]
    assert sorted(p.name for p in node.cdi.directory.iterdir()) == ["claim-uid-good.json"]


def test_a_claim_with_one_bad_device_is_refused_whole(node: Node) -> None:
    claim = node.api.add(resource_claim("uid-1", [result("gpu-0"), result("gpu-7")]))
    devices, error = prepare_one(node, claim)
    assert devices == ()
    assert error == "device gpu-7: not on this node"
    assert node.preparer.held() == {}


def test_a_refused_claim_is_prepared_once_its_device_is_back(node: Node) -> None:
    claim = node.api.add(resource_claim("uid-1", [result("gpu-0")]))
    node.devices["gpu-0"] = (Vendor.NVIDIA, gpu(0, Health.UNHEALTHY))
    assert prepare_one(node, claim)[1] == "device gpu-0: unhealthy"
    node.devices["gpu-0"] = (Vendor.NVIDIA, gpu(0))
    devices, error = prepare_one(node, claim)
    assert error is None
    assert [d.device for d in devices] == ["gpu-0"]


def test_a_checkpoint_that_cannot_be_written_fails_the_claim_and_removes_its_spec(
    tmp_path: Path,
) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "dra").write_text("not a directory", encoding="utf-8")
    node = Node(root=tmp_path, api=ClaimApi(), devices=gpus(1))
    claim = node.api.add(resource_claim("uid-1", [result("gpu-0")]))
    devices, error = prepare_one(node, claim)
    assert devices == ()
    assert (error or "").startswith("FileExistsError: ")
    assert node.cdi.writes == 1
    assert not node.cdi.path("uid-1").exists()
    assert node.checkpoint.get(DRIVER, "uid-1") is None


# --- unprepare --------------------------------------------------------------------------------


def test_unprepare_removes_the_spec_and_the_record_and_forgives_unknown_claims(
    node: Node,
) -> None:
    one = node.api.add(resource_claim("uid-1", [result("gpu-0")], name="one"))
    two = node.api.add(resource_claim("uid-2", [result("gpu-1")], name="two"))
    node.preparer.prepare([one, two])
    unknown = ClaimRef(namespace="team-a", name="never", uid="uid-never")
    assert node.preparer.unprepare([one, unknown]) == {"uid-1": None, "uid-never": None}
    assert not node.cdi.path("uid-1").exists()
    assert node.cdi.path("uid-2").exists()
    assert node.preparer.held() == {"gpu-1": frozenset({"uid-2"})}
    assert node.preparer.unprepare([one]) == {"uid-1": None}


def test_unprepare_removes_a_spec_left_by_a_prepare_that_was_never_recorded(node: Node) -> None:
    node.cdi.write("uid-orphan", [])
    orphan = ClaimRef(namespace="team-a", name="orphan", uid="uid-orphan")
    assert node.preparer.unprepare([orphan]) == {"uid-orphan": None}
    assert not node.cdi.path("uid-orphan").exists()


def test_an_unprepare_that_fails_keeps_the_record_for_the_retry(node: Node) -> None:
    claim = node.api.add(resource_claim("uid-1", [result("gpu-0")]))
    prepare_one(node, claim)

    def refuse(claim_uid: str) -> None:
        raise PermissionError(f"cannot remove the spec of {claim_uid}")

    node.cdi.remove = refuse  # type: ignore[method-assign]
    errors = node.preparer.unprepare([claim])
    assert errors == {"uid-1": "PermissionError: cannot remove the spec of uid-1"}
    assert node.checkpoint.get(DRIVER, "uid-1") is not None


# --- checkpoint -------------------------------------------------------------------------------


def prepared(uid: str, driver: str = DRIVER, device: str = "gpu-0") -> PreparedClaim:
    return PreparedClaim(
        uid=uid,
        namespace="team-a",
        name=f"claim-{uid}",
        driver=driver,
        devices=(
            PreparedDevice(
                requests=("gpu",),
                pool=NODE,
                device=device,
                cdi_ids=(f"{GPU_CDI}={device}", claim_cdi_id(uid)),
                share_id="s-1",
                consumed={"memory": 2048},
            ),
        ),
    )


def test_checkpoint_round_trips_through_the_file(tmp_path: Path) -> None:
    store = PreparedClaims(tmp_path)
    npu = names.driver_name(Vendor.ASCEND)
    store.put(prepared("uid-1"))
    store.put(prepared("uid-1", driver=npu, device="npu-0"))  # one claim, two of our drivers
    store.put(prepared("uid-2", device="gpu-1"))
    assert store.remove(DRIVER, "uid-2")
    assert not store.remove(DRIVER, "uid-2")
    again = PreparedClaims(tmp_path)
    assert again.claims() == store.claims()
    assert again.get(DRIVER, "uid-1") == prepared("uid-1")
    assert again.get(npu, "uid-1") == prepared("uid-1", driver=npu, device="npu-0")
    assert [c.driver for c in again.claims(npu)] == [npu]
    data = json.loads((tmp_path / "dra" / "prepared.json").read_text(encoding="utf-8"))
    assert data["drivers"][DRIVER]["uid-1"] == {
        "namespace": "team-a",
        "name": "claim-uid-1",
        "devices": [
            {
                "requests": ["gpu"],
                "pool": NODE,
                "device": "gpu-0",
                "cdi_ids": [f"{GPU_CDI}=gpu-0", claim_cdi_id("uid-1")],
                "share_id": "s-1",
                "consumed": {"memory": 2048},
            }
        ],
    }
    assert not list((tmp_path / "dra").glob("*.tmp"))


@pytest.fixture
def logs() -> Iterator[list[MutableMapping[str, Any]]]:
    with capture_logs() as captured:
        yield captured


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        '{"format": 99, "drivers": {}}',
        '{"format": 1, "drivers": {"d": {"u": {"namespace": 1, "name": "n", "devices": []}}}}',
        '{"format": 1, "drivers": {"d": {"u": {"namespace": "a", "name": "n"}}}}',
        '{"format": 1, "drivers": []}',
        "[]",
    ],
)
def test_a_corrupt_checkpoint_is_set_aside_with_a_warning(
    tmp_path: Path, content: str, logs: list[MutableMapping[str, Any]]
) -> None:
    path = tmp_path / "dra" / "prepared.json"
    path.parent.mkdir()
    path.write_text(content, encoding="utf-8")
    store = PreparedClaims(tmp_path)
    assert store.claims() == ()
    assert not path.exists()
    assert (tmp_path / "dra" / "prepared.json.corrupt").read_text(encoding="utf-8") == content
    assert [e["log_level"] for e in logs if "corrupt" in e["event"]] == ["warning"]
    store.put(prepared("uid-1"))
    assert PreparedClaims(tmp_path).get(DRIVER, "uid-1") == prepared("uid-1")
