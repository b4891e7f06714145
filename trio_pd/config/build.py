"""The RouterConfig a command line (or a config file) asks for, built from the flag table.

Generic: every row with a `field` puts its value (from the command line, else its environment
variable, else its default; inverted or converted as the row says) at its dotted path, and the
nested values become their frozen classes. Only what no row can say is spelled out here: the
workers (`--prefill`/`--decode`, and the engine they speak), `--mini-lb`, `--backend vllm`, the
optional sub-configs (`enables`) and SGLang's flags a PD router does not act on (`compat.py`: a
warning, or a refusal). Then `checks.check` judges the finished config. Every problem is one
`ConfigError`, naming the flag (or the environment variable) it came from, never printing a key.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from trio_pd.config import compat
from trio_pd.config.checks import ConfigError, check
from trio_pd.config.flags import SERVE_FLAGS, Flag
from trio_pd.config.membership import EtcdConfig, KubernetesConfig
from trio_pd.config.router import (
    BreakerConfig,
    EdgeConfig,
    HealthConfig,
    OverloadConfig,
    PolicyConfig,
    RetryConfig,
    RouterConfig,
    TimeoutConfig,
)
from trio_pd.spec import Engine, WorkerSpec

NESTED: dict[str, type] = {
    "retry": RetryConfig,
    "breaker": BreakerConfig,
    "health": HealthConfig,
    "policy": PolicyConfig,
    "timeouts": TimeoutConfig,
    "edges": EdgeConfig,
    "overload": OverloadConfig,
}
OPTIONAL: dict[str, type] = {"kubernetes": KubernetesConfig, "etcd": EtcdConfig}
MINI_LB = (
    "--mini-lb: SGLang's MiniLB routes at random; trio_pd keeps serving and applies that: "
    "--policy random for prefill and decode"
)


def build_config(
    values: Mapping[str, Any],
    given: Collection[str] = (),
    environ: Mapping[str, str] | None = None,
    table: tuple[Flag, ...] = SERVE_FLAGS,
) -> RouterConfig:
    """`values`: every row's parsed value by its `dest` (defaults included); `given`: the flags
    the command line named (for the foreign flags and the environment's place); `environ`: the
    environment variables rows may be read from."""
    environ = environ or {}
    errors, warnings = compat.check_values(values, given)
    if errors:
        raise ConfigError("; ".join(errors))
    fields: dict[str, Any] = {}
    sources: dict[str, str] = {}  # field -> where its value came from, for the checks' errors
    enabled = {row.enables for row in table if row.enables and values.get(row.dest)}
    if values.get("discovery_provider") == "kubernetes":  # SMG's spelling of --service-discovery
        enabled.add("kubernetes")
    for row in table:
        if row.field is None:
            continue
        value, source = values.get(row.dest, row.default), row.name
        if row.env and row.name not in given and not value and environ.get(row.env):
            value, source = environ[row.env], f"${row.env}"
        try:
            value = converted(row, value)
        except ValueError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        fields[row.field] = value
        sources[row.field] = source
    if values.get("mini_lb"):
        warnings.append(MINI_LB)
        fields.update({"policy.policy": "random", "policy.prefill_policy": None,
                       "policy.decode_policy": None})  # fmt: skip
    if values.get("sticky_sessions"):  # SMG's alias of --routing-key-override
        fields["policy.routing_key_override"] = True
    if values.get("sticky_key_idle_secs") is not None:  # SMG's alias of --max-idle-secs
        fields["policy.max_idle_secs"] = values["sticky_key_idle_secs"]
        sources["policy.max_idle_secs"] = "--sticky-key-idle-secs"
    if values.get("foreign_backend") == "vllm":  # SMG's `--backend vllm --pd-disaggregation`
        fields["vllm_pd_disaggregation"] = True
    engine: Engine = "vllm" if fields.get("vllm_pd_disaggregation") else "sglang"
    if engine == "vllm" and "kubernetes" in enabled:  # the pods found speak vLLM's protocol too
        fields["kubernetes.engine"] = engine
    top = nest(fields, enabled)
    top["prefill"] = tuple(
        # vLLM has no bootstrap port: one given is accepted and ignored (vllm-router's rule)
        WorkerSpec(u, "prefill", None if engine == "vllm" else p, m, engine=engine)
        for u, p, m in values.get("prefill", [])
    )
    top["decode"] = tuple(
        WorkerSpec(u, "decode", None, m, engine=engine) for u, m in values.get("decode", [])
    )
    top["startup_warnings"] = tuple(warnings)
    try:
        config = RouterConfig(**top)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    check(config, sources)
    return config


def converted(row: Flag, value: Any) -> Any:
    if row.invert:
        return not value
    if row.convert is not None and value is not None:
        return row.convert(value)
    return value


def nest(fields: Mapping[str, Any], enabled: Collection[str]) -> dict[str, Any]:
    """Dotted paths -> RouterConfig's keyword arguments, nested groups made into their classes;
    an optional sub-config only when enabled (else None)."""
    groups: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for path, value in fields.items():
        head, dot, rest = path.partition(".")
        if dot:
            groups.setdefault(head, {})[rest] = value
        else:
            top[path] = value
    for name, cls in NESTED.items():
        top[name] = cls(**groups.get(name, {}))
    for name, cls in OPTIONAL.items():
        if name not in enabled:
            top[name] = None
            continue
        try:
            top[name] = cls(**groups.get(name, {}))
        except ValueError as exc:
            what = "service discovery" if name == "kubernetes" else f"--{name}-*"
            raise ConfigError(f"{what}: {exc}") from None
    return top
