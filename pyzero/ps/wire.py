"""Messages between parameter-server workers and servers.

The transport is the standard library's ``multiprocessing.connection``: TCP
(so it spans hosts), length-prefixed messages, an HMAC handshake with a shared
key, and a clean EOF when the peer dies (a killed worker is noticed at once,
nothing half-read is ever applied). A message is a small pickled header
followed by the raw bytes of each tensor it carries, received straight into
preallocated tensors (no pickling of tensor data).
"""
from __future__ import annotations

import os
from multiprocessing.connection import Client, Connection, Listener

import torch

DEFAULT_KEY = b"pyzero-ps"


def authkey() -> bytes:
    """The shared key servers and workers authenticate with (PYZERO_PS_KEY, else a default)."""
    key = os.environ.get("PYZERO_PS_KEY")
    return key.encode() if key else DEFAULT_KEY


class PeerLost(ConnectionError):
    """The other end of a parameter-server connection went away (process died or closed)."""


def listen(host: str = "0.0.0.0", port: int = 0) -> Listener:
    return Listener((host, port), authkey=authkey(), backlog=64)


def connect(host: str, port: int) -> Connection:
    return Client((host, port), authkey=authkey())


def send(conn: Connection, header: dict, tensors=()) -> None:
    """Send `header` (picklable, small) and then each tensor's bytes (contiguous CPU tensors)."""
    tensors = [t.detach().contiguous() for t in tensors]
    header = dict(header, _tensors=[(str(t.dtype).replace("torch.", ""), t.numel()) for t in tensors])
    try:
        conn.send(header)
        for t in tensors:
            conn.send_bytes(memoryview(t.view(torch.uint8).numpy()) if t.numel() else b"")
    except (OSError, EOFError) as e:
        raise PeerLost(f"connection lost while sending {header.get('op')!r}: {e}") from e


def recv(conn: Connection, timeout: float | None = None) -> tuple[dict, list[torch.Tensor]]:
    """Receive one message: (header, tensors). PeerLost on EOF; TimeoutError after `timeout` s."""
    try:
        if timeout is not None and not conn.poll(timeout):
            raise TimeoutError(f"no message within {timeout} s")
        header = conn.recv()
        tensors = []
        for dtype, n in header.pop("_tensors"):
            t = torch.empty(n, dtype=getattr(torch, dtype))
            if n:
                conn.recv_bytes_into(memoryview(t.view(torch.uint8).numpy()))
            else:
                conn.recv_bytes()
            tensors.append(t)
        return header, tensors
    except (OSError, EOFError) as e:
        raise PeerLost(f"connection lost: {type(e).__name__}: {e}") from e
