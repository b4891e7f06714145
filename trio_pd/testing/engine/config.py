"""The simulator's frozen configuration (one object per engine process or test engine)."""

from __future__ import annotations

from typing import Literal

import attrs

Role = Literal["prefill", "decode"]
ROLES: tuple[str, ...] = ("prefill", "decode")


def _check_role(_inst: object, _attr: attrs.Attribute, value: str) -> None:
    if value not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {value!r}")


def _at_least_one(_inst: object, attr: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ValueError(f"{attr.name} must be at least 1, not {value!r}")


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
    disconnect_poll_secs: float = 4.0
    faults: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    events_path: str | None = None
    model: str = "sim-model"
    keep_alive_secs: float = 5.0  # must stay above the router's client keep-alive expiry
    dp_size: int = attrs.field(default=1, validator=_at_least_one)  # data-parallel ranks
    api_key: str | None = None  # every route but /health* and /metrics* needs "Bearer KEY"
    ssl_certfile: str | None = None  # serve the HTTP API over HTTPS (bootstrap stays HTTP)
    ssl_keyfile: str | None = None  # None: the key is in ssl_certfile
    ssl_ca_certs: str | None = None  # also require client certificates signed by this CA

    def __attrs_post_init__(self) -> None:
        if (self.ssl_keyfile or self.ssl_ca_certs) and not self.ssl_certfile:
            raise ValueError("ssl_keyfile and ssl_ca_certs need ssl_certfile")

    @property
    def scheme(self) -> str:
        """Of the HTTP API; the prefill's bootstrap server is always plain HTTP."""
        return "https" if self.ssl_certfile else "http"
