"""The parent <-> worker command protocol: length-prefixed orjson frames over a TCP socket on 127.0.0.1.

The parent listens; every torchrun rank connects and first sends ``{"hello": ..., "token": ...}`` with the secret
token the parent passed in its environment (so no other local process can drive the workers). Every receive has a
timeout; a closed socket or a timeout raises ``ProtocolError``. JSON (not pickle): nothing received is executed.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

import orjson

HEADER = struct.Struct(">Q")
MAX_FRAME = 1 << 31
TOKEN_ENV = "SKYRL_SIM_WORKER_TOKEN"


class ProtocolError(ConnectionError):
    """The other side closed the connection, sent garbage, or did not answer in time."""


def send(sock: socket.socket, message: dict[str, Any]) -> None:
    body = orjson.dumps(message, option=orjson.OPT_SERIALIZE_NUMPY)
    sock.sendall(HEADER.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, size: int, deadline: float) -> bytes:
    chunks: list[bytes] = []
    remaining = size
    while remaining:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ProtocolError("timed out waiting for the other side")
        sock.settimeout(min(left, 1.0))
        try:
            chunk = sock.recv(min(remaining, 1 << 20))
        except TimeoutError:
            continue
        except OSError as exc:
            raise ProtocolError(f"connection failed: {exc}") from exc
        if not chunk:
            raise ProtocolError("connection closed by the other side")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def recv(sock: socket.socket, timeout_s: float) -> dict[str, Any]:
    """One message, or ProtocolError after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    (size,) = HEADER.unpack(_recv_exact(sock, HEADER.size, deadline))
    if size > MAX_FRAME:
        raise ProtocolError(f"frame of {size} bytes is too large")
    try:
        message = orjson.loads(_recv_exact(sock, size, deadline))
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"malformed frame: {exc}") from exc
    if not isinstance(message, dict):
        raise ProtocolError("a frame must hold a JSON object")
    return message
