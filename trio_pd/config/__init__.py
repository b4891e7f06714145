"""The router's configuration: frozen values built once (by the CLI) and read everywhere else.

This package is the configuration layer: it imports only the leaves (`trio_pd.spec`), so every
layer above can name a config value without importing another layer. The names below are its
public face; `router` holds the router's own values, `keys` the control-plane keys,
`membership` the membership sources' values and `compat` SGLang's router flags a PD router
does not act on.
"""

from trio_pd.config.keys import ControlKey, parse_keys
from trio_pd.config.membership import EtcdConfig, KubernetesConfig
from trio_pd.config.router import (
    ASSIGNMENT_MODES,
    KEYED_POLICIES,
    LOAD_METRICS,
    POLICY_NAMES,
    PREFILL_POLICY_NAMES,
    AssignmentMode,
    BreakerConfig,
    EdgeConfig,
    HealthConfig,
    LoadMetric,
    OverloadConfig,
    PolicyConfig,
    PolicyName,
    RetryConfig,
    RouterConfig,
    TimeoutConfig,
)

__all__ = [
    "ASSIGNMENT_MODES",
    "KEYED_POLICIES",
    "LOAD_METRICS",
    "POLICY_NAMES",
    "PREFILL_POLICY_NAMES",
    "AssignmentMode",
    "BreakerConfig",
    "ControlKey",
    "EdgeConfig",
    "EtcdConfig",
    "HealthConfig",
    "KubernetesConfig",
    "LoadMetric",
    "OverloadConfig",
    "PolicyConfig",
    "PolicyName",
    "RetryConfig",
    "RouterConfig",
    "TimeoutConfig",
    "parse_keys",
]
