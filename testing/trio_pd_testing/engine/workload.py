"""Turns a request body into the simulator's token model, normalized as SGLang normalizes it.

Input length = whitespace words of the text / prompt / chat message contents (or len(input_ids));
output length = max_new_tokens (generate) or max_tokens / max_completion_tokens (OpenAI),
default 16 (SGLang: 128 on /generate, up to the context on chat: shorter here, for speed).

Batch size is the number of PROMPTS (`managers/io_struct.py` `_determine_batch_size`): a list
of texts or of input_id lists on /generate, a list prompt on /v1/completions; a chat request is
always one prompt. Parallel sampling (`n` on the OpenAI routes, `sampling_params.n` on
/generate, `_handle_parallel_sampling`) multiplies each prompt by n inside the engine: the
request then has batch_size x n items, prompt-major (item k is sample k % n of prompt k // n),
and its answer is a list (a batch) even for one prompt.

Rooms (`_normalize_bootstrap_params`): a scalar room R on a batch expands to R + i for prompt i;
a list gives prompt i its i-th room. All n samples of a prompt share that prompt's room (so with
n > 1 several engine requests wait on ONE room: see decode.py).

Errors: `BadRequest` is what FastAPI's schema validation refuses (400 before any work, on every
route); `Refused` is a ValueError the engine raises while normalizing or registering a request
(`io_struct.py`, `tokenizer_manager.py`), answered per route (failures.py).
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
    """Fails the engine's request schema (pydantic): 400 on every route, before any work."""


class Refused(ValueError):
    """A ValueError the engine raises on a valid body (rid rules, duplicates, ranks, length)."""


@attrs.frozen
class Workload:
    api: str  # "generate" | "completions" | "chat"
    stream: bool
    prompts: tuple[tuple[int, ...], ...]  # token ids per prompt
    is_single: bool  # one prompt given as a scalar (before parallel sampling)
    n: int  # parallel samples per prompt
    max_new_tokens: int
    logprobs: bool
    top_logprobs: int
    prompt_rooms: tuple[int, ...] | None  # one per prompt, None when missing
    bootstrap_host: str | None
    bootstrap_port: int | None
    model: str | None
    include_usage: bool
    text_prompt: bool  # the engine tokenizes it (the window of config.tokenize_window)
    # completions' `return_token_ids`: each chunk's `token_ids`, the first's `prompt_token_ids`
    return_token_ids: bool = False

    def start_of(self, item: int) -> int:
        """Tokens of the answer before this request's first (a resumed request's, `continued`)."""
        return continued(self.prompts[item // self.n])

    @property
    def batch_size(self) -> int:
        return len(self.prompts)

    @property
    def size(self) -> int:
        """Engine requests (items): prompts x samples."""
        return len(self.prompts) * self.n

    @property
    def is_batch(self) -> bool:
        """The engine answers a list (SGLang: `not obj.is_single` after normalization)."""
        return not self.is_single or self.n > 1

    def prompt_of(self, item: int) -> int:
        return item // self.n

    def room_of(self, item: int) -> int | None:
        return self.prompt_rooms[item // self.n] if self.prompt_rooms else None

    def prompt_len(self, item: int) -> int:
        return len(self.prompts[item // self.n])

    @property
    def rooms(self) -> tuple[int, ...] | None:
        """The room of every item (samples of one prompt repeat it)."""
        if self.prompt_rooms is None:
            return None
        return tuple(self.room_of(i) for i in range(self.size))  # type: ignore[misc]

    @property
    def first_room(self) -> int | None:
        return self.prompt_rooms[0] if self.prompt_rooms else None


def word_id(word: str) -> int:
    return 100 + zlib.crc32(word.encode()) % 32000


def text_ids(text: str) -> tuple[int, ...]:
    return tuple(word_id(w) for w in text.split())


def output_id(i: int) -> int:
    """Token id of the i-th (1-based) generated token `tok<i>`."""
    return 50_000 + i


def output_text(count: int, start: int = 1) -> str:
    """The text of `count` tokens from `tok<start>` on; a continuation (start > 1) begins with
    the space that separates it from the tokens before it, as SGLang's detokenizer renders a
    resumed answer of a byte-level BPE model."""
    text = " ".join(f"tok{i}" for i in range(start, start + count))
    return f" {text}" if start > 1 and count else text


def continued(prompt: tuple[int, ...]) -> int:
    """How many of the prompt's last ids are generated tokens in order (`tok1 ... tokM`): a
    resumed request (a router's migration sends prompt + the tokens already streamed as
    `input_ids`) continues with `tok<M+1>`, so its tokens are the uninterrupted run's, byte for
    byte, as greedy decoding on a real engine. 0 for any other prompt."""
    if not prompt:
        return 0
    last = prompt[-1] - output_id(0)
    if last < 1 or last > len(prompt):
        return 0
    tail = prompt[len(prompt) - last :]
    return last if all(t == output_id(i + 1) for i, t in enumerate(tail)) else 0


def parse_workload(api: str, body: dict[str, Any]) -> Workload:
    if api == "generate":
        prompts, is_single, text = _generate_inputs(body)
        params = body.get("sampling_params")
        n, max_new = _sampling(params)
        logprobs = bool(body.get("return_logprob") or False)
        top = body.get("top_logprobs_num") or 0
    elif api == "completions":
        prompts, is_single, text = _completion_inputs(body)
        n = _positive_int(body.get("n", 1), "n")
        max_new = body.get("max_tokens", DEFAULT_MAX_TOKENS)
        if isinstance(max_new, int) and not isinstance(max_new, bool) and max_new <= 0:
            raise BadRequest("max_tokens must be positive")
        lp = body.get("logprobs")
        logprobs = lp is not None and lp is not False
        top = lp if isinstance(lp, int) and not isinstance(lp, bool) else 0
    elif api == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list")
        prompts = (text_ids(" ".join(_content_text(m) for m in messages)),)
        is_single, text = True, False  # the chat template yields input ids, no tokenizing
        n = _positive_int(body.get("n", 1), "n")
        max_new = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS
        logprobs = bool(body.get("logprobs", False))
        top = body.get("top_logprobs") or 0
    else:
        raise BadRequest(f"unknown api {api!r}")
    if max_new is None:
        max_new = DEFAULT_MAX_TOKENS
    if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 0:
        raise BadRequest("max tokens must be a non-negative integer")
    if not isinstance(top, int) or isinstance(top, bool) or top < 0:
        raise BadRequest("top logprobs must be a non-negative integer")
    options = body.get("stream_options") or {}
    return Workload(
        api=api,
        stream=bool(body.get("stream", False)),
        prompts=prompts,
        is_single=is_single,
        n=n,
        max_new_tokens=max_new,
        logprobs=logprobs,
        top_logprobs=top,
        prompt_rooms=_rooms(body.get("bootstrap_room"), len(prompts), is_single and n == 1),
        bootstrap_host=_scalar(body.get("bootstrap_host"), "bootstrap_host"),
        bootstrap_port=_scalar(body.get("bootstrap_port"), "bootstrap_port"),
        model=body.get("model"),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        text_prompt=text,
        return_token_ids=api == "completions" and body.get("return_token_ids") is True,
    )


def _sampling(params: Any) -> tuple[int, Any]:
    """(parallel_sample_num, max_new_tokens) of /generate's sampling_params."""
    if params is None:
        return 1, None
    if isinstance(params, dict):
        return _positive_int(params.get("n", 1), "sampling_params.n"), params.get("max_new_tokens")
    if isinstance(params, list) and all(isinstance(p, dict) for p in params):
        if not params:
            return 1, None
        n = params[0].get("n", 1)
        if any(p.get("n", 1) != n for p in params):
            raise Refused(
                "The parallel_sample_num should be the same for all samples in sample params."
            )
        return _positive_int(n, "sampling_params.n"), params[0].get("max_new_tokens")
    raise BadRequest("sampling_params must be an object or a list of objects")


def _positive_int(value: Any, name: str) -> int:
    if value is None:
        return 1
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BadRequest(f"{name} must be a positive integer")
    return value


Inputs = tuple[tuple[tuple[int, ...], ...], bool, bool]  # prompts, is_single, text


def _generate_inputs(body: dict[str, Any]) -> Inputs:
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is not None:
        if isinstance(text, str):
            return (text_ids(text),), True, True
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return tuple(text_ids(t) for t in text), False, True
        raise BadRequest("text must be a string or a non-empty list of strings")
    if input_ids is not None:
        prompts, single = _id_inputs(input_ids, "input_ids")
        return prompts, single, False
    raise Refused("Either text, input_ids or input_embeds should be provided.")


def _completion_inputs(body: dict[str, Any]) -> Inputs:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return (text_ids(prompt),), True, True
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return tuple(text_ids(p) for p in prompt), False, True
    if isinstance(prompt, list) and prompt:
        prompts, single = _id_inputs(prompt, "prompt")
        return prompts, single, False
    raise BadRequest("prompt must be a string, a list of strings or token ids")


def _id_inputs(value: Any, name: str) -> tuple[tuple[tuple[int, ...], ...], bool]:
    if isinstance(value, list) and value and all(_is_int(t) for t in value):
        return (tuple(value),), True
    if (
        isinstance(value, list)
        and value
        and all(isinstance(x, list) and all(_is_int(t) for t in x) for x in value)
    ):
        return tuple(tuple(x) for x in value), False
    if isinstance(value, list) and not value:
        raise Refused(f"{name} cannot be empty.")
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
        strings = [t for t in texts if isinstance(t, str)]
        if len(strings) != len(texts):
            raise BadRequest("a text content part needs a string `text`")
        return " ".join(strings)
    raise BadRequest("message content must be a string or a list of parts")


def _rooms(value: Any, prompts: int, single: bool) -> tuple[int, ...] | None:
    """One room per prompt, as `_normalize_bootstrap_params` hands them to the prompts."""
    if value is None:
        return None
    if _is_int(value):
        return tuple(value + i for i in range(prompts))  # a single request: just R
    if not isinstance(value, list) or not value or not all(_is_int(r) for r in value):
        raise BadRequest("bootstrap_room must be an integer or a list of integers")
    if single:
        # SGLang leaves a list on a single request and breaks later; say so at once instead
        raise BadRequest("bootstrap_room must be an integer for a single request")
    if len(value) < prompts:  # SGLang: an IndexError (500) when it reaches prompt len(value)
        raise BadRequest(f"bootstrap_room must be a list of at least {prompts} integers")
    return tuple(value[:prompts])  # further entries are never read (their samples reuse these)


def _scalar(value: Any, name: str) -> Any:
    if isinstance(value, list):  # the simulator serves one bootstrap host/port per request
        if not value or any(v != value[0] for v in value):
            raise BadRequest(f"{name} list must repeat one value (the simulator's limit)")
        return value[0]
    return value
