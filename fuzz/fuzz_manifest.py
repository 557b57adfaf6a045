"""Fuzz target for the block manifest decoder and the selection built on it
(``tspd.core.manifest``).

The input is a manifest payload (pre-allocation frame 2). The only exception allowed
out of :func:`parse_manifest` and :func:`validate_manifest` is
:class:`~tspd.core.errors.ContractError`; anything else is a finding. A manifest that
parses round-trips through its wire form; one that also validates against
:data:`CONTRACT` is rebuilt exactly from block tables holding its ids, and chunking
its prompt sends each of its blocks exactly once.

Short runs are part of the test suite (``tests/core/test_fuzz_targets_layout.py``).
Long runs by hand::

    pip install atheris
    python fuzz/fuzz_manifest.py [libFuzzer flags]

Without atheris the same command runs a hypothesis loop over random bytes.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Final

from tspd.core.contract import CacheContract
from tspd.core.errors import ContractError
from tspd.core.manifest import (
    BlockManifest,
    build_manifest,
    logical_slots,
    parse_manifest,
    select_chunk,
    validate_manifest,
)
from tspd.testing.layouts import multi_layer_contract

__all__ = ["CONTRACT", "check_manifest", "test_one_input"]

CONTRACT: Final[CacheContract] = multi_layer_contract(
    layers=2, num_pages=16, heads=1, head_dim=2, page_tokens=4, with_state_group=True
)
"""The destination contract fuzzed manifests are validated against: a 4-token-page
history group ``kv`` and a latest-snapshot group ``state``, 16 pages each."""


def check_manifest(manifest: BlockManifest) -> None:
    """The invariants of a parsed manifest, and of a valid one against CONTRACT."""
    assert parse_manifest(manifest.to_json()) == manifest
    refusals: list[str] = []
    for peer in ("destination", "source"):
        try:
            validate_manifest(manifest, CONTRACT, peer)
        except ContractError as err:
            refusals.append(str(err))
    if refusals:
        # Both peers refuse the same manifest, each in its own name.
        assert len(refusals) == 2, refusals
        assert refusals[0].startswith("destination manifest "), refusals
        assert refusals[1] == "source" + refusals[0].removeprefix("destination"), refusals
        return
    # Valid: tables with the manifest's ids at its logical slots rebuild it.
    tables: dict[str, list[int]] = {}
    for spec, group in zip(CONTRACT.group_specs, manifest.groups, strict=True):
        slots = logical_slots(spec, manifest.prefix_len, manifest.prompt_len)
        row = [0] * slots.stop
        for slot, block in zip(slots, group.block_ids, strict=True):
            row[slot] = block
        tables[spec.group_id] = row
    rebuilt = build_manifest(
        CONTRACT,
        tables,
        manifest.prefix_len,
        manifest.prompt_len,
        state_prefix_cached=manifest.state_prefix_cached,
    )
    assert rebuilt == manifest, (rebuilt, manifest)
    # Two chunks split at the midpoint send every block once, in manifest order.
    middle = (manifest.prefix_len + manifest.prompt_len) // 2
    cuts = sorted({middle, manifest.prompt_len} - {manifest.prefix_len})
    sent: dict[str, list[int]] = {gid: [] for gid in CONTRACT.group_ids}
    begin = manifest.prefix_len
    for n, end in enumerate(cuts):
        selection = select_chunk(CONTRACT, tables, manifest, begin, end, first=n == 0)
        begin = end
        if selection is None:
            continue
        for chosen in selection.groups:
            ids = manifest.block_ids(chosen.group_id)
            assert [ids[p] for p in chosen.destination_positions] == list(chosen.source_block_ids)
            sent[chosen.group_id].extend(chosen.destination_positions)
    for group in manifest.groups:
        assert sent[group.group_id] == list(range(len(group.block_ids)))


def test_one_input(data: bytes) -> None:
    """Parse ``data`` as a manifest and check it."""
    try:
        manifest = parse_manifest(data)
    except ContractError:
        return
    check_manifest(manifest)


def main(argv: list[str]) -> None:
    """Fuzz with atheris when it is installed, else with hypothesis over random bytes."""
    if importlib.util.find_spec("atheris") is not None:
        atheris = importlib.import_module("atheris")
        atheris.Setup(argv, test_one_input)
        atheris.Fuzz()
        return
    from hypothesis import given, settings
    from hypothesis import strategies as st

    settings(max_examples=100_000, deadline=None)(given(st.binary())(test_one_input))()


if __name__ == "__main__":
    main(sys.argv)
