"""Opening the hot path's connections to workers: TCP (checked destinations), TLS, TCP_NODELAY.

`connect` gives an `http11.Connection` over a plain socket (`PlainStream`) or a TLS stream,
within the connect timeout; every failure is a `TransportError` saying why (`http11.py` says
what the connection then does).
"""

from __future__ import annotations

import socket
import ssl

import trio

from trio_pd.upstream.destinations import DestinationRefused, Destinations
from trio_pd.upstream.http11 import Connection, PlainStream, TransportError, describe_error


def _connect_reason(exc: OSError) -> str:
    """trio.open_tcp_stream raises one OSError whose cause groups each attempt's error."""
    cause = exc.__cause__
    errors = cause.exceptions if isinstance(cause, BaseExceptionGroup) else (exc,)
    reasons = []
    for error in errors:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        if reason not in reasons:
            reasons.append(reason)
    return "; ".join(reasons)


async def connect(
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
    connect_timeout: float,
    keepalive_expiry: float,
    destinations: Destinations | None = None,
) -> Connection:
    """Open a TCP connection (and complete the TLS handshake when `ssl_context` is given), both
    within `connect_timeout` seconds; TCP_NODELAY is on.

    With `destinations` the host is resolved and checked there and the connection made to the
    checked addresses themselves, in order; a refused one is a TransportError saying why."""
    where = f"{host}:{port}"
    try:
        with trio.fail_after(connect_timeout):
            if destinations is None:
                stream = await trio.open_tcp_stream(host, port)
            else:
                stream = await _open_checked(host, port, destinations)
            try:
                stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
                if ssl_context is None:
                    # Plain TCP: take the socket out of trio's SocketStream and drive it directly.
                    sock = socket.socket(fileno=stream.socket.detach())
                    sock.setblocking(False)
                    return Connection(PlainStream(sock), sock, None, keepalive_expiry)
                tls = trio.SSLStream(
                    stream,
                    ssl_context,
                    server_hostname=server_hostname or host,
                    https_compatible=True,  # EOF without close_notify ends a body, as in HTTPS
                )
                await tls.do_handshake()
            except BaseException:
                stream.socket.close()
                raise
    except trio.TooSlowError:
        raise TransportError(
            "timeout", f"connecting to {where} timed out after {connect_timeout:g} s"
        ) from None
    except DestinationRefused as exc:
        raise TransportError("transport", str(exc)) from exc
    except trio.BrokenResourceError as exc:  # the TLS handshake failed (verification, reset...)
        raise TransportError(
            "transport", f"TLS handshake with {where} failed: {describe_error(exc)}"
        ) from exc
    except OSError as exc:
        raise TransportError(
            "transport", f"cannot connect to {where}: {_connect_reason(exc)}"
        ) from exc
    return Connection(tls, stream.socket, tls, keepalive_expiry)


async def _open_checked(host: str, port: int, destinations: Destinations) -> trio.SocketStream:
    """A TCP stream to the first of `host`'s checked addresses that accepts (each tried in
    getaddrinfo's order), checked again once connected (`Destinations.check_connected`)."""
    errors: list[OSError] = []
    for address in await destinations.resolve(host, port, "legs"):
        try:
            stream = await trio.open_tcp_stream(address, port)
        except OSError as exc:
            errors.append(exc)
            continue
        try:
            destinations.check_connected(stream.socket, "legs")
        except BaseException:
            stream.socket.close()
            raise
        return stream
    if len(errors) == 1:
        raise errors[0]
    causes: list[Exception] = []
    for error in errors:  # trio's own error groups each address's attempts as its cause
        inner = error.__cause__
        if isinstance(inner, ExceptionGroup):
            causes.extend(inner.exceptions)
        else:
            causes.append(error)
    failed = OSError(f"no address of {host} accepted the connection")
    failed.__cause__ = ExceptionGroup("connect attempts", causes) if causes else None
    raise failed
