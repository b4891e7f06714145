"""A vLLM-mode engine's configuration and its state while it runs (vLLM 0.33.0, docs/vllm.md)."""

from __future__ import annotations

import uuid

import attrs
import httpx2
import trio

from trio_pd_testing.engine.events import EventLog
from trio_pd_testing.engine.vllm_kv import BlockPool

VERSION = "0.33.0"  # the vLLM whose behaviour this models
FAILURE_POLICIES = ("fail", "recompute")


@attrs.frozen
class VllmEngineConfig:
    host: str = "127.0.0.1"
    port: int = 0
    model: str = "sim-model"
    num_blocks: int = 4096  # the KV cache, in blocks
    block_size: int = 16  # tokens per block (vLLM's default)
    kv_lease_duration: float = 30.0  # kv_connector_extra_config.kv_lease_duration
    # The old fixed lease (VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s): no heartbeat extends it.
    fixed_lease: bool = False
    heartbeat_interval: float | None = None  # None: kv_lease_duration // 6, as vLLM
    kv_load_failure_policy: str = "fail"
    prefill_ms_per_token: float = 0.0
    inter_token_ms: float = 0.0
    default_max_tokens: int = 16
    max_num_seqs: int = 256  # requests running at once; the rest wait
    keep_alive_secs: float = 5.0
    faults: tuple[str, ...] = ()  # process-wide sim_fault specs
    events_path: str | None = None
    # --enable-prompt-tokens-details: without it `usage.prompt_tokens_details` is null.
    prompt_tokens_details: bool = True
    max_model_len: int = 1 << 20  # --max-model-len: a longer prompt is refused (400)

    @property
    def heartbeat_secs(self) -> float:
        if self.heartbeat_interval is not None:
            return self.heartbeat_interval
        return max(self.kv_lease_duration / 6, 0.05)  # vLLM: kv_lease_duration // 6


@attrs.define(eq=False)
class VllmState:
    config: VllmEngineConfig
    events: EventLog
    pool: BlockPool
    engine_id: str = attrs.Factory(lambda: str(uuid.uuid4()))
    port: int = 0
    faults: tuple[str, ...] = ()
    running: trio.Semaphore = attrs.field(default=None)
    client: httpx2.AsyncClient | None = None
    seen_prompts: set[str] = attrs.Factory(set)  # the prefix cache, by whole prompt
    counter: int = 0
    # `hold@Ntok`: a stream paused after its N-th token until `release_held()` (no clock).
    released: trio.Event = attrs.Factory(trio.Event)

    def release_held(self) -> None:
        self.released.set()

    def __attrs_post_init__(self) -> None:
        self.running = trio.Semaphore(self.config.max_num_seqs)

    def next_id(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}-{self.counter:06d}-{uuid.uuid4().hex[:8]}"
