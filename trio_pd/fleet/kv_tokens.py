"""A request's prompt ids as the engine will make them, off the event loop.

The engine tokenizes with its model directory's `tokenizer.json` (HF fast tokenizer); the router
loads the same file with HF `tokenizers` (the Rust library the fast tokenizer wraps) from
`--tokenizer-path` (SMG 1.13's flag: a model directory or the file itself). Per route, as SGLang
0.5.23 does:
- `/generate` `text`, `/v1/completions` `prompt`: encoded with special tokens
  (`tokenizer_manager._tokenize_one_request`);
- `/generate` `input_ids`, a completions prompt of token ids, a chat request's `input_ids`: the
  ids themselves, nothing tokenized;
- `/v1/chat/completions` `messages`: the model's chat template (`kv_chat.py`), then encoded
  with special tokens only when the tokenizer adds none of its own.
The body is parsed again here (the router's inspection keeps only a capped routing text), in a
worker thread, one at a time (`CapacityLimiter(1)`: a CPU budget of one core at most); bodies
over `MAX_BODY_BYTES`, prompts over `MAX_CHARS` characters or `MAX_IDS` ids, media (whose tokens
the engine's processor adds), and anything not rendered as the engine would are routed by the
approximate tree (None).
"""

from __future__ import annotations

import os
from typing import Any

import orjson
import trio

from trio_pd.fleet.kv_chat import ChatTemplate, load_template

GENERATE = "/generate"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MAX_CHARS = 262_144  # characters of prompt tokenized at most (about 64k tokens)
MAX_IDS = 262_144  # token ids of a prompt taken at most
MAX_BODY_BYTES = 4 * MAX_CHARS  # bodies parsed at most (a chat's JSON around its text)
MEDIA_KEYS = ("image_data", "video_data", "audio_data")


class PromptTokenizer:
    def __init__(self, path: str) -> None:
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        from tokenizers import Tokenizer  # imported only when kv_aware is used (~10 ms)

        self.tokenizer: Any = Tokenizer.from_file(file)
        # SGLang's `_tokenizer_auto_adds_specials`: a rendered chat is then encoded without.
        self.adds_specials = len(self.tokenizer.encode("", add_special_tokens=True).ids) > 0
        self.chat: ChatTemplate | None = load_template(os.path.dirname(os.path.abspath(file)))
        self.limiter = trio.CapacityLimiter(1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int] | None:
        if len(text) > MAX_CHARS:
            return None
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def prompt_ids(self, path: str, body: bytes) -> list[int] | None:
        """The ids the engine will prefill for this single-prompt body, or None."""
        if len(body) > MAX_BODY_BYTES:
            return None
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(payload, dict):
            return None
        if path == CHAT:
            if payload.get("input_ids") is not None:
                return _ids(payload["input_ids"])
            if self.chat is None:
                return None
            text = self.chat.render(payload)
            return None if text is None else self.encode(text, not self.adds_specials)
        if path == GENERATE:
            text, ids = payload.get("text"), payload.get("input_ids")
            if text is not None and ids is not None:
                return None  # the engine refuses both
            if any(payload.get(k) not in (None, [], "") for k in MEDIA_KEYS):
                return None  # its media processor puts the media's own tokens in the prompt
        elif path == COMPLETIONS:
            text = ids = payload.get("prompt")
        else:
            return None
        if isinstance(text, str):
            return self.encode(text) if text else None
        return _ids(ids)

    async def tokens(self, path: str, body: bytes) -> list[int] | None:
        return await trio.to_thread.run_sync(self.prompt_ids, path, body, limiter=self.limiter)


def _ids(value: Any) -> list[int] | None:
    """A list of token ids as given, or None (empty, too long, not all ids)."""
    if not isinstance(value, list) or not value or len(value) > MAX_IDS:
        return None
    for item in value:
        if type(item) is not int or item < 0:
            return None
    return value
