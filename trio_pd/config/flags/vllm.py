"""The table's rows for vLLM PD pairs (docs/vllm.md): which protocol the static workers speak,
the KV connector, and what a prefill answer without its handoff means (one row a flag)."""

from __future__ import annotations

from trio_pd.config.flags.flag import SWITCH, Flag

KV_CONNECTORS = ("nixl",)  # pull mode; push modes (NIXL push, MoRI-IO, Mooncake) not yet
MISSING_KV_PARAMS = ("decode-local", "fail")

VLLM: tuple[Flag, ...] = (
    Flag(
        "--vllm-pd-disaggregation",
        "the --prefill/--decode workers are vLLM engines (NixlConnector): prefill first, then "
        "decode with prefill's kv_transfer_params (vllm-router's flag; SMG's `--backend vllm` "
        "means the same); a --prefill bootstrap port is accepted and ignored",
        field="vllm_pd_disaggregation",  # build.py: also set by --backend vllm
        action=SWITCH,
        group="vLLM PD",
    ),
    Flag(
        "--kv-connector",
        "the vLLM KV connector of the pairs: nixl (pull; push modes are not supported yet)",
        field="kv_connector",
        default="nixl",
        choices=KV_CONNECTORS,
        group="vLLM PD",
    ),
    Flag(
        "--vllm-missing-kv-params",
        "a vLLM prefill that answers 200 without kv_transfer_params: send decode the plain "
        "request (decode-local: it computes the prompt again) or answer 502 (fail); counted "
        "either way (trio_pd_vllm_kv_params_missing_total)",
        field="vllm_missing_kv_params",
        default="decode-local",
        choices=MISSING_KV_PARAMS,
        group="vLLM PD",
    ),
)
