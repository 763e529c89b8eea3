"""Who is calling the intake: bearer tokens checked by Kubernetes TokenReview (cached), and the
pure rules of who may report what.

The rules: a call needs a bearer token that TokenReview authenticates as the agent's
ServiceAccount; each fault in it must be about the node the token is bound to (kubelet gives
the agent's pod a token bound to that pod, which names the pod's node in the user's extra
`authentication.kubernetes.io/node-name`). A token not bound to a pod on a node may report
about no node. What the restarter's pod cache says about the pods a fault names is judged in
`evidence`.
"""

from __future__ import annotations

import enum
import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
REQUEST_TIMEOUT = (5.0, 10.0)  # connect, read


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


class TokenReviewer:
    """`Review` through the API server's TokenReview (needs `create` on `tokenreviews`).

    With `audiences`, a token must be meant for one of them (a projected token with its own
    audience, so that the agent's API-server token is not what it sends the restarter)."""

    def __init__(self, api: client.ApiClient, *, audiences: Sequence[str] = ()) -> None:
        # Typed as Any: with `_preload_content=False` the call returns the raw HTTP response.
        self._auth: Any = client.AuthenticationV1Api(api)
        self._audiences = list(audiences)

    def __call__(self, token: str) -> Identity:
        body = client.V1TokenReview(
            api_version="authentication.k8s.io/v1",
            kind="TokenReview",
            spec=client.V1TokenReviewSpec(token=token, audiences=self._audiences or None),
        )
        try:
            response = self._auth.create_token_review(
                body, _preload_content=False, _request_timeout=REQUEST_TIMEOUT
            )
            status = json.loads(response.data).get("status") or {}
        except ApiException as exc:
            msg = f"TokenReview failed: HTTP {exc.status}: {exc.reason}"
            raise ReviewUnavailable(msg) from None
        except (OSError, ValueError, urllib3.exceptions.HTTPError) as exc:
            msg = f"TokenReview failed: {type(exc).__name__}: {exc}"
            raise ReviewUnavailable(msg) from None
        user = status.get("user") or {}
        identity = Identity(
            authenticated=bool(status.get("authenticated")),
            username=str(user.get("username") or ""),
            extra={str(k): tuple(map(str, v or ())) for k, v in (user.get("extra") or {}).items()},
            error=str(status.get("error") or ""),
        )
        # An authenticator that ignores audiences says so by not echoing one we asked for.
        echoed = set(status.get("audiences") or ())
        if identity.authenticated and self._audiences and not echoed & set(self._audiences):
            return Identity(authenticated=False, error="token not meant for the restarter")
        return identity


class CachedReviewer:
    """A `Review` that remembers answers: authenticated ones for `positive_ttl` seconds, refused
    ones for `negative_ttl`. Failures to review (ReviewUnavailable) are never remembered."""

    def __init__(
        self,
        review: Review,
        *,
        positive_ttl: float = 60.0,
        negative_ttl: float = 5.0,
        max_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._review = review
        self._positive_ttl = positive_ttl
        self._negative_ttl = negative_ttl
        self._max_entries = max_entries
        self._clock = clock
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, tuple[float, Identity]] = OrderedDict()

    def __call__(self, token: str) -> Identity:
        key = hashlib.sha256(token.encode()).hexdigest()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] > self._clock():
                return hit[1]
        identity = self._review(token)
        ttl = self._positive_ttl if identity.authenticated else self._negative_ttl
        with self._lock:
            self._cache[key] = (self._clock() + ttl, identity)
            self._cache.move_to_end(key)
            while len(self._cache) > self._max_entries:
                self._cache.popitem(last=False)
        return identity
