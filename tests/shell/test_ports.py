"""free_port: ports below the kernel's ephemeral range, checked, with a fallback."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tspd.shell import ports
from tspd.shell.ports import free_port, port_range


@pytest.fixture(autouse=True)
def fresh_range() -> Iterator[None]:
    port_range.cache_clear()
    yield
    port_range.cache_clear()


def _ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_ports_come_from_below_the_ephemeral_range_that_connections_use() -> None:
    low = _ephemeral_low()
    picked = {free_port() for _ in range(50)}
    assert all(ports.LOWEST_PORT <= port < low for port in picked)
    assert len(picked) > 40  # random, not the same port again and again


def test_a_picked_port_binds() -> None:
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_a_port_that_is_taken_is_not_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(ports, "port_range", lambda: range(busy, busy + 2))
        assert {free_port() for _ in range(20)}.isdisjoint({busy})


def test_when_every_candidate_is_taken_a_port_zero_probe_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(ports, "port_range", lambda: range(busy, busy + 1))
        port = free_port()
    assert port != busy
    assert port >= _ephemeral_low()  # the kernel's pick


def test_an_unreadable_range_file_assumes_linux_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(ports, "_RANGE_FILE", tmp_path / "missing")
    assert port_range() == range(ports.LOWEST_PORT, ports.DEFAULT_EPHEMERAL_LOW)


def test_an_ephemeral_range_starting_low_leaves_only_the_probe(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake = tmp_path / "range"
    fake.write_text("1024\t65535\n")
    monkeypatch.setattr(ports, "_RANGE_FILE", fake)
    assert len(port_range()) == 0
    assert free_port() >= _ephemeral_low()
