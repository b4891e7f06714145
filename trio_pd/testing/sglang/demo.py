"""`make demo-sglang`: trio_pd in front of a real SGLang 0.5.23 pair on this CPU.

Starts a real prefill (--context-length 1024) and decode (4096), then `trio-pd serve` in front,
and shows a normal request, a stream, and a prefill that really fails: a prompt the prefill
refuses (400) while the decode has already registered the room and waits for KV. The client
gets the prefill's 400, and the decode's own `/v1/loads` is idle again milliseconds later.
Everything is stopped on the way out, Ctrl-C included.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from trio_pd.testing.sglang.launcher import REPO_ROOT, SGLangPair, free_port, http_status

LOG_DIR = REPO_ROOT / ".cache" / "sglang-logs" / "demo"
PREFILL_CONTEXT = 1024


def post(url: str, body: dict, timeout: float = 60.0) -> tuple[int, bytes, float]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read(), time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return e.code, e.read(), time.monotonic() - t0


def busy(decode_url: str) -> int:
    with urllib.request.urlopen(decode_url + "/v1/loads", timeout=5) as response:
        snapshot = json.load(response)
    total = 0
    for load in snapshot["loads"]:
        queues = load.get("disaggregation", {})
        total += load["num_running_reqs"] + load["num_waiting_reqs"]
        total += sum(v for k, v in queues.items() if k.endswith("_queue_reqs"))
    return total


def start_router(pair: SGLangPair) -> tuple[subprocess.Popen, str, Path]:
    port, metrics = free_port(), free_port()
    log_path = LOG_DIR / "router.log"
    command = [
        sys.executable, "-m", "trio_pd", "serve",
        "--host", "127.0.0.1", "--port", str(port),
        "--prefill", pair.prefill_url, str(pair.bootstrap_port),
        "--decode", pair.decode_url,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics), "--admin-port", "0",
        "--policy", "round_robin", "--disable-retries",
    ]  # fmt: skip
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while http_status(url + "/readiness") != 200:
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"trio-pd serve did not become ready; see {log_path}")
        time.sleep(0.2)
    return process, url, log_path


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
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    # Ctrl-C and SIGTERM end the demo through the finally blocks below.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    print("starting a real SGLang prefill/decode pair (about 30-60 s on 2 cores) ...")
    pair = SGLangPair.start(prefill_context_length=PREFILL_CONTEXT, log_dir=LOG_DIR, name="demo")
    router = None
    try:
        print(pair.describe())
        router, url, log_path = start_router(pair)
        print(f"trio-pd serve at {url} (log {log_path})")
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
