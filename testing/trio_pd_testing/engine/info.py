"""The engine's information and probe endpoints (`entrypoints/http_server.py`).

- GET /server_info: the resolved server arguments (`server_args.resolved_dict`: what the
  launcher was given with every resolution applied, e.g. `--dp-size N --enable-dp-attention`
  reported as dp_size=1, attn_dp_size=N, and `enable_dp_attention` kept as attn_dp_size > 1),
  plus scheduler info, `internal_states` (one per DP rank), `version`, `frontend`. The
  simulator's own settings (timeouts, faults) are under `simulator`, which no SGLang has.
- GET /get_server_info: the deprecated alias; SGLang logs a warning on every call, the
  simulator logs a `deprecated_endpoint` event.
- GET /model_info (and deprecated /get_model_info, same event), GET /v1/models.
- GET /health and /health_generate: one handler; 503 while starting (health_status) or
  stopping, else a 1-token generation that answers after >= 1 s on SGLang (it sleeps a second
  before looking for the scheduler's output): `health_generate_secs` here.
- GET /ready: cheap, 200 when up and not stopping, else 503.
- GET|POST /flush_cache: 200.
"""

from __future__ import annotations

import time
from typing import Any

import trio

from trio_pd_testing.engine.config import SGLANG_VERSION
from trio_pd_testing.engine.state import EngineState
from trio_pd_testing.engine.workload import DEFAULT_BOOTSTRAP_PORT


def server_info(engine: EngineState, http_port: int | None, bootstrap_port: int | None) -> Any:
    cfg = engine.config
    ranks = cfg.num_dp_ranks
    args = {
        "model_path": cfg.model,
        "tokenizer_path": cfg.model,
        "served_model_name": cfg.model,
        "host": cfg.host,
        "port": http_port,
        "context_length": cfg.context_length,
        "tp_size": cfg.tp_size_resolved,
        "pp_size": 1,
        "dp_size": cfg.dp_size_resolved,
        "attn_dp_size": cfg.attn_dp_size_resolved,
        "enable_dp_attention": cfg.attn_dp_size_resolved > 1,
        "load_balance_method": cfg.load_balance_method_resolved,
        "max_running_requests": cfg.max_running,  # per DP rank
        "max_total_tokens": cfg.max_total_tokens,
        "disaggregation_mode": cfg.role,
        "disaggregation_bootstrap_port": (
            bootstrap_port if cfg.role == "prefill" and bootstrap_port else DEFAULT_BOOTSTRAP_PORT
        ),
        "disaggregation_transfer_backend": cfg.transfer_backend,
        "enable_dynamic_batch_tokenizer": cfg.enable_dynamic_batch_tokenizer,
        "dynamic_batch_tokenizer_batch_timeout": cfg.dynamic_batch_tokenizer_batch_timeout,
        "tokenizer_worker_num": cfg.tokenizer_worker_num,
        "skip_server_warmup": True,
        "ssl_certfile": cfg.ssl_certfile,
        "ssl_keyfile": cfg.ssl_keyfile,
        "ssl_ca_certs": cfg.ssl_ca_certs,
        "page_size": cfg.page_size,
        "kv_events_config": cfg.kv_events_config,
    }
    return {
        **args,
        "launch_command": None,
        "max_total_num_tokens": cfg.max_total_tokens,
        "max_req_input_len": cfg.context_length - 1,
        "startup_time": {},
        "internal_states": [{"dp_rank": r, "last_gen_throughput": 0.0} for r in range(ranks)],
        "version": SGLANG_VERSION,
        "frontend": "python",
        "kv_events": engine.kv.describe(),  # `describe_kv_events_publisher`: None when off
        "simulator": {  # not SGLang's: this simulator's own settings
            "name": "trio_pd_testing.engine",
            "waiting_timeout": cfg.waiting_timeout,
            "bootstrap_timeout": cfg.bootstrap_timeout,
            "disconnect_poll_secs": cfg.disconnect_poll_secs,
            "tokenize_window": cfg.tokenize_window,
            "health_generate_secs": cfg.health_generate_secs,
            "heartbeat_interval": cfg.heartbeat_interval,
            "deferred_kv_release_timeout": cfg.deferred_kv_release_timeout,
            "legacy_load_endpoint": cfg.legacy_load_endpoint,
            "faults": [f.spec for f in engine.faults],
        },
    }


def model_info(engine: EngineState) -> dict[str, Any]:
    cfg = engine.config
    return {
        "model_path": cfg.model,
        "served_model_name": cfg.model,
        "tokenizer_path": cfg.model,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "load_format": "dummy",
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": cfg.role,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": None,
        "architectures": None,
    }


def models(engine: EngineState) -> dict[str, Any]:
    cfg = engine.config
    card = {
        "id": cfg.model,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "sglang",
        "root": cfg.model,
        "parent": None,
        "max_model_len": cfg.context_length,
    }
    return {"object": "list", "data": [card]}


async def health_status(engine: EngineState) -> int:
    """What GET /health and /health_generate answer (after the 1-token generation)."""
    if engine.stopping or engine.health_status != 200:
        return 503 if engine.stopping else engine.health_status
    await trio.sleep(engine.config.health_generate_secs)
    return 503 if engine.stopping else 200


def ready_status(engine: EngineState) -> int:
    return 503 if engine.stopping or engine.health_status != 200 else 200
