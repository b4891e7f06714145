"""SMG 1.13's discovery manifest (`--discovery-provider file --discovery-file F`), read as a
membership document of `shared_file.py`.

SMG's shape (`service_discovery/file.rs`):
    {"version": 1,
     "workers": [{"id": "decode-a", "url": "10.0.0.23:8000", "worker_type": "decode"},
                 {"id": "prefill-a", "url": "10.0.0.22:8000", "worker_type": "prefill",
                  "bootstrap_port": 8998, "kv_connector": "MooncakeConnector"}]}

As SMG reads it: the manifest is strict, so an unknown field or version rejects the whole file
(the last good set stays: a misspelled field fails visibly instead of being dropped), a URL
without a scheme is `http://`, and `{"version": 1, "workers": []}` is an intentionally empty
fleet. A record's `kv_connector`, `kv_role` and `kv_engine_id` are accepted and not acted on: a
SGLang PD pair transfers KV by its own `--disaggregation-transfer-backend`. Each record is
checked as `POST /workers` checks a body (`worker_json.py`), and one that fails rejects the
file too (a hand-written `--membership-file` skips only that entry). Another program writes the file
(atomically, a rename over it); the router only reads it.
"""

from __future__ import annotations

from typing import Any

from trio_pd.membership.worker_json import spec_from_json

MANIFEST_VERSION = 1
RESYNC_SECS = 30.0  # `--discovery-check-interval-secs`' default: a full reread this often
FIELDS = frozenset(
    {"id", "url", "worker_type", "bootstrap_port", "model_id", "kv_connector", "kv_role",
     "kv_engine_id"}
)  # fmt: skip
IGNORED = ("kv_connector", "kv_role", "kv_engine_id")
SOURCE = "discovery_file"  # the source its workers carry (beside a --membership-file's "file")


def smg_manifest(data: Any) -> dict[str, Any]:
    """The membership document (`shared_file.read_workers`) of an SMG manifest; ValueError,
    naming the record, for anything SMG would refuse."""
    if not isinstance(data, dict):
        raise ValueError("a discovery manifest is a JSON object")
    if data.get("version") != MANIFEST_VERSION:
        raise ValueError(f"unsupported version {data.get('version')!r}; this router reads 1")
    unknown = set(data) - {"version", "workers"}
    if unknown or not isinstance(data.get("workers"), list):
        raise ValueError(f"a manifest is {{version, workers: [...]}}; unknown: {sorted(unknown)}")
    workers = []
    for index, record in enumerate(data["workers"]):
        if not isinstance(record, dict):
            raise ValueError(f"workers[{index}]: a record is an object")
        extra = set(record) - FIELDS
        if extra:
            raise ValueError(f"workers[{index}]: unknown field(s) {sorted(extra)}")
        if record.get("id") == "":
            raise ValueError(f"workers[{index}]: id must not be empty")
        entry = {key: value for key, value in record.items() if key not in IGNORED}
        url = entry.get("url")
        if isinstance(url, str) and "://" not in url:
            entry["url"] = f"http://{url}"
        try:
            spec_from_json(entry)  # one bad record rejects the file, as in SMG
        except ValueError as exc:
            raise ValueError(f"workers[{index}]: {exc}") from None
        workers.append(entry)
    return {"version": MANIFEST_VERSION, "workers": workers}
