"""How optimizer steps are cut into tiles, shared by the recorder's prediction
(``eventlog.predictive``) and the replay's batched steps (``eventlog.fold.deferred``): both
must cut a param where the other does, or the replayed bits differ from the predicted ones.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

#: Tiles start and end on multiples of this many bytes from their tensor's start. torch's
#: fused CPU Adam shares a call's elements among its threads in 64-byte cache lines, and
#: runs each range's elements past its last whole vector through a scalar loop whose bits
#: differ from the vector loop's: a tile boundary off that grid would move elements from
#: one loop to the other, and the replay would miss the seal.
TILE_ALIGN = 64


class _Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


_S = TypeVar("_S", bound=_Sized)


def units_of(tiles: list[_S], unit_bytes: int) -> list[list[_S]]:
    """Consecutive tiles gathered into units of at most ``unit_bytes`` of gradient (a bigger
    tile is a unit of its own), so small params do not pay one optimizer call each."""
    units: list[list[_S]] = []
    size = 0
    for tile in tiles:
        if not units or size + tile.nbytes > unit_bytes:
            units.append([])
            size = 0
        units[-1].append(tile)
        size += tile.nbytes
    return units
