"""The simulator's frozen configuration (one object per engine process or test engine).

Field names follow SGLang 0.5.23's server arguments where the simulator models one (`dp_size`,
`attn_dp_size`, `load_balance_method`, `max_running_requests` as `max_running`, ...); the
properties at the end resolve them the way the engine does (`server_args.py`,
`arg_groups/serving_hook.py`, `runtime_context.py`), and GET /server_info reports the resolved
values. Timeouts default to SGLang's own (`environ.py`), except where a test wants speed and the
field says so.
"""

from __future__ import annotations

from typing import Literal

import attrs

Role = Literal["prefill", "decode"]
ROLES: tuple[str, ...] = ("prefill", "decode")
LOAD_BALANCE_METHODS = (
    "auto",
    "round_robin",
    "follow_bootstrap_room",
    "total_requests",
    "total_tokens",
)
TRANSFER_BACKENDS = ("mooncake", "nixl", "ascend", "mori", "fake")
SGLANG_VERSION = "0.5.23"  # the engine release this simulator models


def _check_role(_inst: object, _attr: attrs.Attribute, value: str) -> None:
    if value not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {value!r}")


def _at_least_one(_inst: object, attr: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ValueError(f"{attr.name} must be at least 1, not {value!r}")


def _one_of(choices: tuple[str, ...]):
    def check(_inst: object, attr: attrs.Attribute, value: str) -> None:
        if value not in choices:
            raise ValueError(f"{attr.name} must be one of {choices}, not {value!r}")

    return check


@attrs.frozen
class EngineConfig:
    """Everything an engine needs; port 0 / bootstrap_port 0 mean "pick an ephemeral port"."""

    role: Role = attrs.field(validator=_check_role)
    host: str = "127.0.0.1"
    port: int = 0
    bootstrap_port: int | None = 0  # prefill only; ignored by decode
    # decode: WaitingForInput limit, counted from the KV metadata publish (slot acquired)
    waiting_timeout: float = 300.0  # SGLANG_DISAGGREGATION_WAITING_TIMEOUT
    # prefill: how long a request waits for its decode's registration
    bootstrap_timeout: float = 300.0  # SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT
    prefill_ms_per_token: float = 0.0
    # prefill: how long a request's KV takes to reach its decode after its computation, in
    # SGLang's inflight queue (`prefill_inflight_queue_reqs`); 0: at once
    kv_transfer_ms: float = 0.0
    inter_token_ms: float = 0.0
    max_running: int = 64  # decode slots (KV preallocations) per data-parallel rank
    max_total_tokens: int = 262_144  # KV pool size per rank (/v1/loads token_usage)
    # Another router's requests queued for compute per rank, reported by /v1/loads from the start
    # (`EngineState.saturate` changes it at run time): a saturated engine for the benchmarks.
    extra_queued: int = 0
    # a prompt this long or longer is refused with SGLang's 400 (SGLang: the model's context;
    # large here unless a test sets it, e.g. a prefill with a shorter context than its decode)
    context_length: int = 1 << 24
    # A non-stream request notices its client left at the next poll of this period, counted
    # from when it reached the scheduler (SGLANG_REQUEST_STATE_WAIT_TIMEOUT, 4 s).
    disconnect_poll_secs: float = 4.0
    faults: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    events_path: str | None = None
    model: str = "sim-model"
    keep_alive_secs: float = 5.0  # must stay above the router's client keep-alive expiry
    # --dp-size, and --attn-dp-size or --dp-size N --enable-dp-attention (see dp_size_resolved)
    dp_size: int = attrs.field(default=1, validator=_at_least_one)
    attn_dp_size: int = attrs.field(default=1, validator=_at_least_one)
    enable_dp_attention: bool = False
    tp_size: int | None = None  # None: attn_dp_size (the usual --tp N --dp N layout)
    load_balance_method: str = attrs.field(default="auto", validator=_one_of(LOAD_BALANCE_METHODS))
    transfer_backend: str = attrs.field(default="mooncake", validator=_one_of(TRANSFER_BACKENDS))
    api_key: str | None = None  # every NORMAL route but /health*, /ready*, /metrics* needs it
    admin_api_key: str | None = None  # ADMIN_OPTIONAL routes (/abort_request) need this one
    ssl_certfile: str | None = None  # serve the HTTP API over HTTPS (bootstrap stays HTTP)
    ssl_keyfile: str | None = None  # None: the key is in ssl_certfile
    ssl_ca_certs: str | None = None  # also require client certificates signed by this CA
    # The window between a request's registration and its dispatch to the scheduler, where an
    # abort is lost and latches (tokenizer_manager.py): the async dynamic batch tokenizer
    # waits up to its batch timeout; tokenize_delay_ms adds more (multimodal processing).
    enable_dynamic_batch_tokenizer: bool = False
    dynamic_batch_tokenizer_batch_timeout: float = 0.002
    tokenize_delay_ms: float = 0.0
    # > 1: the tokenizer manager forwards aborts of rids it has not registered
    tokenizer_worker_num: int = attrs.field(default=1, validator=_at_least_one)
    # Generated tokens that cut characters of several UTF-8 bytes, detokenized the way SGLang's
    # detokenizer does (its text held back until the character is whole): `detokenize.py`.
    multibyte_tokens: bool = False
    # Be an engine before 0.5.23: the old GET /get_load, no /v1/loads (a router's fallback).
    legacy_load_endpoint: bool = False
    # GET /health and /health_generate run a 1-token generation; SGLang answers after >= 1 s.
    # 0 here so in-process test engines answer probes at once; `trio-pd-testing engine`: 1.
    health_generate_secs: float = 0.0
    # decode: each prefill bootstrap server it talks to gets GET /health every interval; after
    # max_failures misses in a row that prefill's unfinished rooms fail (conn.py heartbeat).
    heartbeat_interval: float = 5.0  # SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL (SGLang: >= 2)
    heartbeat_max_failures: int = 2  # SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE
    # decode: an unreachable bootstrap server is retried this often, 1 s apart (decode.py)
    bootstrap_retries: int = 15
    bootstrap_retry_interval: float = 1.0
    # decode: KV pages of a transfer that was aborted or failed stay held until the prefill
    # acknowledges the abort, or this long (SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_*)
    deferred_kv_release: bool = True
    deferred_kv_release_timeout: float = 30.0
    # prefill: SGLang's --kv-events-config JSON (`{"publisher": "zmq", "endpoint":
    # "tcp://127.0.0.1:0", "replay_endpoint": ...}`; port 0: ephemeral, simulator only) and the
    # KV page size (--page-size: the events' block size)
    kv_events_config: str | None = None
    page_size: int = attrs.field(default=1, validator=_at_least_one)

    def __attrs_post_init__(self) -> None:
        if (self.ssl_keyfile or self.ssl_ca_certs) and not self.ssl_certfile:
            raise ValueError("ssl_keyfile and ssl_ca_certs need ssl_certfile")
        if self.enable_dp_attention and self.attn_dp_size > 1:
            raise ValueError("give --attn-dp-size N, or --dp-size N --enable-dp-attention")
        if self.dp_size_resolved > 1 and self.attn_dp_size_resolved > 1:
            raise ValueError("dp_size and attn_dp_size cannot both be above 1")

    @property
    def scheme(self) -> str:
        """Of the HTTP API; the prefill's bootstrap server is always plain HTTP."""
        return "https" if self.ssl_certfile else "http"

    # ---- resolution, as SGLang 0.5.23 reports it in /server_info ---------------------------
    @property
    def dp_size_resolved(self) -> int:
        """`--dp-size N --enable-dp-attention` resolves to dp_size=1, attn_dp_size=N."""
        return 1 if self.enable_dp_attention else self.dp_size

    @property
    def attn_dp_size_resolved(self) -> int:
        return self.dp_size if self.enable_dp_attention else self.attn_dp_size

    @property
    def num_dp_ranks(self) -> int:
        """The ranks behind this URL: dp_size x attn_dp_size (runtime_context.num_dp_ranks_of)."""
        return self.dp_size_resolved * self.attn_dp_size_resolved

    @property
    def tp_size_resolved(self) -> int:
        return self.tp_size if self.tp_size is not None else self.attn_dp_size_resolved

    @property
    def load_balance_method_resolved(self) -> str:
        """`auto`: follow_bootstrap_room on a PD prefill, round_robin on a decode."""
        if self.load_balance_method != "auto":
            return self.load_balance_method
        return "follow_bootstrap_room" if self.role == "prefill" else "round_robin"

    @property
    def tokenize_window(self) -> float:
        """Seconds between registration and dispatch of a text prompt."""
        batch = self.dynamic_batch_tokenizer_batch_timeout
        return (
            batch if self.enable_dynamic_batch_tokenizer else 0.0
        ) + self.tokenize_delay_ms / 1e3
