"""`trio-pd serve|engine|demo`: SGLang-router-compatible flags turned into a RouterConfig."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from trio_pd.config import (
    POLICY_NAMES,
    BreakerConfig,
    HealthConfig,
    PolicyConfig,
    RetryConfig,
    RouterConfig,
    WorkerSpec,
)


class PrefillAction(argparse.Action):
    """`--prefill URL [PORT|none]`: a bootstrap port is optional, `none` means no port."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        url, *rest = values
        if len(rest) > 1:
            parser.error(f"{option_string} takes URL [PORT|none], got {' '.join(values)}")
        port: int | None = None
        if rest and rest[0].lower() != "none":
            try:
                port = int(rest[0])
            except ValueError:
                parser.error(f"{option_string}: bootstrap port must be an int or none: {rest[0]}")
        check_url(parser, url)
        items = list(getattr(namespace, self.dest) or [])
        items.append((url, port))
        setattr(namespace, self.dest, items)


def check_url(parser: argparse.ArgumentParser, url: str) -> None:
    if not url.startswith(("http://", "https://")):
        parser.error(f"worker URL must start with http:// or https://: {url}")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    d = RouterConfig()
    p.add_argument(
        "--prefill",
        nargs="+",
        action=PrefillAction,
        metavar=("URL", "PORT"),
        default=[],
        help="prefill worker URL and bootstrap port (or none); repeatable",
    )
    p.add_argument(
        "--decode", action="append", default=[], metavar="URL", help="decode worker URL; repeatable"
    )
    p.add_argument(
        "--pd-disaggregation",
        action="store_true",
        help="accepted for SGLang router compatibility (always on)",
    )
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--workers", type=int, default=d.workers, help="hypercorn worker processes")
    p.add_argument("--request-timeout-secs", type=float, default=d.request_timeout_secs)
    p.add_argument("--max-payload-size", type=int, default=d.max_payload_size)
    p.add_argument("--max-concurrent-requests", type=int, default=d.max_concurrent_requests)
    p.add_argument("--queue-size", type=int, default=d.queue_size)
    p.add_argument("--queue-timeout-secs", type=float, default=d.queue_timeout_secs)
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--log-level",
        default=d.log_level,
        choices=["debug", "info", "warning", "error", "critical"],
    )
    p.add_argument("--prometheus-port", type=int, default=None)
    pol = PolicyConfig()
    p.add_argument("--policy", choices=POLICY_NAMES, default=pol.policy)
    p.add_argument("--prefill-policy", choices=POLICY_NAMES, default=None)
    p.add_argument("--decode-policy", choices=POLICY_NAMES, default=None)
    p.add_argument("--cache-threshold", type=float, default=pol.cache_threshold)
    p.add_argument("--balance-abs-threshold", type=int, default=pol.balance_abs_threshold)
    p.add_argument("--balance-rel-threshold", type=float, default=pol.balance_rel_threshold)
    p.add_argument("--eviction-interval-secs", type=float, default=pol.eviction_interval_secs)
    p.add_argument("--max-tree-size", type=int, default=pol.max_tree_size)
    r = RetryConfig()
    p.add_argument("--retry-max-retries", type=int, default=r.max_retries)
    p.add_argument("--retry-initial-backoff-ms", type=int, default=r.initial_backoff_ms)
    p.add_argument("--retry-max-backoff-ms", type=int, default=r.max_backoff_ms)
    p.add_argument("--retry-backoff-multiplier", type=float, default=r.backoff_multiplier)
    p.add_argument("--retry-jitter-factor", type=float, default=r.jitter_factor)
    p.add_argument("--disable-retries", action="store_true")
    b = BreakerConfig()
    p.add_argument("--cb-failure-threshold", type=int, default=b.failure_threshold)
    p.add_argument("--cb-success-threshold", type=int, default=b.success_threshold)
    p.add_argument("--cb-timeout-duration-secs", type=float, default=b.timeout_duration_secs)
    p.add_argument("--disable-circuit-breaker", action="store_true")
    h = HealthConfig()
    p.add_argument("--health-check-interval-secs", type=float, default=h.interval_secs)
    p.add_argument("--health-check-timeout-secs", type=float, default=h.timeout_secs)
    p.add_argument("--health-failure-threshold", type=int, default=h.failure_threshold)
    p.add_argument("--health-success-threshold", type=int, default=h.success_threshold)
    p.add_argument("--health-check-endpoint", default=h.endpoint)


def router_config(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        prefill=tuple(WorkerSpec(url, "prefill", port) for url, port in args.prefill),
        decode=tuple(WorkerSpec(url, "decode") for url in args.decode),
        host=args.host,
        port=args.port,
        workers=args.workers,
        request_timeout_secs=args.request_timeout_secs,
        max_payload_size=args.max_payload_size,
        max_concurrent_requests=args.max_concurrent_requests,
        queue_size=args.queue_size,
        queue_timeout_secs=args.queue_timeout_secs,
        api_key=args.api_key,
        log_level=args.log_level,
        prometheus_port=args.prometheus_port,
        retry=RetryConfig(
            max_retries=args.retry_max_retries,
            initial_backoff_ms=args.retry_initial_backoff_ms,
            max_backoff_ms=args.retry_max_backoff_ms,
            backoff_multiplier=args.retry_backoff_multiplier,
            jitter_factor=args.retry_jitter_factor,
            enabled=not args.disable_retries,
        ),
        breaker=BreakerConfig(
            failure_threshold=args.cb_failure_threshold,
            success_threshold=args.cb_success_threshold,
            timeout_duration_secs=args.cb_timeout_duration_secs,
            enabled=not args.disable_circuit_breaker,
        ),
        health=HealthConfig(
            interval_secs=args.health_check_interval_secs,
            timeout_secs=args.health_check_timeout_secs,
            failure_threshold=args.health_failure_threshold,
            success_threshold=args.health_success_threshold,
            endpoint=args.health_check_endpoint,
        ),
        policy=PolicyConfig(
            policy=args.policy,
            prefill_policy=args.prefill_policy,
            decode_policy=args.decode_policy,
            cache_threshold=args.cache_threshold,
            balance_abs_threshold=args.balance_abs_threshold,
            balance_rel_threshold=args.balance_rel_threshold,
            eviction_interval_secs=args.eviction_interval_secs,
            max_tree_size=args.max_tree_size,
        ),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trio-pd", description="Prefill/decode disaggregated LLM router on trio."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(commands.add_parser("serve", help="run the PD router"))
    from trio_pd.engine.cli import add_arguments as add_engine_arguments

    add_engine_arguments(commands.add_parser("engine", help="run a simulated PD engine"))
    commands.add_parser("demo", help="start a local PD cluster and show it working")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        from trio_pd.server import run

        run(router_config(args))
    elif args.command == "engine":
        from trio_pd.engine.cli import run as run_engine

        run_engine(args)
    else:
        from trio_pd.demo import main as run_demo

        run_demo()
