"""Migration (issue 29): whether a request whose decode broke may resume, and the resumed body.

A decode that breaks after its prefill succeeded (reset, a dead engine, an engine aborting the
request while it shuts down, silence past `--stream-idle-timeout-secs`) costs the client its
answer today. Migration runs the request again on a fresh pair with the prompt plus the tokens
the client already got as the new prompt (`input_ids`: token-exact, the engine's own ids) and
the token budget reduced by as many, under the same rid; `stitch.py` makes the two streams one.

Everything here is pure (the client's parsed body, the ids; no I/O):

- `refusal(path, body, stream, engine)`: why a request may NOT resume (a `REFUSALS` key), or
  None. Refused is whatever resuming would change: structured output (the grammar's state is
  lost), penalties and stop strings (the engine counts and matches them over the output only,
  and the tokens already sent would be prompt to it), logprobs (positions and input logprobs
  are relative to the new prompt), batches and media, prompt truncation, and a chat stream
  (SGLang 0.5.23's chunks carry no token ids: `return_token_ids` is refused with `stream` on
  chat, `serving_chat.py`; `sglext.output_ids` comes only with the last chunk; on vLLM 0.32
  see docs/vllm.md §10). A pair whose engine does not resume (`Engine.RESUMES`) is refused.
- `resume_body(path, body, prompt_ids, sent_ids)`: the body of the resumed attempt (the
  router then splices its bootstrap fields and the same rid in, as for any attempt).
- `seam_lists` / `seam_of`: where the resumed prompt ends when the break fell inside a
  character of several UTF-8 bytes (below).

The seam. SGLang's detokenizer sends a character's text only once all its bytes arrived (until
then only a printable prefix, up to the last space: `detokenizer_manager.py`, the "\ufffd"
branch), and it decodes a request behind the last ids of its prompt. A resumed prompt that ends
inside a character would put the character's first bytes in that window: its text would never
be sent. So a greedy request resumes from the last id after which the text is whole (the
"seam"), the ids after it are generated again (greedy: the same ones; the stitcher drops the
ids and the text the client already has), and the resumed text continues the seam's exactly.
Where that is depends on the tokenizer, so the engine's own `/detokenize` says, in one call at
the resume (`seam_lists`: the answer's whole text, and for each of the last `SEAM_TOKENS` ends
the ids just before it and the ids after it; `seam_of` reads the answer). A sampled request
keeps every id sent (its tail would not come again), at the cost of that character's text.

What is exact: under greedy decoding the resumed tokens are the ones the broken decode would
have sent (checked on the real pair, docs/protocol.md §13). Sampling with temperature > 0
continues from the same context with another random state: a valid answer, not the same one.
"""

from __future__ import annotations

from typing import Any

import attrs

from trio_pd.pd.payload import CHAT, COMPLETIONS, GENERATE

# SGLang 0.5.23's defaults when a body does not say (`sampling/sampling_params.py`
# `max_new_tokens: 128`; `entrypoints/openai/protocol.py` CompletionRequest `max_tokens: 16`);
# vLLM 0.32's CompletionRequest says 16 too (`entrypoints/openai/completion/protocol.py`).
GENERATE_DEFAULT_MAX_NEW_TOKENS = 128
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

# Why a request is not resumed: the `outcome` label of trio_pd_migrations_total is
# `refused_<key>`; the value is what the docs and the log say.
REFUSALS: dict[str, str] = {
    "engine": "the pair's engine does not resume streams (`Engine.RESUMES`)",
    "batch": "a batch of prompts",
    "multimodal": "images, audio or video in the prompt",
    "structured_output": "structured output (json_schema, regex, ebnf, structural_tag, "
    "response_format): the grammar's state cannot be carried over",
    "logprobs": "logprobs: positions and input logprobs would be those of the new prompt",
    "penalty": "frequency, presence or repetition penalties: the engine counts them over its "
    "own output only",
    "stop_strings": "stop strings: one spanning the break would go unmatched",
    "chat_stream": "a chat stream: SGLang 0.5.23's chat chunks carry no token ids; on vLLM "
    "0.32 a token-exact resume is a completions request, which runs no chat template, "
    "reasoning or tool parser (docs/vllm.md §10)",
    "truncation": "truncate_prompt_tokens: the engine would cut the resumed prompt (the "
    "prompt plus the tokens sent) elsewhere",
    "continuous_usage": "stream_options.continuous_usage_stats: per-chunk counts would restart",
    "echo": "echo or suffix on completions",
    "engine_state": "hidden states, routed experts, sessions, beam search or a custom logit "
    "processor",
    "budget_spent": "every token was already sent",
}

STRUCTURED_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")
STRUCTURED_FORMATS = ("json_schema", "json_object", "structural_tag")
STATE_KEYS = (
    "return_hidden_states",
    "return_routed_experts",
    "session_params",
    "custom_logit_processor",
    "input_embeds",
)
MULTIMODAL_KEYS = ("image_data", "video_data", "audio_data")


def sampling_of(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """Where the sampling options live: /generate's `sampling_params`, else the body itself."""
    if path == GENERATE:
        params = body.get("sampling_params")
        return params if isinstance(params, dict) else {}
    return body


def refusal(path: str, body: dict[str, Any], stream: bool) -> str | None:
    """Why this request may not resume after its decode broke (a `REFUSALS` key), or None."""
    if path == GENERATE:
        if isinstance(body.get("text"), list) or _nested(body.get("input_ids")):
            return "batch"
        if isinstance(body.get("sampling_params"), list):
            return "batch"
        if any(body.get(key) not in (None, [], "") for key in MULTIMODAL_KEYS):
            return "multimodal"
    if path == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            return "batch"
        if body.get("echo") or body.get("suffix"):
            return "echo"
    if path == CHAT and _has_media(body.get("messages")):
        return "multimodal"
    params = sampling_of(path, body)
    if any(params.get(key) not in (None, "") for key in STRUCTURED_KEYS):
        return "structured_output"
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") in STRUCTURED_FORMATS:
        return "structured_output"
    if _logprobs(path, body):
        return "logprobs"
    if (params.get("frequency_penalty") or 0) != 0 or (params.get("presence_penalty") or 0) != 0:
        return "penalty"
    if params.get("repetition_penalty") not in (None, 1, 1.0):
        return "penalty"
    if params.get("stop") or params.get("stop_regex"):
        return "stop_strings"
    if any(body.get(key) for key in STATE_KEYS) or (params.get("beam_width") or 1) > 1:
        return "engine_state"
    if body.get("truncate_prompt_tokens") is not None:
        return "truncation"
    if stream and path == CHAT:
        return "chat_stream"
    options = body.get("stream_options")
    if stream and isinstance(options, dict) and options.get("continuous_usage_stats"):
        return "continuous_usage"
    return None


def _nested(ids: Any) -> bool:
    return isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)


def _has_media(messages: Any) -> bool:
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            isinstance(part, dict) and part.get("type", "text") != "text" for part in content
        ):
            return True
    return False


def _logprobs(path: str, body: dict[str, Any]) -> bool:
    if path == GENERATE:
        return bool(body.get("return_logprob"))
    value = body.get("logprobs")
    return value is not None and value is not False


def token_budget(path: str, body: dict[str, Any]) -> int:
    """The output tokens the client asked for, the engine's default when it did not say."""
    if path == GENERATE:
        value = sampling_of(path, body).get("max_new_tokens")
        default = GENERATE_DEFAULT_MAX_NEW_TOKENS
    else:
        value = body.get("max_completion_tokens") if path == CHAT else None
        value = value if value is not None else body.get("max_tokens")
        default = COMPLETIONS_DEFAULT_MAX_TOKENS
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def resume_body(
    path: str, body: dict[str, Any], prompt_ids: list[int], sent_ids: list[int]
) -> dict[str, Any]:
    """The resumed attempt's body: the prompt's ids plus the ids already sent as the prompt,
    the budget (and any minimum) reduced by as many; everything else as the client sent it.

    /generate resumes on /generate (`input_ids`), completions on completions (a token-id
    `prompt`, which SGLang's CompletionRequest accepts). A chat request reaches here only
    without a stream (nothing was sent): it runs again as it came.
    """
    sent = len(sent_ids)
    if path == CHAT or not sent:
        return dict(body)
    ids = [*prompt_ids, *sent_ids]
    remaining = token_budget(path, body) - sent
    if path == GENERATE:
        params = dict(sampling_of(path, body))
        params["max_new_tokens"] = remaining
        if params.get("min_new_tokens"):
            params["min_new_tokens"] = max(0, params["min_new_tokens"] - sent)
        out = {k: v for k, v in body.items() if k not in ("text", "input_ids")}
        out["input_ids"] = ids
        out["sampling_params"] = params
        return out
    out = {k: v for k, v in body.items() if k != "max_completion_tokens"}
    out["prompt"] = ids
    out["max_tokens"] = remaining
    if out.get("min_tokens"):
        out["min_tokens"] = max(0, out["min_tokens"] - sent)
    return out


# SGLang decodes a request's first output behind its prompt's last 5 ids
# (`schedule_batch.py` INIT_INCREMENTAL_DETOKENIZATION_OFFSET).
DETOKENIZE_CONTEXT = 5
SEAM_TOKENS = 8  # the last ends of the sent ids a seam is looked for among
# Ids decoded before an end to see whether it cuts a character: UTF-8 resynchronizes within 4
# bytes and a token has at least one (a skipped special token none: the margin).
SEAM_WINDOW = 8
REPLACEMENT = "\ufffd"  # how a fast tokenizer decodes cut or invalid UTF-8
SAMPLING_EPS = 1e-6  # SGLang: temperature below it is greedy (`sampling_params.py`)


def greedy(path: str, body: dict[str, Any]) -> bool:
    """Whether the engine decodes greedily (temperature 0 or top_k 1, as SGLang reads them):
    the ids after a seam then come again, the same ones."""
    params = sampling_of(path, body)
    temperature, top_k = params.get("temperature"), params.get("top_k")
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        temperature = None
    if temperature is not None and 0 <= temperature < SAMPLING_EPS:
        return True
    return top_k == 1 and not isinstance(top_k, bool)


def skip_special_tokens(path: str, body: dict[str, Any]) -> Any:
    """The request's `skip_special_tokens` (None: the engine's default), for /detokenize."""
    return sampling_of(path, body).get("skip_special_tokens")


@attrs.frozen
class Seam:
    """Where a resumed prompt ends: the first `keep` ids sent, whose text is `text`."""

    keep: int
    text: str


def seam_ends(sent: int) -> list[int]:
    """The ends looked at, last first: every id sent, then one fewer, ... (0: none kept)."""
    return list(range(sent, max(0, sent - SEAM_TOKENS) - 1, -1))


def seam_lists(prompt_ids: list[int], sent_ids: list[int]) -> list[list[int]]:
    """The id lists `/detokenize` decodes for `seam_of`: the prompt's context and the answer,
    the context alone, then per end (`seam_ends`) the ids just before it and the ids after it."""
    context = prompt_ids[-DETOKENIZE_CONTEXT:]
    lists = [[*context, *sent_ids], list(context)]
    for end in seam_ends(len(sent_ids)):
        lists.append(sent_ids[max(0, end - SEAM_WINDOW) : end])
        lists.append(sent_ids[end:])
    return lists


def seam_of(texts: Any, sent: int, client_text: str) -> Seam | None:
    """The last end after which the text is whole, from `/detokenize`'s answer to `seam_lists`
    (`texts`); None when the answer is not one, no end in reach is whole, or the text the
    client got does not fit the engine's there (then nothing is changed).

    An end is whole when the ids before it decode without a cut character at the end (an end
    with no id before it is the prompt's). The text up to a whole end is the answer's text
    less that of the ids after it (UTF-8 decodes piecewise at a whole end); the engine sent
    the client that text, short of what it held back, plus perhaps a printable prefix of the
    next character's (the seam must agree with it)."""
    ends = seam_ends(sent)
    if not isinstance(texts, list) or len(texts) != 2 + 2 * len(ends):
        return None
    if not all(isinstance(t, str) for t in texts):
        return None
    whole, context = texts[0], texts[1]
    if not whole.startswith(context):
        return None
    answer = whole[len(context) :]
    for i, end in enumerate(ends):
        before, after = texts[2 + 2 * i], texts[3 + 2 * i]
        if end and (not before or before.endswith(REPLACEMENT)):
            continue
        if not answer.endswith(after):
            return None
        text = answer[: len(answer) - len(after)]
        # The client may lack text the engine held back; past the seam it may have a
        # printable prefix of the tail's text, never more than every id's.
        beyond = end < sent and client_text.startswith(text)
        return Seam(end, text) if beyond or text.startswith(client_text) else None
    return None


def remaining_tokens(path: str, body: dict[str, Any], sent: int) -> int:
    return token_budget(path, body) - sent


def within_context(prompt: int, sent: int, remaining: int, context: int | None) -> bool:
    """The resumed request fits the engine's context (prompt + sent + remaining tokens); True
    when the context is unknown (the engine then judges, and a refusal fails the migration)."""
    return context is None or context <= 0 or prompt + sent + remaining <= context
