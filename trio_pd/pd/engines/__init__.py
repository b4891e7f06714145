"""The engines a PD pair can run: one module each, behind one protocol (`protocol.py`).

`dispatch.py` asks `engine_for` for a pair's engine and never names one; a new engine is a
module here with its `Engine` (its attempt's builder and `attempt.EngineRules`) and one line in
`ENGINES`.
"""

from __future__ import annotations

from trio_pd.pd.engines import sglang, vllm
from trio_pd.pd.engines.protocol import Engine

ENGINES: dict[str, Engine] = {
    sglang.NAME: sglang,
    vllm.NAME: vllm,
}


def engine_for(name: str) -> Engine:
    """The engine of a pair (`WorkerSpec.engine`: the prefill's, which the pair shares)."""
    return ENGINES[name]
