"""The exceptions of etcd membership: etcd's own answers, and a store refusing a worker."""

from __future__ import annotations


class EtcdError(Exception):
    """etcd answered with an error (``code`` is the gRPC status code, when it gave one)."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class EtcdUnavailable(EtcdError):
    """No endpoint answered, or one failed mid-request."""


class EtcdCompacted(EtcdError):
    """The revision asked for was compacted away; ``compact_revision`` is the oldest kept."""

    def __init__(self, message: str, compact_revision: int) -> None:
        super().__init__(message, 11)
        self.compact_revision = compact_revision


class LeaseNotFound(EtcdError):
    """The lease named in a request has expired or was revoked."""


class DuplicateWorker(ValueError):
    """A worker with this URL and role is already registered (the admin API answers 409)."""


class UnstorableSpec(ValueError):
    """The spec cannot be written to etcd as it is (a per-worker api_key)."""
