"""Write the tiny random-weight Llama the vLLM tier serves (run under `.venv-vllm`).

The SGLang tier's model (`../sglang/make_model.py`: the same seeded byte-level BPE tokenizer,
chat template and file set) with one change: vLLM's CPU attention backend refuses a head
dimension under 32 (`vllm/v1/attention/backends/cpu_attn.py`), so hidden 128 over 4 heads of 32
instead of 64 over 4 of 16. The engines load it with `--load-format dummy` (seeded random
weights, identical on both servers), so no weights are written or downloaded.
Usage: `python make_model.py DIR` (idempotent: an existing complete directory is kept).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

# Bumped whenever the files change, so a stale cache is rebuilt.
FORMAT = "trio_pd-tiny-llama-vllm-1"


def _sglang_maker():
    """The SGLang tier's maker, loaded by path (this runs as a script under the engines' venv,
    where trio_pd is not importable)."""
    path = Path(__file__).resolve().parent.parent / "sglang" / "make_model.py"
    spec = importlib.util.spec_from_file_location("sglang_make_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write(directory: Path) -> None:
    base = _sglang_maker()
    sglang_config = base.model_config

    def model_config() -> dict:
        return {**sglang_config(), "hidden_size": 128, "intermediate_size": 256, "head_dim": 32}

    base.model_config = model_config
    base.FORMAT = FORMAT
    base.write(directory)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    write(Path(sys.argv[1]))
