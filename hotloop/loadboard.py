"""The rollout's users' load in a small shared-memory file, for a trainer on the same host.

Owns the file's format and its two sides: `LoadBoard` (the rollout writes its counts at every
change) and `LoadReader` (a trainer's compute hooks read them, a few hundred nanoseconds per
read with no thread to wake). Why: `users_first = "pause"` must hold the trainer within
milliseconds of a user's request arriving, and a watcher thread that learns it over gRPC must
first get a core, which on a host whose cores the engine and the trainer keep busy took
tens of milliseconds, a good part of a prefill. The gRPC stream (`Rollout.WatchLoad`) stays
the way to learn the board's path, and the fallback where the file is not visible (another
host or container).

Format (little-endian, 24 bytes): magic `HLLOAD1\\0`, a random u64 nonce (sent over the stream
too, so a reader never trusts a stale or foreign file at the same path), u32 users' requests in
flight, u32 of those still waiting for a first token. Writes are two aligned 4-byte stores; a
reader may see one count updated before the other, which only matters for a microsecond.

Does not own: what the counts mean (services/rollout/core.py `UserLoad`), or the policy.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import struct
import tempfile
from pathlib import Path

MAGIC = b"HLLOAD1\0"
_HEADER = struct.Struct("<8sQ")  # magic, nonce
_COUNTS = struct.Struct("<II")  # in flight, waiting
SIZE = _HEADER.size + _COUNTS.size


def _directory() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class LoadBoard:
    """The writer (one per rollout process). `close` removes the file."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.nonce = secrets.randbits(63)
        d = Path(directory) if directory else _directory()
        self.path = d / f"hotloop-load-{os.getpid()}-{self.nonce:x}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.ftruncate(fd, SIZE)
            self._mm = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        _HEADER.pack_into(self._mm, 0, MAGIC, self.nonce)
        self.write(0, 0)

    def write(self, in_flight: int, waiting: int) -> None:
        _COUNTS.pack_into(self._mm, _HEADER.size, in_flight, waiting)

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._mm.close()
        with contextlib.suppress(OSError):
            self.path.unlink()


class LoadReader:
    """The reader. `open` returns None where the board is not this host's (or is gone)."""

    def __init__(self, mm: mmap.mmap, path: str) -> None:
        self._mm, self.path = mm, path

    @classmethod
    def open(cls, path: str, nonce: int) -> LoadReader | None:
        if not path:
            return None
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None  # another host or container: the stream it is
        try:
            if os.fstat(fd).st_size < SIZE:
                return None
            mm = mmap.mmap(fd, SIZE, prot=mmap.PROT_READ)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        magic, got = _HEADER.unpack_from(mm, 0)
        if magic != MAGIC or got != nonce:
            mm.close()
            return None
        return cls(mm, path)

    def counts(self) -> tuple[int, int]:
        """(users' requests in flight, those waiting for a first token)."""
        return _COUNTS.unpack_from(self._mm, _HEADER.size)

    def waiting(self) -> int:
        return _COUNTS.unpack_from(self._mm, _HEADER.size)[1]

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._mm.close()
