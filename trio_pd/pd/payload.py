"""What the router reads of a client's JSON body, without a schema, and the bounds it enforces.

The router never re-serializes a client's body: `inspect_body` validates it, reads the few keys
routing needs, and hands back the client's own bytes, into which `injection.splice` writes the
router's fields. Only a body that already carries router-owned keys (`bootstrap_*`, `rid`, the DP
rank fields when the router picks ranks) is rewritten without them, so the legs never see a key
twice.

Everything here is a pure function of the bytes and runs before any leg starts. Its cost is
bounded: list lengths are capped (`--max-batch-size`) before the router builds a room per item,
and the routing text is cut to `ROUTING_TEXT_LIMIT` characters. Parsing itself costs time in
proportion to the body (up to ~0.3 µs per JSON value), so `edge/intake.py` runs it in a worker
process for bodies of `OFFLOAD_BYTES` or more: a large body never stalls the event loop that
relays everyone else's tokens. That is why the result is a plain picklable value.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from trio_pd import jsonbody as json_body
from trio_pd.errors import RouterError, bad_request

GENERATE = "/generate"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# Prefix matching beyond this many characters changes no routing decision worth its memory.
ROUTING_TEXT_LIMIT = 32_768
ROUTING_MESSAGE_LIMIT = 1_024  # messages (and content parts) looked at for the routing text
OFFLOAD_BYTES = 32 * 1024  # bodies this large are inspected off the event loop
BOOTSTRAP_KEYS = frozenset(("bootstrap_host", "bootstrap_port", "bootstrap_room"))


@attrs.frozen
class Inspected:
    """What routing needs to know of a valid client body, and the bytes the legs start from."""

    body: bytes  # the client's bytes, or the client's object less the router-owned keys
    empty: bool  # `{}`: the injected fields need no leading comma
    stream: bool
    logprobs: bool
    batch: int | None  # None: a single sequence (scalar bootstrap fields)
    text: str | None  # the routing text, capped
    length: int  # characters of the routing text before the cap (bucket policy); 0: no text
    model: str | None
    rid: Any  # the client's own `rid` (str, list or None); the router owns the key on the legs
    multimodal: bool = False  # images, audio or video: the engine's abort latch window is real
    samples: int = 1  # n > 1: each sample is its own PD request (`pd/samples.py`); body has no n


@attrs.frozen
class Refused:
    """A body refused with a 4xx, as a picklable value (crosses the worker-process boundary)."""

    status: int
    message: str
    error_type: str

    def error(self) -> RouterError:
        return RouterError(self.status, self.message, self.error_type)


def inspect_body(
    path: str, raw: bytes, max_batch: int, owned_keys: frozenset[str]
) -> Inspected | Refused:
    """Validate `raw` for `path` and read what routing needs; never raises for bad input."""
    try:
        payload = json_body.parse_object(raw)
        batch = batch_size(path, payload, max_batch)
        stream = stream_flag(payload)
        samples = sample_count(path, payload, max_batch)
        if samples > 1 and batch is not None:
            raise bad_request(
                f"n > 1 with a batch of {batch} prompts is not supported on PD engines: send "
                "one prompt per request (each of its n samples is its own PD request)"
            )
    except RouterError as error:
        return Refused(error.status, error.message, error.error_type)
    present = owned_keys.intersection(payload)
    if present or samples > 1:
        kept = {k: v for k, v in payload.items() if k not in present}
        if samples > 1:
            kept = without_n(path, kept)
        raw = json_body.dump(kept)
        empty = not kept
    else:
        empty = not payload
    model = payload.get("model")
    text, length = prompt_text(path, payload)
    return Inspected(
        body=raw,
        empty=empty,
        stream=stream,
        logprobs=wants_logprobs(path, payload),
        batch=batch,
        text=text[:ROUTING_TEXT_LIMIT] if text else None,
        length=length,
        model=model if isinstance(model, str) else None,
        rid=payload.get("rid"),
        multimodal=is_multimodal(path, payload),
        samples=samples,
    )


def stream_flag(payload: dict[str, Any]) -> bool:
    """`stream`: true, false, or absent (null: false). Anything else is refused with 400.

    Engines differ on other values: SGLang 0.5.23's `/generate` contract refuses them ("invalid
    type: integer `1`, expected a boolean"), while its OpenAI routes are pydantic models whose lax
    `bool` streams for `1`, `"true"`, `"yes"`, `"on"`... A value the router took for "no stream"
    and the engine for "stream" would have the router buffer a stream whole, past every stream
    timeout; refusing it, as the /generate contract and the OpenAI API (a boolean) do, leaves
    no value on which the two can disagree."""
    stream = payload.get("stream")
    if stream is None or isinstance(stream, bool):
        return stream is True
    what = JSON_TYPES.get(type(stream), "a value of another type")
    raise bad_request(f"`stream` must be true or false, not {what}")


JSON_TYPES = {
    int: "a number",
    float: "a number",
    str: "a string",
    list: "a list",
    dict: "an object",
}


def batch_size(path: str, payload: dict[str, Any], limit: int) -> int | None:
    """Prompts a request carries (None: a single one, scalar bootstrap fields); a batch over
    `limit` is refused with 400 before the router spends anything on it. The engine's batch
    size is the number of prompts; `n` samples each of them (`sample_count`)."""
    size = _batch_size(path, payload)
    if size is not None and size > limit:
        raise bad_request(
            f"the batch size is {size}, more than this router's --max-batch-size {limit}"
        )
    return size


def _batch_size(path: str, payload: dict[str, Any]) -> int | None:
    if path == GENERATE:
        text = payload.get("text")
        if isinstance(text, list):
            return len(text)
        ids = payload.get("input_ids")
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            return len(ids)
        return None
    if path == COMPLETIONS:
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            return len(prompt)
        return None
    return None


def sample_count(path: str, payload: dict[str, Any], limit: int) -> int:
    """How many samples the client asks of each prompt: `n` on the OpenAI routes,
    `sampling_params.n` on `/generate` (SGLang's `parallel_sample_num`). 1 when absent or at
    most 1; over `limit` (`--max-batch-size`) it is refused with 400.

    PD engines cannot sample n > 1 themselves (one room, one rid: the prefill answers n
    choices and the decode waits forever, docs/protocol.md §2), so the router runs each sample
    as its own PD request (`pd/samples.py`). That needs the router and the engine to count the
    same `n`, so `n` must be a JSON integer: SGLang 0.5.23's OpenAI models read `n: int` with
    pydantic's lax mode (`entrypoints/openai/protocol.py`: `8.0` and `"8"` are 8), which a
    router counting only integers would send as one PD request the engine samples 8 times
    (the extra samples wait for KV that never comes). Anything else, `null` and booleans
    included, is a 400 here. A list of per-prompt `sampling_params` is a batch: the engine
    takes its first item's `n` for all (`managers/io_struct.py` `_handle_parallel_sampling`),
    so an `n` in one of them other than 1 is refused like `n` with any batch."""
    if path == GENERATE:
        params = payload.get("sampling_params")
        if isinstance(params, list):
            for item in params:
                if isinstance(item, dict) and "n" in item and _count(item["n"]) != 1:
                    raise bad_request(
                        "`n` in a list of sampling_params (a batch) is not supported on PD "
                        "engines: send one prompt per request with `sampling_params.n`"
                    )
            return 1
        if not isinstance(params, dict) or "n" not in params:
            return 1
        n = _count(params["n"])
    else:
        if "n" not in payload:
            return 1
        n = _count(payload["n"])
    if n <= 1:
        return 1
    if n > limit:
        raise bad_request(f"n is {n}, more than this router's --max-batch-size {limit}")
    return n


def _count(n: Any) -> int:
    """`n` as the router counts it: a JSON integer, else a 400 (see `sample_count`)."""
    if isinstance(n, int) and not isinstance(n, bool):
        return n
    what = "a boolean" if isinstance(n, bool) else JSON_TYPES.get(type(n), "null")
    raise bad_request(f"`n` must be an integer, not {what}")


def without_n(path: str, payload: dict[str, Any]) -> dict[str, Any]:
    """The body one sample of an n > 1 request carries: the client's, without `n`."""
    if path == GENERATE:
        params = dict(payload["sampling_params"])
        del params["n"]
        return {**payload, "sampling_params": params}
    return {k: v for k, v in payload.items() if k != "n"}


def prompt_text(path: str, payload: dict[str, Any]) -> tuple[str | None, int]:
    """The prompt as text and its length in characters: `/generate` `text`, completions
    `prompt` (the first of a batch), chat the conversation's text parts joined by newlines.
    Cache-aware matches on the text's first `ROUTING_TEXT_LIMIT` characters, bucket balances on
    the length. A chat text joins the first `ROUTING_MESSAGE_LIMIT` messages (and parts of
    each); its length counts them all, as the joined text would be. Values of unexpected types
    are skipped: the engines judge the request, the router only needs a routing hint."""
    if path == CHAT:
        messages = payload.get("messages")
        if not isinstance(messages, list):
            return None, 0
        return _conversation(messages)
    value = payload.get("text" if path == GENERATE else "prompt")
    if isinstance(value, list) and value:
        value = value[0]
    text = value if isinstance(value, str) and value else None
    return text, len(text) if text else 0


def _conversation(messages: list[Any]) -> tuple[str | None, int]:
    """One pass over a conversation's text parts (each message's string content or the `text`
    of its content parts): the first `ROUTING_MESSAGE_LIMIT` messages, and parts of each, joined
    by newlines; and the length of all of them joined so."""
    kept: list[str] = []
    chars = parts = 0
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts: Iterable[Any] = (content,)
        elif isinstance(content, list):
            texts = (p.get("text") if isinstance(p, dict) else None for p in content)
        else:
            continue
        for number, text in enumerate(texts):
            if isinstance(text, str):
                chars += len(text)
                parts += 1
                if index < ROUTING_MESSAGE_LIMIT and number < ROUTING_MESSAGE_LIMIT:
                    kept.append(text)
    return "\n".join(kept) or None, chars + parts - 1 if parts else 0


MULTIMODAL_KEYS = ("image_data", "video_data", "audio_data")


def is_multimodal(path: str, payload: dict[str, Any]) -> bool:
    """Whether the engine processes media before scheduling this request (`/generate`'s
    `image_data`/`video_data`/`audio_data`, a chat content part that is not text): its
    tokenizer manager then awaits between registering the rid and scheduling it, the window in
    which an abort is lost and latches (docs/protocol.md §10, `pd/engines/sglang.abort_hook`)."""
    if path == GENERATE:
        return any(payload.get(key) not in (None, [], "") for key in MULTIMODAL_KEYS)
    if path == CHAT:
        messages = payload.get("messages")
        if not isinstance(messages, list):
            return False
        for message in messages[:ROUTING_MESSAGE_LIMIT]:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list) and any(
                isinstance(part, dict) and part.get("type", "text") != "text" for part in content
            ):
                return True
    return False


def wants_logprobs(path: str, payload: dict[str, Any]) -> bool:
    if path == GENERATE:
        return bool(payload.get("return_logprob"))
    return bool(payload.get("logprobs"))
