"""`python -m trio_pd_testing.sglang [--prefill-context-length N] [--admin-api-key K]`.

Starts a real pair, prints its URLs as one JSON line, and keeps it until SIGINT or SIGTERM (for
benchmarks and by-hand exploration); every engine process is killed on the way out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trio_pd_testing import real_pair
from trio_pd_testing.sglang.launcher import REPO_ROOT, SGLangPair


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trio_pd_testing.sglang")
    parser.add_argument("--prefill-context-length", type=int)
    parser.add_argument("--api-key")
    parser.add_argument("--admin-api-key")
    parser.add_argument("--log-dir", default=str(REPO_ROOT / ".cache" / "sglang-logs"))
    args = parser.parse_args(argv)
    return real_pair.hold(
        lambda: SGLangPair.start(
            prefill_context_length=args.prefill_context_length,
            api_key=args.api_key,
            admin_api_key=args.admin_api_key,
            log_dir=Path(args.log_dir),
            name="manual",
        ),
        lambda pair: {
            "prefill_url": pair.prefill_url,
            "decode_url": pair.decode_url,
            "bootstrap_port": pair.bootstrap_port,
            "startup_secs": round(pair.startup_secs, 1),
        },
    )


if __name__ == "__main__":
    sys.exit(main())
