"""The resume plan and the refusal rules of migration (`pd/migration.py`), and the stitching of a
resumed stream onto what the client already got (`pd/stitch.py`): pure, no sockets."""

from __future__ import annotations

import pytest

from trio_pd.pd.engines import ENGINES
from trio_pd.pd.migration import (
    REFUSALS,
    refusal,
    resume_body,
    token_budget,
    within_context,
)
from trio_pd.pd.payload import CHAT, COMPLETIONS, GENERATE
from trio_pd.pd.resume import Migration
from trio_pd.pd.stitch import Transcript

GREEDY = {"max_new_tokens": 8, "temperature": 0}


@pytest.mark.parametrize(
    ("path", "body", "stream", "reason"),
    [
        (GENERATE, {"text": "hi", "sampling_params": GREEDY}, True, None),
        (GENERATE, {"input_ids": [1, 2], "sampling_params": GREEDY}, True, None),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": 8}, True, None),
        (COMPLETIONS, {"prompt": [5, 6, 7], "max_tokens": 8}, True, None),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}]}, False, None),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}]}, True, "chat_stream"),
        (GENERATE, {"text": ["a", "b"]}, True, "batch"),
        (GENERATE, {"input_ids": [[1], [2]]}, True, "batch"),
        (COMPLETIONS, {"prompt": ["a", "b"]}, True, "batch"),
        (GENERATE, {"text": "a", "image_data": "x.png"}, True, "multimodal"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            False,
            "multimodal",
        ),
        (GENERATE, {"text": "a", "sampling_params": {"json_schema": "{}"}}, True,
         "structured_output"),
        (GENERATE, {"text": "a", "sampling_params": {"regex": "a+"}}, True, "structured_output"),
        (GENERATE, {"text": "a", "sampling_params": {"ebnf": "r"}}, True, "structured_output"),
        (COMPLETIONS, {"prompt": "a", "regex": "a+"}, True, "structured_output"),
        (CHAT, {"messages": [], "response_format": {"type": "json_schema"}}, False,
         "structured_output"),
        (CHAT, {"messages": [], "response_format": {"type": "json_object"}}, False,
         "structured_output"),
        (CHAT, {"messages": [], "response_format": {"type": "text"}}, False, None),
        (GENERATE, {"text": "a", "return_logprob": True}, True, "logprobs"),
        (COMPLETIONS, {"prompt": "a", "logprobs": 0}, True, "logprobs"),
        (CHAT, {"messages": [], "logprobs": True}, False, "logprobs"),
        (CHAT, {"messages": [], "logprobs": False}, False, None),
        (COMPLETIONS, {"prompt": "a", "frequency_penalty": 0.5}, True, "penalty"),
        (GENERATE, {"text": "a", "sampling_params": {"repetition_penalty": 1.1}}, True,
         "penalty"),
        (GENERATE, {"text": "a", "sampling_params": {"repetition_penalty": 1.0}}, True, None),
        (COMPLETIONS, {"prompt": "a", "stop": ["\n"]}, True, "stop_strings"),
        (GENERATE, {"text": "a", "sampling_params": {"stop_token_ids": [2]}}, True, None),
        (COMPLETIONS, {"prompt": "a", "echo": True}, True, "echo"),
        (GENERATE, {"text": "a", "return_hidden_states": True}, True, "engine_state"),
        (COMPLETIONS, {"prompt": "a", "stream_options": {"continuous_usage_stats": True}}, True,
         "continuous_usage"),
        (COMPLETIONS, {"prompt": "a", "stream_options": {"include_usage": True}}, True, None),
        (COMPLETIONS, {"prompt": "a", "truncate_prompt_tokens": 4}, True, "truncation"),
        (COMPLETIONS, {"prompt": "a", "return_token_ids": True}, True, None),
    ],
)  # fmt: skip
def test_refusal_rules(path: str, body: dict, stream: bool, reason: str | None) -> None:
    assert refusal(path, body, stream) == reason
    if reason is not None:
        assert reason in REFUSALS


def test_an_engine_that_does_not_resume_is_refused_by_name_of_no_engine() -> None:
    """`Migration.decide` on a pair whose engine has `RESUMES` False: `refused_engine`."""
    migration = Migration(COMPLETIONS, None, 2, None)  # type: ignore[arg-type]
    assert migration.decide(False) == "refused_engine" and "engine" in REFUSALS
    assert all(engine.RESUMES for engine in ENGINES.values())  # vLLM resumes too (issue 29)


def test_generate_resumes_on_input_ids_with_the_budget_reduced() -> None:
    body = {
        "text": "hello there",
        "sampling_params": {"max_new_tokens": 10, "temperature": 0, "min_new_tokens": 4},
        "stream": True,
        "extra": {"kept": 1},
    }
    out = resume_body(GENERATE, body, [1, 2, 3], [50, 51, 52])
    assert out["input_ids"] == [1, 2, 3, 50, 51, 52]
    assert "text" not in out
    assert out["sampling_params"] == {"max_new_tokens": 7, "temperature": 0, "min_new_tokens": 1}
    assert out["stream"] is True and out["extra"] == {"kept": 1}
    assert body["sampling_params"]["max_new_tokens"] == 10  # the client's body is untouched


def test_generate_without_a_budget_uses_the_engines_default() -> None:
    out = resume_body(GENERATE, {"input_ids": [1]}, [1], [9, 9])
    assert out["sampling_params"]["max_new_tokens"] == 128 - 2


def test_completions_resume_on_a_token_id_prompt() -> None:
    out = resume_body(COMPLETIONS, {"prompt": "hi", "max_tokens": 5, "stream": True}, [7], [8])
    assert out == {"prompt": [7, 8], "max_tokens": 4, "stream": True}
    assert token_budget(COMPLETIONS, {"prompt": "x"}) == 16


def test_nothing_sent_runs_the_request_again_as_it_came() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
    assert resume_body(CHAT, body, [], []) == body
    assert resume_body(COMPLETIONS, {"prompt": "x"}, [1], []) == {"prompt": "x"}


def test_context_bound() -> None:
    assert within_context(10, 5, 5, 20)
    assert not within_context(10, 5, 6, 20)
    assert within_context(10, 5, 6, None)


# ------------------------------------------------------------------------- stitching


def gen_event(ids: list[int], count: int, text: str, finish: dict | None = None) -> dict:
    return {
        "text": text,
        "output_ids": ids,
        "meta_info": {
            "id": "rid",
            "prompt_tokens": 4,
            "completion_tokens": count,
            "finish_reason": finish,
        },
    }


def test_generate_whole_answer_events_are_continued() -> None:
    """SGLang's default: every event carries the whole answer so far."""
    t = Transcript(GENERATE)
    assert t.relay(gen_event([10], 1, "a")) == gen_event([10], 1, "a")
    t.relay(gen_event([10, 11], 2, "a b"))
    assert t.cumulative is True and t.ids == [10, 11] and t.text == "a b"
    t.resume()
    # the resumed engine: prompt 4 + 2 sent = 6 tokens, its own answer starts at 0
    resumed = gen_event([12], 1, " c")
    resumed["meta_info"]["prompt_tokens"] = 6
    resumed["meta_info"]["id"] = "rid-2"
    out = t.relay(resumed)
    assert out["meta_info"]["id"] == "rid"
    assert out["output_ids"] == [10, 11, 12] and out["text"] == "a b c"
    assert out["meta_info"]["completion_tokens"] == 3
    assert out["meta_info"]["prompt_tokens"] == 4
    last = gen_event([12, 13], 2, " c d", {"type": "length", "length": 2})
    out = t.relay(last)
    assert out["output_ids"] == [10, 11, 12, 13] and out["text"] == "a b c d"
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert t.finished


def test_generate_incremental_events_are_continued() -> None:
    """`--incremental-streaming-output`: each event carries its own ids and text."""
    t = Transcript(GENERATE)
    t.relay(gen_event([10], 1, "a"))
    t.relay(gen_event([11], 2, " b"))
    assert t.cumulative is False and t.ids == [10, 11] and t.text == "a b"
    t.resume()
    out = t.relay(gen_event([12], 1, " c"))
    assert out["output_ids"] == [12] and out["text"] == " c"
    assert out["meta_info"]["completion_tokens"] == 3
    assert t.ids == [10, 11, 12] and t.text == "a b c"


def comp_chunk(text: str, ids: list[int], prompt: list[int] | None = None, **extra) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": extra.pop("finish", None),
              "token_ids": ids}  # fmt: skip
    if prompt is not None:
        choice["prompt_token_ids"] = prompt
    return {"id": "rid", "object": "text_completion", "created": extra.pop("created", 100),
            "choices": [choice], "usage": extra.pop("usage", None)}  # fmt: skip


def test_completions_ids_are_taken_out_and_usage_counts_both_attempts() -> None:
    t = Transcript(COMPLETIONS, strip_ids=True)
    out = t.relay(comp_chunk("a", [10], prompt=[1, 2, 3]))
    assert "token_ids" not in out["choices"][0] and "prompt_token_ids" not in out["choices"][0]
    t.relay(comp_chunk(" b", [11]))
    assert t.prompt_ids == [1, 2, 3] and t.ids == [10, 11] and t.text == "a b"
    t.resume()
    chunk = comp_chunk(" c", [12], prompt=[1, 2, 3, 10, 11], created=105)
    out = t.relay({**chunk, "id": "rid-2"})
    assert out["created"] == 100 and out["id"] == "rid" and out["choices"][0]["text"] == " c"
    assert "prompt_token_ids" not in out["choices"][0]
    assert t.prompt_ids == [1, 2, 3]  # the original's, not the resumed prompt
    usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
    out = t.relay({"id": "rid", "created": 105, "choices": [], "usage": usage})
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_completions_ids_the_client_asked_for_stay() -> None:
    t = Transcript(COMPLETIONS, strip_ids=False)
    out = t.relay(comp_chunk("a", [10], prompt=[1]))
    assert out["choices"][0]["token_ids"] == [10]
    assert out["choices"][0]["prompt_token_ids"] == [1]
    t.resume()
    out = t.relay(comp_chunk(" b", [11], prompt=[1, 10]))
    assert out["choices"][0]["token_ids"] == [11]  # the client's ids go on
    assert "prompt_token_ids" not in out["choices"][0]  # it has the original prompt's


def test_whole_answer_events_are_read_only_when_a_break_asks() -> None:
    """Each /generate event carries every id so far: past the second (which tells the modes
    apart) the transcript keeps the last one's bytes and parses it only when asked."""
    import orjson

    t = Transcript(GENERATE)
    t.relay(gen_event([10], 1, "a"))
    t.relay(gen_event([10, 11], 2, "a b"))
    assert t.defer(orjson.dumps(gen_event([10, 11, 12], 3, "a b c")))
    assert t.ids == [10, 11]  # not read yet
    assert t.sent == 3 and t.ids == [10, 11, 12] and t.text == "a b c"
    t.resume()
    assert not t.defer(b"{}")  # a resumed attempt's events are rewritten, each one


def test_an_abort_event_ends_the_chunk_after_the_events_before_it() -> None:
    """The events before an engine's abort event in one chunk reach the client (and the
    transcript); the abort itself is the break, never relayed."""
    import orjson

    from trio_pd.pd.payload import Inspected
    from trio_pd.pd.resume import Migration, _through

    def frame(obj: dict) -> bytes:
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    inspected = Inspected(b'{"text": "x", "stream": true}', False, True, False, None, "x", 1, None,
                          None)  # fmt: skip
    migration = Migration.for_request(GENERATE, inspected, 2)
    assert migration is not None and migration.transcript is not None
    t = migration.transcript
    events = [frame(gen_event([10], 1, "a")), frame(gen_event([10, 11], 2, "a b"))]
    out, broken = _through(migration, t, events)
    assert broken is None and out == b"".join(events)
    aborted = gen_event([10, 11, 12, 13], 4, "a b c d", {"type": "abort", "message": "x"})
    more = [frame(gen_event([10, 11, 12], 3, "a b c")), frame(aborted)]
    out, broken = _through(migration, t, more)
    assert broken is not None and out == more[0]
    assert migration.break_reason == "inband"
    assert t.sent == 3 and t.text == "a b c"  # what the client got, not the abort's 4


# ------------------------------------------------------------------------- the seam

CUT = "\ufffd"  # how /detokenize renders a cut character


def detokenized(lists: list[list[int]], vocab: dict[int, bytes]) -> list[str]:
    """/detokenize of a byte-level tokenizer (cut or invalid UTF-8 as "\ufffd")."""
    return [b"".join(vocab[i] for i in ids).decode("utf-8", "replace") for ids in lists]


# ids 1-5: the prompt; 10 "a", 11 " b \xd8" (ب's first byte), 12 "\xa8c" (ب whole), 13 " d"
VOCAB = {1: b"p", 2: b" q", 3: b" r", 4: b" s", 5: b" t", 10: b"a", 11: b" b \xd8",
         12: b"\xa8c", 13: b" d", 14: b" \xe2", 15: b"\x82", 16: b"\xac"}  # fmt: skip
PROMPT = [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    ("sent", "client_text", "keep", "text"),
    [
        ([10, 11, 12], "a b \u0628c", 3, "a b \u0628c"),  # whole: every id kept
        ([10, 11], "a b ", 1, "a"),  # cut after ب's first byte; "a b " went out
        ([10, 11, 12, 14, 15], "a b \u0628c ", 3, "a b \u0628c"),  # € cut after 2 bytes
        ([10, 11], "a", 1, "a"),  # the engine sent nothing of the cut part
        ([11], "", 0, ""),  # nothing whole but the prompt: every id comes again
    ],
)
def test_the_seam_is_the_last_end_after_which_the_text_is_whole(
    sent: list[int], client_text: str, keep: int, text: str
) -> None:
    from trio_pd.pd.migration import Seam, seam_lists, seam_of

    lists = seam_lists(PROMPT, sent)
    assert lists[0] == [*PROMPT[-5:], *sent] and lists[1] == PROMPT[-5:]
    assert seam_of(detokenized(lists, VOCAB), len(sent), client_text) == Seam(keep, text)


def test_no_seam_when_the_answer_disagrees_or_none_is_in_reach() -> None:
    from trio_pd.pd.migration import SEAM_TOKENS, seam_lists, seam_of

    sent = [10, 11]
    texts = detokenized(seam_lists(PROMPT, sent), VOCAB)
    assert seam_of(texts, len(sent), "x") is None  # the client's text is not the engine's
    whole = [10, 11, 12]
    texts = detokenized(seam_lists(PROMPT, whole), VOCAB)
    assert seam_of(texts, len(whole), "a b \u0628c") is not None
    assert seam_of(texts, len(whole), "a b \u0628c!") is None  # more text than its ids have
    texts = detokenized(seam_lists(PROMPT, sent), VOCAB)
    assert seam_of(texts[:-1], len(sent), "a") is None  # not an answer to the lists
    assert seam_of("a", len(sent), "a") is None
    # a run of cut characters longer than the ends looked at: no seam, every id kept
    vocab = {**VOCAB, 20: b"\xd8", 21: b"\xa8\xd8"}
    long = [10, *([20] + [21] * SEAM_TOKENS)]
    texts = detokenized(seam_lists(PROMPT, long), vocab)
    assert seam_of(texts, len(long), "a") is None


@pytest.mark.parametrize(
    ("path", "body", "want"),
    [
        (GENERATE, {"sampling_params": {"temperature": 0}}, True),
        (GENERATE, {"sampling_params": {"temperature": 0.0, "top_k": 5}}, True),
        (GENERATE, {"sampling_params": {"top_k": 1}}, True),
        (GENERATE, {"sampling_params": {"temperature": 0.7}}, False),
        (GENERATE, {}, False),  # SGLang's default temperature is 1
        (COMPLETIONS, {"temperature": 0}, True),
        (COMPLETIONS, {"temperature": 1e-7}, True),
        (COMPLETIONS, {"temperature": True}, False),
        (COMPLETIONS, {}, False),
    ],
)
def test_greedy_is_read_as_sglang_reads_it(path: str, body: dict, want: bool) -> None:
    from trio_pd.pd.migration import greedy

    assert greedy(path, body) is want


def test_generate_resumed_from_a_seam_drops_what_the_client_has() -> None:
    """Whole-answer events: the client got [10, 11] and "a b " (ب held back); the resume keeps
    [10] ("a"), the engine sends 11 again (text "a b " again: dropped), then 12 with ب."""
    t = Transcript(GENERATE)
    t.relay(gen_event([10], 1, "a"))
    t.relay(gen_event([10, 11], 2, "a b "))
    t.resume(1, "a")
    assert t.relay(gen_event([11], 1, " b ")) is None  # nothing the client has not got
    out = t.relay(gen_event([11, 12], 2, " b \u0628c"))
    assert out["output_ids"] == [10, 11, 12] and out["text"] == "a b \u0628c"
    assert out["meta_info"]["completion_tokens"] == 3
    last = gen_event([11, 12, 13], 3, " b \u0628c d", {"type": "length", "length": 3})
    out = t.relay(last)
    assert out["output_ids"] == [10, 11, 12, 13] and out["text"] == "a b \u0628c d"
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert t.ids == [10, 11, 12, 13]


def test_incremental_events_resumed_from_a_seam_give_only_what_is_new() -> None:
    t = Transcript(GENERATE)
    t.relay(gen_event([10], 1, "a"))
    t.relay(gen_event([11], 2, " b "))
    t.resume(1, "a")
    assert t.relay(gen_event([11], 1, " b ")) is None
    out = t.relay(gen_event([12], 2, "\u0628c"))
    assert out["output_ids"] == [12] and out["text"] == "\u0628c"
    assert out["meta_info"]["completion_tokens"] == 3


def test_text_the_engine_held_back_goes_out_with_the_next_event() -> None:
    """The client got [10, 11] and only "a" (nothing printable of the cut part): the seam's
    text is "a" too; had the engine held back whole text, the next new event carries it."""
    t = Transcript(GENERATE)
    t.relay(gen_event([10], 1, "a"))
    t.relay(gen_event([10, 11], 2, "a"))
    t.resume(2, "a b")  # (a seam whose text the client lacks part of)
    out = t.relay(gen_event([12], 1, "c"))
    assert out["output_ids"] == [10, 11, 12] and out["text"] == "a bc"


def test_completions_resumed_from_a_seam_drop_the_ids_and_text_sent() -> None:
    t = Transcript(COMPLETIONS, strip_ids=False)
    t.relay(comp_chunk("a", [10], prompt=[1]))
    t.relay(comp_chunk(" b ", [11]))
    t.resume(1, "a")
    assert t.relay(comp_chunk(" b ", [11], prompt=[1, 10])) is None
    out = t.relay(comp_chunk("\u0628c", [12]))
    assert out["choices"][0]["token_ids"] == [12] and out["choices"][0]["text"] == "\u0628c"
    usage = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    out = t.relay({"id": "rid", "created": 105, "choices": [], "usage": usage})
    assert out["usage"] == {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}
    assert t.ids == [10, 11, 12] and t.text == "a b \u0628c"
