"""Every implemented flag of `trio-pd serve`, given a value that is not its default, reaches the
RouterConfig with that value (issue 19: 21 of the implemented SGLang flags were never given one).

`CASES` holds one case per implemented flag (SGLang's and trio_pd's own; the flags trio_pd only
accepts are `config/compat.py`'s and tested in test_flag_surface.py). A flag added to the CLI
without a case here fails `test_every_implemented_flag_has_a_case`; a flag whose value is lost on
the way (a typo in `router_config`, a field never set) fails its case, because the same command
line without the flag must give a different value.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest

from tests.flag_surface import serve_actions
from trio_pd.cli.main import build_parser, router_config
from trio_pd.config import ControlKey, RouterConfig, compat
from trio_pd.config.flags import DIFFERS
from trio_pd.spec import WorkerSpec

PREFILL_URL, DECODE_URL = "http://127.0.0.1:30001", "http://127.0.0.1:30011"
WORKERS = ["--prefill", PREFILL_URL, "--decode", DECODE_URL]
KUBE = ["--service-discovery", "--prefill-selector", "role=prefill", "--decode-selector",
        "role=decode", "--kube-api-server", "http://127.0.0.1:1"]  # fmt: skip
ETCD = ["--etcd-endpoints", "http://127.0.0.1:2379"]


@attrs.frozen
class Case:
    values: list[str]  # after the flag ("{tmp}" is a temporary directory)
    get: Callable[[RouterConfig], Any]
    expected: Any
    companions: list[str] = attrs.Factory(list)  # needed beside it, in both command lines


def kube(field: str) -> Callable[[RouterConfig], Any]:
    return lambda c: getattr(c.kubernetes, field)


def etcd(field: str) -> Callable[[RouterConfig], Any]:
    return lambda c: getattr(c.etcd, field) if c.etcd is not None else None


def on(path: str) -> Callable[[RouterConfig], Any]:
    def get(config: RouterConfig) -> Any:
        value: Any = config
        for part in path.split("."):
            value = getattr(value, part)
        return value

    return get


def case(values: list[str], path: str, expected: Any, *companions: str) -> Case:
    return Case(values, on(path), expected, list(companions))


CASES: dict[str, Case] = {
    # vLLM PD (issue 22): --kv-connector has one value yet (NO_EFFECT below)
    "--vllm-pd-disaggregation": case([], "vllm_pd_disaggregation", True),
    "--vllm-missing-kv-params": case(["fail"], "vllm_missing_kv_params", "fail"),
    "--access-log": case([], "access_log", True),
    "--admin-host": case(["127.0.0.2"], "admin_host", "127.0.0.2"),
    "--admin-port": case(["29111"], "admin_port", 29111),
    "--api-key": case(["k-1"], "api_key", "k-1"),
    "--worker-admin-api-key": case(["adm-1"], "worker_admin_api_key", "adm-1"),
    "--max-buffered-bytes": case(["12345678"], "max_buffered_bytes", 12345678),
    "--max-sse-event-bytes": case(["65536"], "max_sse_event_bytes", 65536),
    "--assignment-mode": case(["min_group"], "policy.assignment_mode", "min_group"),
    # SMG 1.13's routing knobs (issue 21)
    "--least-load-kv-pressure-weight": case(["0.5"], "policy.least_load_kv_pressure_weight", 0.5),
    "--least-load-default-throughput": case(["500"], "policy.least_load_default_throughput", 500.0),
    "--least-load-mean-prefill-tokens": case(["64"], "policy.least_load_mean_prefill_tokens", 64),
    "--least-load-max-waiting-requests": case(["4"], "policy.least_load_max_waiting_requests", 4),
    "--power-of-two-load-metric": case(["requests"], "policy.power_of_two_load_metric", "requests"),
    "--prefix-token-count": case(["32"], "policy.prefix_token_count", 32),
    "--tokenizer-path": case(["/models/m"], "policy.tokenizer_path", "/models/m"),
    "--kv-index-max-blocks": case(["1000"], "policy.kv_index_max_blocks", 1000),
    "--kv-events-stale-secs": case(["2.5"], "policy.kv_events_stale_secs", 2.5),
    "--prefix-hash-load-factor": case(["2.5"], "policy.prefix_hash_load_factor", 2.5),
    "--prefix-hash-balance-abs-threshold": case(
        ["3"], "policy.prefix_hash_balance_abs_threshold", 3
    ),
    "--routing-key-override": case([], "policy.routing_key_override", True),
    "--sticky-sessions": case([], "policy.routing_key_override", True),
    "--sticky-key-idle-secs": case(["60"], "policy.max_idle_secs", 60),
    "--routing-key-headers": case(
        ["x-session", "x-user"], "policy.routing_key_headers", ("x-session", "x-user")
    ),
    "--balance-abs-threshold": case(["7"], "policy.balance_abs_threshold", 7),
    "--balance-rel-threshold": case(["2.5"], "policy.balance_rel_threshold", 2.5),
    "--bootstrap-port-annotation": Case(
        ["x.io/b"], kube("bootstrap_port_annotation"), "x.io/b", KUBE
    ),
    "--bucket-adjust-interval-secs": case(["9"], "policy.bucket_adjust_interval_secs", 9),
    "--ca-cert-paths": case(["{tmp}/ca.pem"], "ca_cert_paths", ("{tmp}/ca.pem",)),
    "--cache-threshold": case(["0.7"], "policy.cache_threshold", 0.7),
    "--cb-failure-threshold": case(["7"], "breaker.failure_threshold", 7),
    "--cb-success-threshold": case(["7"], "breaker.success_threshold", 7),
    "--cb-timeout-duration-secs": case(["2.5"], "breaker.timeout_duration_secs", 2.5),
    "--cb-window-duration-secs": case(["9"], "breaker.window_duration_secs", 9),
    "--client-body-timeout-secs": case(["2.5"], "timeouts.client_body_secs", 2.5),
    "--client-cert-path": case(
        ["{tmp}/c.pem"], "client_cert_path", "{tmp}/c.pem", "--client-key-path", "{tmp}/k.pem"
    ),
    "--client-key-path": case(
        ["{tmp}/k.pem"], "client_key_path", "{tmp}/k.pem", "--client-cert-path", "{tmp}/c.pem"
    ),
    "--control-plane-api-keys": case(
        ["k1:ops:admin:s,1"], "control_plane_api_keys", (ControlKey("k1", "ops", "admin", "s,1"),)
    ),
    "--control-plane-audit-enabled": case([], "control_plane_audit_enabled", True),
    "--cors-allowed-origins": case(
        ["http://a.example"], "cors_allowed_origins", ("http://a.example",)
    ),
    "--data-plane-api-keys": case(["dk-1", "dk-2"], "data_plane_api_keys", ("dk-1", "dk-2")),
    "--decode": case(
        [DECODE_URL, "model=m2"],
        "decode",
        (
            WorkerSpec(DECODE_URL, "decode", None, None),
            WorkerSpec(DECODE_URL, "decode", None, "m2"),
        ),
    ),
    "--decode-policy": case(["round_robin"], "policy.decode_policy", "round_robin"),
    "--decode-selector": Case(["tier=d"], kube("decode_selector"), {"tier": "d"}, KUBE),
    "--default-model": case(["m1"], "default_model", "m1"),
    "--disable-circuit-breaker": case([], "breaker.enabled", False),
    "--disable-health-check": case([], "health.periodic", False),
    "--disable-retries": case([], "retry.enabled", False),
    "--migration-limit": case(["0"], "migration_limit", 0),
    "--disable-worker-overload-protection": case([], "overload.protection", False),
    "--dp-aware": case([], "dp_aware", True),
    "--enable-http2": case([], "enable_http2", True),
    "--enable-trace": case([], "enable_trace", True),
    "--etcd-dial-timeout-secs": Case(["2.5"], etcd("dial_timeout_secs"), 2.5, ETCD),
    "--etcd-endpoints": Case(
        ["http://127.0.0.1:2379"], etcd("endpoints"), ("http://127.0.0.1:2379",)
    ),
    "--etcd-lease-ttl-secs": Case(["7"], etcd("lease_ttl_secs"), 7, ETCD),
    "--etcd-prefix": Case(["/other"], etcd("prefix"), "/other", ETCD),
    "--etcd-request-timeout-secs": Case(["2.5"], etcd("request_timeout_secs"), 2.5, ETCD),
    "--etcd-resync-secs": Case(["2.5"], etcd("resync_secs"), 2.5, ETCD),
    "--eviction-interval-secs": case(["2.5"], "policy.eviction_interval_secs", 2.5),
    "--first-token-timeout-secs": case(["2.5"], "timeouts.first_token_secs", 2.5),
    "--health-check-endpoint": case(["/ready"], "health.endpoint", "/ready"),
    "--health-check-interval-secs": case(["2.5"], "health.interval_secs", 2.5),
    "--health-check-timeout-secs": case(["2.5"], "health.timeout_secs", 2.5),
    "--health-failure-threshold": case(["7"], "health.failure_threshold", 7),
    "--health-success-threshold": case(["7"], "health.success_threshold", 7),
    "--host": case(["127.0.0.2"], "host", "127.0.0.2"),
    "--kube-api-server": Case(
        ["http://127.0.0.1:9"], kube("api_server"), "http://127.0.0.1:9", KUBE
    ),
    "--kube-ca-file": Case(["{tmp}/ca.crt"], kube("ca_file"), "{tmp}/ca.crt", KUBE),
    "--kube-resync-secs": Case(["2.5"], kube("resync_secs"), 2.5, KUBE),
    "--kube-stall-timeout-secs": Case(["2.5"], kube("stall_timeout_secs"), 2.5, KUBE),
    "--kube-token-file": Case(["{tmp}/token"], kube("token_file"), "{tmp}/token", KUBE),
    "--kube-watch-timeout-secs": Case(["7"], kube("watch_timeout_secs"), 7, KUBE),
    "--log-dir": case(["{tmp}/logs"], "log_dir", "{tmp}/logs"),
    "--log-json": case([], "log_json", True),
    "--log-level": case(["debug"], "log_level", "debug"),
    "--max-batch-size": case(["7"], "max_batch_size", 7),
    "--max-concurrent-requests": case(["7"], "max_concurrent_requests", 7),
    "--pd-admission-wait-secs": case(["2.5"], "overload.pd_admission_wait_secs", 2.5),
    "--prefill-max-inflight-requests-per-worker": case(["7"], "overload.prefill_max_inflight", 7),
    "--prefill-queue-size": case(["7"], "overload.prefill_queue_size", 7),
    "--prefill-queue-timeout-secs": case(["2.5"], "overload.prefill_queue_timeout_secs", 2.5),
    "--worker-overload-shed": case([], "overload.shed", True),
    "--worker-overload-token-usage": case(["0.5"], "overload.token_usage", 0.5),
    "--worker-overload-waiting-requests": case(["7"], "overload.waiting_requests", 7),
    "--max-idle-secs": case(["7"], "policy.max_idle_secs", 7),
    "--max-payload-size": case(["7"], "max_payload_size", 7),
    "--max-tree-size": case(["7"], "policy.max_tree_size", 7),
    "--membership-file": case(["{tmp}/m.json"], "membership_file", "{tmp}/m.json"),
    "--mini-lb": case([], "policy.policy", "random"),  # SGLang's MiniLB routes at random
    "--model-id-from": Case(["namespace"], kube("model_id_from"), "namespace", KUBE),
    "--no-abort-on-cancel": case([], "abort_on_cancel", False),
    "--otlp-traces-endpoint": case(["127.0.0.1:4318"], "otlp_traces_endpoint", "127.0.0.1:4318"),
    "--policy": case(["random"], "policy.policy", "random"),
    "--port": case(["31000"], "port", 31000),
    "--prefill": case(
        [PREFILL_URL, "9001", "model=m1"],
        "prefill",
        (
            WorkerSpec(PREFILL_URL, "prefill", None, None),
            WorkerSpec(PREFILL_URL, "prefill", 9001, "m1"),
        ),
    ),
    "--prefill-hold-timeout-secs": case(["2.5"], "timeouts.prefill_hold_secs", 2.5),
    "--prefill-policy": case(["bucket"], "policy.prefill_policy", "bucket"),
    "--prefill-selector": Case(["tier=p"], kube("prefill_selector"), {"tier": "p"}, KUBE),
    "--prometheus-duration-buckets": case(["2", "0.5"], "prometheus_duration_buckets", (0.5, 2.0)),
    "--prometheus-host": case(["127.0.0.2"], "prometheus_host", "127.0.0.2"),
    "--prometheus-port": case(["29555"], "prometheus_port", 29555),
    "--queue-size": case(["7"], "queue_size", 7),
    "--queue-timeout-secs": case(["2.5"], "queue_timeout_secs", 2.5),
    "--rate-limit-tokens-per-second": case(["7"], "rate_limit_tokens_per_second", 7),
    "--request-id-headers": case(["x-my-id"], "request_id_headers", ("x-my-id",)),
    "--request-timeout-secs": case(["2.5"], "request_timeout_secs", 2.5),
    "--retry-backoff-multiplier": case(["2.5"], "retry.backoff_multiplier", 2.5),
    "--retry-initial-backoff-ms": case(["7"], "retry.initial_backoff_ms", 7),
    "--retry-jitter-factor": case(["0.5"], "retry.jitter_factor", 0.5),
    "--retry-max-backoff-ms": case(["7000"], "retry.max_backoff_ms", 7000),
    "--retry-max-retries": case(["7"], "retry.max_retries", 7),
    "--selector": Case(["app=x"], kube("selector"), {"app": "x"}, KUBE),
    "--service-discovery": Case([], lambda c: c.kubernetes is not None, True, KUBE[1:]),
    "--service-discovery-namespace": Case(["ns1"], kube("namespace"), "ns1", KUBE),
    "--service-discovery-port": Case(["8080"], kube("port"), 8080, KUBE),
    "--shutdown-grace-period-secs": case(["2.5"], "shutdown_grace_period_secs", 2.5),
    "--stream-idle-timeout-secs": case(["2.5"], "timeouts.stream_idle_secs", 2.5),
    "--stream-stall-timeout-secs": case(["2.5"], "timeouts.stream_stall_secs", 2.5),
    "--tls-cert-path": case(
        ["{tmp}/c.pem"], "tls_cert_path", "{tmp}/c.pem", "--tls-key-path", "{tmp}/k.pem"
    ),
    "--tls-handshake-timeout-secs": case(["2.5"], "tls_handshake_timeout_secs", 2.5),
    # The connection edges (issue 21, SMG 1.13).
    "--sse-keepalive-secs": case(["0"], "edges.sse_keepalive_secs", 0.0),
    "--header-read-timeout-secs": case(["7.5"], "edges.header_read_timeout_secs", 7.5),
    "--idle-connection-timeout-secs": case(["0"], "edges.idle_connection_timeout_secs", 0.0),
    "--upstream-pool-idle-timeout-secs": case(
        ["1.5"], "edges.upstream_pool_idle_timeout_secs", 1.5
    ),
    "--health-check-port": case(["31999"], "edges.health_check_port", 31999),
    "--max-client-connections": case(["500"], "edges.max_client_connections", 500),
    "--remove-unhealthy-workers": case([], "health.remove_unhealthy_workers", True),
    "--no-remove-unhealthy-workers": case([], "health.remove_unhealthy_workers", False),
    "--model-alias": case(["gpt=alpha"], "model_aliases", (("gpt", "alpha"),)),
    # SMG 1.13's spelling of discovery.
    "--discovery-provider": Case(["kubernetes"], on("discovery_provider"), "kubernetes", KUBE),
    "--discovery-file": case(  # the last one given counts; the file flags need the provider
        ["/tmp/m.json"],
        "discovery_file",
        "/tmp/m.json",
        "--discovery-provider",
        "file",
        "--discovery-file",
        "/tmp/other.json",
    ),
    "--discovery-check-interval-secs": case(
        ["2.5"],
        "discovery_check_interval_secs",
        2.5,
        "--discovery-provider",
        "file",
        "--discovery-file",
        "/tmp/m.json",
    ),
    "--tls-key-path": case(
        ["{tmp}/k.pem"], "tls_key_path", "{tmp}/k.pem", "--tls-cert-path", "{tmp}/c.pem"
    ),
    "--worker-ports-annotation": Case(
        ["x.io/ports"], kube("worker_ports_annotation"), "x.io/ports", KUBE
    ),
    "--worker-startup-check-interval": case(["7"], "load_poll_interval_secs", 7),
    "--worker-startup-timeout-secs": case(["7"], "health.startup_timeout_secs", 7),
    "--worker-url-allow": case(["10.0.0.0/8"], "worker_url_allow", ("10.0.0.0/8",)),
    "--workers": case(["3"], "workers", 3),
}
# Flags SGLang's router has that change nothing in trio_pd, by design (DIFFERS says why):
# the command line with them must give exactly the config without them.
NO_EFFECT = ("--enable-igw", "--pd-disaggregation")
# Flags with one accepted value so far: given it, the config is the one without the flag.
SINGLE_VALUE = {"--kv-connector": "nixl"}


# `--config FILE` gives values of other flags: tests/test_config_file.py.
FILE_FLAGS = ("--config",)


def implemented() -> set[str]:
    return {f for f in serve_actions() if f not in compat.BY_FLAG and f not in FILE_FLAGS}


def test_vllm_mode_makes_the_static_workers_vllm_and_ignores_the_bootstrap_port() -> None:
    for mode in (["--vllm-pd-disaggregation"], ["--backend", "vllm"]):
        config = parse(["--prefill", PREFILL_URL, "9001", "--decode", DECODE_URL, *mode])
        assert config.vllm_pd_disaggregation is True
        assert config.prefill == (WorkerSpec(PREFILL_URL, "prefill", None, engine="vllm"),)
        assert config.decode == (WorkerSpec(DECODE_URL, "decode", None, engine="vllm"),)
        assert config.startup_warnings == ()
    assert {w.engine for w in (*parse(WORKERS).prefill, *parse(WORKERS).decode)} == {"sglang"}


def test_every_implemented_flag_has_a_case() -> None:
    flags = implemented()
    assert len(flags) > 90
    known = set(CASES) | set(NO_EFFECT) | set(SINGLE_VALUE)
    assert sorted(flags - known) == [], "flags without a value test"
    assert sorted(known - flags) == [], "cases for no flag"


@pytest.mark.parametrize("flag", sorted(SINGLE_VALUE))
def test_flags_with_one_value(flag: str) -> None:
    assert parse([*WORKERS, flag, SINGLE_VALUE[flag]]) == parse(WORKERS)
    with pytest.raises(SystemExit):
        parse([*WORKERS, flag, "not-" + SINGLE_VALUE[flag]])


def parse(argv: list[str]) -> RouterConfig:
    return router_config(build_parser().parse_args(["serve", *argv]))


def filled(value: Any, tmp: Path) -> Any:
    if isinstance(value, str):
        return value.replace("{tmp}", str(tmp))
    if isinstance(value, tuple):
        return tuple(filled(v, tmp) for v in value)
    return value


@pytest.mark.parametrize("flag", sorted(CASES))
def test_each_flags_value_reaches_the_config(
    flag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in ("TRIO_PD_API_KEY", "TRIO_PD_DATA_PLANE_API_KEYS"):
        monkeypatch.delenv(variable, raising=False)
    spec = CASES[flag]
    base = WORKERS  # --prefill and --decode add a second worker to these
    companions = [filled(a, tmp_path) for a in spec.companions]
    given = [flag, *(filled(v, tmp_path) for v in spec.values)]
    expected = filled(spec.expected, tmp_path)
    assert spec.get(parse([*base, *companions, *given])) == expected
    assert spec.get(parse([*base, *companions])) != expected, f"{flag}: that is the default"


@pytest.mark.parametrize("flag", NO_EFFECT)
def test_flags_that_change_nothing(flag: str) -> None:
    assert flag in DIFFERS
    assert parse([*WORKERS, flag]) == parse(WORKERS)
