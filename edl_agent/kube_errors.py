"""The API's failure as both processes and the restarter's in-memory cluster see it, without a
client library (`kube` re-exports it beside the clients that raise it)."""

from __future__ import annotations


class ApiError(Exception):
    """An API call failed; `status` is the HTTP status (None when no answer came)."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
