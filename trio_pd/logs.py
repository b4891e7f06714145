"""Stdlib logging with the request id on every line (a contextvar trio tasks inherit)."""

from __future__ import annotations

import contextvars
import logging

current_request_id: contextvars.ContextVar[str] = contextvars.ContextVar(
    "trio_pd_request_id", default="-"
)
FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = current_request_id.get()
        return True


def configure(level: str) -> None:
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger("trio_pd")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
