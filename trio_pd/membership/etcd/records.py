"""etcd's key layout and a worker as an etcd key: pure, no I/O.

Key layout under ``--etcd-prefix`` (default ``/trio-pd``)::

    <prefix>/workers/<role>/<id>   {"url": ..., "bootstrap_port": int|null, "model_id": str|null}
    <prefix>/urls/<role>/<quoted url>   the id registered for that URL and role (the duplicate
                                        guard; written and deleted with the worker key)
    <prefix>/serial/<role>              the last id number handed out (never leased, never reused)

Only ``workers/`` is read as membership: a worker key written by another tool (with any id
segment) is a worker too. A stored ``api_key`` field is ignored.
"""

from __future__ import annotations

from urllib.parse import quote, urlsplit

import attrs
import orjson

from trio_pd.membership.etcd.wire import KeyValue
from trio_pd.spec import ENGINES, ROLES, Role, WorkerRecord, WorkerSpec

SOURCE = "etcd"


@attrs.frozen
class EtcdKeys:
    """The keys of one ``--etcd-prefix``, and the worker a key under ``workers/`` holds."""

    prefix: str

    @property
    def workers_prefix(self) -> bytes:
        return f"{self.prefix}/workers/".encode()

    def worker_key(self, role: Role, worker_id: str) -> bytes:
        return self.workers_prefix + f"{role}/{worker_id}".encode()

    def url_key(self, role: Role, url: str) -> bytes:
        return f"{self.prefix}/urls/{role}/{quote(url, safe='')}".encode()

    def serial_key(self, role: Role) -> bytes:
        return f"{self.prefix}/serial/{role}".encode()

    def record_of(self, kv: KeyValue) -> WorkerRecord:
        """The worker ``kv`` (a key under ``workers/``) holds; ValueError saying what is wrong."""
        rest = kv.key[len(self.workers_prefix) :].decode("utf-8", "replace")
        role, _, worker_id = rest.partition("/")
        if role not in ROLES:
            raise ValueError(f"role must be prefill or decode: {role!r}")
        if not worker_id or "/" in worker_id:
            raise ValueError(f"bad worker id {worker_id!r}")
        spec = decode_spec(role, kv.value)
        meta = {
            "etcd_key": kv.key.decode(errors="replace"),
            "create_revision": str(kv.create_revision),
            "mod_revision": str(kv.mod_revision),
        }
        if kv.lease:
            meta["lease"] = f"{kv.lease:x}"
        return WorkerRecord(worker_id, spec, SOURCE, meta)


def encode_spec(spec: WorkerSpec) -> bytes:
    engine = {"engine": spec.engine} if spec.engine != "sglang" else {}
    return orjson.dumps(
        {"url": spec.url, "bootstrap_port": spec.bootstrap_port, "model_id": spec.model_id,
         **engine}
    )  # fmt: skip


def decode_spec(role: Role, value: bytes) -> WorkerSpec:
    """The stored JSON as a WorkerSpec; ValueError saying what is wrong."""
    try:
        data = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    url = data.get("url")
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url must be an http(s) URL: {url!r}")
    port = data.get("bootstrap_port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int)):
        raise ValueError(f"bootstrap_port must be an integer or null: {port!r}")
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"bootstrap_port out of range: {port}")
    model_id = data.get("model_id")
    if model_id is not None and not isinstance(model_id, str):
        raise ValueError(f"model_id must be a string or null: {model_id!r}")
    engine = data.get("engine", "sglang")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}: {engine!r}")
    # a stored api_key is ignored on purpose
    return WorkerSpec(url, role, port, model_id, engine=engine)
