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
prealloc and transfer queues) as well as those queued for compute, and on a PD prefill those
waiting for their decode's handshake (its bootstrap queue, `load_inquirer.py`): `RankLoad.queued`
is the compute queue alone, what an overload judgement must read.

A load report is believed only when it could be true (docs/policies.md "Load"): a count below
zero, a figure no engine could reach (`MAX_REQUESTS`, `MAX_TOKENS`, a KV usage past
`MAX_TOKEN_USAGE`, a throughput that is not a finite number under `MAX_THROUGHPUT`) or figures
that contradict each other (more requests waiting for KV, or bootstrapping, than waiting at
all; more waiting than held on an old `/get_load`) is a worker's fault, `LoadReportRejected`:
the fleet drops the worker's load as unknown rather than routing on a lie (`Fleet.reject_load`).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import httpx2
import orjson

from trio_pd.fleet.reports import EngineLoad, KvEventsInfo, RankLoad, ServerInfo

log = logging.getLogger(__name__)

LOADS_PATH = "/v1/loads?include=core,disagg,queues"
LEGACY_LOAD_PATH = "/get_load"
SERVER_INFO_PATH = "/server_info"
LEGACY_SERVER_INFO_PATH = "/get_server_info"
MAX_DP = 1024  # a DP width beyond this is not believed
MAX_ANSWER = 4 << 20  # an info answer larger than this is refused (they are a few KB)
# Beyond these a rank's report is a lie, not a load: SGLang's running batch and queues hold
# thousands of requests, its KV pool millions of tokens.
MAX_REQUESTS = 1 << 24
MAX_TOKENS = 1 << 40
MAX_TOKEN_USAGE = 1.5  # a ratio of the KV pool (SGLang rounds it; 1.0 is full)
MAX_THROUGHPUT = 1e9  # tokens per second


class EngineInfoError(ValueError):
    """An engine's answer the router cannot read (not JSON, wrong types, too large)."""


class LoadReportRejected(EngineInfoError):
    """A load report that cannot be true: a worker fault. `reason` is `negative`, `absurd` or
    `contradictory` (the label of `trio_pd_load_reports_rejected_total`)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason} load report: {detail}")
        self.reason = reason


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


def _count(item: dict[str, Any], name: str, limit: int = MAX_REQUESTS) -> int:
    """A count a rank reports: an integer from 0 to `limit` (absent: 0)."""
    value = _int(item.get(name))
    if value < 0:
        raise LoadReportRejected("negative", f"{name} = {value}")
    if value > limit:
        raise LoadReportRejected("absurd", f"{name} = {value}")
    return value


def _rate(item: dict[str, Any], name: str, limit: float) -> float:
    """A ratio or rate a rank reports: a finite number from 0 to `limit` (absent: 0)."""
    value = _number(item.get(name))
    if value < 0:
        raise LoadReportRejected("negative", f"{name} = {value}")
    if not math.isfinite(value) or value > limit:
        raise LoadReportRejected("absurd", f"{name} = {value}")
    return value


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
        waiting = _count(item, "num_waiting_reqs")
        for_kv = sending = bootstrapping = 0
        if isinstance(disagg, dict) and disagg.get("mode") == "decode":
            for_kv = _count(disagg, "decode_prealloc_queue_reqs") + _count(
                disagg, "decode_transfer_queue_reqs"
            )
            if for_kv > waiting:  # SGLang counts both queues in num_waiting_reqs
                raise LoadReportRejected(
                    "contradictory", f"{for_kv} waiting for KV of {waiting} waiting"
                )
        if isinstance(disagg, dict) and disagg.get("mode") == "prefill":
            sending = _count(disagg, "prefill_inflight_queue_reqs")
            bootstrapping = _count(disagg, "prefill_bootstrap_queue_reqs")
            if bootstrapping > waiting:  # SGLang counts the bootstrap queue in num_waiting_reqs
                raise LoadReportRejected(
                    "contradictory", f"{bootstrapping} bootstrapping of {waiting} waiting"
                )
        ranks.append(
            RankLoad(
                dp_rank=_int(item.get("dp_rank"), index),
                running=_count(item, "num_running_reqs"),
                waiting=waiting,
                waiting_for_kv=for_kv,
                sending=sending,
                bootstrapping=bootstrapping,
                used_tokens=_count(item, "num_used_tokens", MAX_TOKENS),
                token_usage=_rate(item, "token_usage", MAX_TOKEN_USAGE),
                max_running=_count(item, "max_running_requests"),
                waiting_tokens=_count(item, "num_waiting_uncached_tokens", MAX_TOKENS),
                gen_throughput=_rate(item, "gen_throughput", MAX_THROUGHPUT),
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
        total, waiting = _count(part, "num_reqs"), _count(part, "num_waiting_reqs")
        if waiting > total:
            raise LoadReportRejected("contradictory", f"{waiting} waiting of {total} requests")
        ranks.append(
            RankLoad(
                dp_rank=_int(part.get("dp_rank"), index),
                running=total - waiting,
                waiting=waiting,
                used_tokens=_count(part, "num_tokens", MAX_TOKENS),
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
        kv_events=parse_kv_events(info.get("kv_events")),
    )


def parse_kv_events(value: Any) -> KvEventsInfo | None:
    """`kv_events` of `/server_info` (None: absent, not zmq, or not believable)."""
    if not isinstance(value, dict) or value.get("publisher") != "zmq":
        return None
    host, topic = value.get("endpoint_host"), value.get("topic", "")
    dp = value.get("dp_size", 1)
    if not (isinstance(host, str) and host and isinstance(topic, str)):
        return None
    if not (isinstance(dp, int) and 1 <= dp <= MAX_DP):
        return None
    port = _port_base(value.get("endpoint_port_base"), dp)
    block = value.get("block_size")
    if port is None or not (isinstance(block, int) and 0 < block <= 65536):
        return None
    replay = value.get("replay_endpoint_port_base")
    replay_port = _port_base(replay, dp)
    if replay is not None and replay_port is None:
        return None
    return KvEventsInfo(host, port, topic, block, dp, replay_port)


def _port_base(value: Any, ranks: int) -> int | None:
    """A port base whose `ranks` ports all exist, else None."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= 65536 - ranks:
        return value
    return None


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
