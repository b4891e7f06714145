"""`python -m trio_pd_testing.vllm [--prefill-max-model-len N]`.

Starts a real vLLM pair, prints its URLs as one JSON line, and keeps it until SIGINT or SIGTERM
(for benchmarks and by-hand exploration); every engine process is killed on the way out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trio_pd_testing import real_pair
from trio_pd_testing.vllm.launcher import REPO_ROOT, VllmPair


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trio_pd_testing.vllm")
    parser.add_argument("--prefill-max-model-len", type=int, default=512)
    parser.add_argument("--decode-max-model-len", type=int, default=2048)
    parser.add_argument("--log-dir", default=str(REPO_ROOT / ".cache" / "vllm-logs"))
    args = parser.parse_args(argv)
    return real_pair.hold(
        lambda: VllmPair.start(
            prefill_max_model_len=args.prefill_max_model_len,
            decode_max_model_len=args.decode_max_model_len,
            log_dir=Path(args.log_dir),
            name="manual",
        ),
        lambda pair: {
            "prefill_url": pair.prefill_url,
            "decode_url": pair.decode_url,
            "startup_secs": round(pair.startup_secs, 1),
        },
    )


if __name__ == "__main__":
    sys.exit(main())
