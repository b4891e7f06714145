"""The /get_load answer: SGLang's load figures.

`num_reqs` (decode: slots taken + queued; prefill: requests in flight), `num_waiting_reqs`,
`num_tokens` (input + output tokens of the requests in flight).
"""

from __future__ import annotations

from typing import Any

from trio_pd.engine.state import EngineState


def load_report(engine: EngineState) -> dict[str, Any]:
    return {
        "num_reqs": engine.running + engine.queued,
        "num_waiting_reqs": engine.queued,
        "num_tokens": engine.inflight_tokens,
    }
