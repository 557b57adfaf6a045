"""KV events between real processes: ``tspd events publish`` and a late ``tspd events tail``.

The tail joins after the publisher has started (a router restarting next to a
running engine): with ``--catch-up`` it replays what it missed from the
publisher's buffer, so it sees the stream from sequence 0, in order, complete.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest
import zmq

from tspd.core.kv_events import block_hash
from tspd.shell.ports import free_port

TSPD = [sys.executable, "-c", "from tspd.cli import main; main()"]


@pytest.fixture
def ipc_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="tspd-int-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _wait_until_published(replay_port: int, *, at_least: int) -> None:
    """Ask the publisher's replay socket until it holds ``at_least`` batches."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            held = 0
            while dealer.poll(2000):
                _, seq, _payload = dealer.recv_multipart()
                if seq == b"\xff" * 8:
                    break
                held += 1
            if held >= at_least:
                return
            time.sleep(0.05)
        raise AssertionError("the publisher process never published")
    finally:
        dealer.close(linger=0)


def test_a_late_tail_catches_up_through_replay_and_sees_every_batch(ipc_dir: str) -> None:
    replay_port = free_port()
    count = 300
    publisher = subprocess.Popen(
        [
            *TSPD,
            "events",
            "publish",
            "--endpoint",
            f"ipc://{ipc_dir}/pub",
            "--replay-endpoint",
            f"tcp://127.0.0.1:{replay_port}",
            "--rate",
            "150",
            "--count",
            str(count),
            "--events-per-batch",
            "2",
            "--linger",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_until_published(replay_port, at_least=30)  # well under way before the tail
        tail = subprocess.run(
            [
                *TSPD,
                "events",
                "tail",
                f"ipc://{ipc_dir}/pub",
                "--replay",
                f"tcp://127.0.0.1:{replay_port}",
                "--catch-up",
                "--json",
                "--count",
                str(count),
                "--duration",
                "30",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        out, err = publisher.communicate(timeout=60)
    finally:
        if publisher.poll() is None:
            publisher.kill()
            publisher.wait()
    assert publisher.returncode == 0, err
    assert f"published {count} batches ({2 * count} events)" in out
    assert tail.returncode == 0, tail.stderr
    items = [json.loads(line) for line in tail.stdout.splitlines()]
    batches = [i for i in items if i["type"] == "batch"]
    assert [b["seq"] for b in batches] == list(range(count))
    assert any(b["replayed"] for b in batches)  # the beginning came from the replay
    assert not any(b["replayed"] for b in batches[-10:])  # the end came live
    assert not [i for i in items if i["type"] in ("lost", "restarted", "undecodable")]
    assert items[0]["type"] == "replay_requested"
    assert (items[0]["start_seq"], items[0]["attempt"]) == (0, 1)
    # The synthetic blocks chain: every stored block hashes its tokens onto its parent.
    for batch in batches:
        for event in batch["events"]:
            if event["type"] == "BlockStored":
                assert event["block_hashes"] == [
                    block_hash(event["parent_block_hash"], event["token_ids"])
                ]
