"""Who is calling the intake: bearer tokens checked by Kubernetes TokenReview, and the answers
cached. The rules the answers are judged by are `core.callers`'.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from edl_agent.restarter.core.callers import Identity, Review, ReviewUnavailable

REQUEST_TIMEOUT = (5.0, 10.0)  # connect, read


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
