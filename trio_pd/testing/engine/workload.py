"""Turns a request body into the simulator's token model.

Input length = whitespace words of the text / prompt / chat message contents (or len(input_ids));
output length = max_new_tokens (generate) or max_tokens / max_completion_tokens (OpenAI),
default 16. Batches: `/generate` with a list of texts or of input_id lists, `/v1/completions`
with a list prompt, `/v1/chat/completions` with n > 1.
"""

from __future__ import annotations

import zlib
from typing import Any

import attrs

DEFAULT_MAX_TOKENS = 16
DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's default when a request carries no port

ENDPOINTS = {
    "/generate": "generate",
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
}


class BadRequest(ValueError):
    """The request cannot be served; answered with 400 and a JSON error."""


@attrs.frozen
class Workload:
    api: str  # "generate" | "completions" | "chat"
    stream: bool
    inputs: tuple[tuple[int, ...], ...]  # token ids per batch item
    is_batch: bool
    max_new_tokens: int
    logprobs: bool
    top_logprobs: int
    rooms: tuple[int, ...] | None  # one per batch item, None when missing
    bootstrap_host: str | None
    bootstrap_port: int | None
    model: str | None
    include_usage: bool

    @property
    def size(self) -> int:
        return len(self.inputs)

    @property
    def first_room(self) -> int | None:
        return self.rooms[0] if self.rooms else None


def word_id(word: str) -> int:
    return 100 + zlib.crc32(word.encode()) % 32000


def text_ids(text: str) -> tuple[int, ...]:
    return tuple(word_id(w) for w in text.split())


def output_id(i: int) -> int:
    """Token id of the i-th (1-based) generated token `tok<i>`."""
    return 50_000 + i


def output_text(count: int, start: int = 1) -> str:
    return " ".join(f"tok{i}" for i in range(start, start + count))


def parse_workload(api: str, body: dict[str, Any]) -> Workload:
    if api == "generate":
        inputs, is_batch = _generate_inputs(body)
        params = body.get("sampling_params") or {}
        if isinstance(params, list):
            params = params[0] if params else {}
        if not isinstance(params, dict):
            raise BadRequest("sampling_params must be an object")
        max_new = params.get("max_new_tokens", DEFAULT_MAX_TOKENS)
        logprobs = bool(body.get("return_logprob", False))
        top = body.get("top_logprobs_num") or 0
    elif api == "completions":
        inputs, is_batch = _completion_inputs(body)
        max_new = body.get("max_tokens", DEFAULT_MAX_TOKENS)
        lp = body.get("logprobs")
        logprobs = lp is not None and lp is not False
        top = lp if isinstance(lp, int) and not isinstance(lp, bool) else 0
    elif api == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list")
        ids = text_ids(" ".join(_content_text(m) for m in messages))
        n = body.get("n") or 1
        if not isinstance(n, int) or n < 1:
            raise BadRequest("n must be a positive integer")
        inputs, is_batch = (ids,) * n, n > 1
        max_new = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS
        logprobs = bool(body.get("logprobs", False))
        top = body.get("top_logprobs") or 0
    else:
        raise BadRequest(f"unknown api {api!r}")
    if max_new is None:
        max_new = DEFAULT_MAX_TOKENS
    if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 0:
        raise BadRequest("max tokens must be a non-negative integer")
    if not isinstance(top, int) or top < 0:
        raise BadRequest("top logprobs must be a non-negative integer")
    options = body.get("stream_options") or {}
    return Workload(
        api=api,
        stream=bool(body.get("stream", False)),
        inputs=inputs,
        is_batch=is_batch,
        max_new_tokens=max_new,
        logprobs=logprobs,
        top_logprobs=top,
        rooms=_rooms(body.get("bootstrap_room"), len(inputs), is_batch),
        bootstrap_host=_scalar(body.get("bootstrap_host"), "bootstrap_host"),
        bootstrap_port=_scalar(body.get("bootstrap_port"), "bootstrap_port"),
        model=body.get("model"),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
    )


def _generate_inputs(body: dict[str, Any]) -> tuple[tuple[tuple[int, ...], ...], bool]:
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is not None:
        if isinstance(text, str):
            return (text_ids(text),), False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return tuple(text_ids(t) for t in text), True
        raise BadRequest("text must be a string or a non-empty list of strings")
    if input_ids is not None:
        return _id_inputs(input_ids, "input_ids")
    raise BadRequest("either text or input_ids is required")


def _completion_inputs(body: dict[str, Any]) -> tuple[tuple[tuple[int, ...], ...], bool]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return (text_ids(prompt),), False
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return tuple(text_ids(p) for p in prompt), True
    if isinstance(prompt, list) and prompt:
        return _id_inputs(prompt, "prompt")
    raise BadRequest("prompt must be a string, a list of strings or token ids")


def _id_inputs(value: Any, name: str) -> tuple[tuple[tuple[int, ...], ...], bool]:
    if isinstance(value, list) and value and all(_is_int(t) for t in value):
        return (tuple(value),), False
    if (
        isinstance(value, list)
        and value
        and all(isinstance(x, list) and all(_is_int(t) for t in x) for x in value)
    ):
        return tuple(tuple(x) for x in value), True
    raise BadRequest(f"{name} must be a list of token ids or a list of such lists")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _content_text(message: Any) -> str:
    if not isinstance(message, dict):
        raise BadRequest("each message must be an object")
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if not all(isinstance(t, str) for t in texts):
            raise BadRequest("a text content part needs a string `text`")
        return " ".join(texts)
    raise BadRequest("message content must be a string or a list of parts")


def _rooms(value: Any, size: int, is_batch: bool) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, list):
        if len(value) != size or not all(_is_int(r) for r in value):
            raise BadRequest(f"bootstrap_room must be a list of {size} integers for this request")
        if len(set(value)) != len(value):
            raise BadRequest("bootstrap_room values must be distinct")
        return tuple(value)
    if not _is_int(value):
        raise BadRequest("bootstrap_room must be an integer")
    if is_batch and size > 1:
        raise BadRequest("a batch request needs a list of bootstrap_room values")
    return (value,) * size


def _scalar(value: Any, name: str) -> Any:
    if isinstance(value, list):  # lists for batches carry the same host/port everywhere
        if not value or any(v != value[0] for v in value):
            raise BadRequest(f"{name} list must repeat one value")
        return value[0]
    return value
