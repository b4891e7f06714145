"""trio_pd: a prefill/decode disaggregated LLM router built on trio structured concurrency."""

__version__ = "0.1.0"
