"""A simulated SGLang 0.5.23 prefill/decode engine pair, for testing and demonstrating PD routers.

A separate program that speaks the PD wire protocol (docs/protocol.md): it imports nothing from the
rest of trio_pd. It models what a router can observe of SGLang 0.5.23 (`sglang/srt/...`; where a
summary and that code disagree, the code wins), each module citing its source:

- loads.py: GET /v1/loads (entrypoints/v1_loads.py, managers/load_snapshot.py,
  scheduler_components/load_inquirer.py); /get_load is gone unless `legacy_load_endpoint`.
- info.py: /server_info and its deprecated alias, /model_info, /v1/models, /health (a 1-token
  generation), /ready (entrypoints/http_server.py, server_args.py).
- workload.py, rids.py: batch size, parallel sampling, rooms and rids as
  managers/io_struct.py normalizes them; duplicates as tokenizer_manager.py refuses them.
- tokenizer.py, scheduler.py, abort.py: registration, dispatch, the abort latch and drop rules
  (managers/tokenizer_manager.py), the prefix-matching abort (managers/scheduler.py),
  disconnects (a stream at once, non-stream at the SGLANG_REQUEST_STATE_WAIT_TIMEOUT poll).
- decode.py, prefill.py, bootstrap.py, heartbeat.py: the PD queues and what an abort frees,
  deferred KV release, room 0, the follow_bootstrap_room conflict, timeouts, the heartbeat
  (disaggregation/decode.py, prefill.py, common/conn.py, mooncake/conn.py, utils.py).
- responses.py, failures.py: answers and errors per route; no meta_info on OpenAI routes
  (entrypoints/openai/protocol.py, serving_*.py, serving_base.py).
- auth.py: NORMAL and ADMIN_OPTIONAL routes, `api_key` and `admin_api_key` (utils/auth.py).

Where it deliberately differs: it is fast and has no model (tokens are words, compute is a
configurable sleep, logprobs are fakes); it injects faults (`--fault`, a request's `sim_fault`,
in an envelope no engine sends); it keeps an event log (events.py) that tests read to see what
the engine saw; its KV handshake is one HTTP exchange with the prefill's bootstrap server; a
slot is held from preallocation to the end; some queues (waiting, retraction, grammar,
chunking) and the n > 1 warmup are not modelled. docs/engine-simulator.md has the full lists.
"""

from trio_pd_testing.engine.config import EngineConfig
from trio_pd_testing.engine.events import EventLog
from trio_pd_testing.engine.serve import EngineHandle, serve_engine

__all__ = ["EngineConfig", "EngineHandle", "EventLog", "serve_engine"]
