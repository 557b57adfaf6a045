"""Staged transfers in the simulator (docs/wire.md#staged-transfers).

With ``SimConfig.staging`` some Prefill and Decode instances have a staging region
on every rank: a real ``numpy`` byte array, as the shell's
:class:`~tspd.shell.arena.HostArena` is, at an address of its own. The cores
negotiate staging as they do between real peers (the route's
:data:`~tspd.core.bootstrap.STAGING_FIELD`, the registration's frame 8, the
pre-allocation's slot, the ``Success``'s blob length); this module does what the
shells do with the result:

* **gather** (Prefill, :func:`gather`): the copies of a
  :class:`~tspd.core.commands.StagedWrite` are read from the rank's arena model
  *when the write is issued* and gathered by the real
  :func:`~tspd.core.staging.gather_blob_parts` into the blob in the rank's staging
  region, in parts of ``SimConfig.staging_part_bytes``; the write that goes out is
  the parts, each from the Prefill's region to the Decode's slot, as
  :class:`tspd.shell.transfers.Staging` makes them. The arena model holds a *tag*
  per cell, not bytes: a cell travels as its tag plus one in its first 8 bytes
  (little-endian; 0 for an empty cell) and zeros after (:func:`encode_cells`);
* **land** (:meth:`tspd.sim.decode.DecodeInstance.land_staged`): the parts that
  land copy bytes from the Prefill's region, read at landing time (a late write
  reads a slot the Prefill may have reused), into the Decode's region;
* **scatter** (Decode, :func:`read_checked`): the slot's blob is refused or
  accepted by the real :func:`~tspd.core.staging.read_blob_table` and
  :func:`~tspd.core.staging.check_within`, with the arguments the shell's
  ``ScatterStaged`` handler passes, and its data copied into the page model.

What the checker needs besides: each Decode rank's *claims* (:class:`Claim`, a slot
the core offered a room and has not taken back, as far as the sim can tell from the
scheduler's events) and each Prefill rank's *holdings* (the blobs its chunks with
the workers hold). A slot offered while it overlaps another room's live claim, a
Prefill blob that overlaps one in flight, a scatter from a slot the room was not
offered, and a blob that its own room wrote whole and the Decode refused are
``staging`` violations; a staged write that lands in a slot its room no longer
claims is ``fencing`` (the engine's own late writes, as for pages).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import numpy as np
import numpy.typing as npt

from tspd.core.commands import DestinationWrite, ScatterStaged, StartTransfer
from tspd.core.copies import CopyPlan
from tspd.core.errors import WireError
from tspd.core.staging import check_within, gather_blob_parts, read_blob_table

if TYPE_CHECKING:
    from tspd.sim.prefill import PrefillRank

__all__ = [
    "TAG_BYTES",
    "Claim",
    "DecodeStaging",
    "PrefillStaging",
    "StagingStats",
    "decode_cells",
    "encode_cells",
    "gather",
    "read_checked",
]

ByteArray = npt.NDArray[np.uint8]
Int64Array = npt.NDArray[np.int64]

#: Bytes of a cell that carry its tag (the rest of the cell is zero).
TAG_BYTES: Final = 8


def encode_cells(cells: Sequence[int | None], cell_bytes: int) -> ByteArray:
    """The bytes of ``cells``: each ``cell_bytes`` long, its tag plus one as a u64
    little-endian first (0: an empty cell), zeros after."""
    n = len(cells)
    tags = np.fromiter((0 if c is None else c + 1 for c in cells), dtype="<u8", count=n)
    out = np.zeros((n, cell_bytes), dtype=np.uint8)
    out[:, :TAG_BYTES] = tags.view(np.uint8).reshape(n, TAG_BYTES)
    return out.reshape(-1)


def decode_cells(data: ByteArray, cell_bytes: int) -> list[int | None]:
    """The cells whose bytes are ``data`` (a multiple of ``cell_bytes`` long)."""
    rows = np.ascontiguousarray(data).reshape(-1, cell_bytes)[:, :TAG_BYTES]
    tags = np.ascontiguousarray(rows).view("<u8").reshape(-1).tolist()
    return [t - 1 if t else None for t in tags]


@dataclass(slots=True)
class StagingStats:
    """What staged transfers did in a run."""

    #: Instances (Prefill and Decode) that have a staging region.
    prefill_instances: int = 0
    decode_instances: int = 0
    #: Pre-allocations from a Decode rank with a staging region: that offered a
    #: slot; that offered none to a Prefill rank offering staging (the room too
    #: small, or no hole in the region); sent to a Prefill rank without staging.
    slots_offered: int = 0
    slots_declined: int = 0
    to_plain_prefill: int = 0
    #: Destination writes a Prefill core planned staged; those a Prefill rank with a
    #: staging region wrote in place (no slot offered, too few copies, no room),
    #: and of these, those whose destination had offered a slot.
    staged_writes: int = 0
    in_place: int = 0
    unstaged: int = 0
    #: Staged writes whose parts all landed with the write.
    blobs_landed: int = 0
    #: ``ScatterStaged`` commands, and how they ended: scattered, refused, or cut
    #: short by the Decode instance's crash.
    scatters: int = 0
    scattered: int = 0
    refused: int = 0
    scatter_crashes: int = 0
    #: Blobs the ``garble`` fault damaged, and staged writes that landed in a slot
    #: their room no longer claims (counted in ``fenced`` too).
    garbled: int = 0
    late_blobs: int = 0
    #: Rooms with at least one blob scattered on some Decode rank.
    rooms: int = 0
    #: The rooms counted in ``rooms``.
    staged_rooms: set[int] = field(default_factory=set, repr=False)


# ------------------------------------------------------------------------- regions


@dataclass(slots=True, eq=False)
class Claim:
    """A slot a Decode core offered a room (``offset``, ``length`` into its region)."""

    offset: int
    length: int
    room: int
    #: The room's index (its tags' room number).
    index: int
    #: Something other than the room's own blob landed in it (a fenced late write
    #: of another room, or the ``garble`` fault): a refusal is then expected.
    damaged: bool = False

    def overlaps(self, offset: int, length: int) -> bool:
        """Whether ``[offset, offset + length)`` shares a byte with the slot."""
        return offset < self.offset + self.length and self.offset < offset + length

    def covers(self, offset: int, length: int) -> bool:
        """Whether ``[offset, offset + length)`` lies inside the slot."""
        return self.offset <= offset and offset + length <= self.offset + self.length


class DecodeStaging:
    """One Decode rank's staging region and the slots its core offered."""

    __slots__ = ("base", "claims", "data")

    def __init__(self, base: int, size: int) -> None:
        self.base = base
        self.data: ByteArray = np.zeros(size, dtype=np.uint8)
        #: Live claims by offset.
        self.claims: dict[int, Claim] = {}

    def overlapping(self, offset: int, length: int) -> list[Claim]:
        """The live claims that share a byte with ``[offset, offset + length)``."""
        return [c for c in self.claims.values() if c.overlaps(offset, length)]

    def release(self, room: int) -> None:
        """The core took the room's slots back (its pages were returned)."""
        for offset in [o for o, c in self.claims.items() if c.room == room]:
            del self.claims[offset]


class PrefillStaging:
    """One Prefill rank's staging region and the blobs its workers' chunks hold."""

    __slots__ = ("base", "data", "held")

    def __init__(self, base: int, size: int) -> None:
        self.base = base
        self.data: ByteArray = np.zeros(size, dtype=np.uint8)
        #: ``(offset, length, room, chunk)`` of each blob a queued or running chunk
        #: holds (until its ``transfer_done``, when the core frees it).
        self.held: list[tuple[int, int, int, StartTransfer]] = []


# ------------------------------------------------------------------------- gather


def gather(rank: PrefillRank, write: DestinationWrite, part_bytes: int) -> CopyPlan | str:
    """Gather ``write``'s blob into ``rank``'s staging region as the shell does
    (:class:`tspd.shell.transfers.Staging`), reading the arena model now; the
    write's parts (staging region to the Decode's slot), or why it cannot be
    gathered (the shell's ``gathering the staged blob … failed``: a core bug)."""
    staged = write.staged
    region = rank.staging
    assert staged is not None
    if region is None:
        return "the rank has no staging region"
    if staged.source_offset < 0 or staged.source_offset + staged.length > len(region.data):
        return (
            f"blob bytes {staged.source_offset}..{staged.source_offset + staged.length} lie "
            f"outside the {len(region.data)}-byte staging region"
        )
    if staged.source_addr != region.base + staged.source_offset:
        return (
            f"source address {staged.source_addr:#x} is not offset {staged.source_offset} of the "
            f"staging region at {region.base:#x}"
        )
    cell = rank.geometry.cell_bytes
    cells = rank.arena
    plan = write.plan
    src = plan.src - staged.src_base
    taken: list[int | None] = []
    for s, n in zip(src.tolist(), plan.length.tolist(), strict=True):
        if s % cell or n % cell or s < 0 or s + n > len(cells) * cell:
            return f"copy of {n} bytes from arena offset {s} is not whole cells of the arena"
        taken += cells[s // cell : (s + n) // cell]
    source = encode_cells(taken, cell)
    positions = np.zeros(len(plan), dtype=np.int64)
    if len(plan) > 1:
        positions[1:] = np.cumsum(plan.length[:-1])
    out = region.data[staged.source_offset : staged.source_offset + staged.length]
    try:
        parts = list(
            gather_blob_parts(
                out, source, positions, plan.dst - staged.dst_base, plan.length, part_bytes
            )
        )
    except ValueError as err:
        return str(err)
    end = parts[-1][1]
    if end != staged.length:
        return f"the blob is {end} bytes where the core planned {staged.length}"
    return CopyPlan.from_copies(
        [(staged.source_addr + a, staged.dest_addr + a, b - a) for a, b in parts]
    )


# ------------------------------------------------------------------------- scatter


def read_checked(
    region: DecodeStaging, command: ScatterStaged
) -> tuple[Int64Array, Int64Array, ByteArray] | str:
    """The shell's checks of a staged blob: its table (``dst_offsets``, ``lengths``)
    and the slot's bytes, or the refusal's text (a :class:`WireError` or
    :class:`ValueError` message, as ``staged_done`` gets it)."""
    start, length = command.slot_offset, command.slot_length
    if start < 0 or start + length > len(region.data):
        return (
            f"staging slot (offset {start}, {length} bytes) lies outside the "
            f"{len(region.data)}-byte staging region"
        )
    blob = region.data[start : start + length]
    try:
        dst, lengths = read_blob_table(blob, command.staged_bytes, length)
        check_within(dst, lengths, command.starts, command.ends)
    except (WireError, ValueError) as err:
        return str(err)
    return dst, lengths, blob
