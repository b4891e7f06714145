"""POST /tokenize and /v1/tokenize (`entrypoints/openai/serving_tokenize.py`, SGLang 0.5.23).

A prompt (a string, or a list of them) is tokenized as the engine tokenizes a text prompt, chat
`messages` as a chat request renders them (`workload.py`: one id per whitespace word); the
answer is `{"tokens", "count", "max_model_len"}`. Exactly one of `prompt` and `messages`, else
a 400 error object (the engine's `validate_tokenize_input`). A router migrating a request asks
this for the prompt's ids, the engine's own (`pd/migration.py`).
"""

from __future__ import annotations

from typing import Any

import orjson

from trio_pd_testing.engine.asgi import Responder
from trio_pd_testing.engine.failures import read_post_body
from trio_pd_testing.engine.state import EngineState
from trio_pd_testing.engine.workload import BadRequest, _content_text, text_ids

PATHS = ("/tokenize", "/v1/tokenize")


async def handle_tokenize(engine: EngineState, scope: dict[str, Any], receive: Any, send: Any):
    resp = Responder(send)
    raw = await read_post_body(scope, receive, resp)
    if raw is None:
        return
    try:
        answer = tokenize(orjson.loads(raw or b"null"), engine.config.context_length)
    except (orjson.JSONDecodeError, BadRequest) as exc:
        await resp.json(400, _error(str(exc)))
        return
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


def _error(message: str) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": "BadRequest", "param": None,
            "code": 400}  # fmt: skip
