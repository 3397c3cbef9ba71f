"""Reading a snapshot file into memory and hashing it, in pieces that replay workers share.

Two equal shard files read on two threads do not finish together, and one core idles
meanwhile; then each file's xxh3 would run on one thread after its last byte was read.
Here a file is read in ``PIECE``-byte pieces posted on the replay's ``WorkBoard``, so a
worker done with its own file reads the rest of the other's; and the file is hashed as it
fills, in order, by whichever thread completes the next piece, so the checksum is ready
(almost) when the last piece is.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import xxhash

from eventlog.fold.sharing import WorkBoard

#: Bytes per piece.
PIECE = 32 * 1024 * 1024


def digest_hex(data: bytes | memoryview | np.ndarray) -> str:
    """xxh3-128 of bytes, hex: a snapshot file's checksum (``_InOrderHash`` is its
    streaming form)."""
    return xxhash.xxh3_128_hexdigest(data)  # type: ignore[arg-type]


def read_and_hash(fd: int, buf: np.ndarray, board: WorkBoard | None,
                  hashed: bool = True) -> tuple[int, str | None]:
    """Fill ``buf`` from the start of file ``fd``; returns the bytes read (fewer than
    ``len(buf)``: the file ended early) and the xxh3-128 (hex) of ``buf`` (``None`` unless
    ``hashed``). With a board, in pieces other workers may take."""
    size, piece_bytes = len(buf), PIECE
    if board is None or size <= piece_bytes:
        got = _pread_full(fd, buf, 0)
        return got, digest_hex(buf) if hashed else None
    starts = range(0, size, piece_bytes)
    done = dict.fromkeys(starts, 0)
    digest = _InOrderHash(buf, piece_bytes) if hashed else None

    def piece(at: int) -> None:
        done[at] = _pread_full(fd, buf[at:at + piece_bytes], at)
        if digest is not None:
            digest.filled(at)

    board.run(starts, piece)
    return sum(done.values()), digest.hexdigest() if digest is not None else None


def _pread_full(fd: int, view: np.ndarray, offset: int) -> int:
    """Read into all of ``view`` from file offset ``offset``, unless the file ends first;
    returns the bytes read."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)  # type: ignore[list-item]  # an array is a buffer
        if not n:
            break
        got += n
    return got


class _InOrderHash:
    """``digest_hex`` of a buffer whose ``piece``-byte pieces are filled in any order, on any
    thread: each piece is hashed once every piece before it is, by the thread that
    completes that run of pieces (the others go on with their work)."""

    def __init__(self, buf: np.ndarray, piece: int) -> None:
        self._buf = buf
        self._piece = piece
        self._hash = xxhash.xxh3_128()  # the streaming form of ``digest_hex``
        self._lock = threading.Lock()
        self._filled: set[int] = set()
        self._next = 0
        self._hashing = False

    def filled(self, at: int) -> None:
        """Piece ``at`` (its start) holds its bytes; hash what is now hashable in order."""
        with self._lock:
            self._filled.add(at)
            if self._hashing:
                return  # the thread hashing now sees it before it stops
            self._hashing = True
        while True:
            with self._lock:
                if self._next not in self._filled:
                    self._hashing = False
                    return
                start = self._next
                self._next += self._piece
            self._hash.update(self._buf[start:start + self._piece])  # type: ignore[arg-type]

    def hexdigest(self) -> str:
        """The digest of the whole buffer (every piece must have been filled)."""
        if self._next < len(self._buf):
            raise RuntimeError(f"hashed {self._next} of {len(self._buf)} bytes")
        return self._hash.hexdigest()
