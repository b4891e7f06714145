"""A request's bodies for vLLM pairs: what they are, made once per request, off the loop when large.

A vLLM attempt (`pd/engines/vllm.py`) sends the prefill a rewritten body and the decode the
client's (less a few keys, plus the prefill's handoff), so it needs the client's body as an
object (`vllm_bodies`). Parsing it is what
`edge/intake.py` already keeps off the event loop for bodies of `OFFLOAD_BYTES` or more (up to
~0.3 µs per JSON value: megabytes of tiny values would freeze every stream this process
relays), so the same holds here: a large body's legs are made in a worker process, which sends
back bytes only (no object crosses, so nothing is rebuilt on the loop), with that parse charged
to the request's account while it runs and the bytes made charged until the request ends. It
happens once per request: its retries and its samples share what was made (`VllmBodyMaker`).
"""

from __future__ import annotations

from typing import Any

import attrs
import orjson
import trio

from trio_pd import jsonbody
from trio_pd.errors import RouterError
from trio_pd.pd.budget import (
    WORKER_COPIES,
    Account,
    OverBudget,
    json_marks,
    over_budget,
    parse_cost,
)
from trio_pd.pd.payload import CHAT, COMPLETIONS, OFFLOAD_BYTES, Refused

# What the router asks of a vLLM prefill (vllm-router 0.1.17's `prepare_prefill_request` and
# `build_prefill_kv_transfer_params` for NIXL): a remote decode will read the blocks.
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
KV_KEY = "kv_transfer_params"


def prefill_body(client: dict[str, Any]) -> bytes:
    """The prefill leg's body: the client's, one token, no stream, the remote-decode params.

    `stream_options` go (vLLM refuses them without `stream: true`); `max_tokens` (and
    `max_completion_tokens` when the client used it) are 1; `min_tokens` (and
    `min_completion_tokens`) are 1, which keeps min <= max (validated) and keeps the one token
    from being EOS (an older engine drops the params then); `n` is 1 (the handoff has one
    consumer). A client's own `kv_transfer_params` never reach an engine."""
    body = {k: v for k, v in client.items() if k not in (KV_KEY, "stream_options")}
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["min_tokens"] = 1
    if "min_completion_tokens" in body:
        body["min_completion_tokens"] = 1
    if "n" in body:
        body["n"] = 1
    body[KV_KEY] = PREFILL_PARAMS
    return jsonbody.dump(body)


def engine_headers(headers: list[tuple[bytes, bytes]], path: str) -> list[tuple[bytes, bytes]]:
    """The legs' headers with the route's prefix taken off `x-request-id`: vLLM names its
    answer `cmpl-<x-request-id>` (`chatcmpl-` on chat, `_base_request_id`,
    entrypoints/serve/engine/serving.py), and the router's ids already carry that prefix, so the
    client saw `cmpl-cmpl-...`; now the answer's id is the router's request id, as one engine's
    would be (checked against vLLM 0.32)."""
    prefix = b"chatcmpl-" if path == CHAT else b"cmpl-"
    return [
        (name, value[len(prefix) :])
        if name == b"x-request-id" and value.startswith(prefix) and len(value) > len(prefix)
        else (name, value)
        for name, value in headers
    ]


def echoes_logprobs(path: str, client: dict[str, Any]) -> bool:
    """A non-stream completion with `echo` and `logprobs`: vLLM computes the prompt's
    logprobs for it (prompt_logprobs), so the router takes them, and the echo, from prefill."""
    return (
        path == COMPLETIONS
        and bool(client.get("echo"))
        and isinstance(client.get("logprobs"), int)
        and not client.get("stream")
    )


def decode_body(
    raw: bytes, client: dict[str, Any], params: dict[str, Any] | None, echo: bool = False
) -> bytes:
    """The decode leg's body: the client's own bytes plus the prefill's params (none: the
    decode computes the prompt itself)."""
    return with_params(decode_base(raw, client, echo), params)


def decode_base(raw: bytes, client: dict[str, Any], echo: bool = False) -> bytes:
    """The decode leg's body before the prefill's params: the client's own bytes (`raw`
    itself), re-serialized only when a key must go: the client's own `kv_transfer_params`, and
    `prompt_logprobs` (and `echo` with logprobs): prefill computed them; asked of the decode
    they make vLLM recompute the prompt instead of reading the blocks."""
    keys = (KV_KEY, "prompt_logprobs", "echo") if echo else (KV_KEY, "prompt_logprobs")
    drop = [key for key in keys if key in client]
    if drop:
        raw = jsonbody.dump({k: v for k, v in client.items() if k not in drop})
    return raw


def with_params(raw: bytes, params: dict[str, Any] | None) -> bytes:
    """`decode_base`'s bytes with the prefill's `kv_transfer_params` spliced in (None: none)."""
    if params is None:
        return raw
    end = raw.rindex(b"}")
    members = b'"kv_transfer_params":' + orjson.dumps(params)
    empty = raw.find(b":", 0, end) < 0  # an object with a member has a colon; `{}` has none
    # One copy of a body that may be megabytes: the join reads the client's bytes in place.
    return b"".join((memoryview(raw)[:end], b"" if empty else b",", members, b"}"))


@attrs.frozen
class VllmBodies:
    """What a vLLM attempt needs of the client's body, made from it once per request (off the
    event loop when large: `pd/vllm_bodies.py`), so no attempt parses it again."""

    prefill: bytes  # the prefill leg's body (`prefill_body`)
    decode: bytes  # `decode_base` of the client's body (b"" off the loop: the client's own)
    decode_echo: bytes  # ... less `echo` too (only when `echo`)
    wants_prompt_logprobs: bool
    echo: bool  # `echoes_logprobs`


def vllm_bodies(path: str, raw: bytes) -> VllmBodies:
    """`VllmBodies` of an inspected client body (valid JSON: `payload.inspect_body` said so);
    RouterError when it cannot be re-serialized (`jsonbody.dump`)."""
    client = jsonbody.parse_object(raw)
    echo = echoes_logprobs(path, client)
    return VllmBodies(
        prefill=prefill_body(client),
        decode=decode_base(raw, client),
        decode_echo=decode_base(raw, client, echo=True) if echo else b"",
        wants_prompt_logprobs=client.get("prompt_logprobs") is not None,
        echo=echo,
    )


@attrs.define(eq=False)
class VllmBodyMaker:
    """One request's `VllmBodies`, made on first use and kept for its other attempts."""

    path: str
    raw: bytes  # the inspected client body (`Inspected.body`)
    marks: int = 0  # its JSON structure count (`budget.json_marks`), to price its parse
    parsers: Any = None  # trio_parallel.WorkerContext of the lifespan; None: inline
    made: VllmBodies | None = None
    # The request's other body, when migration sends one (the first attempt's asks for token
    # ids; a resumed attempt's prompt is token ids): its bodies are made once for its attempts.
    variant: VllmBodyMaker | None = None
    _lock: trio.Lock = attrs.field(factory=trio.Lock, init=False)

    def variant_for(self, raw: bytes) -> VllmBodyMaker:
        """The maker of `raw`, a body other than the client's (kept while it is the last)."""
        kept = self.variant
        if kept is None or (kept.raw is not raw and kept.raw != raw):
            marks = json_marks(raw)  # its parse priced as the client's was (`generation.py`)
            kept = self.variant = VllmBodyMaker(self.path, raw, marks, self.parsers)
        return kept

    async def bodies(self, account: Account | None) -> VllmBodies:
        """The bodies (RouterError: 413/429 from the budget, 400 when they cannot be made)."""
        async with self._lock:  # samples run at once: one of them makes, the others wait
            if self.made is None:
                self.made = await self._make(account)
            return self.made

    async def _make(self, account: Account | None) -> VllmBodies:
        raw = self.raw
        if self.parsers is None or len(raw) < OFFLOAD_BYTES:
            made = vllm_bodies(self.path, raw)
        else:
            cost = parse_cost(len(raw), self.marks) + WORKER_COPIES * len(raw)
            charge(account, cost, "parsing the body")
            try:
                result = await self.parsers.run_sync(
                    vllm_bodies_off_loop, self.path, raw, kill_on_cancel=True
                )
            finally:
                if account is not None:
                    account.release(cost)
            if isinstance(result, Refused):
                raise result.error()
            made = result
            if not made.decode:
                made = attrs.evolve(made, decode=raw)  # unchanged: not shipped back
        held = len(made.prefill) + len(made.decode_echo)
        held += 0 if made.decode is raw else len(made.decode)
        charge(account, held, "the vLLM legs' bodies")
        return made


def charge(account: Account | None, amount: int, what: str) -> None:
    if account is None:
        return
    try:
        account.charge(amount)
    except OverBudget as error:
        raise over_budget(error, what) from None


def vllm_bodies_off_loop(path: str, raw: bytes) -> VllmBodies | Refused:
    """`vllm_bodies` in a worker process: a decode body left as the client's own is not sent
    back (the caller has it), and a refusal crosses as a picklable value."""
    try:
        made = vllm_bodies(path, raw)
    except RouterError as error:
        return Refused(error.status, error.message, error.error_type)
    return attrs.evolve(made, decode=b"") if made.decode is raw else made
