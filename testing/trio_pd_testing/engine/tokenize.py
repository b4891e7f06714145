"""POST /tokenize, /v1/tokenize, /detokenize and /v1/detokenize (SGLang 0.5.23's
`entrypoints/openai/serving_tokenize.py`).

A prompt (a string, or a list of them) is tokenized as the engine tokenizes a text prompt, chat
`messages` as a chat request renders them (`workload.py`: one id per whitespace word); the
answer is `{"tokens", "count", "max_model_len"}`. Exactly one of `prompt` and `messages`, else
a 400 error object (the engine's `validate_tokenize_input`). A router migrating a request asks
this for the prompt's ids, the engine's own (`pd/migration.py`).

/detokenize takes `tokens` (a list of ids, or a list of such lists) and answers `{"text"}` (a
string, or one per list), decoded with the simulator's vocabulary (`detokenize.py`); a router
migrating a request asks it where the text of the ids already sent ends.
"""

from __future__ import annotations

from typing import Any

import orjson

from trio_pd_testing.engine.asgi import Responder
from trio_pd_testing.engine.detokenize import decode
from trio_pd_testing.engine.failures import read_post_body
from trio_pd_testing.engine.state import EngineState
from trio_pd_testing.engine.workload import BadRequest, _content_text, text_ids

PATHS = ("/tokenize", "/v1/tokenize", "/detokenize", "/v1/detokenize")
DETOKENIZE_PATHS = ("/detokenize", "/v1/detokenize")


async def handle_tokenize(engine: EngineState, scope: dict[str, Any], receive: Any, send: Any):
    resp = Responder(send)
    raw = await read_post_body(scope, receive, resp)
    if raw is None:
        return
    try:
        body = orjson.loads(raw or b"null")
        if scope["path"] in DETOKENIZE_PATHS:
            answer = detokenize(body, engine.config.multibyte_tokens)
        else:
            answer = tokenize(body, engine.config.context_length)
    except (orjson.JSONDecodeError, BadRequest) as exc:
        await resp.json(400, _error(str(exc)))
        return
    if "text" in answer:
        texts = answer["text"]
        engine.events.emit("detokenize", lists=len(texts) if isinstance(texts, list) else 1,
                           dp_rank=None)  # fmt: skip
    else:
        engine.events.emit("tokenize", count=answer["count"], dp_rank=None)
    await resp.json(200, answer)


def tokenize(body: Any, context_length: int) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("the body must be an object")
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise BadRequest("Exactly one of 'prompt' or 'messages' must be provided.")
    if messages is not None:
        if not isinstance(messages, list):
            raise BadRequest("messages must be a list")
        ids = list(text_ids(" ".join(_content_text(m) for m in messages)))
        return {"tokens": ids, "count": len(ids), "max_model_len": context_length}
    if isinstance(prompt, str):
        ids = list(text_ids(prompt))
        return {"tokens": ids, "count": len(ids), "max_model_len": context_length}
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        lists = [list(text_ids(p)) for p in prompt]
        return {"tokens": lists, "count": [len(x) for x in lists], "max_model_len": context_length}
    raise BadRequest(f"Invalid prompt type: {type(prompt)}. Expected str or List[str].")


def detokenize(body: Any, multibyte: bool) -> dict[str, Any]:
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list):
        raise BadRequest("tokens must be a list of integers or a list of such lists")
    if tokens and all(_is_id(t) for t in tokens):
        return {"text": decode(tokens, multibyte)}
    if tokens and all(isinstance(x, list) and all(_is_id(t) for t in x) for x in tokens):
        return {"text": [decode(x, multibyte) for x in tokens]}
    if not tokens:
        return {"text": ""}
    raise BadRequest("Invalid input: 'tokens' must be a list of integers.")


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _error(message: str) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": "BadRequest", "param": None,
            "code": 400}  # fmt: skip
