"""Bootstrap server, Prefill and Decode as three hosts: Linux network namespaces
joined by a bridge, addresses from 198.18.0.0/15, Mooncake across them and no
127.0.0.1 anywhere in the run.

Four scenarios: a clean run; a partition between Prefill and Decode; a partition
between Decode and the bootstrap server only; a Prefill host that vanishes and comes
back with the same address. The clean run is ``tspd demo``'s roles; the three fault
scenarios are driven by ``netns_role.py``, with this test as the router sending each
room to both sides at a fixed rate (as a PD router does: two sides walking one room
list on their own drift apart after a fault and never meet again), and print their
figures (run with ``-s``): time to detect, failures by reason, rooms lost, time to
recover. Timing is asserted only against generous bounds derived from the
configured timeouts.

Needs root and ``ip netns`` (CI has both); elsewhere the tests skip and say why.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest

TSPD = str(Path(sys.executable).with_name("tspd"))
ROLE = str(Path(__file__).with_name("netns_role.py"))
SUBNET = "198.18.0"
HOSTS = {"boot": 1, "pre": 2, "dec": 3}
#: A MAC no host has: frames sent to it cross the bridge and are dropped by everyone.
NOWHERE = "02:00:c6:12:00:fe"


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
    made: list[str] = field(default_factory=list)

    def ns(self, host: str) -> str:
        return f"tspd-{self.tag}-{host}"

    def addr(self, host: str) -> str:
        return f"{SUBNET}.{HOSTS[host]}"

    def mac(self, host: str) -> str:
        """The host's NIC address: the same whenever the host comes back."""
        return f"02:00:c6:12:00:{HOSTS[host]:02x}"

    def exec(self, host: str, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host), *args]

    def link(self, host: str, up: bool) -> None:
        """Plug ``host``'s cable into the bridge, or pull it out."""
        _run(*self.exec("br", "ip", "link", "set", f"v-{host}", "up" if up else "down"))

    def add_bridge(self) -> None:
        _run("ip", "netns", "add", self.ns("br"))
        self.made.append(self.ns("br"))
        _run(*self.exec("br", "ip", "link", "add", "br0", "type", "bridge"))
        _run(*self.exec("br", "ip", "link", "set", "br0", "up"))

    def add_host(self, host: str) -> None:
        """A host: its namespace, its NIC (``eth0``, its MAC and address) cabled to
        the bridge."""
        _run("ip", "netns", "add", self.ns(host))
        if self.ns(host) not in self.made:
            self.made.append(self.ns(host))
        _run(
            "ip", "link", "add", f"v-{host}", "netns", self.ns("br"), "type", "veth",
            "peer", "name", "eth0", "netns", self.ns(host),
        )  # fmt: skip
        _run(*self.exec("br", "ip", "link", "set", f"v-{host}", "master", "br0"))
        _run(*self.exec("br", "ip", "link", "set", f"v-{host}", "up"))
        _run(*self.exec(host, "ip", "link", "set", "eth0", "address", self.mac(host)))
        _run(*self.exec(host, "ip", "addr", "add", f"{self.addr(host)}/24", "dev", "eth0"))
        _run(*self.exec(host, "ip", "link", "set", "eth0", "up"))
        _run(*self.exec(host, "ip", "link", "set", "lo", "up"))

    def remove_host(self, host: str) -> float:
        """The host vanishes: its cable is pulled first (nothing it still sends, no
        FIN or RST, gets out), then its processes are killed and its namespace is
        deleted with its NIC. Returns when the cable was out (``time.monotonic()``)."""
        self.link(host, up=False)
        pulled = time.monotonic()
        _kill_namespace(self.ns(host), wait=True)
        # Namespaces die asynchronously; the NIC (both veth ends) goes now, so the
        # host can come back at once.
        subprocess.run([*self.exec("br", "ip", "link", "del", f"v-{host}")], check=False)
        return pulled

    def partition(self, a: str, b: str, cut: bool) -> None:
        """Cut (or heal) ``a`` <-> ``b`` alone: each addresses the other's frames to a
        MAC no host has, so both directions are dropped silently while every other
        pair still talks (no packet filter needed). Healing forgets the bogus entry:
        the next packet asks ARP again."""
        for here, there in ((a, b), (b, a)):
            if cut:
                _run(
                    *self.exec(here, "ip", "neigh", "replace", self.addr(there),
                               "lladdr", NOWHERE, "dev", "eth0", "nud", "permanent"),
                )  # fmt: skip
            else:
                _run(*self.exec(here, "ip", "neigh", "del", self.addr(there), "dev", "eth0"))


def _kill_namespace(name: str, wait: bool = False) -> None:
    """Kill every process in namespace ``name`` (``wait``: until they are gone), then
    delete it."""
    pids = subprocess.run(
        ["ip", "netns", "pids", name], capture_output=True, text=True, check=False
    ).stdout.split()
    for pid in pids:
        subprocess.run(["kill", "-9", pid], check=False)
    deadline = time.monotonic() + 10
    while wait and pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if _running(pid)]
        time.sleep(0.05)
    subprocess.run(["ip", "netns", "del", name], check=False)


def _running(pid: str) -> bool:
    """Whether process ``pid`` still runs (a zombie has left its namespaces)."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    why = _can_make_namespaces()
    if why is not None:
        pytest.skip(why)
    c = Cluster(str(os.getpid() % 100000))
    try:
        c.add_bridge()
        for host in HOSTS:
            c.add_host(host)
        yield c
    finally:
        for name in reversed(c.made):
            _kill_namespace(name)


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


# ---------------------------------------------------------------- routed scenarios

#: The timeouts the routed scenarios run under (TokenSpeed's variables; the heartbeat
#: interval is ``netns_role.py``'s option, as ``tspd demo decode --heartbeat-interval``).
WAITING_TIMEOUT = 4
BOOTSTRAP_TIMEOUT = 6
HEARTBEAT_INTERVAL = 1.0
HEARTBEAT_MAX_FAILURES = 2
#: The bootstrap client's fixed limits (docs/protocol.md#proto-bootstrap-clients).
HEALTH_CONNECT, HEALTH_READ, LOOKUP = 2.0, 3.0, 5.0
#: The longest the Decode can take to declare a silent bootstrap address dead: each
#: failing round sleeps an interval, then waits out a connect or a read.
HEARTBEAT_BOUND = HEARTBEAT_MAX_FAILURES * (HEARTBEAT_INTERVAL + max(HEALTH_CONNECT, HEALTH_READ))
#: The router's rate and each room's prefill forward (it keeps about RATE * FORWARD
#: rooms in flight for a fault to catch).
RATE = 10.0
FORWARD = 0.5
#: Slack on top of a bound: scheduling on a loaded 2-core host.
SLACK = 3.0


def _routed_env() -> dict[str, str]:
    return {
        **os.environ,
        "MC_LOG_LEVEL": "ERROR",
        "MC_TRANSFER_TIMEOUT": "5",
        "TOKENSPEED_DISAGGREGATION_WAITING_TIMEOUT": str(WAITING_TIMEOUT),
        "TOKENSPEED_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(BOOTSTRAP_TIMEOUT),
        "TOKENSPEED_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": str(HEARTBEAT_MAX_FAILURES),
    }


class Role:
    """A ``netns_role.py`` process on a host: rooms go in on stdin, its JSON lines are
    collected by a thread as they come (``t`` on the shared monotonic clock)."""

    def __init__(self, c: Cluster, host: str, role: str, log: Path) -> None:
        self.name = role
        self.log = log
        self._stderr: IO[str] = log.open("w")
        self.proc = subprocess.Popen(
            c.exec(
                host, sys.executable, ROLE, role, "--host", c.addr(host),
                "--bootstrap", f"{c.addr('boot')}:8998",
                "--heartbeat-interval", str(HEARTBEAT_INTERVAL),
                "--forward-seconds", str(FORWARD),
            ),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
            text=True, env=_routed_env(), bufsize=1,
        )  # fmt: skip
        self.records: list[dict[str, Any]] = []
        self.sent: dict[int, float] = {}
        self.output: list[str] = []
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            if line.startswith("{"):
                record = json.loads(line)
                self.records.append(record)
                if record["event"] == "ready":
                    self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float = 60.0) -> float:
        assert self._ready.wait(timeout), f"{self.name} never got ready: {self.stderr()}"
        ready = [r for r in self.records if r["event"] == "ready"]
        assert ready, f"{self.name} exited before it got ready: {self.stderr()}"
        assert ready[0].get("registered", True), f"{self.name} did not reach the bootstrap server"
        return float(ready[0]["t"])

    def send(self, room: int) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(f"{room}\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            return  # the host is gone: the router's request to it fails
        self.sent[room] = time.monotonic()

    def finish(self, timeout: float) -> None:
        """Close stdin (no more rooms) and wait for the rooms in flight to end."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError, OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        finally:
            self._reader.join(5)
            self._stderr.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if not self._stderr.closed:
            self._stderr.close()

    def rooms(self) -> dict[int, dict[str, Any]]:
        """Every room that ended, by room."""
        return {int(r["room"]): r for r in self.records if r["event"] == "room"}

    def stderr(self) -> str:
        """The end of the process's log (stderr)."""
        if not self._stderr.closed:
            self._stderr.flush()
        return self.log.read_text()[-3000:]


class Router(threading.Thread):
    """The PD router: room after room at :data:`RATE`, each to the Decode and, while
    one is up, to the Prefill (``prefill = None`` while its host is gone)."""

    def __init__(self, decode: Role, prefill: Role | None, first: int = 1000) -> None:
        super().__init__(daemon=True)
        self.decode = decode
        self.prefill = prefill
        self.next = first
        self.stopped = threading.Event()

    def run(self) -> None:
        due = time.monotonic()
        while not self.stopped.is_set():
            prefill = self.prefill
            if prefill is not None:
                prefill.send(self.next)
            self.decode.send(self.next)
            self.next += 1
            due += 1 / RATE
            self.stopped.wait(max(0.0, due - time.monotonic()))

    def stop(self) -> None:
        self.stopped.set()
        if self.is_alive():
            self.join(5)


def _kind(reason: str | None) -> str:
    """A reason without what varies from room to room (numbers, ports, durations)."""
    text = re.sub(r"\b(Request|room) \d+", r"\1 N", reason or "no reason given")
    text = re.sub(r"after \d+(\.\d+)?s", "after Xs", text)
    return re.sub(r"moved from \S+ to \S+", "moved from OLD to NEW", text)


def _by_reason(rooms: dict[int, dict[str, Any]]) -> Counter[str]:
    return Counter(
        f"[{r['reason_class']}] {_kind(r['reason'])}" for r in rooms.values() if not r["ok"]
    )


def _lost(role: Role) -> list[int]:
    """Rooms ``role`` was sent that never ended there."""
    return sorted(set(role.sent) - set(role.rooms()))


def _report(title: str, **figures: object) -> None:
    print(f"\n{title}")
    for name, value in figures.items():
        if isinstance(value, Counter):
            print(f"  {name}:")
            for reason, count in value.most_common():
                print(f"    {count:4d}  {reason}")
        elif isinstance(value, float):
            print(f"  {name}: {value:.2f} s")
        else:
            print(f"  {name}: {value}")


def _first_after(rooms: dict[int, dict[str, Any]], t: float, *, ok: bool) -> float | None:
    times = [float(r["t"]) for r in rooms.values() if r["ok"] is ok and float(r["t"]) >= t]
    return min(times, default=None)


@dataclass
class _Routed:
    """A routed run's processes (:func:`_routed_run`)."""

    prefill: Role
    decode: Role
    router: Router
    #: When the router started.
    started: float
    #: Roles started during the run, killed with the others on the way out.
    extra: list[Role] = field(default_factory=list)


@contextlib.contextmanager
def _routed_run(cluster: Cluster, tmp_path: Path, prefill_log: str) -> Iterator[_Routed]:
    """The bootstrap server, a Prefill host and a Decode host, ready, with the router
    sending rooms to both; on the way out the router stops and every process is
    killed."""
    server = _start_bootstrap(cluster)
    prefill = Role(cluster, "pre", "prefill", tmp_path / prefill_log)
    decode = Role(cluster, "dec", "decode", tmp_path / "decode.log")
    router = Router(decode, prefill)
    run: _Routed | None = None
    try:
        prefill.wait_ready()
        decode.wait_ready()
        run = _Routed(prefill, decode, router, time.monotonic())
        router.start()
        yield run
    finally:
        router.stop()
        for role in (decode, prefill, *(run.extra if run is not None else ())):
            role.kill()
        server.kill()


def test_a_partition_fails_rooms_with_reasons_and_new_rooms_succeed_after_the_heal(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The Decode host's cable is pulled (it loses the Prefill and the bootstrap
    server) for longer than the heartbeat bound while the router keeps sending
    rooms, then plugged back.

    * Rooms in flight and rooms routed during the cut fail on both sides, each with
      a reason, within the bound their timeouts imply; none is lost.
    * After the heal, with nothing restarted, every room routed once a lookup can no
      longer be pending succeeds on both sides."""
    cut_length = HEARTBEAT_BOUND + 2.0
    with _routed_run(cluster, tmp_path, "prefill.log") as run:
        prefill, decode, started = run.prefill, run.decode, run.started
        time.sleep(3.0)
        cut = time.monotonic()
        cluster.link("dec", up=False)
        time.sleep(cut_length)
        cluster.link("dec", up=True)
        healed = time.monotonic()
        time.sleep(LOOKUP + 10.0)
        run.router.stop()
        stopped = time.monotonic()
        decode.finish(60)
        prefill.finish(60)
    d_rooms, p_rooms = decode.rooms(), prefill.rooms()
    d_detect = _first_after(d_rooms, cut, ok=False)
    p_detect = _first_after(p_rooms, cut, ok=False)
    after = {k: r for k, r in d_rooms.items() if decode.sent[k] >= healed}
    first_ok = _first_after(after, healed, ok=True)
    failed_after = [k for k, r in after.items() if not r["ok"]]
    _report(
        f"partition Prefill <-> Decode (the Decode's cable pulled {cut_length:.1f} s; "
        f"heartbeat bound {HEARTBEAT_BOUND:.1f} s, waiting timeout {WAITING_TIMEOUT} s, "
        f"bootstrap timeout {BOOTSTRAP_TIMEOUT} s, MC_TRANSFER_TIMEOUT 5 s)",
        rooms_sent=len(decode.sent),
        time_to_detect=f"decode {_seconds(d_detect, cut)}, prefill {_seconds(p_detect, cut)}",
        decode_failures=_by_reason(d_rooms),
        prefill_failures=_by_reason(p_rooms),
        rooms_lost=f"decode {len(_lost(decode))}, prefill {len(_lost(prefill))}",
        time_to_recover=(first_ok - healed) if first_ok is not None else "never",
        failed_after_the_heal=len(failed_after),
        last_failure_after_the_heal=_seconds(
            max((float(r["t"]) for r in d_rooms.values() if not r["ok"]), default=None), healed
        ),
        run=stopped - started,
    )
    out = "".join(decode.output + prefill.output)
    assert "127.0.0.1" not in out
    assert _lost(decode) == []
    assert _lost(prefill) == []
    assert all(r["ok"] for r in d_rooms.values() if r["t"] < cut)
    d_failed = {k: r for k, r in d_rooms.items() if not r["ok"]}
    assert d_failed, "the partition failed no room"
    for side in (d_rooms, p_rooms):
        for r in side.values():
            assert r["ok"] or (r["reason"] and r["reason_class"]), r
    # Each failure within its bound: the slowest path is a room routed just before
    # the Decode declares the address dead, whose lookup then waits out its limit.
    bound = HEARTBEAT_BOUND + LOOKUP + max(WAITING_TIMEOUT, BOOTSTRAP_TIMEOUT) + SLACK
    for k, r in d_failed.items():
        assert float(r["t"]) - max(decode.sent[k], cut) <= bound, (k, r)
    for k, r in p_rooms.items():
        if not r["ok"]:
            assert float(r["t"]) - max(prefill.sent[k], cut) <= bound, (k, r)
    # After the heal: every room routed once no lookup can be pending succeeds on
    # both sides, without restarting anything.
    assert first_ok is not None
    settled = healed + LOOKUP + HEARTBEAT_INTERVAL + SLACK
    late = [k for k, sent in decode.sent.items() if sent >= settled]
    assert late
    assert all(d_rooms[k]["ok"] for k in late), _by_reason({k: d_rooms[k] for k in late})
    assert all(p_rooms[k]["ok"] for k in late), _by_reason({k: p_rooms[k] for k in late})
    for role in (decode, prefill):
        assert role.proc.returncode == 0, role.stderr()


def _seconds(when: float | None, since: float) -> str:
    return "never" if when is None else f"{when - since:.2f} s"


def test_a_partition_from_the_bootstrap_server_fails_only_past_the_heartbeat_bound(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Decode <-> bootstrap server cut, Prefill <-> Decode fine
    (docs/protocol.md#proto-failure-prefill-death: the Decode heartbeats ``/health`` of
    the Prefill's bootstrap address, which is this server).

    * A cut shorter than the heartbeat bound fails nothing: rooms route through the
      cached parallel info and rank endpoints and keep succeeding.
    * A cut longer than the bound: rooms keep succeeding until the bootstrap address
      is declared dead (no sooner than one heartbeat interval, no later than the
      bound); then the rooms in flight fail with ``Losing connection with prefill
      instance``, and new rooms, which need a lookup again, fail with ``Could not
      fetch prefill parallel info`` (their Prefill halves with its bootstrap timeout).
    * After the heal new rooms succeed on both sides, nothing restarted; no room is
      lost on either side."""
    # The long cut outlasts the heartbeat bound and then a whole lookup.
    blip_length, cut_length = HEARTBEAT_INTERVAL + 1.5, HEARTBEAT_BOUND + LOOKUP + 2.0
    with _routed_run(cluster, tmp_path, "prefill.log") as run:
        prefill, decode, started = run.prefill, run.decode, run.started
        time.sleep(3.0)
        blip = time.monotonic()
        cluster.partition("dec", "boot", cut=True)
        time.sleep(blip_length)
        cluster.partition("dec", "boot", cut=False)
        time.sleep(3.0)
        cut = time.monotonic()
        cluster.partition("dec", "boot", cut=True)
        time.sleep(cut_length)
        cluster.partition("dec", "boot", cut=False)
        healed = time.monotonic()
        time.sleep(LOOKUP + 8.0)
        run.router.stop()
        stopped = time.monotonic()
        decode.finish(60)
        prefill.finish(60)
    d_rooms, p_rooms = decode.rooms(), prefill.rooms()
    dead = _first_after(d_rooms, cut, ok=False)
    first_ok = _first_after(
        {k: r for k, r in d_rooms.items() if decode.sent[k] >= healed}, healed, ok=True
    )
    cached_ok = [
        r for k, r in d_rooms.items() if r["ok"] and decode.sent[k] >= cut and r["t"] < (dead or 0)
    ]
    _report(
        "partition Decode <-> bootstrap server "
        f"(blip {blip_length:.1f} s, then {cut_length:.1f} s; heartbeat bound "
        f"{HEARTBEAT_BOUND:.1f} s)",
        rooms_sent=len(decode.sent),
        failed_during_blip=sum(1 for r in d_rooms.values() if not r["ok"] and r["t"] < cut),
        time_to_detect=(dead - cut) if dead is not None else "never",
        new_rooms_ok_on_cached_routes_before_detection=len(cached_ok),
        decode_failures=_by_reason(d_rooms),
        prefill_failures=_by_reason(p_rooms),
        failed_on_decode_but_ok_on_prefill=sum(
            1 for k, r in d_rooms.items() if not r["ok"] and p_rooms.get(k, {}).get("ok")
        ),
        rooms_lost=f"decode {len(_lost(decode))}, prefill {len(_lost(prefill))}",
        time_to_recover=(first_ok - healed) if first_ok is not None else "never",
        run=stopped - started,
    )
    out = "".join(decode.output + prefill.output)
    assert "127.0.0.1" not in out
    # Nothing is lost: every room either side was sent ended there.
    assert _lost(decode) == []
    assert _lost(prefill) == []
    # A cut shorter than the heartbeat bound fails nothing (nor does the clean start).
    early = {k: r for k, r in d_rooms.items() if r["t"] < cut}
    assert all(r["ok"] for r in early.values()), _by_reason(early)
    assert any(decode.sent[k] >= blip and r["ok"] for k, r in early.items())
    # The long cut: the address is declared dead within the heartbeat bound, not at
    # the first missed beat; until then new rooms on cached routes succeed.
    assert dead is not None, "the Decode never noticed the bootstrap server was gone"
    assert HEARTBEAT_INTERVAL <= dead - cut <= HEARTBEAT_BOUND + SLACK, dead - cut
    assert cached_ok, "no room succeeded on its cached route during the cut"
    d_failed = {k: r for k, r in d_rooms.items() if not r["ok"]}
    for room, r in d_failed.items():
        assert r["reason_class"], r
        assert r["reason"].startswith(
            ("Losing connection with prefill instance", "Could not fetch prefill parallel info")
        ), (room, r["reason"])
        # Failures stop with the last lookup that was pending at the heal.
        assert decode.sent[room] < healed + LOOKUP, (room, r)
    assert any(r["reason"].startswith("Losing connection") for r in d_failed.values())
    assert any(r["reason"].startswith("Could not fetch") for r in d_failed.values())
    assert all(r["reason"] for r in p_rooms.values() if not r["ok"])
    # After the heal, with no restart: the first new room succeeds within a lookup's
    # bound, and every room sent once a lookup can no longer be pending succeeds on
    # both sides.
    assert first_ok is not None
    assert first_ok - healed <= LOOKUP + FORWARD + SLACK
    settled = healed + LOOKUP + SLACK
    late = [k for k, sent in decode.sent.items() if sent >= settled]
    assert late
    assert all(d_rooms[k]["ok"] for k in late), _by_reason({k: d_rooms[k] for k in late})
    assert all(p_rooms[k]["ok"] for k in late), _by_reason({k: p_rooms[k] for k in late})
    for role in (decode, prefill):
        assert role.proc.returncode == 0, role.stderr()


def test_a_prefill_host_that_vanishes_and_comes_back_with_its_address(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The Prefill host disappears (cable pulled, processes killed, namespace deleted)
    while rooms are in flight, and comes back later as a new namespace with the same
    address and MAC and a new Prefill process. The bootstrap server and the Decode
    run on untouched.

    * The Decode's heartbeat asks the bootstrap server, which lives, so it never
      declares the address dead: the rooms in flight fail with a reason within the
      waiting timeout (docs/protocol.md#proto-decode-room-table), as do the rooms the
      router keeps sending the Decode while the Prefill is gone.
    * Once the new Prefill has registered with the bootstrap server, the Decode
      learns its new control endpoint — the next good heartbeat re-fetches it and
      fails the rooms that pre-allocated with the old process (``restarted: its
      control endpoint moved``), or the route, dropped after three waiting timeouts
      in a row, is fetched again — and registers with it: new rooms succeed on both
      sides without restarting the Decode or the bootstrap server.
    * No room is lost on the Decode or the new Prefill."""
    again: Role | None = None
    outage = WAITING_TIMEOUT + 4.0
    with _routed_run(cluster, tmp_path, "prefill-1.log") as run:
        prefill, decode, router, started = run.prefill, run.decode, run.router, run.started
        time.sleep(3.0)
        router.prefill = None  # the router's requests to the Prefill fail from now on
        gone = cluster.remove_host("pre")
        prefill.kill()
        sent_so_far = dict(decode.sent)  # one copy: the router thread adds to it
        in_flight = {k for k, sent in sent_so_far.items() if sent < gone} - {
            k for k, r in decode.rooms().items() if r["t"] < gone
        }
        time.sleep(max(0.0, gone + outage - time.monotonic()))
        cluster.add_host("pre")
        back = time.monotonic()
        again = Role(cluster, "pre", "prefill", tmp_path / "prefill-2.log")
        run.extra.append(again)
        ready = again.wait_ready()
        router.prefill = again
        time.sleep(12.0)
        router.stop()
        stopped = time.monotonic()
        decode.finish(60)
        again.finish(60)
    assert again is not None
    d_rooms, p_rooms = decode.rooms(), again.rooms()
    detected = _first_after(d_rooms, gone, ok=False)
    first_ok = _first_after({k: r for k, r in d_rooms.items() if k in again.sent}, ready, ok=True)
    in_flight_failed = {k: d_rooms[k] for k in in_flight if k in d_rooms and not d_rooms[k]["ok"]}
    # A room whose KV and Success were on the wire when the cable went still succeeds.
    in_flight_done = {k: d_rooms[k] for k in in_flight if k in d_rooms and d_rooms[k]["ok"]}
    during = {k: r for k, r in d_rooms.items() if gone <= decode.sent[k] < ready}
    _report(
        f"Prefill host gone for {back - gone:.1f} s, its new Prefill ready "
        f"{ready - back:.1f} s after the host came back (waiting timeout "
        f"{WAITING_TIMEOUT:.0f} s, heartbeat {HEARTBEAT_INTERVAL:.0f} s x "
        f"{HEARTBEAT_MAX_FAILURES})",
        rooms_sent=f"decode {len(decode.sent)}, first prefill {len(prefill.sent)}, "
        f"new prefill {len(again.sent)}",
        in_flight_at_the_vanishing=f"{len(in_flight)} ({len(in_flight_done)} of them had "
        "their KV and Success on the wire already)",
        time_to_detect=(detected - gone) if detected is not None else "never",
        address_declared_dead=sum(
            1 for r in d_rooms.values() if (r["reason"] or "").startswith("Losing connection")
        ),
        last_in_flight_room_failed=(
            max(float(r["t"]) for r in in_flight_failed.values()) - gone
            if in_flight_failed
            else "n/a"
        ),
        decode_failures=_by_reason(d_rooms),
        new_prefill_failures=_by_reason(p_rooms),
        rooms_lost=f"decode {len(_lost(decode))}, new prefill {len(_lost(again))} "
        f"(the vanished Prefill took {len(set(prefill.sent) - set(prefill.rooms()))} "
        "with it)",
        time_to_recover=(first_ok - ready) if first_ok is not None else "never",
        run=stopped - started,
    )
    out = "".join(decode.output + prefill.output + again.output)
    assert "127.0.0.1" not in out
    assert _lost(decode) == []
    assert _lost(again) == []
    # Before the host vanished every room succeeded.
    assert all(r["ok"] for r in d_rooms.values() if r["t"] < gone)
    # Every room in flight when it vanished failed on the Decode, with a reason,
    # within the waiting timeout (the bootstrap server answers the heartbeat), unless
    # what completed it was already on the wire.
    assert in_flight_failed, "no room was in flight when the host vanished"
    assert set(in_flight_failed) | set(in_flight_done) == in_flight, {
        k: d_rooms.get(k) for k in in_flight
    }
    assert all(float(r["t"]) - gone < 1.0 for r in in_flight_done.values()), in_flight_done
    assert detected is not None
    # The bootstrap server lives: the Decode never declares the address dead.
    assert not any((r["reason"] or "").startswith("Losing connection") for r in d_rooms.values())
    for r in in_flight_failed.values():
        assert r["reason"], r
        assert r["reason_class"], r
        assert float(r["t"]) - gone <= WAITING_TIMEOUT + HEARTBEAT_INTERVAL + SLACK, r
    # So did the rooms routed to the Decode while the Prefill was gone.
    assert during
    assert not any(r["ok"] for r in during.values())
    assert all(r["reason"] and r["reason_class"] for r in during.values())
    # The new Prefill: new rooms succeed, without restarting the Decode or the
    # bootstrap server, once one heartbeat has noticed the new endpoint.
    assert first_ok is not None
    assert first_ok - ready <= HEARTBEAT_INTERVAL + HEALTH_READ + FORWARD + SLACK
    settled = ready + HEARTBEAT_INTERVAL + HEALTH_READ + SLACK
    late = [k for k, sent in again.sent.items() if sent >= settled]
    assert late
    assert all(d_rooms[k]["ok"] for k in late), _by_reason({k: d_rooms[k] for k in late})
    assert all(p_rooms[k]["ok"] for k in late), _by_reason({k: p_rooms[k] for k in late})
    for role in (decode, again):
        assert role.proc.returncode == 0, role.stderr()
