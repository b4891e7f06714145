"""The one exception family of the router and its JSON error envelope (docs/protocol.md §7)."""

from __future__ import annotations

import orjson


class RouterError(Exception):
    """An error the router answers itself: status, message, OpenAI-style type and code."""

    def __init__(
        self,
        status: int,
        message: str,
        error_type: str,
        code: str | int | None = None,
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.code = code if code is not None else status
        self.headers = headers

    def body(self) -> bytes:
        return error_body(self.message, self.error_type, self.code)


def without_frames(error: RouterError) -> RouterError:
    """`error` holding none of the frames it was raised through, nor the exceptions it was
    raised while handling (`__context__`, `__cause__`). A handler that keeps an error past its
    `except` block, or awaits inside it (answering the error: without this first, a refused
    body outlives its answer, tests/router/test_containment4_memory.py), otherwise keeps every
    local of those frames, a request's body among them, in a cycle with its own frame that only
    a full collection frees (`serve/process.py` `tune_gc`: practically never)."""
    error.__traceback__ = None
    error.__context__ = None
    error.__cause__ = None
    return error


def first_router_error(group: BaseExceptionGroup) -> RouterError:
    """The first RouterError in a (possibly nested) exception group, in the group's order: the
    one the client is answered with when `except* RouterError` caught several. The group must
    hold one."""
    found = group.subgroup(RouterError)
    assert found is not None, "the group holds no RouterError"
    error: BaseException = found
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    assert isinstance(error, RouterError)
    return error


def error_body(message: str, error_type: str, code: str | int) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": error_type, "code": code}})


def bad_request(message: str) -> RouterError:
    return RouterError(400, message, "invalid_request_error")


def not_found(path: str) -> RouterError:
    return RouterError(404, f"no route for {path}", "not_found_error")


def method_not_allowed(method: str, path: str, allowed: tuple[str, ...]) -> RouterError:
    allow = ", ".join(allowed).encode()
    return RouterError(
        405,
        f"method {method} is not allowed on {path}",
        "method_not_allowed",
        headers=((b"allow", allow),),
    )


def payload_too_large(limit: int) -> RouterError:
    return RouterError(413, f"request body exceeds {limit} bytes", "payload_too_large")


def unauthorized() -> RouterError:
    return RouterError(401, "missing or invalid API key", "authentication_error")


def no_worker(message: str, code: str | None = None) -> RouterError:
    return RouterError(503, message, "service_unavailable", code)


def gateway_timeout(message: str) -> RouterError:
    return RouterError(504, message, "timeout_error")


def internal_error() -> RouterError:
    return RouterError(500, "internal router error (logged with this request id)", "internal_error")
