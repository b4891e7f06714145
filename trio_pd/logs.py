"""Stdlib logging with the request id on every line (a contextvar trio tasks inherit), as text
or as JSON lines (`--log-json`), and the access log (`--access-log`): one line per request."""

from __future__ import annotations

import contextvars
import logging
import os
import time
from typing import Any

import orjson

current_request_id: contextvars.ContextVar[str] = contextvars.ContextVar(
    "trio_pd_request_id", default="-"
)
FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"
access_log = logging.getLogger("trio_pd.access")


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = current_request_id.get()
        return True


class JsonLinesFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, pid, request id, message, and the fields
    an access line carries (`extra={"access": {...}}`)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": os.getpid(),
            "request_id": getattr(record, "request_id", "-"),
            "message": record.getMessage(),
        }
        access = getattr(record, "access", None)
        if access:
            line.update(access)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line).decode()


def configure(level: str, *, json_lines: bool = False) -> None:
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonLinesFormatter() if json_lines else logging.Formatter(FORMAT))
    root = logging.getLogger("trio_pd")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def log_access(fields: dict[str, Any]) -> None:
    """The access line of one request; in text form `key=value` pairs, in JSON the fields."""
    text = " ".join(f"{k}={v}" for k, v in fields.items())
    access_log.info("%s", text, extra={"access": fields})
