"""One answer out of two streams: what the client got, and the resumed stream made to follow it.

A migrated stream (`migration.py`) is the broken decode's events up to the last one the client
got whole, then the resumed attempt's. `Transcript` records the first part as it is relayed
(the ids, the text, the counts) and rewrites the second so the client reads one answer: no token
twice or missing, the counts of the whole answer, the prompt of the original request.

Each attempt has its own engine rid, which the engine writes into its events (`meta_info.id`,
an OpenAI chunk's `id`): resumed events carry the first attempt's, the answer's one id.

Per route, as SGLang 0.5.23 streams it (checked on the real pair, docs/protocol.md §13):

- `/generate`: each event carries `text`, `output_ids` and `meta_info` (`completion_tokens`,
  `prompt_tokens`, `finish_reason`). By default both `text` and `output_ids` are the whole
  answer so far (`managers/tokenizer_manager.py` `_handle_batch_output`); with the engine's
  `--incremental-streaming-output` they are each event's own. An event's ids are the whole
  answer when they are as many as `completion_tokens`, else a delta: that reads both modes.
  Resumed events get the ids and text already sent in front (whole-answer mode), and every
  count the tokens already sent added: `completion_tokens`, a `length` finish's `length`;
  `prompt_tokens` is the original prompt's.
- `/v1/completions`: each chunk's `choices[0].text` is a delta; the router asks for
  `return_token_ids` (each chunk's `token_ids`, the first one's `prompt_token_ids`) and takes
  them out again unless the client asked. Resumed chunks keep the original's `created`; the
  usage chunk counts the original prompt and both attempts' tokens.

Only whole events reach the client during a migratable stream, so "what the client got" is a
list of events, never half of one.

A resume from a seam (`migration.py`: the break fell inside a character of several bytes, and
a greedy request resumes from the last id after which the text is whole) starts the resumed
attempt's view there: the answer is the seam's ids and text, then the resumed attempt's. Its
first ids come again and its first text may be a printable prefix the client already has (or
the client may lack text the engine held back): each resumed event gives the client only what
lies past what it got, and an event with nothing past it (no new id, no new text, no finish)
is dropped. The client's ids therefore never repeat and never go missing.
"""

from __future__ import annotations

import contextlib
from typing import Any

import attrs
import orjson

from trio_pd.pd.payload import COMPLETIONS, GENERATE

ROUTER_IDS_KEYS = ("token_ids", "prompt_token_ids")


@attrs.define
class Transcript:
    """The answer the client has got so far, across attempts."""

    path: str
    strip_ids: bool = False  # completions: the router asked for token ids, the client did not
    ids: list[int] = attrs.Factory(list)  # output ids the client got (exact, the engine's)
    text: str = ""  # the text the client got
    prompt_ids: list[int] | None = None  # completions: the engine's own ids of the prompt
    prompt_tokens: int | None = None  # the original prompt's token count
    created: int | None = None  # completions: the first chunk's `created`
    answer_id: str | None = None  # the answer's id (the engine rid of the first attempt)
    finished: bool = False  # a finish reason went out
    # The resumed attempt's view: the answer's tokens and text before it began (up to the
    # seam: perhaps fewer than the client got), and its own so far.
    base_ids: list[int] = attrs.Factory(list)
    base_text: str = ""
    local_ids: list[int] = attrs.Factory(list)
    local_text: str = ""
    cumulative: bool | None = None  # /generate: whole-answer events (None: not yet known)
    attempts: int = 1
    # /generate, first attempt, whole-answer events: the last event's data, parsed only when a
    # break asks (`settle`): each event carries every id so far, so parsing them all would
    # cost the stream's length squared.
    deferred: bytes | None = None

    @property
    def sent(self) -> int:
        self.settle()
        return len(self.ids)

    def defer(self, data: bytes) -> bool:
        """Keep a /generate event unparsed when the next one would make it moot: True when
        kept (the event goes to the client as it came)."""
        if self.path == GENERATE and self.cumulative is True and not self.resumed:
            self.deferred = data
            return True
        return False

    def settle(self) -> None:
        """Read the deferred event, if any: the transcript is then up to date."""
        data, self.deferred = self.deferred, None
        if data is not None:
            with contextlib.suppress(orjson.JSONDecodeError):
                self.relay(orjson.loads(data))

    def resume(self, keep: int | None = None, text: str | None = None) -> None:
        """The next events come from a resumed attempt, which continues the client's first
        `keep` ids, whose text is `text` (a seam; by default all the client got)."""
        self.settle()
        self.base_ids = self.ids[:keep] if keep is not None else list(self.ids)
        self.base_text = self.text if text is None else text
        self.local_ids = []
        self.local_text = ""
        self.attempts += 1

    @property
    def resumed(self) -> bool:
        return self.attempts > 1

    def relay(self, event: Any) -> Any:
        """The event as the client must get it (rewritten when resumed), recorded as sent;
        None when a resumed event holds nothing the client has not got (dropped)."""
        self.deferred = None  # this event is newer: a deferred one is moot
        if not isinstance(event, dict):
            return event
        if self.path == GENERATE:
            return self._generate(event)
        if self.path == COMPLETIONS:
            return self._completions(event)
        return event

    # -- /generate ----------------------------------------------------------------------------

    def _generate(self, event: dict[str, Any]) -> dict[str, Any] | None:
        meta = event.get("meta_info")
        ids = event.get("output_ids")
        if not isinstance(meta, dict) or not isinstance(ids, list):
            return event
        count = meta.get("completion_tokens")
        text = event.get("text")
        text = text if isinstance(text, str) else ""
        whole = isinstance(count, int) and len(ids) == count
        # a second event with new tokens tells the modes apart
        news = isinstance(count, int) and count > len(self.local_ids)
        if self.cumulative is None and self.local_ids and news:
            self.cumulative = whole
        if whole:
            self.local_ids = list(ids)
            grown = text if text.startswith(self.local_text) else self.local_text + text
        else:
            self.local_ids = [*self.local_ids, *ids]
            grown = self.local_text + text
        self.local_text = grown
        new_ids, new_text = self.advance()
        if self.prompt_tokens is None:
            self.prompt_tokens = meta.get("prompt_tokens")
        if self.answer_id is None and isinstance(meta.get("id"), str):
            self.answer_id = meta["id"]
        finish = meta.get("finish_reason")
        if finish is not None:
            self.finished = True
        if not self.resumed:
            return event
        if not new_ids and not new_text and finish is None:
            return None  # ids generated again, text the client has
        out = dict(event)
        if self.cumulative is not False:  # whole-answer events (SGLang's default)
            out["output_ids"] = list(self.ids)
            out["text"] = self.text
        else:
            out["output_ids"] = new_ids
            out["text"] = new_text
        new_meta = dict(meta)
        if self.answer_id is not None and "id" in meta:
            new_meta["id"] = self.answer_id
        base = len(self.base_ids)
        if isinstance(count, int):
            new_meta["completion_tokens"] = max(base + count, len(self.ids))
        if self.prompt_tokens is not None:
            new_meta["prompt_tokens"] = self.prompt_tokens
        if isinstance(finish, dict) and isinstance(finish.get("length"), int):
            new_meta["finish_reason"] = {**finish, "length": base + finish["length"]}
        out["meta_info"] = new_meta
        return out

    def advance(self) -> tuple[list[int], str]:
        """The answer is the base and the attempt's own; the client gets what lies past what
        it got (recorded): the new ids and the new text."""
        new_ids = self.local_ids[len(self.ids) - len(self.base_ids) :]
        owed = len(self.text) - len(self.base_text)  # < 0: text the engine had held back
        if owed >= 0:
            new_text = self.local_text[owed:]
        else:
            new_text = self.base_text[len(self.text) :] + self.local_text
        if new_ids:
            self.ids.extend(new_ids)
        if new_text:
            self.text += new_text
        return new_ids, new_text

    # -- /v1/completions ----------------------------------------------------------------------

    def _completions(self, event: dict[str, Any]) -> dict[str, Any] | None:
        choices = event.get("choices")
        out = event
        changed = False
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            choice = choices[0]
            token_ids = choice.get("token_ids")
            if isinstance(token_ids, list):
                self.local_ids.extend(token_ids)
            prompt_ids = choice.get("prompt_token_ids")
            if isinstance(prompt_ids, list) and self.prompt_ids is None:
                self.prompt_ids = list(prompt_ids)
                self.prompt_tokens = len(prompt_ids)
            text = choice.get("text")
            if isinstance(text, str):
                self.local_text += text
            new_ids, new_text = self.advance()
            finish = choice.get("finish_reason")
            if finish is not None:
                self.finished = True
            nothing = not new_ids and not new_text and finish is None
            if self.resumed and nothing and not isinstance(event.get("usage"), dict):
                return None  # ids generated again, text the client has
            if self.resumed and (new_ids != token_ids or new_text != text):
                # a seam: the client gets only what lies past what it got
                choice = {**choice, "text": new_text}
                if isinstance(token_ids, list):
                    choice["token_ids"] = new_ids
                out = {**event, "choices": [choice, *choices[1:]]}
                changed = True
            # The router's ids go; a resumed attempt's prompt ids (the prompt plus the tokens
            # already sent) too: the client got the original prompt's.
            cut = ROUTER_IDS_KEYS if self.strip_ids else ("prompt_token_ids",)
            if (self.strip_ids or self.resumed) and any(key in choice for key in cut):
                choice = {k: v for k, v in choice.items() if k not in cut}
                out = {**event, "choices": [choice, *choices[1:]]}
                changed = True
        if self.created is None and isinstance(event.get("created"), int):
            self.created = event["created"]
        if self.answer_id is None and isinstance(event.get("id"), str):
            self.answer_id = event["id"]
        if not self.resumed:
            return out
        if not changed:
            out = dict(event)
        if self.created is not None and "created" in out:
            out["created"] = self.created
        if self.answer_id is not None and "id" in out:
            out["id"] = self.answer_id
        usage = out.get("usage")
        if isinstance(usage, dict):
            out["usage"] = self.usage(usage)
        return out

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """A resumed attempt's usage as the whole answer's: the original prompt, all tokens."""
        fixed = dict(usage)
        completion = usage.get("completion_tokens")
        if isinstance(completion, int):
            fixed["completion_tokens"] = len(self.base_ids) + completion
        if self.prompt_tokens is not None:
            fixed["prompt_tokens"] = self.prompt_tokens
        if isinstance(fixed.get("prompt_tokens"), int) and isinstance(
            fixed.get("completion_tokens"), int
        ):
            fixed["total_tokens"] = fixed["prompt_tokens"] + fixed["completion_tokens"]
        return fixed
