"""Swap space for optimizer state on a local disk (NVMe): one file per sub-group.

I/O is a small thread pool calling ``os.preadv`` / ``os.pwritev`` (they
release the GIL) on large chunks of page-aligned buffers. Files are opened
with ``O_DIRECT`` where the filesystem accepts it (ext4, xfs: no page-cache
copy, so the state does not come back into RAM as cache), and buffered where
it does not (tmpfs, some network filesystems); :attr:`Swapper.direct` says
which. Space is reserved up front with ``posix_fallocate``, so a disk that is
too small fails when the optimizer is built, not mid-run; a write that still
fails (ENOSPC, EIO) raises :class:`SwapError` and the swapper refuses further
use. The swap files are scratch space, never a checkpoint: they are created
under a fresh directory below ``nvme_path`` and removed on close.
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

ALIGN = 4096                  # O_DIRECT needs block-aligned offsets, sizes and addresses
CHUNK = 8 << 20               # bytes per pread/pwrite call; chunks of one transfer run in parallel


class SwapError(RuntimeError):
    """A swap read or write failed; the optimizer state in the swap files is no longer consistent."""


def round_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` (rounded up to ALIGN) whose data pointer is ALIGN-aligned."""
    nbytes = round_up(max(nbytes, 1))
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    off = (-raw.data_ptr()) % ALIGN
    return raw[off:off + nbytes]


def check_path(path, needed_bytes: int, arg: str = "nvme_path") -> None:
    """Raise ValueError naming `arg` unless `path` is an existing, writable directory with
    at least `needed_bytes` free (os.statvfs)."""
    if path is None:
        raise ValueError(f"{arg}: required (a directory on a local disk for the swap files)")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{arg}: expected a directory path, got {type(path).__name__}")
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"{arg}: {path!r} does not exist")
    if not os.path.isdir(path):
        raise ValueError(f"{arg}: {path!r} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{arg}: {path!r} is not writable")
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if free < needed_bytes:
        have, need = format_bytes(free), format_bytes(needed_bytes)
        if have == need:  # (sizes that round to the same figure)
            have, need = f"{free} bytes", f"{needed_bytes} bytes"
        raise ValueError(f"{arg}: {path!r} has {have} free, the swap files need {need}")


def format_bytes(n: int) -> str:
    """n bytes in the largest of bytes, KiB, MiB and GiB that keeps the figure >= 1: '512 bytes', '1.50 KiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= 1024 and round(n / scale, 2) >= 1:
            return f"{n / scale:.2f} {unit}"
    return f"{n} byte" + ("" if n == 1 else "s")


def _open(path: str, direct: bool | None):
    """(fd, is_direct): O_DIRECT unless the filesystem refuses it (or direct=False)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    if direct is not False and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o600), True
        except OSError as e:
            if direct or e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
    return os.open(path, flags, 0o600), False


class Swapper:
    """Files ``group{k}.swap`` of ``sizes[k]`` bytes (rounded up to ALIGN) under a fresh
    directory in `path`; asynchronous whole-file reads into and writes from aligned buffers."""

    def __init__(self, path, sizes: list[int], threads: int = 4, direct: bool | None = None):
        self.sizes = [round_up(int(s)) for s in sizes]
        check_path(path, sum(self.sizes))
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"io_threads: expected an int >= 1, got {threads!r}")
        self.dir = tempfile.mkdtemp(prefix="pyzero-swap-", dir=os.fspath(path))
        self.fds: list[int] = []
        self.failed: BaseException | None = None
        self._finalizer = weakref.finalize(self, Swapper._cleanup, self.fds, self.dir)
        try:
            for k, size in enumerate(self.sizes):
                fd, is_direct = _open(os.path.join(self.dir, f"group{k}.swap"), direct)
                self.fds.append(fd)
                if k == 0:
                    self.direct = is_direct
                _reserve(fd, size, self.dir)
        except BaseException:
            self.close()
            raise
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pyzero-swap")
        self.bytes_read = self.bytes_written = 0
        self._lock = threading.Lock()

    @staticmethod
    def _cleanup(fds, d):
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        fds.clear()
        shutil.rmtree(d, ignore_errors=True)

    def close(self) -> None:
        """Wait for nothing, close the files and delete the swap directory."""
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        self._finalizer()
        self.closed = True

    closed = False

    def grow(self, sizes: list[int]) -> None:
        """Make file k ``sizes[k]`` bytes (rounded up to ALIGN, not smaller than now); the new bytes read as
        zeros. The space is checked and reserved first (ValueError naming nvme_path when it is short)."""
        self._check()
        sizes = [round_up(int(s)) for s in sizes]
        if len(sizes) != len(self.sizes) or any(new < old for new, old in zip(sizes, self.sizes)):
            raise ValueError(f"sizes: expected {len(self.sizes)} sizes, none below the files' {self.sizes}, "
                             f"got {sizes}")
        check_path(self.dir, sum(sizes) - sum(self.sizes))
        for fd, size, old in zip(self.fds, sizes, self.sizes):
            if size > old:
                _reserve(fd, size, self.dir)
        self.sizes = sizes

    def _check(self):
        if self.closed:
            raise SwapError("the swap files were removed by close(): the optimizer state on disk is gone (save it "
                            "before closing; a new optimizer can load that)")
        if self.failed is not None:
            raise SwapError(f"{self.failed} (an earlier transfer failed; the swapper is unusable)") from self.failed

    def _transfer(self, k: int, buf: torch.Tensor, write: bool) -> Future:
        self._check()
        size = self.sizes[k]
        if buf.dtype != torch.uint8 or buf.numel() < size or buf.data_ptr() % ALIGN:
            raise ValueError(f"buffer: expected an ALIGN-aligned uint8 tensor of >= {size} bytes")
        view = memoryview(buf.numpy()).cast("B")
        fd = self.fds[k]
        parts = [self.pool.submit(self._io, fd, view[o:min(o + CHUNK, size)], o, write)
                 for o in range(0, size, CHUNK)]
        done: Future = Future()
        # finish() sees each part only as its argument: a closure over `parts` would be a reference cycle
        # (part -> its callbacks -> finish -> parts) that kept `done`, its callbacks and what they hold (the
        # optimizer, its swap files) alive until a garbage-collection pass.
        state, lock = {"left": len(parts), "errs": []}, threading.Lock()

        def finish(f):
            with lock:
                if f.exception() is not None:
                    state["errs"].append(f.exception())
                state["left"] -= 1
                last = state["left"] == 0
            if last:
                errs = state["errs"]
                if errs:
                    err = _swap_error(errs[0], self.dir, k, write)
                    err.__cause__ = errs[0]
                    self.failed = self.failed or err
                    done.set_exception(err)
                else:
                    done.set_result(size)

        for f in parts:
            f.add_done_callback(finish)
        with self._lock:
            if write:
                self.bytes_written += size
            else:
                self.bytes_read += size
        return done

    @staticmethod
    def _io(fd: int, view: memoryview, offset: int, write: bool) -> None:
        while len(view):
            n = os.pwritev(fd, [view], offset) if write else os.preadv(fd, [view], offset)
            if n <= 0:
                raise OSError(errno.EIO, "short transfer")
            view, offset = view[n:], offset + n

    def read(self, k: int, buf: torch.Tensor) -> Future:
        """Start reading file k into `buf`; the Future raises SwapError on failure."""
        return self._transfer(k, buf, write=False)

    def write(self, k: int, buf: torch.Tensor) -> Future:
        """Start writing `buf` to file k; the Future raises SwapError on failure."""
        return self._transfer(k, buf, write=True)

    def read_range(self, k: int, offset: int, out: torch.Tensor) -> None:
        """Synchronously read bytes [offset, offset + out.nbytes) of file k into `out` (any alignment)."""
        self._check()
        nbytes = out.numel() * out.element_size()
        lo, hi = offset // ALIGN * ALIGN, round_up(offset + nbytes)
        tmp = aligned_empty(hi - lo)
        self._io(self.fds[k], memoryview(tmp.numpy()).cast("B")[:hi - lo], lo, write=False)
        out.view(-1).view(torch.uint8).copy_(tmp[offset - lo:offset - lo + nbytes])

    def write_range(self, k: int, offset: int, src: torch.Tensor) -> None:
        """Synchronously write `src` to bytes [offset, offset + src.nbytes) of file k (read-modify-write)."""
        self._check()
        nbytes = src.numel() * src.element_size()
        lo, hi = offset // ALIGN * ALIGN, round_up(offset + nbytes)
        tmp = aligned_empty(hi - lo)
        view = memoryview(tmp.numpy()).cast("B")[:hi - lo]
        try:
            self._io(self.fds[k], view, lo, write=False)
            tmp[offset - lo:offset - lo + nbytes].copy_(src.contiguous().view(-1).view(torch.uint8))
            self._io(self.fds[k], view, lo, write=True)
        except OSError as e:
            self.failed = self.failed or _swap_error(e, self.dir, k, True)
            raise self.failed from e


def _reserve(fd: int, size: int, d: str) -> None:
    """Allocate the file's blocks now (zero-filled), so running out of space shows up here."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise ValueError(f"nvme_path: not enough space in {d!r} for {size} more bytes of swap files") from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)  # no fallocate here: sparse file, space is taken on first write


def _swap_error(e: BaseException, d: str, k: int, write: bool) -> SwapError:
    what = "writing" if write else "reading"
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return SwapError(f"out of disk space {what} swap file {k} in {d!r}; the optimizer state is "
                         "inconsistent, free space and restore from the last checkpoint (it is not touched)")
    return SwapError(f"{what} swap file {k} in {d!r} failed: {e}; the optimizer state is inconsistent, "
                     "restore from the last checkpoint (it is not touched)")
