"""Block manifests and layerwise block selection.

A *block manifest* (docs/protocol.md#proto-manifest) lists, per page group in contract
group order, the scheduler block ids holding one request's logical block slots. Decode
publishes its manifest in pre-allocation frame 2 (the *destination* manifest); Prefill
builds its own *source* manifest from its block tables using Decode's prompt window. In
layerwise mode Prefill instead selects, per forward chunk, the source blocks that became
ready and their positions in Decode's manifest (:class:`Selection`,
docs/protocol.md#proto-layerwise-selection).

Messages follow the S3/R-pd wording ("Cache-transfer PD …") where the protocol gives
one, and S1's wording elsewhere; every failure is a
:class:`~tspd.core.errors.ContractError`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from tspd.core.contract import CacheContract, GroupSpec, is_bool
from tspd.core.errors import ContractError

__all__ = [
    "MAX_MANIFEST_BYTES",
    "BlockManifest",
    "ManifestGroup",
    "Selection",
    "SelectionGroup",
    "build_manifest",
    "build_selection",
    "logical_slots",
    "parse_manifest",
    "require_same_prompt_window",
    "same_prompt_window",
    "select_chunk",
    "validate_manifest",
]

MAX_MANIFEST_BYTES: Final = 2 << 20
"""Largest manifest payload accepted or emitted (2097152 bytes)."""

Peer = Literal["destination", "source"]
"""Whose manifest is validated: Decode's (``"destination"``) or Prefill's own."""

_PD: Final = "Cache-transfer PD"


def logical_slots(spec: GroupSpec, prefix_len: int, prompt_len: int) -> range:
    """The logical block slots of a request's window that a group transfers
    (docs/protocol.md#proto-logical-slots).

    ``full_suffix`` groups send every slot from the prefix boundary (or the sliding
    window's first slot, whichever is later) to the end of the prompt; any other
    policy sends only the slot holding the prompt's last token.
    """
    g = spec.block_granularity
    if spec.transfer_policy == "full_suffix":
        begin = prefix_len // g
        if spec.is_sliding:
            assert spec.sliding_window_tokens is not None
            begin = max(begin, max(0, prompt_len - spec.sliding_window_tokens + 1) // g)
        end = -(-prompt_len // g)
        return range(begin, max(begin, end))
    last = (prompt_len - 1) // g
    return range(last, last + 1)


# --------------------------------------------------------------------------- manifest


@dataclass(frozen=True, slots=True)
class ManifestGroup:
    """One group's block ids, in logical slot order."""

    group_id: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlockManifest:
    """One request's blocks on one rank, for the window ``[prefix_len, prompt_len)``.

    ``state_prefix_cached`` is R-pd's extension (docs/protocol.md#proto-manifest-schema);
    its semantics are not known (docs/protocol.md#proto-open-questions), so tspd
    carries and compares it but never acts on it.
    """

    groups: tuple[ManifestGroup, ...]
    prefix_len: int
    prompt_len: int
    state_prefix_cached: bool | None = None

    def block_ids(self, group_id: str) -> tuple[int, ...]:
        """The block ids of ``group_id``."""
        for group in self.groups:
            if group.group_id == group_id:
                return group.block_ids
        raise ContractError(f"Cache block manifest has no group {group_id!r}")

    def payload_bytes(self, contract: CacheContract) -> int:
        """The KV bytes the manifest's blocks hold under ``contract``: each block's
        field payloads, without the fields' padding."""
        return sum(
            len(group.block_ids)
            * sum(f.payload_bytes for f in contract.fields_for_group(group.group_id))
            for group in self.groups
        )

    def to_json(self) -> bytes:
        """The wire form: compact ASCII JSON, keys ``groups, prefix_len, prompt_len``
        and ``state_prefix_cached`` when set.

        The same bytes as ``json.dumps`` with those options, written out directly
        (a Decode rank sends one per room, and ``json.dumps`` with options builds
        an encoder per call: ~2 µs of a one-page room's ~4): short id lists of plain
        ``int`` are joined, longer ones go through one shared encoder; lengths or a
        flag of another type, through ``json.dumps``."""
        cached = self.state_prefix_cached
        if (
            type(self.prefix_len) is not int
            or type(self.prompt_len) is not int
            or (cached is not None and type(cached) is not bool)
        ):
            return self._dumped()
        groups: list[str] = []
        for g in self.groups:
            ids = g.block_ids
            if len(ids) <= _JOINED_IDS and set(map(type, ids)) <= _INT:
                listed = ",".join(map(str, ids))
            else:  # the encoder json.dumps uses, so the same bytes (or error)
                listed = _ENCODER.encode(ids)[1:-1]
            groups.append(f'{{"group_id":{_ENCODER.encode(g.group_id)},"block_ids":[{listed}]}}')
        tail = "" if cached is None else f',"state_prefix_cached":{"true" if cached else "false"}'
        text = (
            f'{{"groups":[{",".join(groups)}],"prefix_len":{self.prefix_len},'
            f'"prompt_len":{self.prompt_len}{tail}}}'
        )
        data = text.encode("ascii")
        if len(data) > MAX_MANIFEST_BYTES:
            raise ContractError(f"Cache block manifest exceeds {MAX_MANIFEST_BYTES} wire bytes")
        return data

    def _dumped(self) -> bytes:
        """:meth:`to_json` through ``json.dumps`` (lengths or a flag of another type)."""
        obj: dict[str, Any] = {
            "groups": [
                {"group_id": g.group_id, "block_ids": list(g.block_ids)} for g in self.groups
            ],
            "prefix_len": self.prefix_len,
            "prompt_len": self.prompt_len,
        }
        if self.state_prefix_cached is not None:
            obj["state_prefix_cached"] = self.state_prefix_cached
        data = json.dumps(obj, separators=(",", ":"), ensure_ascii=True).encode("ascii")
        if len(data) > MAX_MANIFEST_BYTES:
            raise ContractError(f"Cache block manifest exceeds {MAX_MANIFEST_BYTES} wire bytes")
        return data


#: One encoder for the manifests' group ids and long id lists (compact, ASCII).
_ENCODER: Final = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True)
#: Id lists up to this long are joined in Python (faster than the encoder's set-up).
_JOINED_IDS: Final = 32


def _malformed(detail: str) -> ContractError:
    return ContractError(f"Cache block manifest {detail}")


def parse_manifest(data: bytes) -> BlockManifest:
    """Decode a manifest payload (pre-allocation frame 2).

    Unknown keys are ignored, as TokenSpeed's decoders do. Every failure, a missing
    key or a wrong type included, is a :class:`ContractError`, so the caller can
    treat it as a malformed pre-allocation (docs/protocol.md#proto-preallocation-checks).
    """
    if not 0 < len(data) <= MAX_MANIFEST_BYTES:
        raise ContractError(f"Cache block manifest payload must be 1..{MAX_MANIFEST_BYTES} bytes")
    try:
        tree = _DECODER.decode(bytes(data).decode("utf-8"))
    except (ValueError, RecursionError) as err:
        raise ContractError("invalid Cache block manifest JSON") from err
    if not isinstance(tree, dict):
        raise ContractError("Cache block manifest payload must be a JSON object")
    for key in ("groups", "prefix_len", "prompt_len"):
        if key not in tree:
            raise _malformed(f"is missing key {key!r}")
    groups = tree["groups"]
    if not isinstance(groups, list):
        raise _malformed("key 'groups' must be an array")
    parsed = tuple(_group(entry, i) for i, entry in enumerate(groups))
    prefix_len = _count(tree["prefix_len"], "prefix_len")
    prompt_len = _count(tree["prompt_len"], "prompt_len")
    cached = tree.get("state_prefix_cached")
    if cached is not None and not isinstance(cached, bool):
        raise _malformed("key 'state_prefix_cached' must be a boolean")
    return BlockManifest(parsed, prefix_len, prompt_len, cached)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} is not JSON")


#: One decoder for every manifest (``json.loads`` with options builds one per call);
#: a decoder keeps no state between calls.
_DECODER: Final = json.JSONDecoder(parse_constant=_reject_constant)


_INT: Final = frozenset((int,))


def _group(entry: Any, index: int) -> ManifestGroup:
    where = f"groups[{index}]"
    if not isinstance(entry, dict):
        raise _malformed(f"{where} must be an object")
    for key in ("group_id", "block_ids"):
        if key not in entry:
            raise _malformed(f"{where} is missing key {key!r}")
    gid = entry["group_id"]
    if not isinstance(gid, str):
        raise _malformed(f"{where}.group_id must be a string")
    ids = entry["block_ids"]
    # set(map(type, ...)) runs in C: a 16,384-page row is checked in ~0.2 ms, not ~1 ms.
    if not isinstance(ids, list) or not set(map(type, ids)) <= _INT:
        raise _malformed(f"{where}.block_ids must be an array of integers")
    return ManifestGroup(gid, tuple(ids))


def _count(value: Any, key: str) -> int:
    if type(value) is not int or value < 0:
        raise _malformed(f"key {key!r} must be a non-negative integer")
    return value


def validate_manifest(manifest: BlockManifest, contract: CacheContract, peer: Peer) -> None:
    """Check a manifest against the contract of the rank that owns its blocks
    (docs/protocol.md#proto-manifest-errors).

    ``peer`` is ``"destination"`` for Decode's manifest (checked against Decode's
    contract, by Prefill on receipt and by Decode before sending) and ``"source"`` for
    Prefill's own.
    """
    if not manifest.prefix_len < manifest.prompt_len:
        raise ContractError(f"{peer} manifest requires prefix_len < prompt_len")
    if manifest.prefix_len < 0:
        raise ContractError(f"{peer} manifest prefix_len must not be negative")
    if tuple(g.group_id for g in manifest.groups) != contract.group_ids:
        raise ContractError(f"{peer} manifest group order disagrees with layout")
    if manifest.prefix_len % contract.plan.prefix_granularity != 0:
        raise ContractError(f"{peer} manifest prefix_len is not aligned to prefix_granularity")
    for group, spec in zip(manifest.groups, contract.group_specs, strict=True):
        gid = spec.group_id
        slots = logical_slots(spec, manifest.prefix_len, manifest.prompt_len)
        # stop - start, not len(): a peer's prompt_len may make the range longer
        # than a C ssize_t, and len() would raise OverflowError instead of this.
        if len(group.block_ids) != slots.stop - slots.start:
            raise ContractError(
                f"{peer} manifest group {gid!r} block count disagrees with its transfer policy"
            )
        bound = contract.virtual_block_count(gid)
        ids = group.block_ids
        if set(map(type, ids)) <= _INT:  # plain ints, the usual case: bounds in C
            bad = bool(ids) and not (min(ids) > 0 and max(ids) < bound)
        else:  # numpy integers and the like, one by one; never a bool
            bad = any(is_bool(block) or not 0 < block < bound for block in ids)
        if bad:
            raise ContractError(f"{peer} manifest group {gid!r} has an out-of-bounds block")


# --------------------------------------------------------------------------- tables


def _check_window(contract: CacheContract, prefix_len: int, prompt_len: int) -> None:
    if prefix_len < 0:
        raise ContractError(f"{_PD} requires a non-negative prefix_len, got {prefix_len}")
    if not prefix_len < prompt_len:
        raise ContractError(f"{_PD} requires prefix_len < prompt_len")
    _check_aligned(contract, prefix_len)


def _check_aligned(contract: CacheContract, prefix_len: int) -> None:
    if prefix_len % contract.plan.prefix_granularity != 0:
        raise ContractError(f"{_PD} prefix_len must be aligned to prefix_granularity")


def _check_tables(contract: CacheContract, tables: Mapping[str, Sequence[int]]) -> None:
    specs = contract.group_specs
    if len(tables) == len(specs) and all(spec.group_id in tables for spec in specs):
        return  # the usual case, without building two sets
    expected = set(contract.group_ids)
    present = set(tables)
    if present != expected:
        raise ContractError(
            "scheduler group IDs disagree with the Paged cache layout: "
            f"missing={sorted(expected - present)}, extra={sorted(present - expected)}"
        )


def _read(
    contract: CacheContract, gid: str, table: Sequence[int], slots: Sequence[int]
) -> tuple[int, ...]:
    """The block ids of ``slots`` (ascending) in one request's table row, checked."""
    if slots and slots[-1] >= len(table):
        raise ContractError(f"table {gid!r} misses logical slot {slots[-1]}")
    bound = contract.virtual_block_count(gid)
    fast = _read_ints(table, slots, bound)
    if fast is not None:
        return fast
    ids = []
    for slot in slots:
        raw = table[slot]
        # Any integer the table holds (numpy's, a tensor's); never a bool.
        block = None if is_bool(raw) else int(raw)
        if block is None or not 0 < block < bound:
            raise ContractError(f"table {gid!r} logical slot {slot} has invalid block ID {raw}")
        ids.append(block)
    return tuple(ids)


#: Fewest slots read by :func:`_read_ints` (below it the checked loop is as fast).
_FAST_READ_SLOTS: Final = 16


def _read_ints(table: Sequence[int], slots: Sequence[int], bound: int) -> tuple[int, ...] | None:
    """The usual row, read at C speed: a list, tuple or integer numpy array whose
    ``slots`` hold plain ids in ``(0, bound)``; ``None`` for anything else (then the
    checked loop reads it and names the first bad slot). Rows of a few slots go
    to the loop too: it is as fast there."""
    if len(slots) < _FAST_READ_SLOTS:
        return None
    if type(table) is list or type(table) is tuple:
        if isinstance(slots, range) and slots.step == 1:
            picked = list(table[slots.start : slots.stop])
        else:
            picked = [table[slot] for slot in slots]
        if set(map(type, picked)) != {int}:
            return None  # bools, numpy scalars, ...: one by one
        ids = tuple(picked)
    else:
        numpy = sys.modules.get("numpy")  # a numpy array implies numpy is loaded
        array: Any = table
        if (
            numpy is None
            or type(array) is not numpy.ndarray
            or array.ndim != 1
            or array.dtype.kind not in "iu"
        ):
            return None
        ids = tuple(array[numpy.asarray(slots)].tolist())
    if min(ids) <= 0 or max(ids) >= bound:
        return None
    return ids


def build_manifest(
    contract: CacheContract,
    tables: Mapping[str, Sequence[int]],
    prefix_len: int,
    prompt_len: int,
    *,
    state_prefix_cached: bool | None = None,
) -> BlockManifest:
    """Build one request's manifest from its block-table rows (one row per group).

    Decode builds its destination manifest from its own window; Prefill builds its
    source manifest from *Decode's* window. Groups come out in contract order,
    whatever the order of ``tables``. Block id 0 (the null page) and negative ids
    (padding) are refused.
    """
    _check_window(contract, prefix_len, prompt_len)
    _check_tables(contract, tables)
    groups = [
        ManifestGroup(
            spec.group_id,
            _read(
                contract,
                spec.group_id,
                tables[spec.group_id],
                logical_slots(spec, prefix_len, prompt_len),
            ),
        )
        for spec in contract.group_specs
    ]
    return BlockManifest(tuple(groups), prefix_len, prompt_len, state_prefix_cached)


def same_prompt_window(a: BlockManifest, b: BlockManifest) -> bool:
    """Whether two destinations describe the same prompt window (R-pd compares
    ``state_prefix_cached`` too)."""
    return (a.prefix_len, a.prompt_len, a.state_prefix_cached) == (
        b.prefix_len,
        b.prompt_len,
        b.state_prefix_cached,
    )


def require_same_prompt_window(manifests: Sequence[BlockManifest]) -> None:
    """Refuse a room whose destinations disagree on the prompt window
    (docs/protocol.md#proto-manifest-build)."""
    if any(not same_prompt_window(manifests[0], m) for m in manifests[1:]):
        raise ContractError("Cache-transfer destinations disagree on the prompt window")


# --------------------------------------------------------------------------- selection


@dataclass(frozen=True, slots=True)
class SelectionGroup:
    """One group's blocks ready in a chunk: Prefill's source block ids and, for each,
    its position in Decode's manifest group."""

    group_id: str
    source_block_ids: tuple[int, ...]
    destination_positions: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Selection:
    """The blocks one Prefill chunk makes ready, per group in contract order."""

    groups: tuple[SelectionGroup, ...]
    is_final: bool

    @property
    def is_empty(self) -> bool:
        """Whether no group has a block to send."""
        return all(not g.source_block_ids for g in self.groups)

    def group(self, group_id: str) -> SelectionGroup:
        """The selection of ``group_id``."""
        for group in self.groups:
            if group.group_id == group_id:
                return group
        raise ContractError(f"layerwise selection has no group {group_id!r}")


def build_selection(
    contract: CacheContract,
    tables: Mapping[str, Sequence[int]],
    prefix_len: int,
    prompt_len: int,
    chunk_start: int,
    chunk_end: int,
) -> Selection:
    """Select the blocks that the tokens ``[chunk_start, chunk_end)`` complete
    (docs/protocol.md#proto-layerwise-selection).

    ``prefix_len``/``prompt_len`` are Decode's window. Only fully written blocks are
    sent, except that the final chunk also sends the prompt's last, partial block
    and every latest-snapshot group's slot.
    """
    _check_aligned(contract, prefix_len)
    if prefix_len < 0:
        raise ContractError(
            f"layerwise selection requires a non-negative prefix_len, got {prefix_len}"
        )
    if not prefix_len < prompt_len:
        raise ContractError("layerwise selection requires prefix_len < prompt_len")
    if not chunk_start < chunk_end:
        raise ContractError("layerwise selection requires chunk_start < chunk_end")
    if not chunk_end <= prompt_len:
        raise ContractError("layerwise selection requires chunk_end <= prompt_len")
    _check_tables(contract, tables)
    is_final = chunk_end == prompt_len
    groups = []
    for spec in contract.group_specs:
        final = logical_slots(spec, prefix_len, prompt_len)
        positions: range
        if spec.transfer_policy == "full_suffix":
            if not final:
                positions = range(0)
            else:
                g = spec.block_granularity
                start = _clamp(chunk_start // g - final[0], len(final))
                ready_end = -(-chunk_end // g) if is_final else chunk_end // g
                positions = range(start, _clamp(ready_end - final[0], len(final)))
        else:
            positions = range(1) if is_final else range(0)
        slots = [final[p] for p in positions]
        ids = _read(contract, spec.group_id, tables[spec.group_id], slots)
        groups.append(SelectionGroup(spec.group_id, ids, tuple(positions)))
    return Selection(tuple(groups), is_final)


def _clamp(value: int, upper: int) -> int:
    return min(max(value, 0), upper)


def select_chunk(
    contract: CacheContract,
    tables: Mapping[str, Sequence[int]],
    window: BlockManifest,
    chunk_begin: int,
    chunk_end: int,
    *,
    first: bool,
) -> Selection | None:
    """The executor's choice for one extend chunk ``[chunk_begin, chunk_end)``
    (docs/protocol.md#proto-layerwise-selection).

    A room's ``first`` chunk starts at ``min(chunk_begin, window.prefix_len)`` so the
    blocks Prefill found in its own cache but Decode lacks go too; later chunks start
    at their own boundary. Returns ``None`` for a non-final chunk that completes no
    block (skip it); the final chunk is never skipped.
    """
    if chunk_end > window.prompt_len:
        raise ContractError("Cache-transfer Prefill chunk extends past Decode's prompt manifest")
    start = min(chunk_begin, window.prefix_len) if first else chunk_begin
    selection = build_selection(
        contract, tables, window.prefix_len, window.prompt_len, start, chunk_end
    )
    if not selection.is_final and selection.is_empty:
        return None
    return selection
