"""free_port: ports below the kernel's ephemeral range, checked, with a fallback.

The tests read a range file of their own (Linux's default, 32768-60999), so they
do not depend on the host's setting."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tspd.shell import ports
from tspd.shell.ports import free_port, port_range

EPHEMERAL_LOW = 32_768


@pytest.fixture(autouse=True)
def linux_default_range(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    fake = tmp_path / "ip_local_port_range"
    fake.write_text(f"{EPHEMERAL_LOW}\t60999\n")
    monkeypatch.setattr(ports, "_RANGE_FILE", fake)
    port_range.cache_clear()
    yield fake
    port_range.cache_clear()


def _listening(port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_ports_come_from_below_the_ephemeral_range_that_connections_use() -> None:
    assert port_range() == range(ports.LOWEST_PORT, EPHEMERAL_LOW)
    picked = {free_port() for _ in range(50)}
    assert all(ports.LOWEST_PORT <= port < EPHEMERAL_LOW for port in picked)
    assert len(picked) > 40  # random, not the same port again and again


def test_a_picked_port_binds() -> None:
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_a_port_that_is_taken_is_not_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    with _listening() as taken:
        busy = taken.getsockname()[1]
        monkeypatch.setattr(ports, "port_range", lambda: range(busy, busy + 2))
        assert busy not in {free_port() for _ in range(20)}


def test_when_every_candidate_is_taken_a_port_zero_probe_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with _listening() as taken:
        busy = taken.getsockname()[1]
        monkeypatch.setattr(ports, "port_range", lambda: range(busy, busy + 1))
        port = free_port()
        assert port != busy
        with _listening(port):  # the kernel's pick, free
            pass


def test_an_unreadable_range_file_assumes_linux_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(ports, "_RANGE_FILE", tmp_path / "missing")
    assert port_range() == range(ports.LOWEST_PORT, ports.DEFAULT_EPHEMERAL_LOW)


def test_an_ephemeral_range_starting_low_leaves_only_the_probe(
    linux_default_range: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    linux_default_range.write_text("1024\t65535\n")
    assert len(port_range()) == 0
    calls: list[int] = []

    def binds(host: str, port: int) -> bool:
        calls.append(port)
        return True

    monkeypatch.setattr(ports, "_binds", binds)
    with _listening(free_port()):
        pass
    assert calls == []  # no candidate tried: the probe answered
