"""`python -m trio_pd.testing.vllm [--prefill-max-model-len N]`.

Starts a real vLLM pair, prints its URLs as one JSON line, and keeps it until SIGINT or SIGTERM
(for benchmarks and by-hand exploration); every engine process is killed on the way out.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from trio_pd.testing.vllm.launcher import REPO_ROOT, VllmPair


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trio_pd.testing.vllm")
    parser.add_argument("--prefill-max-model-len", type=int, default=512)
    parser.add_argument("--decode-max-model-len", type=int, default=2048)
    parser.add_argument("--log-dir", default=str(REPO_ROOT / ".cache" / "vllm-logs"))
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    pair = VllmPair.start(
        prefill_max_model_len=args.prefill_max_model_len,
        decode_max_model_len=args.decode_max_model_len,
        log_dir=Path(args.log_dir),
        name="manual",
    )
    try:
        info = {
            "prefill_url": pair.prefill_url,
            "decode_url": pair.decode_url,
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
