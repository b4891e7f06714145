"""Engine-direct scenarios of vLLM's PD protocol: the observables trio_pd relies on.

Each scenario talks to a prefill and a decode directly (no router), as trio_pd does, and returns
a JSON-able dict: statuses, body *shapes* (keys and types at every depth, lists element by
element: `tests/sglang/scenarios.shape`), the handoff's fields, id rules, what a stream carries.
`tests/vllm/test_recording.py` runs them
against the real pair and compares with (or, with `TRIO_PD_VLLM_RECORD=1`, writes)
`tests/data/vllm_0.32.0_observables.json`; `tests/engine/test_vllm_differential.py` runs the
same functions against the simulator's vLLM mode in `make test` and compares with the
recording. Async on trio with httpx2, so in-process simulator engines keep running meanwhile.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import orjson

from tests.sglang import scenarios as sglang_scenarios
from tests.sglang.scenarios import shape_differences

# The vLLM rules of the strict comparison (`tests/sglang/scenarios.shape_differences`): which
# lists may differ in length between the real tiny tokenizer and the simulator's one token a
# word (token lists, block ids: one list per KV-cache group, one id per 16 tokens), compared
# element by element against the recording's last; no field may be `null` in one and a value
# in the other.
SHAPE_RULES: dict[str, list[str]] = {
    "optional": [],
    "any_length": sorted(
        {
            "remote_block_ids",
            "tokens",
            "token_logprobs",
            "top_logprobs",
            "text_offset",
            "prompt_logprobs",
            "content",
        }
    ),
}


# Lists of dicts keyed by token (completions' `top_logprobs`) or token id (`prompt_logprobs`):
# the keys are the tokenizer's, not the protocol's, so each entry's shape is one `<token>` key.
TOKEN_KEYED = ("top_logprobs", "prompt_logprobs")


def shape(value: Any, field: str = "") -> Any:
    """`tests/sglang/scenarios.shape` (every depth, lists element by element), with the
    token-keyed dicts of `TOKEN_KEYED` lists reduced to one `<token>` key."""
    if isinstance(value, dict):
        return {k: shape(v, k) for k, v in sorted(value.items())}
    if isinstance(value, list):
        if field in TOKEN_KEYED:
            return [{"<token>": shape(next(iter(v.values())))} if v else shape(v) for v in value]
        return [shape(v, field) for v in value]
    return sglang_scenarios.shape(value)


RECORDING = Path(__file__).resolve().parents[1] / "data" / "vllm_0.32.0_observables.json"
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass
class Target:
    prefill_url: str
    decode_url: str
    model: str
    # A prompt over the prefill's context and under the decode's (a real prefill 400).
    long_prompt: str


Observables = dict[str, Any]
Scenario = Callable[[Target, httpx2.AsyncClient], Awaitable[Observables]]


def rid() -> str:
    return uuid.uuid4().hex[:24]


async def prefill(t: Target, client: httpx2.AsyncClient, path: str, body: dict, request_id: str):
    body = {**body, "model": t.model, "stream": False, "max_tokens": 1, "min_tokens": 1}
    body["kv_transfer_params"] = PREFILL_PARAMS
    return await client.post(t.prefill_url + path, json=body, headers={"x-request-id": request_id})


def completion(prompt: str = "the tiny model says hello") -> dict:
    return {"prompt": prompt, "max_tokens": 4}


def chat() -> dict:
    return {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


async def pd_non_stream(t: Target, client: httpx2.AsyncClient) -> Observables:
    out: Observables = {}
    for name, path, body in (
        ("completions", "/v1/completions", completion()),
        ("chat", "/v1/chat/completions", chat()),
    ):
        request_id = rid()
        p = await prefill(t, client, path, body, request_id)
        params = p.json()["kv_transfer_params"]
        d = await client.post(
            t.decode_url + path,
            json={**body, "model": t.model, "kv_transfer_params": params},
            headers={"x-request-id": request_id + "d"},
        )
        prefix = "chatcmpl-" if name == "chat" else "cmpl-"
        out[name] = {
            "prefill_status": p.status_code,
            "prefill_shape": shape(p.json()),
            "handoff_keys": sorted(params),
            "handoff_shape": shape(params),
            "prefill_id_is_prefix_plus_x_request_id": p.json()["id"] == prefix + request_id,
            "remote_request_id_starts_with_id": params["remote_request_id"].startswith(
                p.json()["id"]
            ),
            "decode_status": d.status_code,
            "decode_shape": shape(d.json()),
            "decode_kv_transfer_params": d.json().get("kv_transfer_params", "absent"),
            "decode_id_is_prefix_plus_x_request_id": d.json()["id"] == prefix + request_id + "d",
            "decode_completion_tokens": d.json()["usage"]["completion_tokens"],
            "decode_cached_tokens_is_handoffs": d.json()["usage"]["prompt_tokens_details"][
                "cached_tokens"
            ]
            == params.get("remote_prefill_cached_tokens"),
        }
    return out


# Enough tokens that the stream has chunks before its last: with 4, a busy machine's API server
# once fell behind its engine and sent the whole answer as one chunk, and the "first chunk"
# compared was the final one (CI from a clean clone, 2026-12-05).
STREAM_TOKENS = 16


def before_the_last(chunks: list[dict]) -> dict:
    """The first chunk not ending its choice (`finish_reason` null); the first when all end."""
    for chunk in chunks:
        if all(choice.get("finish_reason") is None for choice in chunk.get("choices", [])):
            return chunk
    return chunks[0]


async def pd_stream(t: Target, client: httpx2.AsyncClient) -> Observables:
    request_id = rid()
    body = {**completion(), "max_tokens": STREAM_TOKENS, "ignore_eos": True}
    p = await prefill(t, client, "/v1/completions", body, request_id)
    params = p.json()["kv_transfer_params"]
    events: list[Any] = []
    stream_body = {**body, "model": t.model, "stream": True, "kv_transfer_params": params}
    async with client.stream("POST", t.decode_url + "/v1/completions", json=stream_body) as r:
        status = r.status_code
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                data = line[5:].strip()
                events.append(data if data == "[DONE]" else orjson.loads(data))
    chunks = [e for e in events if isinstance(e, dict)]
    return {
        "status": status,
        "ends_with_done": events[-1] == "[DONE]",
        "any_event_names_kv_transfer_params": any("kv_transfer_params" in e for e in chunks),
        "chunk_shape": shape(before_the_last(chunks)),
        "last_chunk_shape": shape(chunks[-1]),
    }


async def prefill_over_its_context(t: Target, client: httpx2.AsyncClient) -> Observables:
    r = await prefill(t, client, "/v1/completions", completion(t.long_prompt), rid())
    return {"status": r.status_code, "shape": shape(r.json())}


async def prefill_echo_logprobs(t: Target, client: httpx2.AsyncClient) -> Observables:
    """What trio_pd asks of a prefill for `echo` with `logprobs` (docs/vllm.md §5): the prompt's
    logprobs and text come from the prefill's answer."""
    body = {**completion(), "echo": True, "logprobs": 2}
    p = await prefill(t, client, "/v1/completions", body, rid())
    choice = p.json()["choices"][0]
    # The decode reads the handoff, so the prefill's blocks are freed now, not by the lease.
    d = await client.post(
        t.decode_url + "/v1/completions",
        json={
            **completion(),
            "model": t.model,
            "kv_transfer_params": p.json()["kv_transfer_params"],
        },
    )
    return {
        "decode_status": d.status_code,
        "status": p.status_code,
        "shape": shape(p.json()),
        "text_starts_with_prompt": choice["text"].startswith(body["prompt"]),
        "has_prompt_logprobs": choice.get("prompt_logprobs") is not None,
    }


SCENARIOS: dict[str, Scenario] = {
    "pd_non_stream": pd_non_stream,
    "pd_stream": pd_stream,
    "prefill_over_its_context": prefill_over_its_context,
    "prefill_echo_logprobs": prefill_echo_logprobs,
}


async def run_all(t: Target, client: httpx2.AsyncClient) -> Observables:
    return {name: await scenario(t, client) for name, scenario in SCENARIOS.items()}


def differences(recorded: Any, live: Any, path: str = "$") -> list[str]:
    """Values exactly, `*shape*` keys by shape, strictly (`shape_differences`, `SHAPE_RULES`)."""
    if isinstance(recorded, dict) and isinstance(live, dict):
        out = [f"{path}.{k}: missing" for k in recorded if k not in live]
        out += [f"{path}.{k}: unexpected" for k in live if k not in recorded]
        for k in recorded.keys() & live.keys():
            if "shape" in k:
                out += shape_differences(recorded[k], live[k], f"{path}.{k}", SHAPE_RULES)
            else:
                out += differences(recorded[k], live[k], f"{path}.{k}")
        return out
    return [] if recorded == live else [f"{path}: recorded {recorded!r}, live {live!r}"]
