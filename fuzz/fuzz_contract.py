"""Fuzz target for the cache transfer contract decoder (``tspd.core.contract``).

The first input byte picks the mode (odd: S3 compatibility mode), the rest is the
contract payload. The only exception allowed out of :func:`parse_contract` is
:class:`~tspd.core.errors.ContractError`; anything else is a finding. A contract that
parses must also behave: its canonical form parses back to the same contract and
re-serialises byte for byte, page offsets and the local-contract checks
(:func:`~tspd.core.contract.check_local_contract`) fail only with ``ContractError``,
every page of every field of a contract those checks accept lies inside its layout,
it is compatible with itself, and deriving a producer schedule fails only with
``ContractError``. A parsed contract need not pass the local checks: a peer's
contract is held to TokenSpeed's rules only.

Short runs are part of the test suite (``tests/core/test_fuzz_targets_layout.py``).
Long runs by hand::

    pip install atheris
    python fuzz/fuzz_contract.py [libFuzzer flags]

Without atheris the same command runs a hypothesis loop over random bytes.
"""

from __future__ import annotations

import importlib.util
import sys

from tspd.core.contract import (
    CacheContract,
    check_local_contract,
    parse_contract,
    validate_peer_layout,
)
from tspd.core.errors import ContractError
from tspd.core.schedule import ProducerSchedule

__all__ = ["check_contract", "test_one_input"]


def check_contract(contract: CacheContract, *, compat: bool) -> None:
    """The invariants every parsed contract keeps."""
    try:
        data = contract.to_json()
    except ContractError:
        # Escaping non-ASCII text may grow a payload past the bound; nothing else may fail.
        return
    again = parse_contract(data, compat=compat)
    assert again == contract, (again, contract)
    assert again.to_json() == data
    try:
        check_local_contract(contract)
        local = True
    except ContractError:
        local = False
    layout_bytes = (contract.plan.num_lcm_blocks + 1) * contract.plan.lcm_block_bytes
    for f in contract.plan.fields:
        try:
            pages = contract.page_count(f.group_id)
        except ContractError:
            assert not local
            continue
        for page in (0, 1, pages - 1, pages, -1, True):
            try:
                start = contract.page_offset(f, page)
            except ContractError:
                assert not local or not 0 <= page < pages or isinstance(page, bool)
                continue
            assert not isinstance(page, bool)
            assert 0 <= page < pages
            if local:
                assert start >= 0
                assert start + f.payload_bytes <= layout_bytes
    for spec in contract.group_specs:
        assert spec.block_granularity > 0
        assert contract.fields_for_group(spec.group_id) == tuple(
            sorted(
                (f for f in contract.plan.fields if f.group_id == spec.group_id),
                key=lambda f: f.field_id,
            )
        )
    validate_peer_layout(contract, contract)
    try:
        schedule = ProducerSchedule.from_contract(contract, 1)
    except ContractError:
        return
    assert schedule.field_ids <= {f.field_id for f in contract.plan.fields}


def test_one_input(data: bytes) -> None:
    """Parse ``data[1:]`` as a contract (compatibility mode when ``data[0]`` is odd)."""
    if not data:
        return
    compat = bool(data[0] & 1)
    try:
        contract = parse_contract(data[1:], compat=compat)
    except ContractError:
        return
    check_contract(contract, compat=compat)


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
