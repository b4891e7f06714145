"""Arbitrary JSON (and not JSON) on the three generation routes of one live router.

Every request goes through a real router over real sockets to the engine simulator, and for each
one the test checks, on both sides:

- the client's answer: an `x-request-id` (ours, echoed); any 5xx carries the docs/protocol.md §7
  envelope; never the router's own `internal_error`;
- the router's own refusals: a body that is not a JSON object (by the strict oracle below) or
  a batch over `--max-batch-size` is a 400 that reached no worker (no `request_start` with its
  request id on either engine), and nothing else is refused by the router;
- what the workers got: for a body an engine accepted (its `request_start` carries `raw`, the
  bytes as received), `raw` parsed with the stdlib `json` (big integers stay exact) equals the
  client's object plus exactly `bootstrap_host`, `bootstrap_port` and `bootstrap_room`, value
  for value and type for type, any client-supplied `bootstrap_*` replaced by the router's. Both
  legs got the same bytes, and without client `bootstrap_*` keys the legs' bytes start with the
  client's own bytes (the router splices, it does not re-serialize);
- afterwards: no decode slot held, no pooled connection active, a normal request still served.

How hypothesis drives an async cluster: `@given` runs on a plain (sync) function in a worker
thread (`trio.to_thread.run_sync`), and each example calls back into the test's trio loop with
`trio.from_thread.run`. So one cluster serves every example, hypothesis keeps its whole engine
(explicit examples, derandomized generation, shrinking a failure to a minimal body), and no
`strategy.example()` is needed. A cluster per example (`trio.run` inside `@given`) would cost a
second or so per example; the bridge costs nothing measurable.

The engine simulator logs `raw` only for bodies it accepts (a body it refuses logs
`request_start` with `body: null` and no `raw`), so the strategies keep the fields an engine
validates mostly valid and put the odd values (integers beyond 64 bits, unicode, floats, nesting)
into fields engines ignore; the test counts how many bodies it compared and requires a floor.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from typing import Any

import attrs
import httpx2
import orjson
import pytest
import trio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.conftest import Cluster, start_cluster
from tests.router.helpers import generate_body, settle

GENERATE, COMPLETIONS, CHAT = "/generate", "/v1/completions", "/v1/chat/completions"
PATHS = (GENERATE, COMPLETIONS, CHAT)
BOOTSTRAP = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
ROUTER_FIELDS = (*BOOTSTRAP, "rid")  # the router owns these on the legs (rid: for aborts)
ENGINE_RID = re.compile(r"trio-pd-[0-9a-f]{32}")
MAX_BATCH = 64  # the fuzzed router's --max-batch-size: batches just over it are drawn too
EXAMPLES = 300
MIN_COMPARED = 60  # bodies whose leg bytes were compared with the client's (runs give 78-90)
MAX_ROOM = 2**63 - 1

# Top-level keys the router or the engines read: drawn on purpose, never as random extras (the
# engine would otherwise build e.g. 10**30 top-logprob entries, or pin an impossible rank).
RESERVED = frozenset(
    {
        *BOOTSTRAP,
        "text", "input_ids", "prompt", "messages", "n", "stream", "stream_options",
        "sampling_params", "max_tokens", "max_completion_tokens", "return_logprob", "logprobs",
        "top_logprobs", "top_logprobs_num", "rid", "model", "sim_fault", "routed_dp_rank",
        "data_parallel_rank", "disagg_prefill_dp_rank",
    }
)  # fmt: skip

EDGE_INTS = (
    0, -1, 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64,
    -(2**64), 10**19, 10**30, -(10**30), 18446744073709551615, 3_000_000, 10**8, 2**200,
)  # fmt: skip

# -- strategies -------------------------------------------------------------------------------

ints = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(EDGE_INTS),
    st.integers(min_value=-(10**80), max_value=10**80),
)
floats = st.floats(allow_nan=False, allow_infinity=False)
texts = st.text(max_size=24)  # any code point but surrogates: emoji, CJK, NUL, RTL marks ...
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts)
any_keys = st.one_of(texts, st.sampled_from(BOOTSTRAP))  # nested bootstrap_* stay untouched
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(any_keys, inner, max_size=5)
    ),
    max_leaves=16,
)
# Any JSON but an integer: for the engines' size fields (a huge int would make the simulator
# build a huge answer; a small one is drawn separately).
non_ints = st.one_of(
    st.none(),
    st.booleans(),
    floats,
    texts,
    st.lists(json_values, max_size=3),
    st.dictionaries(any_keys, json_values, max_size=3),
)
small_counts = st.integers(min_value=0, max_value=4)
extras = st.dictionaries(texts.filter(lambda k: k not in RESERVED), json_values, max_size=5)
client_bootstrap = st.dictionaries(st.sampled_from(BOOTSTRAP), json_values, max_size=3)
rids = st.one_of(texts, st.lists(texts, max_size=3), json_values)
token_ids = st.lists(st.integers(min_value=0, max_value=60_000), max_size=12)


def batch_lists(element: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Any]]:
    """Lists for batch fields: mostly small, sometimes just over the router's limit."""
    return st.one_of(
        st.lists(element, max_size=4),
        st.lists(element, min_size=MAX_BATCH - 1, max_size=MAX_BATCH + 2),
    )


def fields(
    required: dict[str, st.SearchStrategy[Any]], optional: dict[str, st.SearchStrategy[Any]]
) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(required, optional=optional)


# Values an engine accepts (the body then runs a whole PD request and its bytes are logged),
# and values of any type (the engines may refuse them; the router must not care).
valid_text_parts = st.fixed_dictionaries({"type": st.just("text"), "text": texts})
other_parts = st.fixed_dictionaries(
    {"type": st.sampled_from(["image_url", "input_audio", "video_url", ""])},
    optional={"image_url": json_values, "text": json_values},
)
valid_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool"])},
        optional={
            "content": st.one_of(
                texts, st.none(), st.lists(st.one_of(valid_text_parts, other_parts), max_size=4)
            ),
            "name": json_values,
        },
    ),
    min_size=1,
    max_size=4,
)
any_messages = st.one_of(
    st.lists(
        st.one_of(
            st.fixed_dictionaries(
                {"role": json_values},
                optional={
                    "content": st.one_of(
                        json_values,
                        st.lists(st.one_of(valid_text_parts, other_parts, json_values)),
                    )
                },
            ),
            json_values,  # a message that is no object at all
        ),
        max_size=4,
    ),
    json_values,
)
huge_counts = st.sampled_from([2**64 - 1, 3_000_000, 10**8, 2**70, -(2**70), MAX_BATCH + 1])
# `stream` is a boolean or null (anything else is refused: payload.stream_flag); the bodies of
# any type try every value, the valid ones mostly what engines take.
streams = st.one_of(st.booleans(), st.none(), json_values)
common_valid = {"stream": st.one_of(st.booleans(), st.none()), "rid": texts, "model": json_values}
common_any = {"stream": streams, "rid": rids, "model": json_values}

VALID_FIELDS = {
    GENERATE: st.builds(
        lambda inputs, rest: {**inputs, **rest},
        st.one_of(
            fields({"text": st.one_of(texts, batch_lists(texts).filter(bool))}, {}),
            fields({"input_ids": st.one_of(token_ids.filter(bool), batch_lists(token_ids))}, {}),
        ),
        fields(
            {},
            {
                **common_valid,
                "sampling_params": st.fixed_dictionaries(
                    {"max_new_tokens": small_counts}, optional={"temperature": floats}
                ),
                "return_logprob": json_values,
                "top_logprobs_num": small_counts,
            },
        ),
    ),
    COMPLETIONS: fields(
        {
            "prompt": st.one_of(
                texts,
                batch_lists(texts).filter(bool),
                token_ids.filter(bool),
                batch_lists(token_ids).filter(bool),
            )
        },
        {
            **common_valid,
            "max_tokens": st.one_of(small_counts, st.none()),
            "logprobs": st.one_of(st.booleans(), st.none(), small_counts),
            "n": json_values,  # anything but an integer is refused (payload.sample_count)
            "stream_options": json_values,
        },
    ),
    CHAT: fields(
        {"messages": valid_messages},
        {
            **common_valid,
            "n": st.one_of(st.integers(1, MAX_BATCH + 2), huge_counts),
            "logprobs": json_values,
            "top_logprobs": small_counts,
            "max_tokens": small_counts,
            "max_completion_tokens": small_counts,
            "stream_options": json_values,
        },
    ),
}
ANY_FIELDS = {
    GENERATE: fields(
        {},
        {
            **common_any,
            "text": st.one_of(texts, batch_lists(texts), json_values),
            "input_ids": st.one_of(token_ids, batch_lists(token_ids), json_values),
            "sampling_params": non_ints,
            "return_logprob": json_values,
            "top_logprobs_num": non_ints,
        },
    ),
    COMPLETIONS: fields(
        {},
        {
            **common_any,
            "prompt": st.one_of(batch_lists(json_values), json_values),
            "max_tokens": non_ints,
            "logprobs": non_ints,
            "n": json_values,
            "stream_options": json_values,
        },
    ),
    CHAT: fields(
        {},
        {
            **common_any,
            "messages": any_messages,
            "n": st.one_of(st.integers(-3, MAX_BATCH + 2), huge_counts, non_ints),
            "logprobs": json_values,
            "top_logprobs": non_ints,
            "max_tokens": non_ints,
            "max_completion_tokens": non_ints,
        },
    ),
}


@attrs.frozen
class Case:
    path: str
    raw: bytes

    def __repr__(self) -> str:  # hypothesis prints this for a falsifying example
        return f"Case({self.path!r}, {self.raw[:2000]!r})"


@st.composite
def object_cases(draw: st.DrawFn) -> Case:
    """A JSON object shaped for one route (sometimes for another), serialized one of many ways."""
    path = draw(st.sampled_from(PATHS))
    shaped_for = draw(st.sampled_from([*[path] * 5, *PATHS]))
    body: dict[str, Any] = {}
    body.update(draw(extras))
    valid = draw(st.integers(0, 4)) > 0 and shaped_for == path
    body.update(draw((VALID_FIELDS if valid else ANY_FIELDS)[shaped_for]))
    if draw(st.integers(0, 3)) == 0:
        body.update(draw(client_bootstrap))
    items = list(body.items())
    order = draw(st.permutations(range(len(items)))) if items else []
    body = dict(items[i] for i in order)
    style = draw(st.sampled_from(["compact", "spaced", "indent", "ascii"]))
    if style == "compact":
        text = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    elif style == "spaced":
        text = " " + json.dumps(body, ensure_ascii=False) + " \n"
    elif style == "indent":
        text = json.dumps(body, ensure_ascii=False, indent=1)
    else:
        text = json.dumps(body)  # \uXXXX escapes
    return Case(path, text.encode())


ODD_BODIES = (
    b"",
    b" ",
    b"{",
    b"}",
    b"{}",
    b"{} {}",
    b"[]",
    b"[{}]",
    b"null",
    b"true",
    b"0",
    b"-1",
    b"18446744073709551616",
    b'"text"',
    b'{"text": NaN}',
    b'{"text": "x", "n": Infinity}',
    b'{"text": "x", "a": -Infinity}',
    b'{"text": "x", "a": 1e400}',  # not a finite double: may be refused, never mangled
    b'{"text": "x", "a": 1' + b"0" * 5000 + b"}",  # past Python's int-digit limit
    b'{"text": "x", "a": -0, "b": -0.0, "c": 1E-400, "d": 1.0000000000000000000001}',
    b'{"text": "x", "a": 12345678901234567890123, "bootstrap_room": 5}',
    b'{"text": "x", "a": "12345678901234567890123"}',
    b"\xef\xbb\xbf" + b'{"text": "x"}',  # a UTF-8 byte order mark
    b'{"text": "\xff\xfe"}',  # not UTF-8
    b'{"text": "\\ud800"}',  # a lone surrogate escape
    b'{"text": "x\x01"}',  # a raw control character inside a string
    b'{"text": "x", "text": "y"}',
    b'{"bootstrap_room": 1, "bootstrap_room": 2, "text": "x"}',
    b'{"bootstrap_host": "evil", "text": "x", "bootstrap_port": 1, "bootstrap_room": -1}',
    b'{"text": "x"}garbage',
    b'{"text": "x",}',
    b"{'text': 'x'}",
    b'{"text": "x"}\x00',
    b'\t\r\n {"text" : "x" } \t\r\n',
    b'{"text":"x","nested":' + b"[" * 200 + b"]" * 200 + b"}",
    b'{"text":"x","nested":' + b"[" * 2000 + b"]" * 2000 + b"}",
    '{"text": "\u00e9\u4e2d\U0001f600\u202e", "\u00e9": "\u0000"}'.encode(),
)


@st.composite
def raw_cases(draw: st.DrawFn) -> Case:
    """Bytes that are no JSON object: garbage, other JSON values, cut or padded objects."""
    path = draw(st.sampled_from(PATHS))
    kind = draw(st.sampled_from(["binary", "value", "cut", "padded", "odd"]))
    if kind == "binary":
        raw = draw(st.binary(max_size=48))
    elif kind == "value":
        raw = json.dumps(draw(json_values.filter(lambda v: not isinstance(v, dict)))).encode()
    elif kind in ("cut", "padded"):
        whole = draw(object_cases()).raw
        if kind == "cut":
            raw = whole[: draw(st.integers(0, max(0, len(whole) - 1)))]
        else:
            raw = whole + draw(st.sampled_from([b"}", b",", b"x", b"\x00", b"]", b"{}", b'""']))
    else:
        raw = draw(st.sampled_from(ODD_BODIES))
    return Case(path, raw)


cases = st.one_of(object_cases(), object_cases(), object_cases(), raw_cases())

# -- the oracle -------------------------------------------------------------------------------


class NotAJsonObject(ValueError):
    pass


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise NotAJsonObject(f"{text[:20]} is not a finite double")
    return value


def _no_constant(name: str) -> Any:
    raise NotAJsonObject(f"{name} is not JSON")


def strict_parse(raw: bytes) -> Any:
    """RFC 8259 JSON, integers exact: UTF-8 only (no BOM), no NaN/Infinity, finite numbers."""
    try:
        text = raw.decode("utf-8")
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and the int-digit limit too
        raise NotAJsonObject(str(exc)) from None


def has_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, list):
        return any(has_lone_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(has_lone_surrogate(k) or has_lone_surrogate(v) for k, v in value.items())
    return False


def batch_size(path: str, body: dict[str, Any]) -> int | None:
    """docs/protocol.md §2's table: how many sequences (None: one, scalar bootstrap fields)."""
    if path == GENERATE:
        text, ids = body.get("text"), body.get("input_ids")
        if isinstance(text, list):
            return len(text)
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            return len(ids)
    elif path == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            return len(prompt)
    return None


def samples_of(path: str, body: dict[str, Any]) -> int:
    """How many samples of its prompt a request asks (`n`; `sampling_params.n` on /generate):
    each is its own PD request, the body less `n` (pd/samples.py)."""
    if path == GENERATE:
        params = body.get("sampling_params")
        n = params.get("n") if isinstance(params, dict) else None
    else:
        n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def n_refused(path: str, body: dict[str, Any]) -> bool:
    """An `n` the router refuses (pd/payload.sample_count): present and not a JSON integer, or
    in a list of per-prompt sampling_params and not 1."""

    def integer(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if path != GENERATE:
        return "n" in body and not integer(body["n"])
    params = body.get("sampling_params")
    if isinstance(params, list):
        return any(
            isinstance(p, dict) and "n" in p and not (integer(p["n"]) and p["n"] == 1)
            for p in params
        )
    return isinstance(params, dict) and "n" in params and not integer(params["n"])


def without_n(path: str, body: dict[str, Any]) -> dict[str, Any]:
    if path == GENERATE:
        params = {k: v for k, v in body["sampling_params"].items() if k != "n"}
        return {**body, "sampling_params": params}
    return {k: v for k, v in body.items() if k != "n"}


def same(a: Any, b: Any) -> bool:
    """Equal value for value and type for type (1 != 1.0 != True; -0.0 keeps its sign)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    return a == b


# -- the check of one request ----------------------------------------------------------------


@attrs.define
class Checker:
    cluster: Cluster
    stats: Counter[str] = attrs.Factory(Counter)
    serial: int = 0

    def assert_envelope(self, response: httpx2.Response, what: str) -> dict[str, Any]:
        assert response.headers.get("content-type", "").startswith("application/json"), what
        error = response.json()["error"]
        assert isinstance(error["message"], str), what
        assert error["message"], what
        assert isinstance(error["type"], str), what
        assert isinstance(error["code"], str | int), what
        return error

    async def check(self, case: Case) -> None:
        self.serial += 1
        rid = f"fuzz-{self.serial}"
        cluster = self.cluster
        response = await cluster.client.post(
            case.path,
            content=case.raw,
            headers={"x-request-id": rid, "content-type": "application/json"},
        )
        what = f"{case!r} -> {response.status_code} {response.content[:300]!r}"
        self.stats[f"status {response.status_code}"] += 1
        assert response.headers["x-request-id"] == rid, what
        if response.status_code >= 500:
            error = self.assert_envelope(response, what)
            assert error["type"] != "internal_error", f"the router failed inside: {what}"
        starts = {
            "prefill": cluster.prefill.events.find("request_start", rid=rid),
            "decode": cluster.decode.events.find("request_start", rid=rid),
        }
        try:
            client = strict_parse(case.raw)
            if not isinstance(client, dict):
                raise NotAJsonObject("not an object")
        except NotAJsonObject:
            client = None
        if client is None:
            self.stats["refused: not a JSON object"] += 1
            self.assert_refused(response, starts, what)
            return
        if has_lone_surrogate(client) and not any(starts.values()):
            # Not valid Unicode text: refusing it (orjson does) is as right as passing it on.
            self.stats["refused: lone surrogate"] += 1
            self.assert_refused(response, starts, what)
            return
        batch = batch_size(case.path, client)
        samples = samples_of(case.path, client)
        # Retries are off: one attempt per sample at most.
        assert all(len(s) <= samples for s in starts.values()), f"retries are off: {what}"
        if batch is not None and batch > MAX_BATCH:
            self.stats["refused: batch over the limit"] += 1
            self.assert_refused(response, starts, what)
            assert str(batch) in response.json()["error"]["message"], what
            return
        stream = client.get("stream")
        if stream is not None and not isinstance(stream, bool):
            # Engines differ on what a non-boolean `stream` means: refused (payload.stream_flag).
            self.stats["refused: stream not a boolean"] += 1
            self.assert_refused(response, starts, what)
            assert "`stream`" in response.json()["error"]["message"], what
            return
        if n_refused(case.path, client):
            self.stats["refused: n not counted"] += 1
            self.assert_refused(response, starts, what)
            assert "`n`" in response.json()["error"]["message"], what
            return
        if samples > MAX_BATCH:
            self.stats["refused: n over the limit"] += 1
            self.assert_refused(response, starts, what)
            assert str(samples) in response.json()["error"]["message"], what
            return
        if samples > 1 and batch is not None:
            self.stats["refused: n > 1 with a batch"] += 1
            self.assert_refused(response, starts, what)
            return
        if samples > 1:
            self.stats["forwarded as samples"] += 1
            client = without_n(case.path, client)
        # A valid body the router must have passed on (it may still have been cut short: an
        # engine refusing it, or prefill failing before decode read its request).
        assert starts["prefill"] or starts["decode"], f"the router answered itself: {what}"
        raws = {role: s[0]["raw"] for role, s in starts.items() if s and "raw" in s[0]}
        if len(raws) == 2 and samples == 1:
            assert raws["prefill"] == raws["decode"], f"the legs got different bodies: {what}"
        if not raws:
            self.stats["forwarded, refused by the engines"] += 1
            for engine in (cluster.prefill, cluster.decode):
                for end in engine.events.find("request_end", rid=rid):
                    self.stats[f"engine said: {str(end.get('error'))[:40]}"] += 1
            return
        self.stats["forwarded, compared"] += 1
        leg_raw = next(iter(raws.values())).encode("utf-8", "surrogateescape")
        self.assert_leg_body(case, client, batch, leg_raw, what, samples)

    def assert_rid(self, client_rid: Any, batch: int | None, rid: Any, what: str) -> None:
        """The engines' rid is always the router's own (a client's, string or list, never
        reaches them: another client could collide with it or have it aborted): one fixed-length
        `trio-pd-<hex>` per attempt, or one `<base>-<i>` per batch item, none a prefix of
        another (the engine aborts by prefix)."""
        if client_rid is not None:
            self.stats["rid: the client's, replaced"] += 1
            assert not same(rid, client_rid), what
        if batch is None:
            assert isinstance(rid, str) and ENGINE_RID.fullmatch(rid), what
        else:
            assert isinstance(rid, list) and len(set(rid)) == len(rid) == batch, what
            assert all(ENGINE_RID.fullmatch(r.rpartition("-")[0]) for r in rid), what
            assert not any(a != b and b.startswith(a) for a in rid for b in rid), what

    def assert_refused(
        self, response: httpx2.Response, starts: dict[str, list[Any]], what: str
    ) -> None:
        assert response.status_code == 400, what
        error = self.assert_envelope(response, what)
        assert error["type"] == "invalid_request_error", what
        assert not starts["prefill"], f"a refused body reached prefill: {what}"
        assert not starts["decode"], f"a refused body reached decode: {what}"

    def assert_leg_body(
        self,
        case: Case,
        client: dict[str, Any],
        batch: int | None,
        leg_raw: bytes,
        what: str,
        samples: int = 1,
    ) -> None:
        leg = strict_parse(leg_raw)
        assert isinstance(leg, dict), what
        added = set(leg) - set(client) - set(ROUTER_FIELDS)
        assert not added, f"the router added {sorted(added)}: {what}"
        lost = set(client) - set(leg)
        assert not lost, f"the router dropped {sorted(lost)}: {what}"
        for key, value in client.items():
            if key not in ROUTER_FIELDS:
                assert same(leg[key], value), f"{key!r}: {leg[key]!r} != {value!r}: {what}"
        self.assert_rid(client.get("rid"), batch, leg["rid"], what)
        host, port, room = (leg[k] for k in BOOTSTRAP)
        prefill = self.cluster.prefill
        if batch is None:
            assert same(host, "127.0.0.1"), what
            assert same(port, prefill.bootstrap_port), what
            assert type(room) is int, what
            assert 1 <= room <= MAX_ROOM, what  # room 0 is the decode's "not yet" sentinel
        else:
            self.stats["forwarded, compared, batch"] += 1
            assert same(host, ["127.0.0.1"] * batch), what
            assert same(port, [prefill.bootstrap_port] * batch), what
            assert all(type(r) is int and 1 <= r <= MAX_ROOM for r in room), what
            assert len(set(room)) == len(room) == batch, what
        if samples == 1 and not any(k in client for k in ROUTER_FIELDS):
            # The client's own bytes, up to its closing brace, are the start of the legs' body.
            end = case.raw.rstrip().rindex(b"}")
            assert leg_raw.startswith(case.raw[:end]), f"the body was re-serialized: {what}"
        else:
            self.stats["forwarded, compared, client bootstrap_* replaced"] += 1


# -- the test ---------------------------------------------------------------------------------


@pytest.fixture
async def cluster(nursery: trio.Nursery):
    """The production default: the router owns each attempt's `rid` (aborts on cancel)."""
    cluster = await start_cluster(nursery, abort_on_cancel=True)
    yield cluster
    await cluster.client.aclose()


async def test_fuzz_generation_routes(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(
        nursery,
        max_batch_size=MAX_BATCH,
        request_timeout_secs=10.0,
        max_payload_size=1 << 20,
        abort_on_cancel=True,
    )
    checker = Checker(cluster)

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(case=cases)
    @example(
        case=Case(
            CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "n": 18446744073709551615}'
        )
    )
    @example(
        case=Case(
            GENERATE,
            b'{"text": "x", "bootstrap_room": 18446744073709551616, "big": -18446744073709551617}',
        )
    )
    @example(
        case=Case(COMPLETIONS, b'{"prompt": [[1], [2]], "bootstrap_host": ["a", "b"], "f": 1e-320}')
    )
    @example(
        case=Case(GENERATE, b'{"text": "x", "x": 1.7976931348623157e308, "y": 5e-324, "z": -0.0}')
    )
    # Batches just over the limit, each shape once: a generated run draws too few of them to
    # count on (1 to 7, by run), and refusing them without reaching an engine is the claim.
    @example(case=Case(GENERATE, orjson.dumps({"text": ["a"] * (MAX_BATCH + 1)})))
    @example(case=Case(GENERATE, orjson.dumps({"input_ids": [[1]] * (MAX_BATCH + 1)})))
    @example(case=Case(COMPLETIONS, orjson.dumps({"prompt": ["a"] * (MAX_BATCH + 1)})))
    @example(case=Case(COMPLETIONS, orjson.dumps({"prompt": [[1, 2]] * (MAX_BATCH + 2)})))
    @example(case=Case(GENERATE, orjson.dumps({"text": ["b"] * (4 * MAX_BATCH), "stream": True})))
    # A non-boolean `stream`, twice: generated runs drew 1 to 5 of them (hypothesis takes some
    # constants from the modules a worker has loaded, so derandomize does not fix the count).
    @example(case=Case(GENERATE, b'{"text": "x", "stream": "yes"}'))
    @example(case=Case(COMPLETIONS, b'{"prompt": "x", "stream": 1}'))
    def run(case: Case) -> None:
        trio.from_thread.run(checker.check, case)

    await trio.to_thread.run_sync(run)
    print(f"\nfuzz: {sorted(checker.stats.items())}")

    # Nothing the run did is left behind, and the router still serves a normal request.
    await settle(lambda: cluster.decode.running == 0 and cluster.decode.queued == 0, timeout=10)
    await settle(lambda: "active" not in cluster.upstream_connections(cluster.decode))
    await settle(lambda: "active" not in cluster.upstream_connections(cluster.prefill))
    response = await cluster.client.post("/generate", json=generate_body())
    assert response.status_code == 200
    assert response.json()["meta_info"]["completion_tokens"] == 4
    # The run really covered what it claims to (a strategy gone wrong would not).
    stats = checker.stats
    assert stats["forwarded, compared"] >= MIN_COMPARED, stats
    assert stats["forwarded, compared, batch"] >= 5, stats
    assert stats["forwarded, compared, client bootstrap_* replaced"] >= 5, stats
    assert stats["refused: not a JSON object"] >= 20, stats
    assert stats["refused: batch over the limit"] >= 5, stats
    assert stats["refused: stream not a boolean"] >= 2, stats  # the two examples at least
    await cluster.client.aclose()


# -- found by hand around the fuzzer's edges ---------------------------------------------------

DEEP_PADDING = b',"pad":"' + b"x" * 40_000 + b'"'  # past OFFLOAD_BYTES: parsed in a worker process


def nested(depth: int, extra: bytes) -> bytes:
    return b'{"text":"deep","a":' + b"[" * depth + b"]" * depth + extra + b"}"


@pytest.mark.parametrize("offloaded", [False, True], ids=["inline", "offloaded"])
@pytest.mark.parametrize(
    ("depth", "extra"),
    [
        (500, b',"big":123456789012345678901234567890'),
        (500, b',"bootstrap_room":7'),
        (1000, b',"big":123456789012345678901234567890'),
        (1000, b',"bootstrap_room":7'),
        (1023, b',"big":-123456789012345678901234567890'),
        (1023, b',"bootstrap_host":"evil"'),
    ],
    ids=["500-bigint", "500-bootstrap", "1000-bigint", "1000-bootstrap", "1023-bigint",
         "1023-bootstrap"],
)  # fmt: skip
async def test_deep_nesting_is_forwarded_or_refused_never_a_500(
    cluster: Cluster, depth: int, extra: bytes, offloaded: bool
) -> None:
    """orjson takes up to 1024 levels; whatever else the router runs on such a body (the exact
    integer path, the re-serialization without client bootstrap_*) must not fail on it: the
    body is either passed on exactly, or refused with a 400 that reached no worker."""
    raw = nested(depth, extra + (DEEP_PADDING if offloaded else b""))
    response = await cluster.client.post("/generate", content=raw)
    rid = response.headers["x-request-id"]
    starts = [
        *cluster.prefill.events.find("request_start", rid=rid),
        *cluster.decode.events.find("request_start", rid=rid),
    ]
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert response.json()["error"]["type"] == "invalid_request_error"
        assert not starts
        return
    assert len(starts) == 2
    leg = starts[0]["raw"].encode("utf-8", "surrogateescape")
    assert leg == starts[1]["raw"].encode("utf-8", "surrogateescape")
    client, got = orjson.loads(raw), orjson.loads(leg)  # orjson: depth up to 1024
    for key in ROUTER_FIELDS:
        client.pop(key, None)
        assert key in got
    if b"big" in extra:
        assert leg.startswith(raw[:-1])  # spliced: the 30-digit integer went as sent
    assert {k: v for k, v in got.items() if k not in ROUTER_FIELDS} == client


# Header values may carry any visible ASCII and obs-text (0x80-0xFF); h11 accepts both.
header_bytes = st.binary(min_size=1, max_size=24).map(
    lambda b: bytes(c for c in b if c > 0x20 and c != 0x7F) or b"x"
)


async def test_request_id_bytes_are_echoed_exactly(cluster: Cluster) -> None:
    """A client's x-request-id of visible ASCII comes back in the response and reaches the
    workers byte for byte (docs/protocol.md §3), on a refused request and on a forwarded one; one
    with obs-text (0x80-0xFF) is replaced by a new id, as SGLang's router does
    (`request_ids.py`), and that id is what the client and the workers get."""
    seen: list[bytes] = []

    async def check(request_id: bytes) -> None:
        seen.append(request_id)
        usable = all(c < 0x7F for c in request_id)
        headers = [(b"x-request-id", request_id)]
        refused = await cluster.client.post("/generate", content=b"[]", headers=headers)
        assert refused.status_code == 400
        echoed = [v for k, v in refused.headers.raw if k.lower() == b"x-request-id"]
        assert len(echoed) == 1, refused.headers.raw
        if usable:
            assert echoed == [request_id]
        else:
            assert echoed[0].startswith(b"gnt-") and echoed[0] != request_id
        forwarded = await cluster.client.post("/generate", json={"text": "x"}, headers=headers)
        expected = request_id if usable else forwarded.headers["x-request-id"].encode()
        assert expected.startswith(b"gnt-") or usable
        text = expected.decode("latin-1")  # how the engine logs a header (its `rid`)
        assert cluster.prefill.events.find("request_start", rid=text), request_id

    @settings(max_examples=40, derandomize=True, deadline=None, database=None)
    @given(request_id=header_bytes)
    @example(request_id=b"caf\xe9")
    @example(request_id=b"plain-ascii-id")
    def run(request_id: bytes) -> None:
        trio.from_thread.run(check, request_id)

    await trio.to_thread.run_sync(run)
    assert len(set(seen)) > 20
    assert any(all(c < 0x7F for c in i) for i in seen) and any(c >= 0x80 for i in seen for c in i)
