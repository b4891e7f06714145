"""What an engine says about itself, read in one place: its loads and its server info.

SGLang 0.5.23 (docs/protocol.md §11, §12):

- `GET /v1/loads` answers one snapshot per DP rank (`loads`: `num_running_reqs`,
  `num_waiting_reqs`, `num_used_tokens`, `token_usage`, `max_running_requests`, ... and, with
  `include=disagg,queues`, a `disaggregation` section: prefill bootstrap/in-flight queues, decode
  prealloc/transfer/retracted queues). `GET /get_load` is gone (404); older engines still serve
  it (one object, or a list per rank, with `num_reqs`, `num_waiting_reqs`, `num_tokens`), so
  the router falls back to it on a 404 and remembers which one the worker speaks.
- `GET /server_info` holds the resolved server args. A worker's DP width is `dp_size *
  attn_dp_size` (`runtime_context.num_dp_ranks_of`): `--dp-size N --enable-dp-attention`
  resolves to `dp_size=1, attn_dp_size=N`. `/get_server_info` is a deprecated alias the engine
  warns about on every call, asked only when `/server_info` is missing (older engines).

On a PD decode, `num_waiting_reqs` counts requests waiting for their KV cache (the decode's
prealloc and transfer queues) as well as those queued for compute: `RankLoad.queued` is the
second alone, what an overload judgement must read.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx2
import orjson

from trio_pd.fleet.reports import EngineLoad, RankLoad, ServerInfo

log = logging.getLogger("trio_pd.engine_info")

LOADS_PATH = "/v1/loads?include=core,disagg,queues"
LEGACY_LOAD_PATH = "/get_load"
SERVER_INFO_PATH = "/server_info"
LEGACY_SERVER_INFO_PATH = "/get_server_info"
MAX_DP = 1024  # a DP width beyond this is not believed
MAX_ANSWER = 4 << 20  # an info answer larger than this is refused (they are a few KB)


class EngineInfoError(ValueError):
    """An engine's answer the router cannot read (not JSON, wrong types, too large)."""


def _int(value: Any, default: int = 0) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise EngineInfoError(f"not an integer: {value!r}")
    return value


def _number(value: Any, default: float = 0.0) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EngineInfoError(f"not a number: {value!r}")
    return float(value)


def _json(body: bytes) -> Any:
    if len(body) > MAX_ANSWER:
        raise EngineInfoError(f"answer larger than {MAX_ANSWER} bytes")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise EngineInfoError(f"not JSON ({exc})") from None


def parse_v1_loads(body: bytes) -> EngineLoad:
    """`GET /v1/loads` (SGLang 0.5.23, `entrypoints/v1_loads.py`)."""
    answer = _json(body)
    loads = answer.get("loads") if isinstance(answer, dict) else None
    if not isinstance(loads, list) or not loads:
        raise EngineInfoError("no `loads` list")
    ranks = []
    for index, item in enumerate(loads):
        if not isinstance(item, dict):
            raise EngineInfoError("a `loads` entry is not an object")
        disagg = item.get("disaggregation")
        for_kv = sending = 0
        if isinstance(disagg, dict) and disagg.get("mode") == "decode":
            for_kv = _int(disagg.get("decode_prealloc_queue_reqs")) + _int(
                disagg.get("decode_transfer_queue_reqs")
            )
        if isinstance(disagg, dict) and disagg.get("mode") == "prefill":
            sending = _int(disagg.get("prefill_inflight_queue_reqs"))
        ranks.append(
            RankLoad(
                dp_rank=_int(item.get("dp_rank"), index),
                running=_int(item.get("num_running_reqs")),
                waiting=_int(item.get("num_waiting_reqs")),
                waiting_for_kv=for_kv,
                sending=sending,
                used_tokens=_int(item.get("num_used_tokens")),
                token_usage=_number(item.get("token_usage")),
                max_running=_int(item.get("max_running_requests")),
                waiting_tokens=_int(item.get("num_waiting_uncached_tokens")),
                gen_throughput=_number(item.get("gen_throughput")),
            )
        )
    return EngineLoad(tuple(ranks), LOADS_PATH.partition("?")[0])


def parse_legacy_load(body: bytes) -> EngineLoad:
    """`GET /get_load` of engines before 0.5.23: one object, or a list of them (one per DP
    rank); `num_reqs` counts running and waiting requests together."""
    answer = _json(body)
    parts = answer if isinstance(answer, list) else [answer]
    if not parts:
        raise EngineInfoError("empty list")
    ranks = []
    for index, part in enumerate(parts):
        if not isinstance(part, dict):
            raise EngineInfoError("not a JSON object")
        if "num_reqs" not in part:
            raise EngineInfoError("no num_reqs")
        total, waiting = _int(part.get("num_reqs")), _int(part.get("num_waiting_reqs"))
        ranks.append(
            RankLoad(
                dp_rank=_int(part.get("dp_rank"), index),
                running=max(0, total - waiting),
                waiting=waiting,
                used_tokens=_int(part.get("num_tokens")),
            )
        )
    return EngineLoad(tuple(ranks), LEGACY_LOAD_PATH)


def parse_server_info(body: bytes) -> ServerInfo:
    """`GET /server_info` (or `/get_server_info`): the fields the router acts on."""
    info = _json(body)
    if not isinstance(info, dict):
        raise EngineInfoError("not a JSON object")
    dp_size = _int(info.get("dp_size"), 1)
    attn_dp = _int(info.get("attn_dp_size"), 1)
    width = dp_size * attn_dp
    if not 1 <= width <= MAX_DP:
        raise EngineInfoError(f"DP width {dp_size} x {attn_dp} out of range")
    backend = info.get("disaggregation_transfer_backend")
    running = info.get("max_running_requests")
    version = info.get("version")
    return ServerInfo(
        dp_width=width,
        transfer_backend=backend if isinstance(backend, str) else None,
        max_running_requests=running if isinstance(running, int) and running > 0 else None,
        abort_latch_hazard=info.get("enable_dynamic_batch_tokenizer") is True,
        version=version if isinstance(version, str) else None,
    )


class EngineAnswerError(EngineInfoError):
    """The engine answered a status other than 2xx."""

    def __init__(self, path: str, status: int) -> None:
        super().__init__(f"GET {path} answered {status}")
        self.status = status


async def get(
    client: httpx2.AsyncClient, base_url: str, path: str, headers: list[tuple[bytes, bytes]]
) -> tuple[int, bytes]:
    """One GET, its answer bounded in size (an engine that lies cannot fill the router)."""
    async with client.stream("GET", base_url + path, headers=headers) as response:
        body = b""
        async for chunk in response.aiter_raw():
            body += chunk
            if len(body) > MAX_ANSWER:
                raise EngineInfoError(f"GET {path}: answer larger than {MAX_ANSWER} bytes")
        return response.status_code, body


async def get_ok(
    client: httpx2.AsyncClient, base_url: str, path: str, headers: list[tuple[bytes, bytes]]
) -> bytes:
    status, body = await get(client, base_url, path, headers)
    if not 200 <= status < 300:
        raise EngineAnswerError(path, status)
    return body


async def fetch_load(
    client: httpx2.AsyncClient,
    base_url: str,
    headers: list[tuple[bytes, bytes]],
    legacy: bool = False,
) -> EngineLoad:
    """The engine's load: `/v1/loads`, or `/get_load` when `legacy` (or on a 404)."""
    if not legacy:
        status, body = await get(client, base_url, LOADS_PATH, headers)
        if status != 404:
            if not 200 <= status < 300:
                raise EngineAnswerError(LOADS_PATH, status)
            return parse_v1_loads(body)
    return parse_legacy_load(await get_ok(client, base_url, LEGACY_LOAD_PATH, headers))


async def fetch_server_info(
    client: httpx2.AsyncClient, base_url: str, headers: list[tuple[bytes, bytes]]
) -> ServerInfo:
    """`/server_info`, or `/get_server_info` on engines without it (a 404)."""
    status, body = await get(client, base_url, SERVER_INFO_PATH, headers)
    if status == 404:
        body = await get_ok(client, base_url, LEGACY_SERVER_INFO_PATH, headers)
    elif not 200 <= status < 300:
        raise EngineAnswerError(SERVER_INFO_PATH, status)
    return parse_server_info(body)


async def fetch_served_model(
    client: httpx2.AsyncClient, base_url: str, headers: list[tuple[bytes, bytes]]
) -> str | None:
    """The model `GET /v1/models` names first (None when it names none)."""
    models = _json(await get_ok(client, base_url, "/v1/models", headers))
    data = models.get("data") if isinstance(models, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict):
        served = data[0].get("id")
        return served if isinstance(served, str) and served else None
    return None
