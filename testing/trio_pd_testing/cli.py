"""`trio-pd-testing engine | demo | sglang | vllm`: the test engines' one command.

Each subcommand is handed whole to its own parser and imports only what it runs: `engine` the
simulator (`python -m trio_pd_testing.engine` is the same), `demo` the demo (`make demo`),
`sglang` and `vllm` a real pair held until Ctrl-C (`python -m trio_pd_testing.sglang|vllm`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: trio-pd-testing {engine,demo,sglang,vllm} ...

trio_pd's test engines (the router itself is `trio-pd`).

commands:
  engine   run a simulated PD engine (trio-pd-testing engine --help)
  demo     start a local PD cluster (two simulators and trio-pd serve) and show it working
  sglang   start a real SGLang 0.5.23 pair (make sglang-env) and hold it until Ctrl-C
  vllm     start a real vLLM 0.32 pair (make vllm-env) and hold it until Ctrl-C
"""


def main(argv: Sequence[str] | None = None) -> None:
    tokens = list(sys.argv[1:] if argv is None else argv)
    command, rest = (tokens[0], tokens[1:]) if tokens else ("", [])
    if command == "engine":
        from trio_pd_testing.engine.cli import main as run_engine

        run_engine(rest, prog="trio-pd-testing engine")
    elif command == "demo" and not rest:
        from trio_pd_testing.demo import main as run_demo

        run_demo()
    elif command == "sglang":
        from trio_pd_testing.sglang.__main__ import main as hold_sglang

        raise SystemExit(hold_sglang(rest))
    elif command == "vllm":
        from trio_pd_testing.vllm.__main__ import main as hold_vllm

        raise SystemExit(hold_vllm(rest))
    elif command in ("-h", "--help"):
        print(USAGE, end="")
    else:
        print(USAGE, end="", file=sys.stderr)
        raise SystemExit(2)
