"""trio_pd's test engines, a distribution of their own (`testing/pyproject.toml`): the PD engine
simulator (`engine`), the demo, and (`sglang`, `vllm`) the launchers of a real SGLang or vLLM PD
pair on a CPU. It never imports the router (it runs `trio-pd serve` as a process), and the
router never imports it: the router's wheel ships without it."""
