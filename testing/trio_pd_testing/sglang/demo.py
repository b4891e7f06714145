"""`make demo-sglang`: trio_pd in front of a real SGLang 0.5.23 pair on this CPU.

Starts a real prefill (--context-length 1024) and decode (4096), then `trio-pd serve` in front,
and shows a normal request, a stream, and a prefill that really fails: a prompt the prefill
refuses (400) while the decode has already registered the room and waits for KV. The client
gets the prefill's 400, and the decode's own `/v1/loads` is idle again milliseconds later.
Everything is stopped on the way out, Ctrl-C included.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request

from trio_pd_testing import real_pair
from trio_pd_testing.sglang.launcher import REPO_ROOT, SGLangPair

LOG_DIR = REPO_ROOT / ".cache" / "sglang-logs" / "demo"
PREFILL_CONTEXT = 1024


def post(url: str, body: dict, timeout: float = 60.0) -> tuple[int, bytes, float]:
    return real_pair.post(url, body, timeout)


def busy(decode_url: str) -> int:
    with urllib.request.urlopen(decode_url + "/v1/loads", timeout=5) as response:
        snapshot = json.load(response)
    total = 0
    for load in snapshot["loads"]:
        queues = load.get("disaggregation", {})
        total += load["num_running_reqs"] + load["num_waiting_reqs"]
        total += sum(v for k, v in queues.items() if k.endswith("_queue_reqs"))
    return total


def demo(pair: SGLangPair, url: str) -> None:
    print("\n1. a normal request: POST /generate")
    body = {"text": "the tiny model says", "sampling_params": {"max_new_tokens": 8}}
    status, raw, secs = post(url + "/generate", body)
    answer = json.loads(raw)
    print(f"   {status} in {secs * 1000:.0f} ms: {answer['meta_info']['completion_tokens']} tokens")

    print("\n2. a stream: POST /v1/chat/completions, stream=true")
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        json.dumps(
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True}
        ).encode(),
        {"content-type": "application/json"},
    )
    events = 0
    with urllib.request.urlopen(request, timeout=60) as response:
        for line in response:
            if line.startswith(b"data:"):
                events += 1
        print(f"   {response.status} {response.headers['content-type']}: {events} events")

    print(f"\n3. a prefill that really fails: a prompt over its --context-length {PREFILL_CONTEXT}")
    long = {"text": "word " * 500, "sampling_params": {"max_new_tokens": 4}}
    status, raw, secs = post(url + "/generate", long)
    answered = time.monotonic()
    print(f"   client: {status} in {secs * 1000:.0f} ms: {raw.decode()[:110]}")
    while busy(pair.decode_url):
        time.sleep(0.002)
    print(
        f"   decode's /v1/loads idle {(time.monotonic() - answered) * 1000:.0f} ms after the "
        "client's answer (without the router's abort it would wait 300 s for KV)"
    )
    aborted = pair.decode.log_text().count("Aborted by AbortReq")
    print(f"   decode log: 'Aborted by AbortReq' x{aborted}")


def main() -> int:
    return real_pair.run_demo(
        lambda: SGLangPair.start(
            prefill_context_length=PREFILL_CONTEXT, log_dir=LOG_DIR, name="demo"
        ),
        lambda pair: [
            "--prefill",
            pair.prefill_url,
            str(pair.bootstrap_port),
            "--decode",
            pair.decode_url,
        ],
        demo,
        LOG_DIR,
        "SGLang prefill/decode pair (about 30-60 s on 2 cores)",
    )


if __name__ == "__main__":
    sys.exit(main())
