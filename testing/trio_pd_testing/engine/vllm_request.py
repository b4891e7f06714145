"""A vLLM request as the simulator reads it: its role, its prompt, what vLLM refuses, faults.

The refusals are vLLM 0.33.0's (`entrypoints/openai/*/protocol.py`, `sampling_params.py`), in
its `ErrorResponse` shape; `sim_fault` specs are the simulator's own (`vllm.py`).
"""

from __future__ import annotations

import zlib
from typing import Any

import attrs

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# The simulator's token ids: a prompt word's (crc of the word), the answer's `tok<i>` (0-based).
OUTPUT_ID_BASE = 60_000


class Refused(Exception):
    """A 4xx vLLM answers before any work (its `ErrorResponse`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status

    def body(self) -> dict[str, Any]:
        error_type = "BadRequestError" if self.status == 400 else "ServiceUnavailableError"
        return error_json(self.message, error_type, self.status, self.param)


def error_json(message: str, error_type: str, code: int, param: str | None = None) -> dict:
    """vLLM's `ErrorResponse` (`entrypoints/serve/engine/protocol.py`)."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


GENERATION_ERROR = error_json("Internal server error", "InternalServerError", 500)


@attrs.define
class Job:
    path: str
    body: dict[str, Any]
    request_id: str
    stream: bool
    prompt: str
    max_tokens: int
    params: dict[str, Any] | None
    faults: dict[str, str | None]  # this role's faults: kind -> argument
    # The caller's `X-Request-Id`: vLLM's answer id is then `cmpl-<it>` / `chatcmpl-<it>`
    # (`_base_request_id`, entrypoints/serve/engine/serving.py; checked on vLLM 0.32).
    external_id: str | None = None

    @property
    def role(self) -> str:
        params = self.params or {}
        if params.get("do_remote_decode"):
            return "prefill"
        if params.get("do_remote_prefill"):
            return "decode"
        return "local"

    @property
    def prompt_tokens(self) -> int:
        return max(1, len(self.prompt.split()))

    @property
    def wants_prompt_logprobs(self) -> bool:
        """`prompt_logprobs`, or echo with logprobs on completions, which vLLM turns into
        prompt_logprobs (`openai/completion/protocol.py` to_sampling_params)."""
        if self.body.get("prompt_logprobs") is not None:
            return True
        return self.path == COMPLETIONS and bool(self.body.get("echo")) and isinstance(
            self.body.get("logprobs"), int)  # fmt: skip


def validate(path: str, body: Any) -> None:
    """What vLLM's protocol models and SamplingParams refuse that a PD router may send."""
    if not isinstance(body, dict):
        raise Refused("The request body must be a JSON object")
    if body.get("stream_options") and not body.get("stream"):
        raise Refused(
            "Stream options can only be defined when `stream=True`.", "stream_options"
        )  # completion/protocol.py, chat_completion/protocol.py validate_stream_options
    if path == CHAT:
        if not isinstance(body.get("messages"), list):
            raise Refused("`messages` is required", "messages")
    elif not isinstance(body.get("prompt"), str | list):
        raise Refused("`prompt` is required", "prompt")
    max_tokens = max_tokens_of(path, body)
    if max_tokens is not None and max_tokens < 1:
        raise Refused(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    min_tokens = body.get("min_tokens", 0)
    if isinstance(min_tokens, int) and max_tokens is not None and min_tokens > max_tokens:
        raise Refused(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."
        )  # sampling_params.py _verify_args
    if body.get("prompt_logprobs") and body.get("stream"):
        raise Refused("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")


def max_tokens_of(path: str, body: dict[str, Any]) -> int | None:
    if path == CHAT and isinstance(body.get("max_completion_tokens"), int):
        return body["max_completion_tokens"]
    value = body.get("max_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def prompt_of(path: str, body: dict[str, Any]) -> str:
    if path == CHAT:
        parts = []
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                parts.append(content)
        return "\n".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = " ".join(str(p) for p in prompt)
    return str(prompt)


def output_token_id(i: int) -> int:
    """The id of the answer's token `tok<i>` (0-based)."""
    return OUTPUT_ID_BASE + i


def prompt_ids_of(path: str, body: dict[str, Any]) -> list[int]:
    """The prompt's token ids: a token-id prompt's own, else one per word of its text."""
    prompt = body.get("prompt") if path == COMPLETIONS else None
    if isinstance(prompt, list) and all(isinstance(p, int) for p in prompt):
        return list(prompt)
    return [100 + zlib.crc32(w.encode()) % 32000 for w in prompt_of(path, body).split()]


def continued(ids: list[int]) -> int:
    """How many of the prompt's last ids are the answer's first tokens in order (`tok0 ...
    tok<M-1>`): a resumed request (a router's migration sends the prompt's ids plus the ids
    already streamed as a token-id prompt) goes on with `tok<M>`, so its tokens are the
    uninterrupted run's, as greedy decoding on a real engine. 0 for any other prompt."""
    if not ids:
        return 0
    count = ids[-1] - OUTPUT_ID_BASE + 1
    if count < 1 or count > len(ids):
        return 0
    tail = ids[len(ids) - count :]
    return count if all(t == output_token_id(i) for i, t in enumerate(tail)) else 0


def parse_faults(specs: list[str], role: str) -> dict[str, str | None]:
    """`[prefill:|decode:]KIND[:ARG]` specs that apply to `role`; `KIND@Ntok` (`die@3tok`)
    is KIND with N as its argument: it fires once the answer has sent N tokens."""
    found: dict[str, str | None] = {}
    for spec in specs:
        parts = spec.strip().split(":")
        if parts[0] in ("prefill", "decode", "local"):
            if parts[0] != role:
                continue
            parts = parts[1:]
        if parts and parts[0]:
            kind, _, after = parts[0].partition("@")
            if after.endswith("tok"):
                found[kind] = after.removesuffix("tok")
            else:
                found[parts[0]] = parts[1] if len(parts) > 1 else None
    return found
