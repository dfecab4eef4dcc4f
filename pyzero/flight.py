"""Flight recorder: every group's last collectives, to explain hangs and mismatches.

Each group keeps a ring of its last ``PYZERO_FLIGHT`` calls (default 256;
0 turns recording off): sequence number, collective, element count, dtype,
reduce op, algorithm, root or peer, start time and state (``started`` for a
synchronous call in progress, ``queued`` for async work not yet known
complete, ``done``, ``failed``). The records live in a C++ ring per group
(csrc/flight.h): the shm transport writes them inside each call, other
backends through :meth:`Ring.begin`; no lock, no I/O, no allocation.

When a collective fails (:class:`CollectiveError` or :class:`CollectiveTimeout`),
the rank asks every other rank of the group for its records through the
job's store and waits up to ``PYZERO_FLIGHT_WAIT`` seconds (default 1) for
the answers; a thread in each process, idle in a blocking store wait until
asked, answers even when its main thread is busy elsewhere (a rank that never
calls). The error is raised again with a summary: which ranks are behind and
the call they have not made, the call each rank is in, ranks that did not
answer (stopped or dead), and the first sequence number at which the ranks'
calls differ (mismatched collectives).

:func:`dump` (``pz.debug_dump``) returns or writes the records on demand.
``PYZERO_TRACE=1`` (or a directory) keeps longer rings with end times and
writes a Chrome trace (chrome://tracing, Perfetto) per rank,
``pyzero_trace_rank<r>.json``, at ``pz.destroy()`` and at exit.

This module imports nothing of pyzero but ``_C`` (pyzero.comm imports it and hooks it into every call).
"""
from __future__ import annotations

import atexit
import datetime
import json
import os
import re
import threading
import time
import warnings

from . import _C
from .envvars import env_int, env_seconds
from .topology import peer_json

MAX_RECORDS = 1 << 20  # PYZERO_FLIGHT's largest value: records kept per group (about 80 MiB)
_DTYPES = {code: name for name, code in dict(_C.DTYPES).items()}
_OPS = {code: name for name, code in dict(_C.OPS).items()}
_ALGOS = {code: name for name, code in dict(_C.ALGOS).items()}
_AUTO = dict(_C.ALGOS)["auto"]

QUEUED, STARTED, DONE, FAILED = 0, 1, 2, 3
STATES = ("queued", "started", "done", "failed")
# The exit waits at most this long for answering threads still connecting (see stop()).
CONNECT_WAIT_S = 5.0
_connecting: list[threading.Thread] = []  # answering threads pz.destroy() left in a store call
P2P = ("send", "recv", "batch_isend_irecv")  # point-to-point calls: a peer, no sequence number

_now = time.monotonic_ns
_WALL0 = time.time() - time.monotonic()  # monotonic -> wall-clock seconds


def _trace_dir() -> str | None:
    raw = os.environ.get("PYZERO_TRACE", "").strip()
    if raw in ("", "0"):
        return None
    return "." if raw == "1" else raw


# Call names by code: the C++ transports' own (csrc/flight.h), then the ones only Python records.
CALLS: list[str] = [name for name, _ in sorted(dict(_C.FLIGHT_CALLS).items(), key=lambda kv: kv[1])]
_CALL_CODE = {name: code for code, name in enumerate(CALLS)}


def _call_code(call: str) -> int:
    code = _CALL_CODE.get(call)
    if code is None:
        code = _CALL_CODE[call] = len(CALLS)
        CALLS.append(call)
    return code


class Ring:
    """One group's last calls in this process, in a C++ ring (csrc/flight.h [Note: flight records]).

    A backend that records its own calls (the shm transport, inside each call) sets ``native``: then
    pyzero.comm does not call :meth:`begin`, and :meth:`failed` takes 0 for "the call that just
    failed", the newest record. Otherwise the hot path (pyzero.comm) is ``i = ring.begin(...)``, then
    ``ring.done(i)`` when a synchronous call returns, ``ring.queued(i, raw)`` for async work,
    ``ring.failed(i, e)`` when the call raised. An async record stays queued until its work is seen
    complete (the C++ transports mark their own).
    """

    __slots__ = ("gid", "ranks", "rank", "c", "native", "works")

    def __init__(self, gid: int, ranks: tuple[int, ...], rank: int, size: int, timed: bool = False):
        self.gid, self.ranks, self.rank = gid, tuple(ranks), rank
        self.c = _C.FlightRing(max(size, 1), timed)
        self.native = False  # set by a backend that records its calls in self.c itself
        # record index -> (raw async handle, whether this object still has to mark its record done),
        # kept to find a failed work's record, until the ring overwrites the record
        self.works: dict = {}

    @property
    def n(self) -> int:
        """Records written so far (the newest one's index)."""
        return self.c.n

    def begin(self, call: str, count: int, code: int, op: int = -1, algo: int = _AUTO, root: int = -1) -> int:
        """Record the start of a collective (`root`: a group rank); returns its record index."""
        if self.c.timed and self.works:
            self._settle()
        return self.c.begin(_call_code(call), count, code, op, algo, root, False)

    def begin_p2p(self, call: str, count: int, code: int, peer: int) -> int:
        """Record the start of a point-to-point call with `peer` (a group rank)."""
        return self.c.begin(_call_code(call), count, code, -1, _AUTO, peer, True)

    def done(self, i: int) -> None:
        self.c.finish(i, DONE)

    def queued(self, i: int, raw) -> None:
        """Call `i` (recorded by :meth:`begin`) went on as async work `raw`: queued until seen complete."""
        self.c.finish(i, QUEUED)
        self._keep(i, raw, True)

    def adopt(self, raw) -> None:
        """Async work of a native backend, which marks its record itself: kept to find that record
        when the work fails."""
        i = getattr(raw, "flight_index", 0)
        if i:
            self._keep(i, raw, False)

    def _keep(self, i: int, raw, managed: bool) -> None:
        works = self.works
        works[i] = (raw, managed)
        if len(works) > self.c.capacity:  # forget handles whose records were overwritten
            old = self.c.n - self.c.capacity
            for k in [k for k in list(works) if k <= old]:
                works.pop(k, None)

    def failed(self, i: int, error: BaseException) -> BaseException:
        """Mark call `i` failed (0 with a native backend: the newest record, if the transport marked it
        failed); a collective error comes back explained by every rank's records."""
        if i:
            self.c.finish(i, FAILED)
        else:
            i = self.c.n
        rec = self.c.record(i)
        if rec is None or rec[-1] != FAILED:
            return error  # a native backend raised before recording the call (or the ring moved on)
        self.works.pop(i, None)
        if isinstance(error, _C.CollectiveError):
            return explain(self, error, rec)
        return error

    # ---- reading ----

    def _settle(self) -> None:
        """Mark the async records whose work completed done (with PYZERO_TRACE: the time seen so)."""
        for i, (w, managed) in list(self.works.items()):  # (a copy: the answering thread reads too)
            if managed and _completed(w):
                self.c.finish(i, DONE)
                self.works[i] = (w, False)

    def records(self) -> list[dict]:
        """The recorded calls, oldest first."""
        self._settle()
        return [_as_dict(rec, self.ranks) for rec in self.c.records()]

    def find_work(self, raw) -> int | None:
        for i, (w, _) in list(self.works.items()):
            if w is raw:
                return i
        return None


def _completed(w) -> bool:
    try:
        return bool(w.is_completed())
    except Exception:  # noqa: BLE001 - a destroyed transport
        return False


class NullRing(Ring):
    """PYZERO_FLIGHT=0: nothing is recorded (errors are raised as they come)."""

    __slots__ = ()

    def __init__(self, gid, ranks, rank, size=1, timed=False):
        self.gid, self.ranks, self.rank = gid, tuple(ranks), rank
        self.c, self.native, self.works = None, True, {}  # native: pyzero.comm calls no begin

    @property
    def n(self) -> int:
        return 0

    def begin(self, call, count, code, op=-1, algo=_AUTO, root=-1) -> int:
        return 0

    def begin_p2p(self, call, count, code, peer) -> int:
        return 0

    def done(self, i) -> None:
        pass

    def queued(self, i, raw) -> None:
        pass

    def adopt(self, raw) -> None:
        pass

    def failed(self, i, error):
        return error

    def records(self) -> list[dict]:
        return []


def _as_dict(rec: tuple, ranks: tuple[int, ...]) -> dict:
    """A C++ record (FlightRing.records) as pyzero.debug_dump shows it; roots and peers as global ranks."""
    _, seq, call, count, code, op, algo, root, t0, t1, state = rec
    name = CALLS[call] if 0 <= call < len(CALLS) else str(call)
    d = {"seq": seq, "call": name, "count": count, "dtype": _DTYPES.get(code, str(code)),
         "op": _OPS.get(op), "algo": _ALGOS.get(algo, str(algo)), "state": STATES[state],
         "start": round(_WALL0 + t0 / 1e9, 6)}
    if root >= 0:
        g = ranks[root] if root < len(ranks) else root
        d["peer" if name in P2P else "root"] = g
    if t1:
        d["end"] = round(_WALL0 + t1 / 1e9, 6)
    return d


def describe(d: dict) -> str:
    """`all_reduce(count=2, op=sum, dtype=float32)` for a record."""
    if d["call"] == "barrier":
        return "barrier()"
    parts = [f"count={d['count']}"]
    if d.get("op") is not None:
        parts.append(f"op={d['op']}")
    if "root" in d:
        parts.append(f"root={d['root']}")
    if "peer" in d:
        parts.append(f"peer={d['peer']}")
    parts.append(f"dtype={d['dtype']}")
    if d.get("algo") not in (None, "auto"):
        parts.append(f"algo={d['algo']}")
    return f"{d['call']}({', '.join(parts)})"


def _same_call(a: dict, b: dict) -> bool:
    if (a["call"], a["count"], a["dtype"], a.get("op"), a.get("root")) != \
            (b["call"], b["count"], b["dtype"], b.get("op"), b.get("root")):
        return False
    return a["algo"] == b["algo"] or "auto" in (a["algo"], b["algo"])  # auto may pick the other one


# ---------------------------------------------------------------------------
# Process state: the rings, the answering thread, the trace


class _Process:
    def __init__(self, read_env: bool = True):
        """`read_env`: read (and check) PYZERO_FLIGHT, PYZERO_TRACE and PYZERO_FLIGHT_WAIT; pz.init does, through
        start(); at import the defaults stand (a bad value is pz.init's error, not import pyzero's)."""
        self.rings: dict[int, Ring] = {}
        self.store = None  # this process's own store connection for answering and asking
        self.prefix = ""
        self.rank = 0
        self.world = 1
        self.pid = os.getpid()  # a forked child (a data loader worker) writes no trace of its own
        self.errored = False  # a collective failed here: peers may want this rank's records
        self.thread: threading.Thread | None = None
        self.connected = threading.Event()  # the answering thread has its store connections (or gave up)
        self.lock = threading.Lock()  # orders that thread's taking the connection with stop()
        self.size, self.trace, self.wait_s = 256, None, 1.0  # (the defaults)
        if not read_env:
            return
        self.size = env_int("PYZERO_FLIGHT", self.size)
        if self.size > MAX_RECORDS:  # (each group allocates its ring at once: a huge value is out of memory)
            raise ValueError(f"PYZERO_FLIGHT={self.size}: expected at most {MAX_RECORDS} records per group "
                             "(0 turns the recorder off)")
        self.trace = _trace_dir()
        self.wait_s = env_seconds("PYZERO_FLIGHT_WAIT", self.wait_s)


_proc = _Process(read_env=False)


def ring(gid: int, ranks: tuple[int, ...], rank: int) -> Ring:
    """A new group's ring (pyzero.comm calls this for every group it joins)."""
    if _proc.size == 0 and not _proc.trace:
        r = _proc.rings[gid] = NullRing(gid, ranks, rank, 1)
        return r
    if _proc.trace:
        r = _proc.rings[gid] = Ring(gid, ranks, rank, max(_proc.size, 1 << 16), timed=True)
    else:
        r = _proc.rings[gid] = Ring(gid, ranks, rank, _proc.size)
    return r


def start(rank: int, size: int, token: str) -> None:
    """At pz.init(), before any group: read the settings, forget the previous job's rings."""
    _proc.__init__()
    if _proc.trace and not os.path.isdir(_proc.trace):  # (found now, not when the trace is written at the end)
        raise ValueError(f"PYZERO_TRACE={os.environ['PYZERO_TRACE']!r}: expected 1 or an existing directory "
                         "to write the trace in")
    _proc.rank, _proc.world, _proc.prefix = rank, size, f"pz/flight/{token}"


def listen(store) -> None:
    """At pz.init(), once the world group exists (every rank has connected to the store): with 2+ ranks,
    start the thread that answers record requests. It opens its own store connections (a connection
    opened while ranks are still joining can stall the store for seconds)."""
    if _proc.world < 2 or _proc.thread is not None:
        return
    _proc.thread = threading.Thread(target=_answer_loop,
                                    args=(store, _proc.prefix, _proc.rank, _proc.connected, _proc.lock),
                                    name="pyzero-flight", daemon=True)
    _proc.thread.start()


def stop() -> None:
    """At pz.destroy(): write the trace (PYZERO_TRACE), stop the answering thread."""
    if _proc.trace and _proc.rings:
        try:
            write_trace()
        except OSError as e:  # (destroy still frees everything: a warning, not an error that stops it part-way)
            warnings.warn(f"PYZERO_TRACE: could not write the trace: {e}", RuntimeWarning, stacklevel=3)
    with _proc.lock:
        connecting = _proc.thread is not None and not _proc.connected.is_set()
        if connecting:
            # Still opening its store connections (right after pz.init, or held up by a slow reverse DNS lookup
            # inside torch's TCPStore): it ends once connected, the prefix no longer matching. It is inside a C++
            # store call, and if the interpreter exits then, finalisation unwinds it through C++ and the process
            # aborts ("terminate called without an active exception"): the exit waits for it (_at_exit).
            _connecting.append(_proc.thread)
            _proc.prefix = ""
    if not connecting and _proc.thread is not None and _proc.store is not None:
        # A stopped store host never answers (a plain store call would block for good): bounded.
        try:  # rank 0 waits up to 1 s for the others (see _leave); a store op takes milliseconds
            _bounded(_leave, (2 * _proc.wait_s if _proc.errored else 0) + (2.0 if _proc.rank == 0 else 0.5))
        except TimeoutError:
            pass
        if _proc.thread.is_alive():
            # The bound ran out first (a loaded machine): the thread is still in a store call, waiting for the
            # "bye" _leave is still sending, or for the store to close. The exit waits for it too.
            _connecting.append(_proc.thread)
    _proc.prefix = ""  # a thread still connecting ends once connected
    _proc.thread = None
    _proc.store = None
    _proc.rings = {}


def wait_connecting() -> None:
    """Let the answering threads pz.destroy() left in a store call end (at most CONNECT_WAIT_S in all). Each holds
    its job's store, which on rank 0 serves the job's port, until it ends."""
    deadline = time.monotonic() + CONNECT_WAIT_S
    while _connecting:
        _connecting[0].join(max(deadline - time.monotonic(), 0.0))
        if _connecting[0].is_alive():
            return
        _connecting.pop(0)


def _bounded(fn, seconds: float):
    """fn() on a daemon thread, given up on after `seconds` (then the store is not used again)."""
    out = []

    def run():
        try:
            out.append(fn())
        except Exception as e:  # noqa: BLE001
            out.append(e)
    t = threading.Thread(target=run, name="pyzero-flight-store", daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        _proc.store = None  # blocked on a store that does not answer: leave it to that thread
        raise TimeoutError(f"the store did not answer within {seconds:g} s")
    if isinstance(out[0], Exception):
        raise out[0]
    return out[0]


def _leave() -> None:
    """Tell this process's answering thread to end (after the peers leave, if a call failed here)."""
    st, pre, thread = _proc.store, _proc.prefix, _proc.thread
    try:
        leaving = st.add(f"{pre}/leaving", 1)
        if _proc.errored:  # peers may still ask for this rank's records: answer until they leave too
            deadline = time.monotonic() + _proc.wait_s
            while leaving < _proc.world and time.monotonic() < deadline:
                time.sleep(0.01)
                leaving = st.add(f"{pre}/leaving", 0)
        n = st.add(f"{pre}/{_proc.rank}/n", 1)
        st.set(f"{pre}/{_proc.rank}/req{n}", "bye")
        thread.join(timeout=1.0)
        stopped = st.add(f"{pre}/stopped", 1)
        if _proc.rank == 0:  # the store lives in this process: let the other threads end first
            deadline = time.monotonic() + 1.0
            while stopped < _proc.world and time.monotonic() < deadline:
                time.sleep(0.005)
                stopped = st.add(f"{pre}/stopped", 0)
    except Exception:  # noqa: BLE001 - the store is gone (rank 0 exited): the thread ends with it
        pass


def _answer(gid: int) -> dict:
    r = _proc.rings.get(gid)
    other = {}
    for g, rr in list(_proc.rings.items()):
        if g != gid:
            open_ = [d for d in rr.records() if d["state"] in ("started", "queued")]
            if open_:
                other[g] = open_[-1]
    return {"rank": _proc.rank, "records": [] if r is None else r.records(), "other_groups": other}


def _answer_loop(store, prefix: str, rank: int, connected: threading.Event, lock: threading.Lock) -> None:
    """`connected`, `lock`: this job's (a later job has its own); `connected` is set once connected or given up."""
    try:
        st = store.clone()  # for waiting on requests
        asking = store.clone()  # for this process's own requests (pyzero.flight.collect)
        asking.set_timeout(datetime.timedelta(seconds=max(_proc.wait_s, 0.1)))
    except Exception:  # noqa: BLE001 - no second connection: records stay local
        connected.set()
        return
    with lock:
        if _proc.prefix != prefix:  # the job ended while connecting
            connected.set()
            return
        _proc.store = asking
        connected.set()
    n = 0
    while True:
        key = f"{prefix}/{rank}/req{n + 1}"
        try:
            st.wait([key], datetime.timedelta(days=1))
            req = st.get(key).decode()
        except Exception as e:  # noqa: BLE001
            if "timeout" in str(e).lower() or "Timeout" in type(e).__name__:
                continue
            return  # the store is gone: the job is over
        n += 1
        if req == "bye":
            return
        if not (req.isdigit() and len(req) <= 18):  # a group id; anything else is not answered
            continue
        try:
            st.set(f"{prefix}/{rank}/dump{n}", json.dumps(_answer(int(req))))
        except Exception:  # noqa: BLE001
            return


def collect(r: Ring, wait_s: float | None = None, skip=()) -> tuple[dict[int, dict | None], str]:
    """Ask the other ranks of `r`'s group (but `skip`) for their records; {global rank: answer or None}, a note.

    A rank answers from its answering thread, or has posted its records when a call failed there (so a
    process that exits right after its error is still heard)."""
    st = _proc.store
    out: dict[int, dict | None] = {g: None for g in r.ranks if g != _proc.rank}
    if st is None:
        return out, "no store to exchange records through"
    wait_s = _proc.wait_s if wait_s is None else wait_s
    pre, asked, note = _proc.prefix, {}, ""
    try:
        for g in out:
            if g not in skip:
                n = st.add(f"{pre}/{g}/n", 1)
                st.set(f"{pre}/{g}/req{n}", str(r.gid))
                asked[g] = n
        deadline = time.monotonic() + wait_s
        while asked:
            for g, n in list(asked.items()):
                for key in (f"{pre}/{g}/dump{n}", f"{pre}/{g}/posted{r.gid}"):
                    if st.check([key]):
                        out[g] = peer_json(st.get(key), key, lambda v: type(v) is dict and type(v.get("records"))
                                           is list and type(v.get("other_groups")) is dict,
                                           "a rank's flight records", max_bytes=64 << 20)
                        del asked[g]
                        break
            if not asked or time.monotonic() > deadline:
                break
            time.sleep(0.002)
    except Exception as e:  # noqa: BLE001
        note = f"the store did not answer ({type(e).__name__})"
    return out, note


def explain(r: Ring, error: BaseException, rec: tuple) -> BaseException:
    """`error` (a collective error of call `rec` on `r`'s group) again, with every rank's records summed up."""
    _proc.errored = True
    try:
        mine = r.records()
        # Ranks the transport saw exit will not answer: do not wait for them.
        m = re.search(r"\(exited: \[([0-9, ]+)\]\)", str(error))
        dead = {r.ranks[int(x)] for x in m.group(1).split(",") if int(x) < len(r.ranks)} if m else set()
        posted = json.dumps(_answer(r.gid))

        def exchange():
            if _proc.thread is not None:
                _proc.connected.wait(_proc.wait_s)  # a failure right after pz.init: still connecting
            if _proc.store is not None:  # for peers that ask after this process has exited
                _proc.store.set(f"{_proc.prefix}/{_proc.rank}/posted{r.gid}", posted)
            return collect(r, skip=dead)
        try:
            if all(g == _proc.rank or g in dead for g in r.ranks):
                # No peer left to ask or to answer later: no store needed (nor a wait for this process's
                # store connections, which a slow reverse DNS lookup in torch's TCPStore can hold up for seconds).
                answers, note = {g: None for g in r.ranks if g != _proc.rank}, ""
            else:
                answers, note = _bounded(exchange, 2 * _proc.wait_s + 0.5)
        except Exception as e:  # noqa: BLE001 - the store host is stopped or gone
            answers, note = {g: None for g in r.ranks if g != _proc.rank}, f"the store did not answer ({e})"
        summary = summarize(r, _as_dict(rec, r.ranks), {_proc.rank: {"records": mine}, **answers}, note)
    except Exception as e:  # noqa: BLE001 - never hide the original error
        summary = f"flight recorder: could not gather records ({type(e).__name__}: {e})"
    new = type(error)(f"{error}\n{summary}")
    new.flight = summary  # the summary alone, for programs that report it
    return new


def work_failed(raw, error: BaseException) -> BaseException:
    """An async call's error (Work.wait): explained like a synchronous one when its record is found."""
    if not isinstance(error, _C.CollectiveError):
        return error
    for r in list(_proc.rings.values()):
        i = r.find_work(raw)
        if i is not None:
            return r.failed(i, error)
    return error


def summarize(r: Ring, failed: dict, by_rank: dict[int, dict | None], note: str = "") -> str:
    """One message: who is behind and where each rank is, silent ranks, the first mismatched call."""
    if failed["call"] in P2P:
        return _summarize_p2p(r, failed, by_rank, note)
    seq = failed["seq"]
    lines = [_header(r, f"seq {seq} {describe(failed)}")]
    silent, behind, colls = [], [], {}
    for g in r.ranks:
        ans = by_rank.get(g)
        if ans is None:
            silent.append(g)
            continue
        recs = [d for d in ans["records"] if d["call"] not in P2P]
        colls[g] = {d["seq"]: d for d in recs}
        last = recs[-1] if recs else None
        open_ = [d for d in ans["records"] if d["state"] in ("started", "queued")]
        if g == _proc.rank:
            continue
        if last is None or last["seq"] < seq:
            behind.append(g)
            where = "has made no collective call on this group" if last is None else \
                f"last called seq {last['seq']} {describe(last)} [{last['state']}]"
            lines.append(f"rank {g} is behind: it has not called seq {seq} ({describe(failed)}); it {where}")
        elif open_:
            d = open_[0]
            lines.append(f"rank {g} is in seq {d['seq']} {describe(d)} [{d['state']}, "
                         f"{time.time() - d['start']:.1f} s]")
        else:
            lines.append(f"rank {g}: last call seq {last['seq']} {describe(last)} [{last['state']}]")
        lines += _elsewhere(g, ans)
    # The first sequence number at which two answering ranks called different collectives.
    common = sorted(set.intersection(*(set(c) for c in colls.values()))) if len(colls) > 1 else []
    for s in common:
        calls = {g: c[s] for g, c in colls.items()}
        ref = calls[min(calls)]
        if any(not _same_call(ref, d) for d in calls.values()):
            lines.append(f"mismatched calls at seq {s}: " + ", ".join(
                f"rank {g} called {describe(d)}" for g, d in sorted(calls.items())))
            break
    if silent:
        lines.append(_unanswered(silent, note))
    return "\n  ".join(lines)


def _summarize_p2p(r: Ring, failed: dict, by_rank: dict[int, dict | None], note: str) -> str:
    """summarize for a send/recv (no sequence number; a peer, not the group, it waits for): what the peer
    (a batch: every other rank) is doing."""
    lines = [_header(r, describe(failed))]
    peers = [failed["peer"]] if "peer" in failed else [g for g in r.ranks if g != _proc.rank]
    silent = []
    for g in peers:
        ans = by_rank.get(g)
        if ans is None:
            silent.append(g)
            continue
        recs = ans["records"]
        open_ = [d for d in recs if d["state"] in ("started", "queued")]
        for d in open_[:4]:
            lines.append(f"rank {g} is in {describe(d)} [{d['state']}, {time.time() - d['start']:.1f} s]")
        if not open_:
            lines.append(f"rank {g}: last call {describe(recs[-1])} [{recs[-1]['state']}]" if recs else
                         f"rank {g} has made no call on this group")
        lines += _elsewhere(g, ans)
    if silent:
        lines.append(_unanswered(silent, note))
    return "\n  ".join(lines)


def _header(r: Ring, call: str) -> str:
    """The summary's first line: the group and the call that failed here."""
    ranks = list(r.ranks)
    # (the transport's message numbers a group's ranks from 0, in the group's order; these lines, globally)
    within = "" if ranks == list(range(len(ranks))) else \
        f"; the error above numbers them 0 to {len(ranks) - 1} in this order, these lines by global rank"
    return (f"flight recorder, group {r.gid} (global ranks {ranks}{within}): this rank (global {_proc.rank}) "
            f"failed in {call}")


def _elsewhere(g: int, ans: dict) -> list[str]:
    """Where rank `g` is in its other groups, from its answer."""
    return [f"rank {g} is also in group {og} seq {d['seq']} {describe(d)} [{d['state']}]"
            for og, d in ans.get("other_groups", {}).items()]


def _unanswered(silent: list[int], note: str) -> str:
    return f"ranks {silent} did not answer (exited, stopped or unreachable)" + (f"; {note}" if note else "")


# ---------------------------------------------------------------------------
# On demand: pz.debug_dump(), the trace


def dump(path: str | None = None) -> dict:
    """This rank's records of every group it is in: {"rank", "groups": [{"gid", "ranks", "records"}]};
    written as JSON to `path` too when given."""
    if path is not None and not isinstance(path, (str, bytes, os.PathLike)):  # (open() takes an int as an fd)
        raise TypeError(f"path: expected None or a file path, got {type(path).__name__} {path!r}")
    out = {"rank": _proc.rank, "time": time.time(),
           "groups": [{"gid": r.gid, "ranks": list(r.ranks), "records": r.records()}
                      for r in _proc.rings.values()]}
    if path is not None:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    return out


def write_trace(path: str | None = None) -> str:
    """Write this rank's calls as a Chrome trace (one row per group); returns the path."""
    if path is None:
        path = os.path.join(_proc.trace or ".", f"pyzero_trace_rank{_proc.rank}.json")
    events = []
    for r in _proc.rings.values():
        for d in r.records():
            ts = d["start"] * 1e6
            ev = {"name": d["call"], "cat": "collective", "pid": _proc.rank, "tid": r.gid, "ts": ts,
                  "args": {k: v for k, v in d.items() if k not in ("start", "end")}}
            if "end" in d:
                ev.update(ph="X", dur=max(d["end"] * 1e6 - ts, 0.0))
            else:
                ev.update(ph="i", s="t")
            events.append(ev)
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return path


@atexit.register
def _at_exit():
    if os.getpid() != _proc.pid:
        return
    if _proc.thread is not None:  # a script that ends without pz.destroy(): end the answering thread
        try:  # as destroy does
            stop()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    elif _proc.trace and _proc.rings:
        try:
            write_trace()
        except OSError:
            pass
    wait_connecting()  # a daemon thread left in a C++ store call aborts the exit (see stop())
