"""A real vLLM engine's `/metrics` page as numbers: what the vLLM tier's tests and
`bench/vllm_doomed.py` read of what the engines saw."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def summed(page: str) -> dict[str, float]:
    """Every sample of the page, summed over labels, by sample name (so a counter is
    `name_total`, a histogram's count `name_count`); `num_gpu_blocks` is the KV pool's size in
    blocks (a label of `vllm:cache_config_info`)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
            if sample.name == "vllm:cache_config_info":
                out["num_gpu_blocks"] = float(sample.labels.get("num_gpu_blocks") or 0)
    return out


def idle(m: dict[str, float]) -> bool:
    """The engine holds no KV block and runs or queues nothing (an absent figure is not idle)."""
    return (
        m.get("vllm:kv_cache_usage_perc", 1.0) == 0.0
        and m.get("vllm:num_requests_running", 1.0) == 0.0
        and m.get("vllm:num_requests_waiting", 1.0) == 0.0
    )
