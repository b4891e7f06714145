"""Response bodies in SGLang's native (/generate) and OpenAI shapes, whole and streamed.

Logprobs are deterministic fakes. Prefill answers carry `meta_info.input_token_logprobs` for every
input token; decode answers carry an empty list there (a PD router merges prefill's in front).
OpenAI bodies get the same `meta_info` (input logprobs, abort reason) as a simulator extension,
so a router's merge and in-band abort detection can be exercised on every endpoint.
"""

from __future__ import annotations

import time
from typing import Any

from trio_pd.testing.engine.workload import Workload, output_id, output_text

ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailable",
}


def error_body(message: str, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(code, "Error"), "code": code}}


def logprob(token_id: int) -> float:
    return -round(0.01 + (token_id % 97) / 10.0, 4)


def triples(ids: list[int] | tuple[int, ...]) -> list[list[Any]]:
    return [[logprob(t), t, None] for t in ids]


def top_triples(ids: list[int] | tuple[int, ...], k: int) -> list[list[list[Any]]]:
    return [[[logprob(t + j), t + j, None] for j in range(k)] for t in ids]


class Shaper:
    """Builds every body of one request; `role` decides whose input logprobs are reported.

    Ids (`meta_info.id`, the OpenAI `id`): the body's rids when the client sent some (one per
    item, as SGLang reports them), else the x-request-id (`<id>-<index>` for batch items).
    """

    def __init__(
        self,
        workload: Workload,
        rid: str,
        model: str,
        role: str,
        item_ids: tuple[str, ...] | None = None,
    ) -> None:
        self.w = workload
        self.item_ids = item_ids
        self.rid = item_ids[0] if item_ids else rid
        self.model = workload.model or model
        self.role = role
        self.created = int(time.time())
        self.out_tokens = 1 if role == "prefill" else workload.max_new_tokens

    # ---- helpers -------------------------------------------------------------------------
    def item_id(self, index: int) -> str:
        if self.item_ids:
            return self.item_ids[index]
        return f"{self.rid}-{index}" if self.w.is_batch else self.rid

    def _input_meta(self, index: int) -> dict[str, Any]:
        meta: dict[str, Any] = {}
        if not self.w.logprobs:
            return meta
        ids = self.w.inputs[index] if self.role == "prefill" else ()
        meta["input_token_logprobs"] = triples(ids)
        if self.w.top_logprobs:
            meta["input_top_logprobs"] = top_triples(ids, self.w.top_logprobs)
        return meta

    def meta_info(self, index: int, done: int, finish: dict[str, Any] | None) -> dict[str, Any]:
        ids = [output_id(i) for i in range(1, done + 1)]
        meta: dict[str, Any] = {
            "id": self.item_id(index),
            "finish_reason": finish,
            "prompt_tokens": len(self.w.inputs[index]),
            "completion_tokens": done,
            "cached_tokens": 0,
            "weight_version": "default",
        }
        if self.w.logprobs:
            meta.update(self._input_meta(index))
            meta["output_token_logprobs"] = triples(ids)
            if self.w.top_logprobs:
                meta["output_top_logprobs"] = top_triples(ids, self.w.top_logprobs)
        return meta

    def length_finish(self) -> dict[str, Any]:
        return {"type": "length", "length": self.out_tokens}

    @staticmethod
    def abort_finish(message: str, status_code: int | None = None) -> dict[str, Any]:
        finish: dict[str, Any] = {"type": "abort", "message": message}
        if status_code is not None:  # SGLang's way of saying whose fault the abort was
            finish["status_code"] = status_code
        return finish

    def _usage(self, completion: int | None = None) -> dict[str, Any]:
        prompt = sum(len(i) for i in self.w.inputs)
        if self.w.api == "chat":
            prompt = len(self.w.inputs[0])  # n choices share one prompt
        done = self.out_tokens * self.w.size if completion is None else completion
        return {
            "prompt_tokens": prompt,
            "completion_tokens": done,
            "total_tokens": prompt + done,
            "prompt_tokens_details": None,
        }

    def _openai_meta(self, abort: str | None = None, code: int | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {}
        if self.w.logprobs:
            meta.update(self._input_meta(0))
        if abort is not None:
            meta["finish_reason"] = self.abort_finish(abort, code)
        return meta

    def _completion_logprobs(self, start: int, stop: int) -> dict[str, Any]:
        tokens = [f"tok{i}" if i == 1 else f" tok{i}" for i in range(start, stop + 1)]
        offsets, pos = [], len(output_text(start - 1)) if start > 1 else 0
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        top = None
        if self.w.top_logprobs:
            top = [
                {f"tok{i}+{j}": logprob(output_id(i) + j) for j in range(self.w.top_logprobs)}
                for i in range(start, stop + 1)
            ]
        return {
            "tokens": tokens,
            "token_logprobs": [logprob(output_id(i)) for i in range(start, stop + 1)],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _chat_logprobs(self, start: int, stop: int) -> dict[str, Any]:
        content = []
        for i in range(start, stop + 1):
            tok = f"tok{i}" if i == 1 else f" tok{i}"
            content.append(
                {
                    "token": tok,
                    "logprob": logprob(output_id(i)),
                    "bytes": list(tok.encode()),
                    "top_logprobs": [
                        {
                            "token": f"{tok}+{j}",
                            "logprob": logprob(output_id(i) + j),
                            "bytes": list(f"{tok}+{j}".encode()),
                        }
                        for j in range(self.w.top_logprobs)
                    ],
                }
            )
        return {"content": content}

    # ---- whole bodies ----------------------------------------------------------------------
    def full(self, abort: str | None = None, abort_code: int | None = None) -> Any:
        """The non-stream body: a completed answer, or an in-band abort."""
        done = 0 if abort is not None else self.out_tokens
        if self.w.api == "generate":
            if abort is not None:
                finish = self.abort_finish(abort, abort_code)
            else:
                finish = self.length_finish()
            items = [
                {
                    "text": output_text(done),
                    "output_ids": [output_id(i) for i in range(1, done + 1)],
                    "meta_info": self.meta_info(i, done, finish),
                }
                for i in range(self.w.size)
            ]
            return items if self.w.is_batch else items[0]
        finish_s = "abort" if abort is not None else "length"
        choices: list[dict[str, Any]] = []
        for i in range(self.w.size):
            choice: dict[str, Any] = {"index": i}
            if self.w.api == "chat":
                choice["message"] = {
                    "role": "assistant",
                    "content": output_text(done),
                    "reasoning_content": None,
                    "tool_calls": None,
                }
                lp = self._chat_logprobs(1, done) if self.w.logprobs else None
            else:
                choice["text"] = output_text(done)
                lp = self._completion_logprobs(1, done) if self.w.logprobs else None
            choice.update({"logprobs": lp, "finish_reason": finish_s, "matched_stop": None})
            choices.append(choice)
        body: dict[str, Any] = {
            "id": self.rid,
            "object": "chat.completion" if self.w.api == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(done * self.w.size),
        }
        meta = self._openai_meta(abort, abort_code)
        if meta:
            body["meta_info"] = meta
        return body

    # ---- stream events ---------------------------------------------------------------------
    def stream_start(self) -> list[Any]:
        """Events sent before the first token (OpenAI chat: the role delta)."""
        if self.w.api != "chat":
            return []
        events = []
        for i in range(self.w.size):
            chunk = self._chunk(i, {"role": "assistant", "content": ""}, None, None)
            if i == 0:
                meta = self._openai_meta()
                if meta:
                    chunk["meta_info"] = meta
            events.append(chunk)
        return events

    def token_event(self, index: int, k: int) -> Any:
        """The event carrying item `index`'s k-th token (1-based)."""
        last = k == self.out_tokens
        if self.w.api == "generate":
            event: dict[str, Any] = {
                "text": output_text(k),
                "output_ids": [output_id(i) for i in range(1, k + 1)],
                "meta_info": self.meta_info(index, k, self.length_finish() if last else None),
            }
            if self.w.is_batch:
                event["index"] = index
            return event
        piece = f"tok{k}" if k == 1 else f" tok{k}"
        if self.w.api == "chat":
            lp = self._chat_logprobs(k, k) if self.w.logprobs else None
            return self._chunk(index, {"content": piece}, lp, None)
        lp = self._completion_logprobs(k, k) if self.w.logprobs else None
        chunk = self._chunk(index, None, lp, "length" if last else None, text=piece)
        if k == 1 and index == 0:
            meta = self._openai_meta()
            if meta:
                chunk["meta_info"] = meta
        return chunk

    def stream_end(self) -> list[Any]:
        """Events after the last token (chat: finish chunks; OpenAI: optional usage chunk)."""
        events: list[Any] = []
        if self.w.api == "chat":
            events += [self._chunk(i, {}, None, "length") for i in range(self.w.size)]
        if self.w.api != "generate" and self.w.include_usage:
            usage_chunk = self._chunk(0, None, None, None)
            usage_chunk["choices"] = []
            usage_chunk["usage"] = self._usage()
            events.append(usage_chunk)
        return events

    def abort_event(self, message: str, code: int | None = None) -> Any:
        if self.w.api == "generate":
            return {
                "text": "",
                "output_ids": [],
                "meta_info": self.meta_info(0, 0, self.abort_finish(message, code)),
            }
        chunk = self._chunk(0, {} if self.w.api == "chat" else None, None, "abort", text="")
        chunk["meta_info"] = self._openai_meta(message, code)
        return chunk

    def _chunk(
        self,
        index: int,
        delta: dict[str, Any] | None,
        logprobs: Any,
        finish: str | None,
        text: str | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self.w.api == "chat":
            choice["delta"] = delta if delta is not None else {}
        else:
            choice["text"] = text or ""
        choice.update({"logprobs": logprobs, "finish_reason": finish, "matched_stop": None})
        return {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.w.api == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": None,
        }
