"""What the router needs to know about a client's JSON body, read without a schema.

The router never re-serializes from a model: it reads a few keys and leaves the rest untouched.
"""

from __future__ import annotations

from typing import Any

GENERATE = "/generate"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
GENERATION_PATHS = (GENERATE, COMPLETIONS, CHAT)


def batch_size(path: str, payload: dict[str, Any]) -> int | None:
    """The number of sequences a request carries, or None for a single one (scalar bootstrap)."""
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
    if path == CHAT:
        n = payload.get("n")
        if isinstance(n, int) and not isinstance(n, bool) and n > 1:
            return n
    return None


def routing_text(path: str, payload: dict[str, Any]) -> str | None:
    """The text a cache-aware policy matches prefixes on: prompt, text or the conversation."""
    if path == GENERATE:
        value = payload.get("text")
    elif path == COMPLETIONS:
        value = payload.get("prompt")
    else:
        messages = payload.get("messages")
        if not isinstance(messages, list):
            return None
        parts = []
        for message in messages:
            if isinstance(message, dict):
                content = message.get("content")
                if isinstance(content, str):
                    parts.append(content)
                elif isinstance(content, list):
                    parts.extend(p["text"] for p in content if isinstance(p, dict) and "text" in p)
        return "\n".join(parts) or None
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[0], str):
        return value[0]
    return None


def wants_logprobs(path: str, payload: dict[str, Any]) -> bool:
    if path == GENERATE:
        return bool(payload.get("return_logprob"))
    return bool(payload.get("logprobs"))


def wants_stream(payload: dict[str, Any]) -> bool:
    return payload.get("stream") is True
