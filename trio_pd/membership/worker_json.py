"""A worker as JSON (`POST /workers`' body, a membership file's entry): checked one way for both.

`url` an http(s) URL a worker can have (`upstream/urls.check_syntax`), `worker_type` prefill or
decode, `bootstrap_port` an integer 1..65535 or null (prefill only), `model_id`, `api_key` and
`admin_api_key` a non-empty string or null, `engine` sglang (the default) or vllm (the PD
protocol it speaks), the keys visible ASCII (they go into an Authorization header: a CR/LF
would inject headers of its own). A ValueError says what is
wrong, never showing a key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trio_pd.config.values import usable_key
from trio_pd.spec import ENGINES, WorkerSpec
from trio_pd.upstream.urls import check_syntax

WORKER_TYPES = ("prefill", "decode")


def spec_from_json(body: Mapping[str, Any]) -> WorkerSpec:
    """The WorkerSpec `body` describes, or a ValueError saying what is wrong with it."""
    worker_type = body.get("worker_type")
    if worker_type is None:
        raise ValueError("worker_type is required: 'prefill' or 'decode'")
    if worker_type not in WORKER_TYPES:
        raise ValueError(f"worker_type must be 'prefill' or 'decode', not {worker_type!r}")
    url = check_syntax(body.get("url"))
    port = body.get("bootstrap_port")
    if port is not None:
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ValueError(f"bootstrap_port must be an integer in 1..65535 or null: {port!r}")
        if worker_type == "decode":
            raise ValueError("bootstrap_port applies to prefill workers only")
    for field in ("model_id", "api_key", "admin_api_key"):
        value = body.get(field)
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{field} must be a non-empty string or null")
    for field in ("api_key", "admin_api_key"):
        if not usable_key(body.get(field)):
            raise ValueError(f"{field} must be visible ASCII (no spaces or control characters)")
    engine = body.get("engine", "sglang")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    return WorkerSpec(
        url, worker_type, port, body.get("model_id"), body.get("api_key"),
        body.get("admin_api_key"), engine,
    )  # fmt: skip
