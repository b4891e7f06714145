"""Command line of the simulator: `trio-pd engine ...` / `python -m trio_pd.testing.engine ...`."""

from __future__ import annotations

import argparse
import logging
import sys

import trio

from trio_pd.testing.engine.config import (
    LOAD_BALANCE_METHODS,
    ROLES,
    TRANSFER_BACKENDS,
    EngineConfig,
)
from trio_pd.testing.engine.faults import FaultError, parse_many
from trio_pd.testing.engine.serve import serve_engine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig(role="prefill")
    parser.add_argument("--role", choices=ROLES, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="HTTP API port (0: ephemeral)")
    parser.add_argument(
        "--bootstrap-port", type=int, default=8998, help="prefill: bootstrap server port"
    )
    parser.add_argument(
        "--waiting-timeout",
        type=float,
        default=defaults.waiting_timeout,
        help="decode: seconds to wait for the KV (SGLANG_DISAGGREGATION_WAITING_TIMEOUT)",
    )
    parser.add_argument(
        "--bootstrap-timeout",
        type=float,
        default=defaults.bootstrap_timeout,
        help="prefill: seconds to wait for the decode's registration",
    )
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.0)
    parser.add_argument("--inter-token-ms", type=float, default=0.0)
    parser.add_argument(
        "--max-running",
        type=int,
        default=defaults.max_running,
        help="decode slots per data-parallel rank (a FIFO queue beyond them)",
    )
    parser.add_argument(
        "--dp-size",
        type=int,
        default=defaults.dp_size,
        help="data-parallel replicas (with --enable-dp-attention: attention-DP groups); a "
        "request's rank is its routed_dp_rank, else bootstrap_room %% ranks",
    )
    parser.add_argument("--attn-dp-size", type=int, default=defaults.attn_dp_size)
    parser.add_argument(
        "--enable-dp-attention",
        action="store_true",
        help="deprecated SGLang spelling: --dp-size N --enable-dp-attention is "
        "dp_size=1, attn_dp_size=N (N ranks either way)",
    )
    parser.add_argument("--tp-size", type=int, default=None)
    parser.add_argument("--load-balance-method", choices=LOAD_BALANCE_METHODS, default="auto")
    parser.add_argument(
        "--disaggregation-transfer-backend",
        dest="transfer_backend",
        choices=TRANSFER_BACKENDS,
        default=defaults.transfer_backend,
    )
    parser.add_argument("--max-total-tokens", type=int, default=defaults.max_total_tokens)
    parser.add_argument("--context-length", type=int, default=defaults.context_length)
    parser.add_argument("--enable-dynamic-batch-tokenizer", action="store_true")
    parser.add_argument("--tokenizer-worker-num", type=int, default=1)
    parser.add_argument(
        "--legacy-load-endpoint",
        action="store_true",
        help="also serve GET /get_load (gone in SGLang 0.5.23), for a router's fallback",
    )
    parser.add_argument(
        "--disconnect-poll-secs",
        type=float,
        default=defaults.disconnect_poll_secs,
        help="a disconnected request is aborted at the next tick of this period",
    )
    parser.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="SPEC",
        help="[ROLE:]KIND[:ARG][@MS], repeatable; KIND: status code, sse_error, abort, close, "
        "hang, slow:MS, refuse",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health* and /metrics*",
    )
    parser.add_argument(
        "--ssl-certfile", default=None, metavar="FILE", help="serve the HTTP API over HTTPS"
    )
    parser.add_argument(
        "--ssl-keyfile", default=None, metavar="FILE", help="its private key (else in the certfile)"
    )
    parser.add_argument(
        "--ssl-ca-certs",
        default=None,
        metavar="FILE",
        help="require client certificates signed by these CAs (mutual TLS)",
    )
    parser.add_argument("--events", default=None, metavar="FILE", help="JSON-lines event log")
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--log-level", default="info")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        role=args.role,
        host=args.host,
        port=args.port,
        bootstrap_port=args.bootstrap_port if args.role == "prefill" else None,
        waiting_timeout=args.waiting_timeout,
        bootstrap_timeout=args.bootstrap_timeout,
        prefill_ms_per_token=args.prefill_ms_per_token,
        inter_token_ms=args.inter_token_ms,
        max_running=args.max_running,
        dp_size=args.dp_size,
        attn_dp_size=args.attn_dp_size,
        enable_dp_attention=args.enable_dp_attention,
        tp_size=args.tp_size,
        load_balance_method=args.load_balance_method,
        transfer_backend=args.transfer_backend,
        max_total_tokens=args.max_total_tokens,
        context_length=args.context_length,
        enable_dynamic_batch_tokenizer=args.enable_dynamic_batch_tokenizer,
        tokenizer_worker_num=args.tokenizer_worker_num,
        legacy_load_endpoint=args.legacy_load_endpoint,
        api_key=args.api_key,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        ssl_ca_certs=args.ssl_ca_certs,
        disconnect_poll_secs=args.disconnect_poll_secs,
        faults=tuple(args.fault),
        events_path=args.events,
        model=args.model,
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
        raise SystemExit(f"trio-pd engine: {exc}") from None
    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"trio-pd engine: {exc}") from None
    try:
        trio.run(serve_engine, config)
    except* KeyboardInterrupt:  # Ctrl-C: trio delivers it inside an exception group
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m trio_pd.testing.engine", description="Simulated SGLang PD engine"
    )
    add_arguments(parser)
    run(parser.parse_args(argv))
