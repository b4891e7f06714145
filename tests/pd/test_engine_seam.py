"""The engine seam (`pd/engines/`): dispatch names no engine, and every engine a worker may speak
has its module behind the one protocol. `make lint` holds the same as an import contract
("Dispatch names no engine", pyproject.toml); this says it of the source text too, so not even
a string or a comment in dispatch is about one engine."""

from __future__ import annotations

import re
from pathlib import Path

import trio_pd.pd.dispatch as dispatch
import trio_pd.pd.retry_state as retry_state
from trio_pd.pd.engines import ENGINES, engine_for
from trio_pd.spec import ENGINES as WORKER_ENGINES


def test_dispatch_names_no_engine() -> None:
    for module in (dispatch, retry_state):
        source = Path(str(module.__file__)).read_text()
        code = "\n".join(line.split("#")[0] for line in source.splitlines())
        named = re.findall(r"\b(sglang|vllm)\b|engines\.(sglang|vllm)", code, re.IGNORECASE)
        if module is dispatch:
            assert not named, f"dispatch names an engine: {named}"
        else:  # the retry state may say in prose where a rule comes from, never import one
            assert "engines." not in code


def test_every_worker_engine_has_its_module() -> None:
    assert set(ENGINES) == set(WORKER_ENGINES)
    for name in WORKER_ENGINES:
        engine = engine_for(name)
        assert name == engine.NAME
        assert callable(engine.new_attempt)
