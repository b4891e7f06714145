"""Fault specs: `[ROLE:]KIND[:ARG][@MS|@Ntok|@held][+kv]`, from --fault or a request's `sim_fault`.

KIND is an HTTP status (`500`, `429`, ...), `sse_error[:CODE]` (an error object inside a 200
answer, code 500 unless given), `abort[:CODE]` (finish_reason abort, with `status_code` CODE when
given), `close`, `hang`, `slow:MS`, `hold` (decode: waits where `slow` does, until the test calls
`EngineState.release_held()`: a slot held for exactly as long as a test needs, no clock;
`hold@Ntok`: the stream pauses there after its N-th token instead), `die` (the whole engine
dies as a SIGKILLed SGLang server does: every connection it has is closed at once, every request
it holds is dropped, and it accepts no more connections; `EngineState.die`), or
(engine level only) `refuse`. `@MS` delays the firing by MS milliseconds; `@Ntok` (decode only)
fires it once the decode's answer has sent N tokens, so "mid-stream" is what happened, not a
guess about the clock (the answer's tokens: a resumed request, whose `input_ids` end with the
answer's first M tokens (`workload.continued`), fires after N - M of its own, and not at all
when M >= N). `+kv` (prefill only) fires the fault after the KV cache was sent, so
decode can answer before prefill fails. `@held+kv` (prefill only) fires it after the KV was sent
once the test calls `EngineState.release_held()`: "the prefill fails after the decode answered"
as what happened, where `@MS+kv` bets on the clock (a busy machine lost that bet).
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from trio_pd_testing.engine.config import ROLES

KINDS = ("status", "sse_error", "abort", "close", "hang", "slow", "hold", "die", "refuse")


class FaultError(ValueError):
    """A fault spec that cannot be parsed."""


@attrs.frozen
class Fault:
    spec: str
    kind: str  # one of KINDS
    role: str | None = None  # None: applies to both roles
    status: int | None = None  # kind == "status"
    arg_ms: float = 0.0  # kind == "slow"
    delay_ms: float = 0.0  # the `@MS` suffix
    after_tokens: int | None = None  # the `@Ntok` suffix: fires once N tokens went out
    after_kv: bool = False  # the `+kv` suffix
    after_release: bool = False  # the `@held` suffix (with +kv): fires once release_held()

    @property
    def is_client_error(self) -> bool:
        return self.kind == "status" and self.status is not None and 400 <= self.status < 500

    @property
    def delay(self) -> float:
        return self.delay_ms / 1000.0


def parse_fault(spec: str) -> Fault:
    if not isinstance(spec, str) or not spec.strip():
        raise FaultError(f"fault spec must be a non-empty string, got {spec!r}")
    text = spec.strip()
    after_kv = text.endswith("+kv")
    text = text.removesuffix("+kv")
    after_release = text.endswith("@held")
    if after_release and not (after_kv and text.startswith("prefill:")):
        raise FaultError(f"@held needs the prefill role and +kv: {spec!r}")
    fault = _parse_plain(spec, text.removesuffix("@held"))
    return (
        attrs.evolve(fault, after_kv=after_kv, after_release=after_release) if after_kv else fault
    )


def _parse_plain(spec: str, text: str) -> Fault:
    delay_ms = 0.0
    after_tokens = None
    if "@" in text:
        text, _, delay = text.rpartition("@")
        if delay.endswith("tok"):
            after_tokens = int(_number(delay.removesuffix("tok"), spec))
            if after_tokens < 1 or text.startswith("prefill:"):
                raise FaultError(f"@Ntok needs N >= 1 and the decode role: {spec!r}")
        else:
            delay_ms = _number(delay, spec)
    fault = _parse_kind(spec, text, delay_ms)
    return attrs.evolve(fault, after_tokens=after_tokens) if after_tokens else fault


def _parse_kind(spec: str, text: str, delay_ms: float) -> Fault:
    parts = text.split(":")
    role = None
    if parts[0] in ROLES:
        role = parts.pop(0)
    if not parts or not parts[0]:
        raise FaultError(f"fault spec {spec!r} has no kind")
    kind, args = parts[0], parts[1:]
    if kind.isdigit():
        status = int(kind)
        if not 100 <= status <= 599 or args:
            raise FaultError(f"bad status fault {spec!r}")
        return Fault(spec, "status", role, status=status, delay_ms=delay_ms)
    if kind == "slow":
        if len(args) != 1:
            raise FaultError(f"slow needs one argument (milliseconds): {spec!r}")
        return Fault(spec, "slow", role, arg_ms=_number(args[0], spec), delay_ms=delay_ms)
    if kind in ("sse_error", "abort") and len(args) == 1:  # `sse_error:400`: the in-band code
        code = args[0]
        if not code.isdigit() or not 100 <= int(code) <= 599:
            raise FaultError(f"bad in-band code in fault spec {spec!r}")
        return Fault(spec, kind, role, status=int(code), delay_ms=delay_ms)
    if kind not in KINDS or args:
        raise FaultError(f"unknown fault {spec!r} (kinds: <status>, {', '.join(KINDS[1:])})")
    return Fault(spec, kind, role, delay_ms=delay_ms)


def _number(text: str, spec: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise FaultError(f"bad number {text!r} in fault spec {spec!r}") from None
    if value < 0:
        raise FaultError(f"negative number in fault spec {spec!r}")
    return value


def parse_many(specs: Iterable[str] | str | None) -> tuple[Fault, ...]:
    if specs is None:
        return ()
    if isinstance(specs, str):
        specs = [specs]
    return tuple(parse_fault(s) for s in specs)


@attrs.frozen
class FaultPlan:
    """What one request on one engine must suffer: an extra delay and at most one terminal fault."""

    terminal: Fault | None = None
    slow_ms: float = 0.0
    hold: bool = False  # wait for EngineState.release_held() where `slow` waits
    hold_after_tokens: int | None = None  # `hold@Ntok`: ...or once N tokens went out

    @property
    def slow(self) -> float:
        return self.slow_ms / 1000.0


def plan_for(role: str, faults: Iterable[Fault]) -> FaultPlan:
    terminal = None
    slow_ms = 0.0
    hold = False
    hold_after = None
    for fault in faults:
        if fault.role not in (None, role) or fault.kind == "refuse":
            continue
        if fault.kind == "slow":
            slow_ms += fault.arg_ms + fault.delay_ms
        elif fault.kind == "hold":
            hold, hold_after = True, fault.after_tokens
        elif terminal is None:
            terminal = fault
    return FaultPlan(terminal, slow_ms, hold, hold_after)
