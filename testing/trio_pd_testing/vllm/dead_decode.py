"""A "decode" that passes a router's first health check, then dies (issue 27 finding 1).

`GET` anything answers 200 until `die()`; then its listener is closed and every later connect
is refused, nothing ever written to it. A router that checked it once takes it for up, sends it
a prefill's handoff, and the prefill's blocks wait for a read that never comes. Shared by the
vLLM tier's findings tests and `bench/vllm_doomed.py`.
"""

from __future__ import annotations

import http.server
import threading


class PassingThenDead:
    def __init__(self) -> None:
        class Ok(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def die(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
