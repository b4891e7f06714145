"""What dispatch asks of an engine: an attempt on a pair, built with that engine's bodies and rules.

Inside the attempt the engine's rules (`attempt.EngineRules`) decide the schedule (parallel
legs, or prefill then decode), how prefill's answer is read and what it makes of decode's body,
how decode's answer is rewritten for the client and which failures mean something else there.
"""

from __future__ import annotations

from typing import Protocol

from trio_pd.fleet.worker import Worker
from trio_pd.pd.attempt import Attempt
from trio_pd.pd.cancel import RequestCancel
from trio_pd.pd.request import DispatchContext, PDRequest, Ranks
from trio_pd.respond import Responder


class Engine(Protocol):
    """An engine module (`sglang.py`, `vllm.py`) as dispatch sees it."""

    NAME: str
    RESUMES: bool  # its streams may resume on a fresh pair after decode broke
    # Its `/detokenize` decodes a batch of id lists (a greedy resume's seam, `migration.py`)
    SEAM_BY_DETOKENIZE: bool

    async def new_attempt(
        self,
        ctx: DispatchContext,
        request: PDRequest,
        responder: Responder,
        cancel: RequestCancel,
        pair: tuple[Worker, Worker],
        times: tuple[float, float],
        ranks: Ranks,
    ) -> Attempt:
        """An attempt of `request` on `pair`, ready to run (RouterError: the request cannot
        go to this engine, or its legs' bodies are too large); `times`: its start, deadline."""
        ...
