"""Every private name trio_pd takes from hypercorn and h11 still exists, with the shape used.

`serve/connection.py` subclasses hypercorn's `TCPServer`, `H11Protocol` and `ProtocolWrapper`,
overrides their underscore methods and swaps h11's receive buffer for a stricter one;
`testing/trio_pd_testing/engine/httpserver.py` drives `TCPServer` by hand. None of that is public
API, so `pyproject.toml` pins both packages exactly and this test names each private piece: an
upgrade that moves one fails here, by name, instead of at a client's first request.
"""

import importlib.metadata
import inspect
import re
from pathlib import Path

import h11
from h11._receivebuffer import ReceiveBuffer, blank_line_regex
from h11._util import LocalProtocolError
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def pinned(name: str) -> str:
    match = re.search(rf'"{name}==([^"]+)"', PYPROJECT.read_text())
    assert match, f"{name} is not pinned exactly in pyproject.toml"
    return match.group(1)


def test_installed_versions_are_the_pinned_ones() -> None:
    for dist in ("hypercorn", "h11"):
        assert importlib.metadata.version(dist) == pinned(dist)


def test_the_test_engines_pin_the_routers_hypercorn() -> None:
    """The simulator's HTTP server drives `TCPServer` too, from its own distribution."""
    testing = PYPROJECT.parent / "testing" / "pyproject.toml"
    assert f'"hypercorn=={pinned("hypercorn")}"' in testing.read_text()


def test_h11_receive_buffer_layout() -> None:
    connection = h11.Connection(h11.SERVER)
    assert isinstance(connection._receive_buffer, ReceiveBuffer)
    buffer = ReceiveBuffer()
    buffer += b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
    assert isinstance(buffer._data, bytearray)
    assert hasattr(buffer, "_multiple_lines_search")
    assert blank_line_regex.search(buffer._data, 0) is not None
    assert buffer.maybe_extract_lines() == [bytearray(b"GET / HTTP/1.1"), bytearray(b"host: x")]
    assert issubclass(LocalProtocolError, Exception)


def test_hypercorn_methods_overridden_or_called_exist() -> None:
    for cls, names in (
        (H11Protocol, ("_check_protocol", "_send_error_response", "_send_h11_event", "handle")),
        (TCPServer, ("_read_data", "_initiate_server_close", "_close", "protocol_send", "run")),
    ):
        for name in names:
            assert inspect.iscoroutinefunction(getattr(cls, name)), f"{cls.__name__}.{name}"
    assert isinstance(MAX_RECV, int) and MAX_RECV > 0


def test_protocol_wrapper_keeps_the_fields_protocol_args_reads() -> None:
    params = inspect.signature(ProtocolWrapper.__init__).parameters
    for name in ("app", "config", "context", "task_group", "state", "ssl", "client", "server"):
        assert name in params, name
    assert "send" in params
    init = inspect.signature(TCPServer.__init__).parameters
    assert list(init)[1:] == ["app", "config", "context", "state", "stream"]


def test_tcp_server_instance_fields_used() -> None:
    source = inspect.getsource(TCPServer.__init__)
    for field in ("self.idle_task", "self.stream", "self.context", "self.state", "self.config"):
        assert field in source, field
    assert "self._task_group" in inspect.getsource(TCPServer.run)
