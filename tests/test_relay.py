"""Pure functions of the relay: SSE framing, in-band failures, the logprob merge."""

from __future__ import annotations

import orjson

from trio_pd.pd.relay import (
    InbandError,
    error_frame,
    event_data,
    inband_failure,
    merge_logprobs,
    split_event,
)


def test_split_event_needs_a_full_event() -> None:
    assert split_event(b"data: {") is None
    assert split_event(b"data: 1\n\ndata: 2") == (b"data: 1\n\n", b"data: 2")
    assert split_event(b"data: 1\r\n\r\nrest") == (b"data: 1\r\n\r\n", b"rest")


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
    first, rest = split_event(frame)
    assert orjson.loads(event_data(first))["error"]["message"] == 'quote " and \\ backslash'
    assert rest == b"data: [DONE]\n\n"
