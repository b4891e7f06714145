"""etcd as the membership store shared by router replicas, through etcd's v3 JSON gateway.

`source.py` is the source and store every replica runs (`EtcdMembership`), `client.py` the
gateway client it talks through, `wire.py` the gateway's JSON shapes, `records.py` the key
layout and a worker as a key, `errors.py` the exceptions. Only the JSON gateway over HTTP(S) is
spoken (no gRPC, no etcd auth, no client certificates).
"""

from __future__ import annotations

from trio_pd.membership.etcd.client import EtcdClient, decode_answer, watch_batches
from trio_pd.membership.etcd.errors import (
    DuplicateWorker,
    EtcdCompacted,
    EtcdError,
    EtcdUnavailable,
    LeaseNotFound,
    UnstorableSpec,
)
from trio_pd.membership.etcd.records import SOURCE, EtcdKeys, decode_spec, encode_spec
from trio_pd.membership.etcd.source import ADD_ATTEMPTS, EtcdMembership
from trio_pd.membership.etcd.wire import KeyValue, WatchEvent, header_revision, prefix_end

__all__ = [
    "ADD_ATTEMPTS",
    "SOURCE",
    "DuplicateWorker",
    "EtcdClient",
    "EtcdCompacted",
    "EtcdError",
    "EtcdKeys",
    "EtcdMembership",
    "EtcdUnavailable",
    "KeyValue",
    "LeaseNotFound",
    "UnstorableSpec",
    "WatchEvent",
    "decode_answer",
    "decode_spec",
    "encode_spec",
    "header_revision",
    "prefix_end",
    "watch_batches",
]
