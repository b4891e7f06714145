"""A simulated SGLang prefill/decode engine pair, for testing and demonstrating PD routers.

A separate program that speaks the PD wire protocol (see PROTOCOL.md): it imports nothing from
the rest of trio_pd.
"""

from trio_pd.testing.engine.config import EngineConfig
from trio_pd.testing.engine.events import EventLog
from trio_pd.testing.engine.serve import EngineHandle, serve_engine

__all__ = ["EngineConfig", "EngineHandle", "EventLog", "serve_engine"]
