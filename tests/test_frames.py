"""Pure functions of the relay: SSE framing, in-band failures, the logprob merge."""

from __future__ import annotations

import orjson
import pytest

from trio_pd.pd import sse
from trio_pd.pd.budget import MemoryBudget, OverBudget
from trio_pd.pd.frames import (
    InbandError,
    answer_failure,
    error_frame,
    event_data,
    inband_failure,
    merge_logprobs,
)
from trio_pd.pd.sse import EventReader, EventTooLarge


def test_events_need_their_blank_line() -> None:
    reader = EventReader(1 << 20)
    assert reader.feed(b"data: {") == []
    assert reader.feed(b"}\n\ndata: 2") == [b"data: {}\n\n"]
    assert reader.pending == b"data: 2"
    assert reader.feed(b"\r\n\r\nrest") == [b"data: 2\r\n\r\n"]
    assert reader.feed(b"\n\ndata: a\n\ndata: b\n\n") == [
        b"rest\n\n",
        b"data: a\n\n",
        b"data: b\n\n",
    ]
    assert reader.pending == b""


def test_first_only_leaves_the_rest_unread() -> None:
    reader = EventReader(1 << 20)
    assert reader.feed(b"data: 1\n\ndata: 2\n\nda", first_only=True) == [b"data: 1\n\n"]
    assert reader.pending == b"data: 2\n\nda"


@pytest.mark.parametrize("terminator", [b"\n\n", b"\r\n\r\n"])
def test_a_terminator_split_anywhere_is_found(terminator: bytes) -> None:
    stream = b"data: one" + terminator + b"data: two" + terminator
    for size in range(1, len(stream) + 1):
        reader = EventReader(1 << 20)
        events = []
        for at in range(0, len(stream), size):
            events += reader.feed(stream[at : at + size])
        assert events == [b"data: one" + terminator, b"data: two" + terminator], size
        assert reader.pending == b""


def test_each_byte_is_scanned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """An event that never ends, 4 MiB in 1024 reads: the terminator search looks at each
    byte a bounded number of times (the old relay re-scanned the whole buffer per read:
    ~2 GiB of searching for these 4 MiB)."""
    scanned = 0
    real = sse.event_end

    def counting(data: bytes | bytearray, start: int) -> int:
        nonlocal scanned
        scanned += len(data) - start
        return real(data, start)

    monkeypatch.setattr(sse, "event_end", counting)
    reader = EventReader(64 << 20)
    piece = b"x" * 4096
    for _ in range(1024):
        assert reader.feed(piece) == []
    assert scanned <= 1024 * (4096 + 3)
    assert reader.feed(b"\n\n") == [b"x" * 4096 * 1024 + b"\n\n"]


def test_an_event_past_the_limit_is_refused_as_it_grows() -> None:
    reader = EventReader(100)
    assert reader.feed(b"data: " + b"x" * 90) == []
    with pytest.raises(EventTooLarge):
        reader.feed(b"x" * 10)
    whole = EventReader(100)
    with pytest.raises(EventTooLarge):  # a complete event larger than the limit, in one read
        whole.feed(b"data: " + b"x" * 200 + b"\n\n")
    assert EventReader(100).feed(b"data: " + b"x" * 90 + b"\n\n")  # within it: fine


def test_a_partial_event_is_charged_to_the_budget() -> None:
    budget = MemoryBudget(1000)
    account = budget.account()
    reader = EventReader(1 << 20, account)
    reader.feed(b"x" * 600)
    assert budget.in_use == 600
    with pytest.raises(OverBudget) as refused:
        reader.feed(b"x" * 600)
    assert refused.value.never  # 1200 bytes could never fit 1000
    reader.close()
    assert budget.in_use == 0


def test_event_data_joins_data_lines() -> None:
    assert event_data(b"event: x\ndata: a\ndata:b\n\n") == b"a\nb"
    assert event_data(b": comment\n\n") is None


def test_inband_failure_kinds() -> None:
    assert inband_failure({"error": {"message": "boom"}}) == InbandError("boom")
    assert inband_failure({"error": "flat"}) == InbandError("flat")
    abort = {"meta_info": {"finish_reason": {"type": "abort", "message": "cut"}}}
    assert inband_failure(abort) == InbandError("cut")
    assert inband_failure([{"text": "ok"}, abort]) == InbandError("cut")
    assert (
        inband_failure({"text": "fine", "meta_info": {"finish_reason": {"type": "length"}}}) is None
    )
    assert inband_failure(None) is None


def test_inband_failure_codes_say_whose_fault() -> None:
    too_long = inband_failure({"error": {"message": "prompt too long", "code": 400}})
    assert too_long == InbandError("prompt too long", 400)
    assert too_long.is_client_error
    abort = {"meta_info": {"finish_reason": {"type": "abort", "message": "m", "status_code": 422}}}
    assert inband_failure(abort) == InbandError("m", 422)
    assert inband_failure({"error": {"message": "oom", "code": "503"}}) == InbandError("oom", 503)
    assert not inband_failure({"error": {"message": "oom", "code": 500}}).is_client_error
    odd = inband_failure({"error": {"message": "x", "code": "BadRequest"}})
    assert odd == InbandError("x") and not odd.is_client_error
    assert inband_failure({"error": {"message": "x", "code": True}}) == InbandError("x")


def test_merge_logprobs_puts_prefill_first() -> None:
    prefill = {"meta_info": {"input_token_logprobs": [[-1, 1, None], [-2, 2, None]]}}
    decode = {"meta_info": {"input_token_logprobs": [[-3, 3, None]], "output_token_logprobs": []}}
    assert merge_logprobs(prefill, decode)
    assert decode["meta_info"]["input_token_logprobs"] == [
        [-1, 1, None],
        [-2, 2, None],
        [-3, 3, None],
    ]
    batch_p = [prefill, {"meta_info": {"input_token_logprobs": [[-9, 9, None]]}}]
    batch_d = [{"meta_info": {}}, {"meta_info": {}}]
    assert merge_logprobs(batch_p, batch_d)
    assert batch_d[1]["meta_info"]["input_token_logprobs"] == [[-9, 9, None]]
    assert not merge_logprobs({"text": "no meta"}, {"meta_info": {}})


def test_error_frame_is_valid_json_then_done() -> None:
    frame = error_frame('quote " and \\ backslash', "upstream_error", 502)
    first, rest = EventReader(1 << 20).feed(frame)
    assert orjson.loads(event_data(first))["error"]["message"] == 'quote " and \\ backslash'
    assert rest == b"data: [DONE]\n\n"


def test_an_answer_nested_deeper_than_a_batch_is_the_workers_fault() -> None:
    deep: object = [{"error": "x"}]
    for _ in range(990):
        deep = [deep]
    found = answer_failure(deep)
    assert found is not None and not found.is_client_error
    assert answer_failure([{"error": "x"}]) == InbandError("x")
    nested_prefill: object = [{"meta_info": {"input_token_logprobs": [[-1, 1, None]]}}]
    nested_decode: object = [{"meta_info": {}}]
    for _ in range(990):
        nested_prefill, nested_decode = [nested_prefill], [nested_decode]
    assert not merge_logprobs(nested_prefill, nested_decode)  # one level: nothing to merge
