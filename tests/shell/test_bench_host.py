"""What ``tspd bench pd`` says of the host beside its 64 MiB rows."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tspd.bench.pd import PdFigures, rows
from tspd.bench.raw import MooncakeLimit, tcp_congestion_control
from tspd.demo.orchestrate import DemoSummary

BIG = 64 << 20


def test_the_hosts_tcp_congestion_control_is_read_from_the_kernels_file(
    tmp_path: Path,
) -> None:
    setting = tmp_path / "tcp_congestion_control"
    setting.write_text("cubic\n")
    assert tcp_congestion_control(str(setting)) == "cubic"


@pytest.mark.parametrize("content", [None, "", "bbr; rm -rf /\n", "\xff\xfe"])
def test_a_host_that_does_not_say_is_unknown(tmp_path: Path, content: str | None) -> None:
    setting = tmp_path / "tcp_congestion_control"
    if content is not None:
        setting.write_bytes(content.encode("latin-1"))
    assert tcp_congestion_control(str(setting)) == "unknown"


def _room(seconds: float) -> DemoSummary:
    return DemoSummary(rooms=1, succeeded=1, handover_latencies=[seconds])


def _numbers(text: str) -> list[float]:
    """The numbers in ``text`` as the side-by-side report reads them."""
    return [float(x.replace(",", "")) for x in re.findall(r"\d[\d,]*\.?\d*", text)]


def _large(contiguous: DemoSummary, scattered: DemoSummary, **more: Any) -> PdFigures:
    """Figures of a ``--large-only`` run: the two in-place rooms, the sync raw
    limits, and ``more`` (pipelined limits, the staged room, the host's setting)."""
    return PdFigures(
        throughput=None,
        latency=None,
        contiguous=contiguous,
        scattered=scattered,
        in_flight=256,
        small_write=None,
        big_write=MooncakeLimit(BIG, 1, p50=0.040, p99=0.050),
        big_scattered_write=MooncakeLimit(BIG, 16384, p50=0.500, p99=0.600),
        zmq=None,
        **more,
    )


def test_the_64_mib_rows_name_the_hosts_setting_after_their_raw_figures() -> None:
    figures = _large(
        _room(0.050),
        _room(0.600),
        big_write_pipelined=MooncakeLimit(BIG, 1, p50=0.030, p99=0.040, mode="pipelined"),
        big_scattered_pipelined=MooncakeLimit(BIG, 16384, p50=0.400, p99=0.500, mode="pipelined"),
        staged=_room(0.080),
        tcp_congestion_control="bbr",
    )
    table = {name: raw for name, _, raw in rows(figures)}
    assert len(table) == 3
    for raw in table.values():
        assert raw.endswith("; host TCP congestion control bbr"), raw
    # Readers of --json take the first number after these words as the raw limit:
    # the host's setting comes after the figures and leaves them first.
    contiguous = table["64 MiB room, 16,384 × 4 KiB pages, contiguous"]
    assert _numbers(contiguous.split("one 64 MiB write")[-1])[0] == pytest.approx(
        BIG / 0.040 / 1e9, abs=1e-3
    )
    scattered = table["64 MiB room, 16,384 × 4 KiB pages, scattered"]
    assert _numbers(scattered.split("descriptors")[-1])[0] == pytest.approx(
        BIG / 0.500 / 1e9, abs=1e-3
    )


def test_a_row_with_a_failed_room_says_why_the_first_one_failed() -> None:
    failed = DemoSummary(
        rooms=2,
        succeeded=0,
        failed=2,
        reasons={2: "second reason", 1: "Mooncake write of 67108864 bytes failed"},
        role_logs={"prefill-0": "E1202 tcp_transport.cpp] failed to read WRITE ack"},
    )
    figures = _large(failed, DemoSummary(rooms=1, failed=1, errors=["decode-0 exited with code 1"]))
    table = {name: tspd for name, tspd, _ in rows(figures)}
    assert table["64 MiB room, 16,384 × 4 KiB pages, contiguous"] == (
        "nan GB/s (2 rooms FAILED: room 1: Mooncake write of 67108864 bytes failed; "
        "prefill-0 log: E1202 tcp_transport.cpp] failed to read WRITE ack)"
    )
    assert table["64 MiB room, 16,384 × 4 KiB pages, scattered"].endswith(
        "(1 rooms FAILED: decode-0 exited with code 1)"
    )


def test_a_failed_rows_log_tails_are_bounded() -> None:
    summary = DemoSummary(
        rooms=1, failed=1, reasons={1: "r" * 5000}, role_logs={"decode-0": "x" * 5000}
    )
    figures = _large(summary, summary)
    row = {name: tspd for name, tspd, _ in rows(figures)}[
        "64 MiB room, 16,384 × 4 KiB pages, contiguous"
    ]
    assert len(row) < 1500, len(row)
    assert row.endswith("x)")
    assert "decode-0 log: ..." in row
