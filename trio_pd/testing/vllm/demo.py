"""`make demo-vllm`: trio_pd in front of a real vLLM 0.32 pair (NIXL) on this CPU.

Starts a real prefill (--max-model-len 512) and decode (2048), then `trio-pd serve
--vllm-pd-disaggregation` in front, and shows a completion whose KV the decode read over NIXL
(the decode's `vllm:nixl_xfer_time_seconds_count`), a chat stream, and a real prefill 400 (a
prompt over the prefill's context) that never reached the decode. Everything is stopped on the
way out, Ctrl-C included.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from trio_pd.testing.sglang.launcher import free_port, http_status
from trio_pd.testing.vllm.launcher import REPO_ROOT, SERVED_MODEL_NAME, VllmPair

LOG_DIR = REPO_ROOT / ".cache" / "vllm-logs" / "demo"


def post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, bytes, float]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read(), time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return e.code, e.read(), time.monotonic() - t0


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def start_router(pair: VllmPair) -> tuple[subprocess.Popen, str]:
    port, metrics = free_port(), free_port()
    command = [
        sys.executable, "-m", "trio_pd", "serve", "--vllm-pd-disaggregation",
        "--host", "127.0.0.1", "--port", str(port),
        "--prefill", pair.prefill_url, "--decode", pair.decode_url,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics), "--admin-port", "0",
        "--policy", "round_robin", "--disable-retries",
    ]  # fmt: skip
    with open(LOG_DIR / "router.log", "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while http_status(url + "/readiness") != 200:
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"trio-pd serve did not become ready; see {LOG_DIR}/router.log")
        time.sleep(0.2)
    return process, url


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
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    print("starting a real vLLM prefill/decode pair (about 30-100 s on 2 cores) ...")
    pair = VllmPair.start(log_dir=LOG_DIR, name="demo")
    router = None
    try:
        print(pair.describe())
        router, url = start_router(pair)
        print(f"trio-pd serve --vllm-pd-disaggregation at {url}")
        demo(pair, url)
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted")
        return 130
    finally:
        if router is not None and router.poll() is None:
            router.terminate()
            try:
                router.wait(timeout=15)
            except subprocess.TimeoutExpired:
                router.kill()
        pair.stop()
        print(f"stopped; logs in {LOG_DIR}")


if __name__ == "__main__":
    sys.exit(main())
