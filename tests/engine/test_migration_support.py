"""What migration (issue 29) needs of the simulator: a decode that dies after N tokens as a
SIGKILLed engine does, `input_ids` that continue an answer byte for byte, completions'
`return_token_ids`, `/tokenize` and `/detokenize`, and (`multibyte_tokens`) tokens that cut a
character, held back as SGLang's detokenizer holds it."""

from __future__ import annotations

import httpx2

from trio_pd_testing.engine.workload import continued, output_id, text_ids

from .helpers import new_room, pd_body, pd_post, sse_events, start_engine


def test_continued_counts_only_an_answer_in_order() -> None:
    assert continued((5, 6, output_id(1), output_id(2), output_id(3))) == 3
    assert continued((5, output_id(2), output_id(3))) == 0  # not from tok1
    assert continued((output_id(1), 7)) == 0
    assert continued(()) == 0


async def test_input_ids_continue_the_answer_byte_for_byte(nursery) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    prompt = list(text_ids("a b c"))
    async with httpx2.AsyncClient(timeout=10) as client:
        full_body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 7}}
        _, full = await pd_post(
            client, prefill, decode, "/generate", pd_body(prefill, new_room(), **full_body)
        )
        whole = full.json()
        sent = whole["output_ids"][:3]
        resumed_body = {"input_ids": prompt + sent, "sampling_params": {"max_new_tokens": 4}}
        _, resumed = await pd_post(
            client, prefill, decode, "/generate", pd_body(prefill, new_room(), **resumed_body)
        )
        rest = resumed.json()
        assert sent + rest["output_ids"] == whole["output_ids"]
        assert "tok1 tok2 tok3" + rest["text"] == whole["text"]
        # a stream's first event of the continuation starts with its separating space
        _, stream = await pd_post(
            client, prefill, decode, "/generate",
            pd_body(prefill, new_room(), stream=True, **resumed_body),
        )  # fmt: skip
        events = [e for e in sse_events(stream.text) if e != "[DONE]"]
        assert events[0]["text"] == " tok4" and events[0]["output_ids"] == [output_id(4)]


async def test_completions_return_token_ids(nursery) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    async with httpx2.AsyncClient(timeout=10) as client:
        body = {"prompt": "x y", "max_tokens": 3, "return_token_ids": True, "stream": True}
        _, stream = await pd_post(
            client, prefill, decode, "/v1/completions", pd_body(prefill, new_room(), **body)
        )
        chunks = [e for e in sse_events(stream.text) if e != "[DONE]"]
        choices = [c["choices"][0] for c in chunks]
        assert choices[0]["prompt_token_ids"] == list(text_ids("x y"))
        assert [i for c in choices for i in c["token_ids"]] == [output_id(k) for k in (1, 2, 3)]
        assert all("prompt_token_ids" not in c for c in choices[1:])
        plain = {**body, "stream": False, "return_token_ids": False}
        _, answer = await pd_post(
            client, prefill, decode, "/v1/completions", pd_body(prefill, new_room(), **plain)
        )
        assert "token_ids" not in answer.json()["choices"][0]


async def test_tokenize(nursery) -> None:
    engine = await start_engine(nursery, "prefill")
    async with httpx2.AsyncClient(timeout=10) as client:
        got = (await client.post(engine.url + "/tokenize", json={"prompt": "a b"})).json()
        assert got["tokens"] == list(text_ids("a b")) and got["count"] == 2
        chat = {"messages": [{"role": "user", "content": "a b"}]}
        got = (await client.post(engine.url + "/v1/tokenize", json=chat)).json()
        assert got["tokens"] == list(text_ids("a b"))
        bad = await client.post(engine.url + "/tokenize", json={})
        assert bad.status_code == 400


async def test_detokenize(nursery) -> None:
    engine = await start_engine(nursery, "prefill", multibyte_tokens=True)
    ids = [output_id(k) for k in (1, 2, 3)]
    async with httpx2.AsyncClient(timeout=10) as client:
        got = (await client.post(engine.url + "/detokenize", json={"tokens": ids})).json()
        assert got == {"text": "tok1 tok2 \u0628 tok3"}
        cut = {"tokens": [ids[:2], ids[1:2], []]}
        got = (await client.post(engine.url + "/v1/detokenize", json=cut)).json()
        assert got == {"text": ["tok1 tok2 \ufffd", " tok2 \ufffd", ""]}  # cut: "\ufffd"
        bad = await client.post(engine.url + "/detokenize", json={"tokens": ["x"]})
        assert bad.status_code == 400
    plain = await start_engine(nursery, "prefill")
    async with httpx2.AsyncClient(timeout=10) as client:
        got = (await client.post(plain.url + "/detokenize", json={"tokens": ids})).json()
        assert got == {"text": "tok1 tok2 tok3"}


async def test_a_cut_character_is_held_back_and_lost_behind_a_resumed_prompt(nursery) -> None:
    """`multibyte_tokens`: tok2 ends with ب's first byte. Streamed, SGLang's detokenizer sends
    the printable prefix "tok1 tok2 " and the character with tok3; a request resumed with
    prompt + [tok1, tok2] has the first byte in its prompt and never sends the character (the
    defect a router's migration must avoid, docs/protocol.md §14); resumed with prompt +
    [tok1], the text follows on whole."""
    prefill = await start_engine(nursery, "prefill", multibyte_tokens=True)
    decode = await start_engine(nursery, "decode", multibyte_tokens=True)
    prompt = list(text_ids("a b c"))

    async def texts(ids: list[int], count: int) -> list[str]:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": count}, "stream": True}
        _, stream = await pd_post(
            client, prefill, decode, "/generate", pd_body(prefill, new_room(), **body)
        )
        return [e["text"] for e in sse_events(stream.text) if e != "[DONE]"]

    async with httpx2.AsyncClient(timeout=10) as client:
        assert await texts(prompt, 3) == ["tok1", "tok1 tok2 ", "tok1 tok2 \u0628 tok3"]
        behind_the_cut = await texts([*prompt, output_id(1), output_id(2)], 1)
        assert behind_the_cut == [" tok3"]  # ب never sent
        before_the_cut = await texts([*prompt, output_id(1)], 2)
        assert before_the_cut == [" tok2 ", " tok2 \u0628 tok3"]
        # and a whole answer is the whole text
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6}}
        _, whole = await pd_post(
            client, prefill, decode, "/generate", pd_body(prefill, new_room(), **body)
        )
        assert whole.json()["text"] == "tok1 tok2 \u0628 tok3 tok4\u20ac tok6"


async def test_die_after_n_tokens_drops_everything(nursery) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode", faults=("decode:die@3tok",))
    async with httpx2.AsyncClient(timeout=10) as client:
        body = pd_body(prefill, new_room(), text="a b", stream=True,
                       sampling_params={"max_new_tokens": 10})  # fmt: skip
        seen = b""
        try:
            async with (
                client.stream("POST", decode.url + "/generate", json=body) as response,
                client.stream("POST", prefill.url + "/generate", json=body),
            ):
                async for chunk in response.aiter_bytes():
                    seen += chunk
            ended = "eof"
        except httpx2.HTTPError as exc:
            ended = type(exc).__name__
        events = [e for e in sse_events(seen.decode()) if e != "[DONE]"]
        assert len(events) == 3, events  # it died right after its third token
        assert b"[DONE]" not in seen, ended
        assert decode.running == 0 and decode.state.stopping
        assert decode.events.find("engine_died")
        try:
            answer = await client.get(decode.url + "/ready")
            status = answer.status_code
        except httpx2.HTTPError:
            status = 0
        assert status == 0  # nothing answers any more
