"""Tokenizing a prompt as the engine does, off the event loop.

The engine tokenizes with its model directory's `tokenizer.json` (HF fast tokenizer,
special tokens added, SGLang's `tokenizer_manager` `_tokenize_one_request`); the router loads the
same file with HF `tokenizers` (the Rust library the fast tokenizer wraps) from
`--tokenizer-path` (SMG 1.13's flag: a model directory or the file itself). It runs in a worker
thread, one at a time (`CapacityLimiter(1)`: a CPU budget of one core at most), and only for
prompts up to `MAX_CHARS` characters; longer ones are routed by the approximate tree.
"""

from __future__ import annotations

import os
from typing import Any

import trio

MAX_CHARS = 262_144  # characters of prompt tokenized at most (about 64k tokens)


class PromptTokenizer:
    def __init__(self, path: str) -> None:
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        from tokenizers import Tokenizer  # imported only when kv_aware is used (~10 ms)

        self.tokenizer: Any = Tokenizer.from_file(file)
        self.limiter = trio.CapacityLimiter(1)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=True).ids
        return ids

    async def tokens(self, text: str) -> list[int] | None:
        if len(text) > MAX_CHARS:
            return None
        return await trio.to_thread.run_sync(self.encode, text, limiter=self.limiter)
