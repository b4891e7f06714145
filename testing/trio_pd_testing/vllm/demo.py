"""`make demo-vllm`: trio_pd in front of a real vLLM 0.32 pair (NIXL) on this CPU.

Starts a real prefill (--max-model-len 512) and decode (2048), then `trio-pd serve
--vllm-pd-disaggregation` in front, and shows a completion whose KV the decode read over NIXL
(the decode's `vllm:nixl_xfer_time_seconds_count`), a chat stream, and a real prefill 400 (a
prompt over the prefill's context) that never reached the decode. Everything is stopped on the
way out, Ctrl-C included.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request

from trio_pd_testing import real_pair
from trio_pd_testing.vllm.launcher import REPO_ROOT, SERVED_MODEL_NAME, VllmPair

LOG_DIR = REPO_ROOT / ".cache" / "vllm-logs" / "demo"


def post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, bytes, float]:
    return real_pair.post(url, body, timeout)


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def demo(pair: VllmPair, url: str) -> None:
    reads = metric(pair.decode_url, "vllm:nixl_xfer_time_seconds_count")
    print("\n1. a completion: POST /v1/completions")
    body = {"model": SERVED_MODEL_NAME, "prompt": "the tiny model says", "max_tokens": 8}
    status, raw, secs = post(url + "/v1/completions", body)
    answer = json.loads(raw)
    print(f"   {status} in {secs * 1000:.0f} ms: {answer['usage']['completion_tokens']} tokens")
    read = metric(pair.decode_url, "vllm:nixl_xfer_time_seconds_count") - reads
    print(f"   the decode's NIXL reads: +{read:.0f}")

    print("\n2. a stream: POST /v1/chat/completions, stream=true")
    chat = {
        "model": SERVED_MODEL_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "stream": True,
    }
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        json.dumps(chat).encode(),
        {"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        events = sum(1 for line in response if line.startswith(b"data:"))
        print(f"   {response.status} {response.headers['content-type']}: {events} events")

    print("\n3. a prefill that really fails: a prompt over its --max-model-len 512")
    decoded = metric(pair.decode_url, "vllm:prompt_tokens_total")
    status, raw, secs = post(url + "/v1/completions", {**body, "prompt": "word " * 300})
    print(f"   client: {status} in {secs * 1000:.0f} ms: {raw.decode()[:120]}")
    seen = metric(pair.decode_url, "vllm:prompt_tokens_total") - decoded
    print(f"   prompt tokens the decode saw meanwhile: {seen:.0f}")


def main() -> int:
    return real_pair.run_demo(
        lambda: VllmPair.start(log_dir=LOG_DIR, name="demo"),
        lambda pair: [
            "--vllm-pd-disaggregation",
            "--prefill",
            pair.prefill_url,
            "--decode",
            pair.decode_url,
        ],
        demo,
        LOG_DIR,
        "vLLM prefill/decode pair (about 30-100 s on 2 cores)",
    )


if __name__ == "__main__":
    sys.exit(main())
