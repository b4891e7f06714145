"""Stdlib logging with the request id on every line (a contextvar trio tasks inherit), as text
or as JSON lines (`--log-json`), and the access log (`--access-log`): one line per request.

`--log-dir` also writes every line to a file of the day, as SMG does (tracing-appender's daily
rotation: `smg.YYYY-MM-DD`, UTC, no pruning); ours are `trio-pd.YYYY-MM-DD`. A new day opens a
new file instead of renaming the old one, and each line is one `write` to a file opened with
O_APPEND, so the processes of `--workers N` can share the file: no rename race, and lines never
interleave.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import orjson

current_request_id: contextvars.ContextVar[str] = contextvars.ContextVar(
    "trio_pd_request_id", default="-"
)
FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"
access_log = logging.getLogger("trio_pd.access")
LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,  # SGLang's spelling
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
LOG_FILE_PREFIX = "trio-pd"  # SMG's is "smg"


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


class DailyFileHandler(logging.Handler):
    """Appends each record to `<directory>/trio-pd.<UTC date of the record>`.

    One `os.write` per record on an O_APPEND descriptor: the kernel appends it whole, so
    several processes may write the same file. The file of a day is opened on its first line.
    """

    def __init__(self, directory: str | os.PathLike[str], prefix: str = LOG_FILE_PREFIX) -> None:
        super().__init__()
        self.directory = Path(directory)
        self.prefix = prefix
        self.day: str | None = None
        self.fd: int | None = None
        self.directory.mkdir(parents=True, exist_ok=True)
        self._open(utc_day(time.time()))  # now: a directory we cannot write fails the start

    def path_of(self, day: str) -> Path:
        return self.directory / f"{self.prefix}.{day}"

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = (self.format(record) + "\n").encode("utf-8", "backslashreplace")
            day = utc_day(record.created)
            if day != self.day:
                self._open(day)
            assert self.fd is not None
            view = memoryview(line)
            while view:
                view = view[os.write(self.fd, view) :]
        except Exception:
            self.handleError(record)

    def _open(self, day: str) -> None:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        fd = os.open(self.path_of(day), flags, 0o644)
        if self.fd is not None:
            os.close(self.fd)
        self.fd, self.day = fd, day

    def close(self) -> None:
        with self.lock:  # type: ignore[union-attr]
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
        super().close()


def utc_day(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(timestamp))


class LogDirError(Exception):
    """`--log-dir` cannot be created or written."""


def configure(level: str, *, json_lines: bool = False, log_dir: str | None = None) -> None:
    """The `trio_pd` loggers: to stderr, and with `log_dir` to the day's file as well (same
    format). Raises LogDirError when the directory cannot be used: logs asked for and lost
    would be found missing only when needed (SMG then logs nowhere at all)."""
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if log_dir is not None:
        try:
            handlers.append(DailyFileHandler(log_dir))
        except OSError as exc:
            raise LogDirError(f"--log-dir {log_dir}: {exc.strerror or exc}") from exc
    formatter = JsonLinesFormatter() if json_lines else logging.Formatter(FORMAT)
    for handler in handlers:
        handler.addFilter(RequestIdFilter())
        handler.setFormatter(formatter)
    root = logging.getLogger("trio_pd")
    for old in root.handlers:
        old.close()
    root.handlers[:] = handlers
    root.setLevel(LEVELS[level.lower()])
    root.propagate = False


def log_access(fields: dict[str, Any]) -> None:
    """The access line of one request; in text form `key=value` pairs, in JSON the fields."""
    text = " ".join(f"{k}={logged_value(v)}" for k, v in fields.items())
    access_log.info("%s", text, extra={"access": fields})


def logged_value(value: Any) -> str:
    """A value as one token of a text log line: as it is when plain, else JSON-quoted. The path
    comes percent-decoded from the client: a `%0A` in it must not start a forged line."""
    text = str(value)
    if text and text.isprintable() and " " not in text and '"' not in text:
        return text
    return json.dumps(text)
