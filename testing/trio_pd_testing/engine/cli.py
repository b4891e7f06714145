"""The simulator's command line: `trio-pd-testing engine ...`, `python -m trio_pd_testing.engine`.

Flag names follow SGLang's (`--dp-size`, `--attn-dp-size`, `--enable-dp-attention`,
`--load-balance-method`, `--api-key`, `--admin-api-key`, `--enable-dynamic-batch-tokenizer`,
`--tokenizer-worker-num`, `--disaggregation-transfer-backend`, `--context-length`,
`--max-running-requests`, `--max-total-tokens`) where the simulator models the setting.
"""

from __future__ import annotations

import argparse
import logging
import sys

import trio

from trio_pd_testing.engine.config import (
    LOAD_BALANCE_METHODS,
    ROLES,
    TRANSFER_BACKENDS,
    EngineConfig,
)
from trio_pd_testing.engine.faults import FaultError, parse_many
from trio_pd_testing.engine.serve import serve_engine

CLI_HEALTH_GENERATE_SECS = 1.0  # SGLang's /health takes >= 1 s; in-process test engines: 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The simulator's flags, in groups (each its own function, in `--help` order)."""
    defaults = EngineConfig(role="prefill")
    _add_listeners_and_pd(parser, defaults)
    _add_capacity(parser, defaults)
    _add_clients(parser, defaults)
    _add_tokenizer_and_health(parser, defaults)
    _add_tls_and_logs(parser, defaults)


def _add_listeners_and_pd(parser: argparse.ArgumentParser, defaults: EngineConfig) -> None:
    """The engine's role and ports, and the PD handshake's timeouts."""
    add = parser.add_argument
    add("--role", choices=ROLES, required=True)
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=30000, help="HTTP API port (0: ephemeral)")
    add("--bootstrap-port", type=int, default=8998, help="prefill: bootstrap server port")
    add(
        "--waiting-timeout",
        type=float,
        default=defaults.waiting_timeout,
        help="decode: seconds to wait for the KV once a slot is held "
        "(SGLANG_DISAGGREGATION_WAITING_TIMEOUT)",
    )
    add(
        "--bootstrap-timeout",
        type=float,
        default=defaults.bootstrap_timeout,
        help="prefill: seconds to wait for the decode's registration "
        "(SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT)",
    )


def _add_capacity(parser: argparse.ArgumentParser, defaults: EngineConfig) -> None:
    """Compute speed, slots, context, data parallelism, the KV transfer backend."""
    add = parser.add_argument
    add("--prefill-ms-per-token", type=float, default=0.0)
    add(
        "--kv-transfer-ms",
        type=float,
        default=0.0,
        help="prefill: a request's KV transfer time after its computation (its inflight queue)",
    )
    add("--inter-token-ms", type=float, default=0.0)
    add(
        "--max-running",
        "--max-running-requests",
        dest="max_running",
        type=int,
        default=defaults.max_running,
        help="decode slots per data-parallel rank (a FIFO queue beyond them)",
    )
    add("--max-total-tokens", type=int, default=defaults.max_total_tokens)
    add(
        "--extra-queued",
        type=int,
        default=0,
        help="/v1/loads reports this many more requests "
        "queued for compute per rank (another router's load)",
    )
    add("--context-length", type=int, default=defaults.context_length)
    add(
        "--dp-size",
        type=int,
        default=defaults.dp_size,
        help="data-parallel replicas (with --enable-dp-attention: attention-DP groups)",
    )
    add("--attn-dp-size", type=int, default=defaults.attn_dp_size)
    add(
        "--enable-dp-attention",
        action="store_true",
        help="deprecated SGLang spelling: --dp-size N --enable-dp-attention is "
        "dp_size=1, attn_dp_size=N",
    )
    add("--tp-size", type=int, default=None)
    add("--load-balance-method", choices=LOAD_BALANCE_METHODS, default="auto")
    add(
        "--disaggregation-transfer-backend",
        dest="transfer_backend",
        choices=TRANSFER_BACKENDS,
        default=defaults.transfer_backend,
    )


def _add_clients(parser: argparse.ArgumentParser, defaults: EngineConfig) -> None:
    """Client disconnects, injected faults, the API keys."""
    add = parser.add_argument
    add(
        "--disconnect-poll-secs",
        type=float,
        default=defaults.disconnect_poll_secs,
        help="a non-stream request notices its client left at the next poll of this period "
        "(SGLANG_REQUEST_STATE_WAIT_TIMEOUT)",
    )
    add(
        "--fault",
        action="append",
        default=[],
        metavar="SPEC",
        help="[ROLE:]KIND[:ARG][@MS], repeatable; KIND: status code, sse_error, abort, close, "
        "hang, slow:MS, refuse",
    )
    add(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health*, /ready*, /metrics*",
    )
    add("--admin-api-key", default=None, help="the key /abort_request and /flush_cache need")


def _add_tokenizer_and_health(parser: argparse.ArgumentParser, defaults: EngineConfig) -> None:
    """The tokenizer, the load endpoint, /health, heartbeats, KV release."""
    add = parser.add_argument
    add("--enable-dynamic-batch-tokenizer", action="store_true")
    add("--dynamic-batch-tokenizer-batch-timeout", type=float, default=0.002)
    add(
        "--tokenize-delay-ms",
        type=float,
        default=0.0,
        help="simulator: widen the registration-to-dispatch window of text prompts",
    )
    add("--tokenizer-worker-num", type=int, default=1)
    add(
        "--multibyte-tokens",
        action="store_true",
        help="simulator: some generated tokens cut a multi-byte UTF-8 character "
        "(detokenized as SGLang does: the text held back until the character is whole)",
    )
    add(
        "--legacy-load-endpoint",
        action="store_true",
        help="also serve GET /get_load (gone in SGLang 0.5.23)",
    )
    add("--health-generate-secs", type=float, default=CLI_HEALTH_GENERATE_SECS)
    add("--heartbeat-interval", type=float, default=defaults.heartbeat_interval)
    add("--heartbeat-max-failures", type=int, default=defaults.heartbeat_max_failures)
    add("--deferred-kv-release-timeout", type=float, default=defaults.deferred_kv_release_timeout)
    add("--kv-events-config", default=None, metavar="JSON", help="SGLang's: publish KV events")
    add("--page-size", type=int, default=defaults.page_size, help="KV page (event block) size")


def _add_tls_and_logs(parser: argparse.ArgumentParser, defaults: EngineConfig) -> None:
    """TLS, the event log, the model name, the log level."""
    add = parser.add_argument
    add("--ssl-certfile", default=None, metavar="FILE", help="serve the HTTP API over HTTPS")
    add(
        "--ssl-keyfile", default=None, metavar="FILE", help="its private key (else in the certfile)"
    )
    add(
        "--ssl-ca-certs",
        default=None,
        metavar="FILE",
        help="require client certificates signed by these CAs (mutual TLS)",
    )
    add("--events", default=None, metavar="FILE", help="JSON-lines event log")
    add("--model", default=defaults.model)
    add("--log-level", default="info")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        role=args.role,
        host=args.host,
        port=args.port,
        bootstrap_port=args.bootstrap_port if args.role == "prefill" else None,
        waiting_timeout=args.waiting_timeout,
        bootstrap_timeout=args.bootstrap_timeout,
        prefill_ms_per_token=args.prefill_ms_per_token,
        kv_transfer_ms=args.kv_transfer_ms,
        inter_token_ms=args.inter_token_ms,
        max_running=args.max_running,
        max_total_tokens=args.max_total_tokens,
        extra_queued=args.extra_queued,
        context_length=args.context_length,
        dp_size=args.dp_size,
        attn_dp_size=args.attn_dp_size,
        enable_dp_attention=args.enable_dp_attention,
        tp_size=args.tp_size,
        load_balance_method=args.load_balance_method,
        transfer_backend=args.transfer_backend,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        ssl_ca_certs=args.ssl_ca_certs,
        disconnect_poll_secs=args.disconnect_poll_secs,
        faults=tuple(args.fault),
        events_path=args.events,
        model=args.model,
        enable_dynamic_batch_tokenizer=args.enable_dynamic_batch_tokenizer,
        dynamic_batch_tokenizer_batch_timeout=args.dynamic_batch_tokenizer_batch_timeout,
        tokenize_delay_ms=args.tokenize_delay_ms,
        tokenizer_worker_num=args.tokenizer_worker_num,
        multibyte_tokens=args.multibyte_tokens,
        legacy_load_endpoint=args.legacy_load_endpoint,
        health_generate_secs=args.health_generate_secs,
        heartbeat_interval=args.heartbeat_interval,
        heartbeat_max_failures=args.heartbeat_max_failures,
        deferred_kv_release_timeout=args.deferred_kv_release_timeout,
        kv_events_config=args.kv_events_config,
        page_size=args.page_size,
    )


def run(args: argparse.Namespace) -> None:
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        parse_many(args.fault)
    except FaultError as exc:
        raise SystemExit(f"trio-pd-testing engine: {exc}") from None
    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"trio-pd-testing engine: {exc}") from None
    try:
        trio.run(serve_engine, config)
    except* KeyboardInterrupt:  # Ctrl-C: trio delivers it inside an exception group
        pass


def main(argv: list[str] | None = None, prog: str = "python -m trio_pd_testing.engine") -> None:
    parser = argparse.ArgumentParser(prog=prog, description="Simulated SGLang PD engine")
    add_arguments(parser)
    run(parser.parse_args(argv))
