"""A real SGLang 0.5.23 PD pair on a CPU-only machine, for tests, demos and benchmarks.

`SGLangPair.start(...)` (see `launcher`) starts the stock engines from `.venv-sglang`
(`make sglang-env`) on 127.0.0.1 and `stop()` kills every process they started.
"""

from trio_pd_testing.sglang.launcher import (
    ENGINE_PYTHON,
    MODEL_DIR,
    SERVED_MODEL_NAME,
    SGLANG_VERSION,
    Engine,
    EngineStartError,
    SGLangPair,
    ensure_model,
    free_port,
    running_pair,
)

__all__ = [
    "ENGINE_PYTHON",
    "MODEL_DIR",
    "SERVED_MODEL_NAME",
    "SGLANG_VERSION",
    "Engine",
    "EngineStartError",
    "SGLangPair",
    "ensure_model",
    "free_port",
    "running_pair",
]
