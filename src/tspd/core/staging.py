"""Staged transfers: slots of a staging buffer, and the blob a staged room travels in.

When a room's pages are scattered, writing them page by page costs one transfer
descriptor a page (docs/protocol.md#proto-copies). Between two tspd peers a room can
instead be *staged*:

1. the Prefill rank gathers the room's bytes into one contiguous *blob* in a slot of
   its own registered staging buffer (:func:`gather_blob`);
2. it writes the blob with a few large descriptors into a slot of the Decode rank's
   staging buffer;
3. the Decode rank parses the blob's table (:func:`read_blob_table`), proves every
   entry lands inside the room's own pages (:func:`room_ranges`,
   :func:`check_within`), copies the data into its arena (:func:`scatter_blob`) and
   only then reports the room complete.

Both staging buffers are carved into slots by a :class:`SlotPool`, one slot per room
in flight. The module is sans-IO: it moves bytes between arrays it is handed and
never touches a socket, an engine or a clock. How the slots and lengths are
announced on the wire is described in docs/wire.md.

Blob format
-----------

All integers are unsigned 64-bit little-endian::

    offset 0        8 bytes   magic b"tspd-stg"                  (BLOB_MAGIC)
    offset 8        u64       n, the number of entries
    offset 16       n x 16    entry i: u64 dst_offset, u64 length (BLOB_ENTRY_BYTES)
    16 + 16 n       ...       the n ranges' bytes, concatenated in table order

``dst_offset`` is a byte offset into the Decode rank's arena (absolute destination
address minus the Decode arena's base), so the blob means the same thing wherever
the Decode rank's staging slot lies. Every ``length`` is at least 1, and the blob's
length is exactly ``16 + 16 n + sum(length)`` (:func:`blob_length`); the Decode
rank refuses anything else (:func:`read_blob_table`), because the blob comes from
a peer.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from tspd.core.contract import CacheContract, PageIndexError
from tspd.core.errors import WireError
from tspd.core.manifest import BlockManifest

__all__ = [
    "BLOB_ENTRY_BYTES",
    "BLOB_HEADER_BYTES",
    "BLOB_MAGIC",
    "MAX_BLOB_OFFSET",
    "SlotPool",
    "blob_data_pad",
    "blob_length",
    "check_within",
    "gather_blob",
    "gather_blob_parts",
    "read_blob_table",
    "room_ranges",
    "scatter_blob",
]

Int64Array = npt.NDArray[np.int64]
ByteArray = npt.NDArray[np.uint8]

#: The first eight bytes of every staged blob.
BLOB_MAGIC: Final = b"tspd-stg"
#: Bytes of the blob header: :data:`BLOB_MAGIC` and the u64 entry count.
BLOB_HEADER_BYTES: Final = 16
#: Bytes of one table entry: u64 ``dst_offset`` and u64 ``length``.
BLOB_ENTRY_BYTES: Final = 16
#: Every ``dst_offset`` and ``dst_offset + length`` of a blob stays below this bound
#: (the bound of every address and copy end in :mod:`tspd.core.copies`), so the
#: int64 arithmetic on them never wraps.
MAX_BLOB_OFFSET: Final = 1 << 62

_TABLE_DTYPE: Final = np.dtype("<u8")
_NONE: Final = np.zeros(0, dtype=np.int64)


# --------------------------------------------------------------------------- slots


class SlotPool:
    """Hands out byte ranges ("slots") of a staging buffer of ``size`` bytes.

    Each slot is rounded up to a multiple of ``align`` bytes (a power of two; 4096 by
    default, so every slot starts on its own page) and placed first fit, at the
    lowest offset where a free hole holds it. When the buffer has no such hole,
    :meth:`alloc` returns ``None``; the caller then moves the room without staging,
    or waits for a slot to be freed. :meth:`free` gives a slot back; neighbouring
    holes merge, so a pool whose slots are all freed is one hole of ``size`` bytes
    again.

    The pool only does bookkeeping: it neither owns nor touches the buffer. Each
    operation costs O(holes), a few per room in flight.
    """

    __slots__ = ("_align", "_hole_lengths", "_hole_starts", "_size", "_slots", "_used")

    def __init__(self, size: int, *, align: int = 4096) -> None:
        if type(size) is not int or size < 0:
            raise ValueError(f"a staging slot pool needs a size of 0 bytes or more, got {size!r}")
        if type(align) is not int or align < 1 or align & (align - 1):
            raise ValueError(
                f"a staging slot pool's alignment must be a power of two (1, 2, 4, ...), "
                f"got {align!r}"
            )
        self._size = size
        self._align = align
        # Free holes, sorted by start, never empty and never touching one another.
        self._hole_starts: list[int] = [0] if size else []
        self._hole_lengths: list[int] = [size] if size else []
        # Slots handed out: offset -> rounded length.
        self._slots: dict[int, int] = {}
        self._used = 0

    @property
    def size(self) -> int:
        """Bytes of the staging buffer the pool divides."""
        return self._size

    @property
    def align(self) -> int:
        """Every slot's offset and rounded length are multiples of this."""
        return self._align

    @property
    def used(self) -> int:
        """Bytes held by slots handed out, each counted at its rounded length."""
        return self._used

    @property
    def slots(self) -> int:
        """Slots handed out and not yet freed."""
        return len(self._slots)

    @property
    def largest_free(self) -> int:
        """Bytes of the largest free hole: ``alloc(n)`` succeeds exactly when ``n``,
        rounded up to :attr:`align`, is at most this."""
        return max(self._hole_lengths, default=0)

    def rounded(self, length: int) -> int:
        """``length`` rounded up to a multiple of :attr:`align` (what a slot of
        ``length`` bytes holds)."""
        return -(-length // self._align) * self._align

    def alloc(self, length: int) -> int | None:
        """The offset of a new slot of at least ``length`` bytes, or ``None`` when no
        free hole holds ``length`` rounded up to :attr:`align`.

        The offset is a multiple of :attr:`align`; the slot is held until
        :meth:`free` is called with that offset. ``length`` must be at least 1.
        """
        if type(length) is not int or length < 1:
            raise ValueError(f"a staging slot must be at least 1 byte long, got {length!r}")
        need = self.rounded(length)
        for i, hole in enumerate(self._hole_lengths):
            if hole >= need:
                start = self._hole_starts[i]
                if hole == need:
                    del self._hole_starts[i]
                    del self._hole_lengths[i]
                else:
                    self._hole_starts[i] = start + need
                    self._hole_lengths[i] = hole - need
                self._slots[start] = need
                self._used += need
                return start
        return None

    def free(self, offset: int) -> None:
        """Give back the slot at ``offset`` (an offset :meth:`alloc` returned).

        Raises :class:`ValueError` when no slot starts there (never allocated, or
        already freed): the caller's bookkeeping of its rooms is wrong.
        """
        length = self._slots.pop(offset, None)
        if length is None:
            raise ValueError(
                f"no staging slot starts at offset {offset!r} (never allocated, or already "
                "freed); free each offset alloc() returned exactly once"
            )
        self._used -= length
        starts, lengths = self._hole_starts, self._hole_lengths
        i = bisect.bisect_left(starts, offset)
        merge_prev = i > 0 and starts[i - 1] + lengths[i - 1] == offset
        merge_next = i < len(starts) and offset + length == starts[i]
        if merge_prev and merge_next:
            lengths[i - 1] += length + lengths[i]
            del starts[i]
            del lengths[i]
        elif merge_prev:
            lengths[i - 1] += length
        elif merge_next:
            starts[i] = offset
            lengths[i] += length
        else:
            starts.insert(i, offset)
            lengths.insert(i, length)

    def holes(self) -> list[tuple[int, int]]:
        """The free holes as ``(offset, length)`` pairs, lowest offset first (for
        tests and diagnostics)."""
        return list(zip(self._hole_starts, self._hole_lengths, strict=True))

    def __repr__(self) -> str:
        return (
            f"SlotPool(size={self._size}, align={self._align}, slots={len(self._slots)}, "
            f"used={self._used}, largest_free={self.largest_free})"
        )


# --------------------------------------------------------------------------- blobs


def blob_length(count: int, data_bytes: int) -> int:
    """Bytes of a blob of ``count`` entries carrying ``data_bytes`` bytes of data
    (``16 + 16 * count + data_bytes``): the slot size a room needs on both sides."""
    if count < 0 or data_bytes < 0:
        raise ValueError(
            f"a staged blob needs a non-negative entry count and data size, got "
            f"{count} entries and {data_bytes} bytes"
        )
    return BLOB_HEADER_BYTES + BLOB_ENTRY_BYTES * count + data_bytes


def blob_data_pad(count: int, align: int) -> int:
    """Bytes to leave before a blob of ``count`` entries placed at an ``align``-aligned
    offset so that its data (after the header and table) starts on an ``align``
    boundary: where a Prefill rank puts the blob it gathers in its own staging
    region. The blob's format is unchanged; only where it lies in the Prefill's
    region moves, so the Decode sees the same bytes.

    Why: the data of a blob placed on a page boundary starts ``16 + 16 * count``
    bytes in, which is 8-24 bytes past a page boundary whenever ``count`` is a
    multiple of 256 (a room of 256, 4,096 or 16,384 pages). Copying 4 KiB pages
    into rows that start just past a page boundary runs into 4K aliasing (each
    load's address matches a recent store's in its low 12 bits): gathering 32 MiB of
    scattered 4 KiB pages took 22 ms there against 6-7 ms at any offset from 32
    bytes on (the 2-core VM, numpy's take; docs/wire.md#staged-transfers)."""
    if count < 0 or align < 1:
        raise ValueError(
            f"a blob's data pad needs a non-negative entry count and a positive "
            f"alignment, got {count} entries and alignment {align}"
        )
    return -(BLOB_HEADER_BYTES + BLOB_ENTRY_BYTES * count) % align


def _byte_view(array: ByteArray, what: str, *, writable: bool) -> memoryview:
    """A flat memoryview of a one-dimensional, C-contiguous uint8 array."""
    if array.dtype != np.uint8 or array.ndim != 1 or not array.flags.c_contiguous:
        raise ValueError(f"{what} must be a one-dimensional, contiguous uint8 array")
    if writable and not array.flags.writeable:
        raise ValueError(f"{what} is read-only; pass a writable view of the buffer")
    return array.data


#: Smallest row the vectorised gather and scatter copy: below it, ranges are copied
#: one by one (a row index costs 8 bytes and a step of numpy's loop).
_MIN_ROW_BYTES: Final = 256


def _row_unit(lengths: Int64Array, offsets: Int64Array) -> int:
    """The largest row size that cuts every range into whole rows at row-aligned
    offsets (the GCD of lengths and offsets), or 0 when below :data:`_MIN_ROW_BYTES`.
    A room of whole pages has its page size here: its ranges are copied as rows,
    by numpy without the GIL (16,384 4 KiB ranges in ~5 ms on the 2-core VM,
    against ~11 ms one by one)."""
    unit = int(np.gcd.reduce(np.concatenate((lengths, offsets))))
    return unit if unit >= _MIN_ROW_BYTES else 0


def _rows(offsets: Int64Array, lengths: Int64Array, unit: int) -> Int64Array:
    """The ``unit``-byte row numbers the ranges cover, range by range in order."""
    counts = lengths // unit
    before = np.cumsum(counts) - counts
    return np.repeat(offsets // unit - before, counts) + np.arange(int(counts.sum()))


def _as_rows(array: ByteArray, unit: int) -> npt.NDArray[np.uint8]:
    """``array``'s whole ``unit``-byte rows as a two-dimensional view."""
    return array[: len(array) // unit * unit].reshape(-1, unit)


def _columns(*arrays: Int64Array) -> tuple[Int64Array, ...]:
    """The arrays as one-dimensional int64 arrays of one length."""
    out = tuple(np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays)
    if len({len(a) for a in out}) > 1:
        raise ValueError("range arrays differ in length: " + ", ".join(str(len(a)) for a in out))
    return out


def gather_blob(
    out: ByteArray,
    source: ByteArray,
    src_offsets: Int64Array,
    dst_offsets: Int64Array,
    lengths: Int64Array,
) -> int:
    """Build a blob in ``out``: the table of ``(dst_offsets[i], lengths[i])`` and the
    bytes ``source[src_offsets[i] : src_offsets[i] + lengths[i]]`` for each ``i``, in
    order (Prefill side). Returns the blob's length, :func:`blob_length` of the
    ranges; the bytes of ``out`` beyond it are left as they were.

    ``source`` is this rank's arena as a uint8 array and ``src_offsets`` are relative
    to it; ``dst_offsets`` are the Decode rank's arena offsets (absolute destination
    address minus the Decode arena's base). ``out`` is a writable view of the staging
    slot, at least the blob's length. Every range is checked before anything is
    copied: a length below 1, a range outside ``source`` or a destination offset
    outside ``[0, 2**62)`` raises :class:`ValueError` and leaves ``out`` untouched.

    Cost: ranges that are whole rows of at least 256 bytes at row-aligned offsets
    (a room of whole pages) are gathered by one numpy call that releases the GIL;
    any others by one memoryview slice copy per range under the GIL. Measured on a
    2-core AMD EPYC VM, 16,384 scattered 4 KiB ranges (64 MiB): ~5 ms as rows,
    ~11 ms range by range (a single contiguous 64 MiB copy takes 3 ms there).
    :func:`gather_blob_parts` does the same work in pieces.
    """
    parts = list(gather_blob_parts(out, source, src_offsets, dst_offsets, lengths))
    return parts[-1][1]


def gather_blob_parts(
    out: ByteArray,
    source: ByteArray,
    src_offsets: Int64Array,
    dst_offsets: Int64Array,
    lengths: Int64Array,
    part_bytes: int = 1 << 62,
    *,
    first_part_bytes: int | None = None,
) -> Iterator[tuple[int, int]]:
    """:func:`gather_blob` in pieces: every range is checked and the header and
    table are written at the first ``next()``; each step then copies ranges until at
    least ``part_bytes`` more of the blob are filled (the first step
    ``first_part_bytes``, when given), and yields the blob bytes ``(start, end)`` it
    completed (the first part starts at 0, with the table; the last ends at the
    blob's length). A caller writes each part while the next one is gathered; a
    small first part starts the first write sooner."""
    opening = part_bytes if first_part_bytes is None else first_part_bytes
    if part_bytes < 1 or opening < 1:
        raise ValueError(
            f"a blob part needs at least 1 byte, got part_bytes={part_bytes}, "
            f"first_part_bytes={first_part_bytes}"
        )
    dst_out = _byte_view(out, "the staging slot", writable=True)
    src_in = _byte_view(source, "the source arena", writable=False)
    src, dst, length = _columns(src_offsets, dst_offsets, lengths)
    n = len(length)
    if n:
        bad = (
            (length < 1)
            | (src < 0)
            | (src > len(source) - length)
            | (dst < 0)
            | (dst >= MAX_BLOB_OFFSET - length)
        )
        if bad.any():
            i = int(np.argmax(bad))
            s, d, m = int(src[i]), int(dst[i]), int(length[i])
            if m < 1:
                why = f"has length {m}; every range needs at least 1 byte"
            elif not 0 <= s <= len(source) - m:
                why = f"reads bytes {s}..{s + m - 1}, outside the {len(source)}-byte source"
            else:
                why = f"writes destination offset {d}..{d + m - 1}, outside [0, 2**62)"
            raise ValueError(f"staged range {i} {why}; nothing was gathered")
    data_bytes = int(length.sum()) if n else 0
    total = blob_length(n, data_bytes)
    if len(out) < total:
        raise ValueError(
            f"the staging slot holds {len(out)} bytes, but the blob of {n} ranges needs "
            f"{total}; allocate a slot of blob_length(count, data_bytes) bytes"
        )
    header = np.array([0, n], dtype=_TABLE_DTYPE).view(np.uint8)
    header[:8] = np.frombuffer(BLOB_MAGIC, dtype=np.uint8)
    out[:BLOB_HEADER_BYTES] = header
    table_end = BLOB_HEADER_BYTES + BLOB_ENTRY_BYTES * n
    if n:
        table = np.empty((n, 2), dtype=_TABLE_DTYPE)
        table[:, 0] = dst
        table[:, 1] = length
        out[BLOB_HEADER_BYTES:table_end] = table.reshape(-1).view(np.uint8)
    if not n:
        yield 0, table_end
        return
    # A part ends with the first range that reaches its due byte (the first part is
    # due first_part_bytes after the table, each next one part_bytes after the last
    # end).
    ends = table_end + np.cumsum(length)
    unit = _row_unit(length, src)
    rows = _rows(src, length, unit) if unit else _NONE
    counts = length // unit if unit else _NONE
    first_row = np.cumsum(counts) - counts
    first, start, due = 0, 0, table_end + opening
    while first < n:
        last = min(int(np.searchsorted(ends, due, side="left")) + 1, n)
        at = table_end if first == 0 else int(ends[first - 1])
        end = int(ends[last - 1])
        if unit:
            # Whole rows of ``unit`` bytes: one numpy gather, without the GIL.
            lo = int(first_row[first])
            np.take(
                _as_rows(source, unit),
                rows[lo : lo + (end - at) // unit],
                axis=0,
                out=out[at:end].reshape(-1, unit),
                mode="clip",  # every range was checked above; "raise" would buffer
            )
        else:
            for s, m in zip(src[first:last].tolist(), length[first:last].tolist(), strict=True):
                dst_out[at : at + m] = src_in[s : s + m]
                at += m
        yield start, end
        first, start, due = last, end, end + part_bytes


def _reject(message: str) -> WireError:
    return WireError("staged blob " + message)


def read_blob_table(
    blob: ByteArray, staged_len: int, slot_len: int
) -> tuple[Int64Array, Int64Array]:
    """Parse and check the table of a blob a peer wrote (Decode side).

    ``blob`` is the staging slot's bytes, ``staged_len`` the blob length the peer
    announced and ``slot_len`` the slot's size. The blob is hostile input: it is
    refused with a :class:`~tspd.core.errors.WireError` whose message starts
    ``"staged blob "`` unless ``staged_len`` lies in ``16..slot_len`` and within
    ``blob``, the magic is :data:`BLOB_MAGIC`, the table fits, every length is at
    least 1, every ``dst_offset`` and ``dst_offset + length`` is below ``2**62``,
    and the lengths sum to exactly the data bytes the blob carries
    (``staged_len - 16 - 16 n``).

    Returns ``(dst_offsets, lengths)`` as new int64 arrays (never views of the
    slot, which the peer may overwrite). Whether the entries land inside the
    room's pages is for :func:`check_within` to decide.
    """
    if type(staged_len) is not int or not BLOB_HEADER_BYTES <= staged_len <= slot_len:
        raise _reject(
            f"of {staged_len!r} bytes is outside the {BLOB_HEADER_BYTES}..{slot_len} bytes "
            "its slot allows"
        )
    if staged_len > len(blob):
        raise _reject(f"of {staged_len} bytes is longer than its {len(blob)}-byte buffer")
    head = np.asarray(blob[:BLOB_HEADER_BYTES], dtype=np.uint8).tobytes()
    if head[:8] != BLOB_MAGIC:
        raise _reject(f"starts with {head[:8]!r}, not the magic {BLOB_MAGIC!r}")
    n = int.from_bytes(head[8:], "little")
    room = (staged_len - BLOB_HEADER_BYTES) // BLOB_ENTRY_BYTES
    if n > room:
        raise _reject(
            f"claims {n} entries, whose table needs {BLOB_ENTRY_BYTES * n} bytes, but only "
            f"{staged_len - BLOB_HEADER_BYTES} bytes follow its header"
        )
    data_bytes = staged_len - BLOB_HEADER_BYTES - BLOB_ENTRY_BYTES * n
    raw = np.ascontiguousarray(blob[BLOB_HEADER_BYTES : BLOB_HEADER_BYTES + BLOB_ENTRY_BYTES * n])
    table = raw.view(_TABLE_DTYPE).reshape(n, 2)
    dst, length = table[:, 0], table[:, 1]
    if n:
        bad = (length < 1) | (length > data_bytes) | (dst >= MAX_BLOB_OFFSET)
        # length <= data_bytes < 2**62 and dst < 2**62 where this is read: no wrap.
        bad |= ~bad & (dst + length >= MAX_BLOB_OFFSET)
        if bad.any():
            i = int(np.argmax(bad))
            d, m = int(dst[i]), int(length[i])
            if m < 1:
                why = "has length 0; every entry needs at least 1 byte"
            elif m > data_bytes:
                why = f"has length {m}, more than the {data_bytes} data bytes the blob carries"
            else:
                why = f"writes bytes {d}..{d + m - 1}, beyond offset 2**62"
            raise _reject(f"entry {i} {why}")
    # Each length is at most data_bytes < 2**62, so the running sum passes data_bytes
    # before it could wrap around 2**64: a sum that wrapped still has a partial sum
    # above data_bytes.
    partial = np.cumsum(length)
    if n and int(partial[-1]) == data_bytes and int(partial.max()) <= data_bytes:
        return dst.astype(np.int64), length.astype(np.int64)
    if not n and not data_bytes:
        return _NONE.copy(), _NONE.copy()
    total = sum(length.tolist())
    raise _reject(
        f"has {n} entries whose lengths sum to {total} bytes, but carries {data_bytes} data bytes"
    )


def scatter_blob(
    blob: ByteArray, dst_offsets: Int64Array, lengths: Int64Array, target: ByteArray
) -> None:
    """Copy a checked blob's data into ``target`` (Decode side): the blob's data
    ranges, in table order, to ``target[dst_offsets[i] : dst_offsets[i] + lengths[i]]``.

    ``target`` is this rank's arena as a uint8 array; ``dst_offsets`` and
    ``lengths`` come from :func:`read_blob_table` and have passed
    :func:`check_within`. Every range is still checked to fit ``target`` and the
    data to fit ``blob`` before anything is copied (:class:`ValueError`).
    Cost as :func:`gather_blob`: 16,384 ranges of 4 KiB scatter in ~5 ms as rows,
    without the GIL (7 ms range by range, holding it) on the same 2-core VM. Two
    entries that name the same bytes (a hostile blob) leave either's bytes there.
    """
    into = _byte_view(target, "the target arena", writable=True)
    data = _byte_view(blob, "the staged blob", writable=False)
    dst, length = _columns(dst_offsets, lengths)
    n = len(length)
    if not n:
        return
    bad = (length < 1) | (dst < 0) | (dst > len(target) - length)
    if bad.any():
        i = int(np.argmax(bad))
        d, m = int(dst[i]), int(length[i])
        raise ValueError(
            f"staged blob entry {i} ({m} bytes at offset {d}) does not fit the "
            f"{len(target)}-byte target arena; nothing was scattered"
        )
    at = BLOB_HEADER_BYTES + BLOB_ENTRY_BYTES * n
    data_end = at + int(length.sum())
    if data_end > len(blob):
        raise ValueError(
            f"staged blob of {len(blob)} bytes is shorter than its table says "
            f"({data_end} bytes); nothing was scattered"
        )
    unit = _row_unit(length, dst)
    if unit:
        # Whole rows of ``unit`` bytes: one scatter that releases the GIL.
        rows = _rows(dst, length, unit)
        _as_rows(target, unit)[rows] = blob[at:data_end].reshape(-1, unit)
        return
    for d, m in zip(dst.tolist(), length.tolist(), strict=True):
        end = at + m
        into[d : d + m] = data[at:end]
        at = end


# --------------------------------------------------------------------------- room bounds


def room_ranges(contract: CacheContract, manifest: BlockManifest) -> tuple[Int64Array, Int64Array]:
    """The bytes a room's pages occupy in this rank's arena, as sorted, disjoint
    intervals ``[starts[k], ends[k])`` relative to the arena base.

    For each group of ``manifest`` and each field of that group, page ``p`` of the
    field covers ``[page_offset(field, p), page_offset(field, p) + payload_bytes)``
    (:meth:`~tspd.core.contract.CacheContract.page_offset`): the field's payload,
    not the padding up to its page stride. Intervals that overlap or touch are
    merged, so a room on consecutive pages of one plane is one interval per plane.

    ``manifest`` is this rank's own manifest (a Decode rank's destination manifest):
    its block ids are page ids of this rank, in ``[0, page_count)``; any other id
    raises :class:`~tspd.core.contract.PageIndexError`.
    """
    starts: list[Int64Array] = []
    payloads: list[Int64Array] = []
    for group in manifest.groups:
        ids = _page_ids(contract, group.group_id, group.block_ids)
        if not len(ids):
            continue
        for field in contract.fields_for_group(group.group_id):
            starts.append(contract.page_offset(field, 0) + ids * field.page_stride_bytes)
            payloads.append(np.full(len(ids), field.payload_bytes, dtype=np.int64))
    if not starts:
        return _NONE.copy(), _NONE.copy()
    start = np.concatenate(starts)
    end = start + np.concatenate(payloads)
    order = np.argsort(start, kind="stable")
    start, end = start[order], end[order]
    reach = np.maximum.accumulate(end)
    first = np.flatnonzero(np.concatenate(([True], start[1:] > reach[:-1])))
    return start[first], np.maximum.reduceat(end, first)


def _page_ids(contract: CacheContract, group_id: str, block_ids: Sequence[int]) -> Int64Array:
    pages = contract.page_count(group_id)
    try:
        if any(type(i) is bool for i in block_ids):
            raise TypeError
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    except (OverflowError, TypeError, ValueError):
        raise PageIndexError(
            f"manifest block ids of group {group_id!r} are not all 64-bit page ids"
        ) from None
    bad = (ids < 0) | (ids >= pages)
    if bad.any():
        page = int(ids[int(np.argmax(bad))])
        raise PageIndexError(
            f"page_id {page} outside [0, {pages}) for group {group_id!r}; a staged room's "
            "manifest must hold this rank's own page ids"
        )
    return ids


def check_within(
    dst_offsets: Int64Array, lengths: Int64Array, starts: Int64Array, ends: Int64Array
) -> None:
    """Require every entry ``[dst_offsets[i], dst_offsets[i] + lengths[i])`` to lie
    entirely inside one interval ``[starts[k], ends[k])`` (Decode side).

    The intervals are :func:`room_ranges` of the room the blob is for (sorted and
    disjoint). A blob entry that reaches outside them would overwrite another
    room's pages or unrelated memory; it is refused with a
    :class:`~tspd.core.errors.WireError` naming the first such entry, before
    anything is scattered.
    """
    dst, length = _columns(dst_offsets, lengths)
    lo, hi = _columns(starts, ends)
    if not len(dst):
        return
    k = np.searchsorted(lo, dst, side="right") - 1
    if len(lo):
        # length <= end - dst rather than dst + length <= end: no int64 wrap.
        inside = (k >= 0) & (length <= hi[np.maximum(k, 0)] - dst)
    else:
        inside = np.zeros(len(dst), dtype=bool)
    inside &= (length >= 1) & (dst >= 0)
    if inside.all():
        return
    i = int(np.argmin(inside))
    a, m = int(dst[i]), int(length[i])
    raise _reject(f"entry {i} writes bytes {a}..{a + m - 1} of the arena, outside the room's pages")
