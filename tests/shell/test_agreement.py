"""Replica agreement: MIN over ranks, single rank, timeouts and mismatched polls."""

from __future__ import annotations

import pytest
import trio

from tspd.core.errors import ProtocolError
from tspd.shell.agreement import AgreementError, SingleRank, ZmqAgreement
from tspd.shell.ports import free_port


def _endpoints(n: int) -> list[str]:
    return [f"tcp://127.0.0.1:{free_port()}" for _ in range(n)]


async def test_single_rank_returns_its_values() -> None:
    assert await SingleRank().agree([5, 1, 2]) == [5, 1, 2]
    assert SingleRank().group_size == 1


async def test_three_ranks_agree_on_the_elementwise_minimum() -> None:
    endpoints = _endpoints(3)
    polls = [[5, 2, 3, 0], [5, 5, 1, 5], [2, 5, 5, 5]]
    results: dict[int, list[list[int]]] = {}

    async def rank(r: int) -> None:
        async with ZmqAgreement(r, endpoints, timeout=10) as agreement:
            out = []
            for round_no in range(20):
                values = [v - (round_no % 2) if v else v for v in polls[r]]
                out.append(await agreement.agree(values))
                if r == 1:
                    await trio.sleep(0.001)  # one rank runs a little behind
            results[r] = out

    async with trio.open_nursery() as nursery:
        for r in range(3):
            nursery.start_soon(rank, r)
    assert results[0] == results[1] == results[2]
    assert results[0][0] == [2, 2, 1, 0]
    assert results[0][1] == [1, 1, 0, 0]
    assert len(results[0]) == 20


async def test_a_missing_rank_times_out_with_its_rank_named() -> None:
    endpoints = _endpoints(2)
    async with ZmqAgreement(0, endpoints, timeout=0.3) as agreement:
        with pytest.raises(AgreementError, match=r"waiting for ranks \[1\]"):
            await agreement.agree([1, 2])


async def test_ranks_polling_different_request_counts_are_refused() -> None:
    endpoints = _endpoints(2)
    errors: list[BaseException] = []

    async def rank(r: int, values: list[int]) -> None:
        async with ZmqAgreement(r, endpoints, timeout=5) as agreement:
            try:
                await agreement.agree(values)
            except ProtocolError as exc:
                errors.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(rank, 0, [1, 2])
        nursery.start_soon(rank, 1, [1])
    assert len(errors) == 2
    assert "same requests in the same order" in str(errors[0])


async def test_agree_before_open_is_an_error() -> None:
    with pytest.raises(AgreementError, match="not open"):
        await ZmqAgreement(0, _endpoints(1)).agree([1])
