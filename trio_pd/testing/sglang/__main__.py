"""`python -m trio_pd.testing.sglang [--prefill-context-length N] [--admin-api-key K]`.

Starts a real pair, prints its URLs as one JSON line, and keeps it until SIGINT or SIGTERM (for
benchmarks and by-hand exploration); every engine process is killed on the way out.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from trio_pd.testing.sglang.launcher import REPO_ROOT, SGLangPair


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trio_pd.testing.sglang")
    parser.add_argument("--prefill-context-length", type=int)
    parser.add_argument("--api-key")
    parser.add_argument("--admin-api-key")
    parser.add_argument("--log-dir", default=str(REPO_ROOT / ".cache" / "sglang-logs"))
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    pair = SGLangPair.start(
        prefill_context_length=args.prefill_context_length,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        log_dir=Path(args.log_dir),
        name="manual",
    )
    try:
        info = {
            "prefill_url": pair.prefill_url,
            "decode_url": pair.decode_url,
            "bootstrap_port": pair.bootstrap_port,
            "startup_secs": round(pair.startup_secs, 1),
            "logs": [str(e.log_path) for e in pair.engines],
        }
        print(json.dumps(info), flush=True)
        while not stop.wait(1.0):
            if not (pair.prefill.alive() and pair.decode.alive()):
                print("an engine died", file=sys.stderr)
                return 1
        return 0
    finally:
        pair.stop()


if __name__ == "__main__":
    sys.exit(main())
