"""Who may report what to the intake: the pure rules.

A call needs a bearer token that TokenReview authenticates as the agent's ServiceAccount; each
fault in it must be about the node the token is bound to (kubelet gives the agent's pod a token
bound to that pod, which names the pod's node in the user's extra
`authentication.kubernetes.io/node-name`). A token not bound to a pod on a node may report about
no node. What the restarter's pod cache says about the pods a fault names is judged in
`evidence`; how a token is reviewed is the `auth` adapter's.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"


class Refusal(enum.StrEnum):
    MALFORMED = "malformed"  # not a ReportRequest (bad UTF-8 in a string, broken encoding)
    NO_TOKEN = "no_token"  # noqa: S105 - no `authorization: Bearer <token>` metadata
    INVALID_TOKEN = "invalid_token"  # noqa: S105 - TokenReview did not authenticate it
    WRONG_SERVICE_ACCOUNT = "wrong_service_account"  # authenticated, but not the agent
    WRONG_NODE = "wrong_node"  # a fault about a node other than the token's
    INVALID_FAULT = "invalid_fault"  # no id, kind, node or time
    TOO_MANY_PODS = "too_many_pods"  # more pods than can hold one device
    POD_ELSEWHERE = "pod_elsewhere"  # a named pod runs on another node (or is another pod)
    POD_UNKNOWN = "pod_unknown"  # a named pod the pod cache did not show, even after its lag
    EXIT_NOT_SEEN = "exit_not_seen"  # a container exit the pod's status does not show
    # A connection past `intake.max_connections_per_peer` (or `max_connections`), closed unread.
    TOO_MANY_CONNECTIONS = "too_many_connections"


@dataclass(frozen=True)
class Identity:
    """What TokenReview said about a token."""

    authenticated: bool
    username: str = ""
    extra: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    error: str = ""

    @property
    def node(self) -> str | None:
        """The node of the pod the token is bound to; None when it names none (or several)."""
        values = self.extra.get(NODE_NAME_EXTRA, ())
        return values[0] if len(values) == 1 and values[0] else None


class ReviewUnavailable(Exception):
    """The API server could not review the token now; no verdict, so nothing is refused."""


Review = Callable[[str], Identity]


def service_account_user(namespace: str, name: str) -> str:
    return f"system:serviceaccount:{namespace}:{name}"


def bearer_token(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    """The token of the first `authorization: Bearer <token>` entry; None when there is none."""
    for key, value in metadata:
        if key.lower() != "authorization" or not isinstance(value, str):
            continue
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return None


def caller_refusal(identity: Identity, *, agent_user: str) -> Refusal | None:
    """Why this caller may not report at all; None when it may. Pure."""
    if not identity.authenticated:
        return Refusal.INVALID_TOKEN
    if identity.username != agent_user:
        return Refusal.WRONG_SERVICE_ACCOUNT
    return None


def fault_refusal(node: str, identity: Identity) -> Refusal | None:
    """Why this caller may not report a fault about `node`; None when it may. Pure."""
    return None if identity.node is not None and identity.node == node else Refusal.WRONG_NODE
