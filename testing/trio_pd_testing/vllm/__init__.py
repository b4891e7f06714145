"""A real vLLM 0.32 (CPU build) PD pair with NIXL, for tests, demos and benchmarks.

`VllmPair.start(...)` (see `launcher`) starts the stock engines from `.venv-vllm`
(`make vllm-env`) on 127.0.0.1 and `stop()` kills every process they started.
"""

from trio_pd_testing.vllm.launcher import (
    ENGINE_PYTHON,
    KV_LEASE_SECS,
    MODEL_DIR,
    SERVED_MODEL_NAME,
    VLLM_VERSION,
    VllmPair,
    ensure_model,
    running_pair,
)

__all__ = [
    "ENGINE_PYTHON",
    "KV_LEASE_SECS",
    "MODEL_DIR",
    "SERVED_MODEL_NAME",
    "VLLM_VERSION",
    "VllmPair",
    "ensure_model",
    "running_pair",
]
