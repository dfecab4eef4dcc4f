"""Messages between parameter-server workers and servers.

Nothing that arrives on a parameter-server connection is executed, unpickled, or allocated for
before it is checked (the threat model is in docs/security.md, "What pyzero trusts"):

- **Handshake**: a mutual HMAC-SHA256 challenge-response over fresh 32-byte nonces, keyed by the
  job's key (made at random for each job by server 0 and handed out through the job's store, or
  ``PYZERO_PS_KEY``/``key=``; never a constant). A peer without the key is refused before it can
  send a message, and a client learns that a server does not hold the key before it sends one.
- **A message** is the magic ``b"PZP1"``, the header's length (4 bytes, little endian, at most
  ``MAX_HEADER``), the header (a UTF-8 JSON object), then the raw bytes of each tensor the header
  lists. The receiver passes an ``expect`` function that checks every field (the op from a fixed
  set, the types and ranges of the values, no field it does not know) and returns the dtypes and
  element counts it accepts, from the shapes it already knows (a server: its shard); the header's
  tensor list must equal them. Only then is anything allocated, and tensor bytes go straight into
  the tensors (``socket.recv_into``). A failed check raises BadMessage: the connection is then out
  of step and is closed.

TCP, so it spans hosts; a dead peer is an EOF, noticed at once, and nothing half-read is applied.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import secrets
import socket
import time

import torch

MAGIC = b"PZP1"  # each message
HELLO = b"PZPSAUTH"  # the handshake (8 bytes)
NONCE = 32
MAX_HEADER = 8 << 20  # a join's header carries the model's parameter names and shapes
MIN_KEY_BYTES = 16
HANDSHAKE_TIMEOUT = 10.0  # s, for the whole handshake
STALL_TIMEOUT = 120.0  # s without a byte in the middle of a message: the peer is lost
DTYPES = {"float32": torch.float32}  # the only tensor dtype on the wire


class PeerLost(ConnectionError):
    """The other end of a parameter-server connection went away (process died or closed)."""


class AuthError(ConnectionRefusedError):
    """The handshake failed: the other end does not hold this job's key (or is not a pz.ps peer)."""


class BadMessage(ValueError):
    """A message that is not what the receiver accepts (format, field, size, dtype); the connection
    it came on must be closed."""


# ---- keys -------------------------------------------------------------------------------------


def resolve_key(key=None) -> bytes | None:
    """`key` (bytes or str), else PYZERO_PS_KEY, else None (the job's store then hands one out)."""
    where = "key"
    if key is None:
        key = os.environ.get("PYZERO_PS_KEY") or None
        where = "PYZERO_PS_KEY"
        if key is None:
            return None
    if isinstance(key, str):
        key = key.encode()
    if not isinstance(key, (bytes, bytearray)):
        raise TypeError(f"key: expected bytes or str, got {type(key).__name__}")
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"{where}: expected a secret of at least {MIN_KEY_BYTES} bytes (e.g. "
                         f"`python -c 'import secrets; print(secrets.token_hex(16))'`), got {len(key)}")
    return bytes(key)


def new_key() -> bytes:
    return secrets.token_bytes(32)


def _mac(key: bytes, role: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(key, role + a + b, hashlib.sha256).digest()


# ---- fields -----------------------------------------------------------------------------------


class Field:
    """A check of one header value, with the words an error uses for it."""

    def __init__(self, what: str, test):
        self.what, self.test = what, test

    def __call__(self, v) -> bool:
        return self.test(v)


def _int_in(lo, hi):
    return lambda v: type(v) is int and lo <= v <= hi


COUNT = Field("an integer in [0, 2**62]", _int_in(0, 1 << 62))
INT = Field("an integer in [-2**62, 2**62]", _int_in(-(1 << 62), 1 << 62))
BOOL = Field("true or false", lambda v: type(v) is bool)
TEXT = Field("a string of at most 4096 characters", lambda v: type(v) is str and len(v) <= 4096)
TRUE = Field("true", lambda v: v is True)
WID = Field("an integer in [0, 2**31)", _int_in(0, (1 << 31) - 1))  # a worker's id
FALSE = Field("false", lambda v: v is False)


def one_of(*values) -> Field:
    return Field(f"one of {list(values)}", lambda v: type(v) is str and v in values)


def optional(f: Field) -> Field:
    return Field(f"null or {f.what}", lambda v: v is None or f(v))


def _is_signature(v) -> bool:
    return type(v) is list and len(v) <= 1 << 20 and all(
        type(e) is list and len(e) == 2 and type(e[0]) is str and len(e[0]) <= 1024 and type(e[1]) is list
        and len(e[1]) <= 64 and all(COUNT(s) for s in e[1]) for e in v)


SIGNATURE = Field("a list of [parameter name, shape] pairs", _is_signature)
SCALAR = Field("a number, string, boolean or null, or a list of integers",
               lambda v: v is None or type(v) in (bool, int, float) or TEXT(v)
               or (type(v) is list and len(v) <= 1 << 16 and all(INT(x) for x in v)))


def check_fields(header: dict, fields: dict[str, Field], what: str) -> None:
    """Every field of `fields` present and passing its check, and no other field; else BadMessage."""
    unknown = sorted(k for k in header if k not in fields)
    if unknown:
        raise BadMessage(f"{what}: unknown fields {[k[:40] for k in unknown[:4]]}")
    missing = sorted(k for k in fields if k not in header)
    if missing:
        raise BadMessage(f"{what}: missing fields {missing}")
    for k, f in fields.items():
        if not f(header[k]):
            raise BadMessage(f"{what}: field {k!r}: expected {f.what}, got {_short(header[k])}")


def check_any(header: dict, what: str, max_fields: int = 64) -> None:
    """A flat object of at most `max_fields` SCALAR values (a server's stats)."""
    if len(header) > max_fields:
        raise BadMessage(f"{what}: {len(header)} fields (at most {max_fields})")
    check_fields(header, {k: SCALAR for k in header if type(k) is str and len(k) <= 64}, what)


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def finite_or_none(x):
    """Infinity (an unbounded staleness) travels as null: JSON has no infinity."""
    return None if isinstance(x, float) and math.isinf(x) else x


# ---- connections --------------------------------------------------------------------------------


class Connection:
    """One authenticated TCP connection (see the module docstring)."""

    def __init__(self, sock: socket.socket, peer: str):
        self.sock, self.peer = sock, peer
        self.closed = False
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()

    def _read_into(self, view: memoryview, first: bool = False, deadline: float | None = None) -> None:
        """Fill `view`; TimeoutError only if `first` and nothing arrived, PeerLost otherwise. `deadline`
        (time.monotonic()): the whole read must end by then, however the bytes trickle in."""
        got, n = 0, len(view)
        while got < n:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerLost(f"{self.peer} did not finish the handshake in {HANDSHAKE_TIMEOUT:g} s")
                self.sock.settimeout(left)
            try:
                k = self.sock.recv_into(view[got:], n - got)
            except TimeoutError:
                if first and got == 0:
                    raise
                if deadline is not None:  # (the socket's timeout was the time left before it)
                    raise PeerLost(f"{self.peer} did not finish the handshake in {HANDSHAKE_TIMEOUT:g} s") from None
                raise PeerLost(f"{self.peer} stalled in the middle of a message") from None
            if k == 0:
                raise PeerLost(f"{self.peer} closed the connection")
            got += k
            if first:
                self.sock.settimeout(STALL_TIMEOUT)

    def _read(self, n: int, first: bool = False, deadline: float | None = None) -> bytes:
        buf = bytearray(n)
        self._read_into(memoryview(buf), first, deadline)
        return bytes(buf)


def _alloc(dtype: torch.dtype, n: int) -> torch.Tensor:
    """Every tensor a message brings is allocated here, after its header has been checked."""
    return torch.empty(n, dtype=dtype)


def send(conn: Connection, header: dict, tensors=()) -> None:
    """Send `header` (a JSON object) and then each tensor's bytes (contiguous float32 CPU tensors)."""
    tensors = [t.detach().contiguous() for t in tensors]
    for t in tensors:
        if t.dtype not in DTYPES.values() or t.device.type != "cpu":
            raise TypeError(f"tensors: the parameter-server wire carries float32 CPU tensors, got {t.dtype} "
                            f"on {t.device}")
    names = {v: k for k, v in DTYPES.items()}
    body = json.dumps(dict(header, tensors=[[names[t.dtype], t.numel()] for t in tensors]),
                      separators=(",", ":"), allow_nan=False).encode()
    if len(body) > MAX_HEADER:
        raise ValueError(f"header: {len(body)} bytes, at most {MAX_HEADER}")
    try:
        conn.sock.sendall(MAGIC + len(body).to_bytes(4, "little") + body)
        for t in tensors:
            if t.numel():
                conn.sock.sendall(memoryview(t.view(torch.uint8).numpy()))
    except OSError as e:
        raise PeerLost(f"connection to {conn.peer} lost while sending {header.get('op', 'a reply')!r}: {e}") from e


def recv(conn: Connection, expect, timeout: float | None = None) -> tuple[dict, list[torch.Tensor]]:
    """Receive one message: (header, tensors). ``expect(header)`` checks the header's fields
    (raising BadMessage) and returns the [(dtype, count)] of the tensors it accepts.

    TimeoutError if no message starts within `timeout` s (the connection stays usable); PeerLost on
    EOF or a reset; BadMessage for anything not accepted (close the connection then)."""
    try:
        conn.sock.settimeout(timeout)
        head = conn._read(8, first=True)
        conn.sock.settimeout(STALL_TIMEOUT)
        if head[:4] != MAGIC:
            raise BadMessage(f"not a pz.ps message (it starts with {head[:4]!r})")
        n = int.from_bytes(head[4:], "little")
        if n > MAX_HEADER:
            raise BadMessage(f"a header of {n} bytes (at most {MAX_HEADER})")
        try:
            header = json.loads(conn._read(n).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise BadMessage(f"the header is not a JSON object ({type(e).__name__})") from None
        if type(header) is not dict:
            raise BadMessage(f"the header is not a JSON object (a {type(header).__name__})")
        declared = header.pop("tensors", None)
        specs = expect(header)
        names = {v: k for k, v in DTYPES.items()}
        want = [[names[d], c] for d, c in specs]
        if declared != want:
            raise BadMessage(f"tensors: expected {want}, the header lists {_short(declared)}")
        tensors = []
        for dtype, count in specs:
            t = _alloc(dtype, count)
            if count:
                conn._read_into(memoryview(t.view(torch.uint8).numpy()))
            tensors.append(t)
        return header, tensors
    except TimeoutError:
        raise TimeoutError(f"no message from {conn.peer} within {timeout} s") from None
    except (PeerLost, BadMessage):
        raise
    except OSError as e:
        raise PeerLost(f"connection to {conn.peer} lost: {type(e).__name__}: {e}") from e


def replies(fields: dict[str, Field], tensors=lambda h: []):
    """An ``expect`` for a reply: `fields`, or an error reply {"ok": false, "error": ...}."""
    def expect(h):
        if h.get("ok") is False and "error" in h:
            check_fields(h, {"ok": FALSE, "error": TEXT}, "error reply")
            return []
        check_fields(h, fields, "reply")
        return tensors(h)
    return expect


# ---- handshake ---------------------------------------------------------------------------------


def accept(sock: socket.socket, addr, key: bytes) -> Connection:
    """Server side of the handshake on a just-accepted socket; AuthError (socket closed) if it fails."""
    conn = Connection(sock, f"{addr[0]}:{addr[1]}")
    try:
        sock.settimeout(HANDSHAKE_TIMEOUT)
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT  # (a client trickling bytes holds a slot no longer)
        mine = secrets.token_bytes(NONCE)
        sock.sendall(HELLO + mine)
        got = conn._read(len(HELLO) + 2 * NONCE, deadline=deadline)
        if got[:len(HELLO)] != HELLO:
            raise AuthError(f"{conn.peer}: not a pz.ps client (it starts with {got[:8]!r})")
        theirs, mac = got[len(HELLO):len(HELLO) + NONCE], got[len(HELLO) + NONCE:]
        if not hmac.compare_digest(mac, _mac(key, b"client", mine, theirs)):
            raise AuthError(f"{conn.peer}: wrong key")
        sock.sendall(_mac(key, b"server", theirs, mine))
        return conn
    except (AuthError, PeerLost, OSError) as e:
        conn.close()
        if isinstance(e, AuthError):
            raise
        raise AuthError(f"{conn.peer}: handshake failed ({type(e).__name__}: {e})") from None


def connect(host: str, port: int, key: bytes, timeout: float = 30.0) -> Connection:
    """Open an authenticated connection to a server; AuthError if either side lacks the other's key."""
    if not isinstance(key, bytes) or len(key) < MIN_KEY_BYTES:
        raise ValueError(f"key: expected the job's key ({MIN_KEY_BYTES}+ bytes), got {type(key).__name__}")
    sock = socket.create_connection((host, port), timeout=timeout)
    conn = Connection(sock, f"{host}:{port}")
    try:
        sock.settimeout(HANDSHAKE_TIMEOUT)
        got = conn._read(len(HELLO) + NONCE)
        if got[:len(HELLO)] != HELLO:
            raise AuthError(f"{conn.peer} is not a pz.ps server")
        theirs, mine = got[len(HELLO):], secrets.token_bytes(NONCE)
        sock.sendall(HELLO + mine + _mac(key, b"client", theirs, mine))
        try:
            mac = conn._read(NONCE)
        except PeerLost:
            raise AuthError(f"the server at {conn.peer} refused this job's key (another job's server, or a "
                            "different PYZERO_PS_KEY)") from None
        if not hmac.compare_digest(mac, _mac(key, b"server", mine, theirs)):
            raise AuthError(f"the server at {conn.peer} does not hold this job's key")
        return conn
    except BaseException:
        conn.close()
        raise


class Listener:
    """A listening TCP socket on (host, port); ``accept`` returns raw sockets (the handshake runs
    in the connection's own thread, so a slow client holds up nobody else)."""

    def __init__(self, host: str, port: int = 0, backlog: int = 64):
        self.sock = socket.create_server((host, port), backlog=backlog)
        self.sock.settimeout(0.2)

    @property
    def address(self) -> tuple[str, int]:
        return tuple(self.sock.getsockname()[:2])

    def accept(self):
        """(socket, address), or None if nothing arrived within 0.2 s."""
        try:
            return self.sock.accept()
        except TimeoutError:
            return None

    def close(self) -> None:
        self.sock.close()
