"""``tspd events tail`` and ``tspd events publish`` against real sockets."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from functools import partial

import pytest
import trio
import zmq
from click.testing import CliRunner, Result

from tspd.cli import main
from tspd.core.kv_config import KVEventsConfig
from tspd.core.kv_events import BlockStored, KVEvent, KVEventBatch, decode_batch, encode_batch
from tspd.core.replay import decode_replay_reply, encode_replay_request
from tspd.shell.kv_publisher import open_kv_publisher
from tspd.shell.ports import free_port
from tspd.shell.zmq import open_socket

EVENTS: list[KVEvent] = [BlockStored((9,), None, (1, 2), 2)]


@pytest.fixture
def ipc_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="tspd-cli-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _invoke(args: list[str]) -> Result:
    return CliRunner().invoke(main, args, env={"COLUMNS": "200"})


async def test_tail_json_prints_batches_in_order(ipc_dir: str) -> None:
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{ipc_dir}/p",
        replay_endpoint="tcp://127.0.0.1:0",
    )
    async with open_kv_publisher(config) as pub, trio.open_nursery() as nursery:
        assert pub.replay_endpoint is not None
        args = ["events", "tail", pub.endpoint, "--replay", pub.replay_endpoint, "--json"]
        args += ["--count", "5", "--duration", "20"]
        done = trio.Event()
        results: list[Result] = []

        async def run_tail() -> None:
            results.append(await trio.to_thread.run_sync(partial(_invoke, args)))
            done.set()

        nursery.start_soon(run_tail)
        with trio.fail_after(25):
            while not done.is_set():
                await pub.apublish(EVENTS)
                with trio.move_on_after(0.02):
                    await done.wait()
    result = results[0]
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    batches = [line for line in lines if line["type"] == "batch"]
    assert len(batches) == 5
    first = batches[0]["seq"]
    assert [b["seq"] for b in batches] == list(range(first, first + 5))
    assert batches[0]["events"] == [
        {
            "type": "BlockStored",
            "block_hashes": [9],
            "parent_block_hash": None,
            "token_ids": [1, 2],
            "block_size": 2,
        }
    ]
    assert batches[0]["dp_rank"] == 0


async def test_tail_shows_gaps_losses_and_restarts() -> None:
    """A raw PUB with a jump and a restart; the tail has no replay socket."""
    port = free_port()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    raw = ctx.socket(zmq.PUB)
    raw.setsockopt(zmq.LINGER, 0)
    raw.bind(f"tcp://127.0.0.1:{port}")
    payload = encode_batch(KVEventBatch(1.0, tuple(EVENTS), 0))
    args = ["events", "tail", f"tcp://127.0.0.1:{port}", "--duration", "2.5"]
    try:
        async with trio.open_nursery() as nursery:
            results: list[Result] = []

            async def run_tail() -> None:
                results.append(await trio.to_thread.run_sync(partial(_invoke, args)))

            nursery.start_soon(run_tail)
            for seq in [*range(40), 50, 51, 0, 1]:
                raw.send_multipart([b"", seq.to_bytes(8, "big"), payload])
                await trio.sleep(0.02)
    finally:
        raw.close(linger=0)
    result = results[0]
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "live dp=0" in out
    assert "+ stored 0000000000000009 parent -" in out
    assert "lost tcp://127.0.0.1:" in out
    assert "#40..#49 (10 batches, no_replay_endpoint)" in out
    assert "restart" in out
    assert "sequence #0 after #51" in out


async def test_publish_generates_a_replayable_synthetic_load(ipc_dir: str) -> None:
    replay_port = free_port()
    args = [
        "events",
        "publish",
        "--endpoint",
        f"ipc://{ipc_dir}/p",
        "--replay-endpoint",
        f"tcp://127.0.0.1:{replay_port}",
        "--rate",
        "0",
        "--count",
        "50",
        "--events-per-batch",
        "3",
        "--linger",
        "3",
    ]
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    replayed: list[tuple[int, bytes]] = []
    async with trio.open_nursery() as nursery:
        results: list[Result] = []

        async def run_publish() -> None:
            results.append(await trio.to_thread.run_sync(partial(_invoke, args)))

        nursery.start_soon(run_publish)
        async with open_socket(ctx, zmq.DEALER) as dealer:
            dealer.sock.connect(f"tcp://127.0.0.1:{replay_port}")
            with trio.fail_after(10):
                while len(replayed) < 50:
                    await trio.sleep(0.1)
                    await dealer.send_multipart(encode_replay_request(0))
                    replayed.clear()
                    while True:
                        reply = decode_replay_reply(await dealer.recv_multipart())
                        if reply.is_end:
                            break
                        replayed.append((reply.seq, reply.payload))
    result = results[0]
    assert result.exit_code == 0, result.output
    assert "published 50 batches (150 events)" in result.stdout
    assert [s for s, _ in replayed] == list(range(50))
    batches = [decode_batch(p) for _, p in replayed]
    assert all(len(b.events) == 3 for b in batches)
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    assert stored
    assert all(e.block_size == 16 and len(e.token_ids) == 16 for e in stored)


def test_publish_refuses_unsupported_endpoints() -> None:
    result = _invoke(["events", "publish", "--endpoint", "inproc://x", "--count", "1"])
    assert result.exit_code != 0
    assert "inproc:// is private" in result.output


def test_tail_dp_ranks_option_checks_its_arguments() -> None:
    ok = _invoke(
        ["events", "tail", "tcp://*:1", "--dp-ranks", "0,1", "--duration", "0.2", "--json"]
    )
    assert ok.exit_code == 0, ok.output
    assert ok.stdout == ""
    bad = _invoke(["events", "tail", "tcp://*:1", "--dp-ranks", "zero"])
    assert bad.exit_code == 2
    assert "--dp-ranks" in bad.output
    ipc = _invoke(["events", "tail", "ipc:///tmp/x", "--dp-ranks", "1"])
    assert ipc.exit_code == 2
    assert "only tcp:// endpoints can be offset" in ipc.output
    both = _invoke(["events", "tail", "tcp://*:1", "--dp-ranks", "1", "--bind"])
    assert both.exit_code == 2
    assert "cannot go with --dp-ranks" in both.output
