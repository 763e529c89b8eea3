"""The DRA calls the node agent makes: ResourceSlices of its node, the ResourceClaims its pods
use, its Node. Made through the generic `request` of either API client (`kube.KubeApi`,
`kube_rest.RestKubeApi`); every failure is an `ApiError` with the HTTP status.

ResourceSlices are cluster-scoped; the agent lists only its node's (field selectors
`spec.nodeName` and `spec.driver`, both supported by the API server).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol
from urllib.parse import quote

from edl_agent.kube import NOT_FOUND, ApiError

GROUP_VERSION = "resource.k8s.io/v1"
SLICES = f"/apis/{GROUP_VERSION}/resourceslices"
LIST_PAGE = 250
APPLY = "application/apply-patch+yaml"  # a JSON body is YAML too


class JsonClient(Protocol):
    """The generic call both API clients have (`kube.NodeApi.request`)."""

    def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        query: Mapping[str, str] | None = None,
        content_type: str | None = None,
    ) -> dict[str, Any]: ...


class DraApi(Protocol):
    def read_node(self, name: str) -> dict[str, Any]: ...

    def list_resource_slices(self, *, node: str, driver: str | None = None) -> list[dict[str, Any]]:
        """Every ResourceSlice of `node` (of `driver` only, when given)."""
        ...

    def create_resource_slice(self, body: Mapping[str, Any]) -> dict[str, Any]: ...

    def replace_resource_slice(self, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """A PUT: `metadata.resourceVersion` in `body` makes it conditional (409 if stale)."""
        ...

    def delete_resource_slice(self, name: str, *, resource_version: str | None = None) -> bool:
        """False when it was gone already; 409 when `resource_version` is not the current."""
        ...

    def read_resource_claim(self, namespace: str, name: str) -> dict[str, Any]: ...

    def apply_claim_device_status(
        self,
        namespace: str,
        name: str,
        uid: str,
        entries: Sequence[Mapping[str, Any]],
        *,
        manager: str,
    ) -> dict[str, Any]:
        """Server-side apply of `status.devices` as field manager `manager` (forced: the
        entries are the driver's own), for the claim of that uid only (409 otherwise)."""
        ...


class KubeDraApi:
    """`DraApi` over a client's generic JSON request."""

    def __init__(self, client: JsonClient) -> None:
        self._client = client

    def read_node(self, name: str) -> dict[str, Any]:
        return self._client.request("GET", f"/api/v1/nodes/{_segment(name)}")

    def list_resource_slices(self, *, node: str, driver: str | None = None) -> list[dict[str, Any]]:
        selector = f"spec.nodeName={node}" + (f",spec.driver={driver}" if driver else "")
        query = {"fieldSelector": selector, "limit": str(LIST_PAGE)}
        items: list[dict[str, Any]] = []
        while True:
            page = self._client.request("GET", SLICES, query=query)
            items.extend(page.get("items") or [])
            more = (page.get("metadata") or {}).get("continue")
            if not more:
                return items
            query = {**query, "continue": str(more)}

    def create_resource_slice(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return self._client.request("POST", SLICES, body)

    def replace_resource_slice(self, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self._client.request("PUT", f"{SLICES}/{_segment(name)}", body)

    def delete_resource_slice(self, name: str, *, resource_version: str | None = None) -> bool:
        options: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if resource_version is not None:
            options["preconditions"] = {"resourceVersion": resource_version}
        try:
            self._client.request("DELETE", f"{SLICES}/{_segment(name)}", options)
        except ApiError as exc:
            if exc.status == NOT_FOUND:
                return False
            raise
        return True

    def read_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        return self._client.request("GET", _claim_path(namespace, name))

    def apply_claim_device_status(
        self,
        namespace: str,
        name: str,
        uid: str,
        entries: Sequence[Mapping[str, Any]],
        *,
        manager: str,
    ) -> dict[str, Any]:
        body = {
            "apiVersion": GROUP_VERSION,
            "kind": "ResourceClaim",
            "metadata": {"namespace": namespace, "name": name, "uid": uid},
            "status": {"devices": [dict(entry) for entry in entries]},
        }
        return self._client.request(
            "PATCH",
            f"{_claim_path(namespace, name)}/status",
            body,
            query={"fieldManager": manager, "force": "true"},
            content_type=APPLY,
        )


def _claim_path(namespace: str, name: str) -> str:
    return f"/apis/{GROUP_VERSION}/namespaces/{_segment(namespace)}/resourceclaims/{_segment(name)}"


def _segment(name: str) -> str:
    return quote(name, safe="")
