"""The simulator's frozen configuration (one object per engine process or test engine).

Field names follow SGLang 0.5.23's server arguments where the simulator models one; the
properties at the end resolve them the way the engine does (`server_args.py`,
`arg_groups/serving_hook.py`, `runtime_context.py`), and GET /server_info reports the resolved
values.
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
    waiting_timeout: float = 300.0  # decode: WaitingForInput limit (SGLang's default)
    bootstrap_timeout: float = 30.0  # prefill: how long to wait for the decode's registration
    prefill_ms_per_token: float = 0.0
    inter_token_ms: float = 0.0
    max_running: int = 64  # decode slots per data-parallel rank
    max_total_tokens: int = 262_144  # KV pool size per rank (/v1/loads token_usage)
    context_length: int = 32_768
    disconnect_poll_secs: float = 4.0
    faults: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    events_path: str | None = None
    model: str = "sim-model"
    keep_alive_secs: float = 5.0  # must stay above the router's client keep-alive expiry
    # --dp-size, and --attn-dp-size or --dp-size N --enable-dp-attention (see num_dp_ranks)
    dp_size: int = attrs.field(default=1, validator=_at_least_one)
    attn_dp_size: int = attrs.field(default=1, validator=_at_least_one)
    enable_dp_attention: bool = False
    tp_size: int | None = None  # None: attn_dp_size (the usual --tp N --dp N layout)
    load_balance_method: str = attrs.field(default="auto", validator=_one_of(LOAD_BALANCE_METHODS))
    transfer_backend: str = attrs.field(default="mooncake", validator=_one_of(TRANSFER_BACKENDS))
    api_key: str | None = None  # every route but /health* and /metrics* needs "Bearer KEY"
    ssl_certfile: str | None = None  # serve the HTTP API over HTTPS (bootstrap stays HTTP)
    ssl_keyfile: str | None = None  # None: the key is in ssl_certfile
    ssl_ca_certs: str | None = None  # also require client certificates signed by this CA
    enable_dynamic_batch_tokenizer: bool = False  # reported in /server_info
    tokenizer_worker_num: int = attrs.field(default=1, validator=_at_least_one)
    # Serve the old GET /get_load (gone in 0.5.23) to test a router's fallback for old engines.
    legacy_load_endpoint: bool = False

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
