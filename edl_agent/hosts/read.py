"""The reads `edl-agent hosts` makes, through the agent's own API client (`kube_rest.connect`).

One run: a LIST of the namespace's pods by label selector; a GET of each node those pods are on
(only of pods fit so far; `resourceVersion=0`, so the API server answers from its watch cache:
a launcher runs the discovery every second); the namespace's ResourceClaims only when some pod's
slots come from its claims. Every failure is an `ApiError` with its HTTP status: a missing node
is an answer (None), a cluster that serves no `resource.k8s.io/v1` has no claims.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from edl_agent.hosts.decide import HostRules, Snapshot, needs_claims, nodes_to_read
from edl_agent.kube import NOT_FOUND, ApiError, NodeApi

CLAIMS_PATH = "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims"


def read_snapshot(
    api: NodeApi, *, namespace: str, selector: str, rules: HostRules, read_nodes: bool = True
) -> Snapshot:
    """The selected pods, their nodes (None when `read_nodes` is false) and, when needed, the
    namespace's ResourceClaims."""
    ns = quote(namespace, safe="")
    pods = _items(
        api.request("GET", f"/api/v1/namespaces/{ns}/pods", query={"labelSelector": selector})
    )
    nodes: dict[str, dict[str, Any] | None] | None = None
    if read_nodes:
        nodes = {name: _node(api, name) for name in nodes_to_read(pods)}
    claims: dict[str, dict[str, Any]] = {}
    if needs_claims(pods, rules):
        try:
            listed = api.request("GET", CLAIMS_PATH.format(namespace=ns))
        except ApiError as exc:
            if exc.status != NOT_FOUND:
                raise
            listed = {}
        claims = {str((c.get("metadata") or {}).get("name")): c for c in _items(listed)}
    return Snapshot(pods=pods, nodes=nodes, claims=claims)


def _node(api: NodeApi, name: str) -> dict[str, Any] | None:
    try:
        return api.request(
            "GET", f"/api/v1/nodes/{quote(name, safe='')}", query={"resourceVersion": "0"}
        )
    except ApiError as exc:
        if exc.status == NOT_FOUND:
            return None
        raise


def _items(listed: dict[str, Any]) -> list[dict[str, Any]]:
    return [item for item in listed.get("items") or [] if isinstance(item, dict)]
