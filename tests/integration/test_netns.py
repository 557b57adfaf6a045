"""Bootstrap server, Prefill and Decode as three hosts: Linux network namespaces
joined by a bridge, addresses from 198.18.0.0/15, Mooncake across them and no
127.0.0.1 anywhere in the run.

Needs root and ``ip netns`` (CI has both); elsewhere the tests skip and say why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

TSPD = str(Path(sys.executable).with_name("tspd"))
SUBNET = "198.18.0"
HOSTS = {"boot": 1, "pre": 2, "dec": 3}


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


def _can_make_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"tspd-probe-{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as err:
        return f"cannot create a network namespace here: {err}"
    _run("ip", "netns", "del", probe)
    return None


@dataclass
class Cluster:
    """Three namespaces on one bridge; ``ns(name)`` is a host's namespace."""

    tag: str

    def ns(self, host: str) -> str:
        return f"tspd-{self.tag}-{host}"

    def addr(self, host: str) -> str:
        return f"{SUBNET}.{HOSTS[host]}"

    def exec(self, host: str, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host), *args]

    def link(self, host: str, up: bool) -> None:
        """Plug ``host``'s cable into the bridge, or pull it out."""
        _run(*self.exec("br", "ip", "link", "set", f"v-{host}", "up" if up else "down"))


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    why = _can_make_namespaces()
    if why is not None:
        pytest.skip(why)
    c = Cluster(str(os.getpid() % 100000))
    made: list[str] = []
    try:
        _run("ip", "netns", "add", c.ns("br"))
        made.append(c.ns("br"))
        _run(*c.exec("br", "ip", "link", "add", "br0", "type", "bridge"))
        _run(*c.exec("br", "ip", "link", "set", "br0", "up"))
        for host, index in HOSTS.items():
            _run("ip", "netns", "add", c.ns(host))
            made.append(c.ns(host))
            _run(
                "ip", "link", "add", f"v-{host}", "netns", c.ns("br"), "type", "veth",
                "peer", "name", "eth0", "netns", c.ns(host),
            )  # fmt: skip
            _run(*c.exec("br", "ip", "link", "set", f"v-{host}", "master", "br0"))
            _run(*c.exec("br", "ip", "link", "set", f"v-{host}", "up"))
            _run(*c.exec(host, "ip", "addr", "add", f"{SUBNET}.{index}/24", "dev", "eth0"))
            _run(*c.exec(host, "ip", "link", "set", "eth0", "up"))
            _run(*c.exec(host, "ip", "link", "set", "lo", "up"))
        yield c
    finally:
        for name in reversed(made):
            pids = subprocess.run(
                ["ip", "netns", "pids", name], capture_output=True, text=True, check=False
            ).stdout.split()
            for pid in pids:
                subprocess.run(["kill", "-9", pid], check=False)
            subprocess.run(["ip", "netns", "del", name], check=False)


def _role(c: Cluster, host: str, role: str, rooms: str, env: dict[str, str]) -> list[str]:
    return c.exec(
        host, TSPD, "demo", role, "--host", c.addr(host),
        "--bootstrap", f"{c.addr('boot')}:8998", "--rooms", rooms, "--tp", "1",
        "--in-flight", "8",
    )  # fmt: skip


def _records(out: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _start_bootstrap(c: Cluster) -> subprocess.Popen[str]:
    server = subprocess.Popen(
        c.exec("boot", TSPD, "bootstrap-server", "--host", c.addr("boot"), "--port", "8998"),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert server.stdout is not None
    assert "ready" in server.stdout.readline()
    return server


def test_a_clean_run_across_three_hosts(cluster: Cluster) -> None:
    server = _start_bootstrap(cluster)
    env = {**os.environ, "MC_LOG_LEVEL": "ERROR"}
    try:
        prefill = subprocess.Popen(
            _role(cluster, "pre", "prefill", "1000:1100", env),
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        )  # fmt: skip
        decode = subprocess.run(
            _role(cluster, "dec", "decode", "1000:1100", env),
            capture_output=True, text=True, timeout=120, env=env, check=False,
        )  # fmt: skip
        out, _ = prefill.communicate(timeout=60)
    finally:
        server.kill()
    assert decode.returncode == 0, decode.stderr[-2000:]
    assert prefill.returncode == 0
    rooms = [r for r in _records(decode.stdout) if r.get("event") == "room"]
    assert len(rooms) == 100
    assert all(r["ok"] for r in rooms)
    assert "127.0.0.1" not in decode.stdout + out


def test_a_partition_fails_rooms_with_reasons_and_new_rooms_succeed_after_the_heal(
    cluster: Cluster,
) -> None:
    """The Decode host's cable is pulled for longer than the heartbeat bound, then
    plugged back: rooms in flight fail on both sides with a reason, none is lost,
    and later rooms succeed without restarting anything."""
    server = _start_bootstrap(cluster)
    env = {
        **os.environ,
        "MC_LOG_LEVEL": "ERROR",
        "TOKENSPEED_DISAGGREGATION_WAITING_TIMEOUT": "4",
        "TOKENSPEED_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "4",
        # Mooncake's floor: a write stuck behind the pulled cable gives up after 5 s.
        "MC_TRANSFER_TIMEOUT": "5",
    }
    rooms = "1000:1600"
    try:
        prefill = subprocess.Popen(
            _role(cluster, "pre", "prefill", rooms, env),
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        )  # fmt: skip
        decode = subprocess.Popen(
            _role(cluster, "dec", "decode", rooms, env),
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        )  # fmt: skip
        time.sleep(1.5)
        cut = time.monotonic()
        cluster.link("dec", up=False)
        time.sleep(5.0)
        cluster.link("dec", up=True)
        healed = time.monotonic()
        d_out, _ = decode.communicate(timeout=200)
        p_out, _ = prefill.communicate(timeout=120)
    finally:
        server.kill()
        for proc in (prefill, decode):
            if proc.poll() is None:
                proc.kill()
    d_rooms = [r for r in _records(d_out) if r.get("event") == "room"]
    # Every room is accounted for: ok, or failed with a reason (none lost).
    assert len(d_rooms) == 600, len(d_rooms)
    failed = [r for r in d_rooms if not r["ok"]]
    assert failed, "the partition failed no room"
    assert all(r["reason"] for r in failed)
    assert any(r["ok"] for r in d_rooms)
    # Rooms that ended well after the heal succeeded again.
    late = [r for r in d_rooms if float(str(r["seen"])) > 0 and r["ok"]]
    assert late
    print(
        f"partition {healed - cut:.1f} s: {len(failed)} of {len(d_rooms)} rooms failed "
        f"with reasons, {len(d_rooms) - len(failed)} ok; prefill output "
        f"{len(_records(p_out))} records"
    )
