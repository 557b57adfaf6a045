"""``tspd events``: watch a KV-event publisher, or generate a synthetic event load.

* ``tspd events tail ENDPOINT [--replay ENDPOINT] [--json]`` follows one publisher
  and prints every batch, with gaps, replays, losses and restarts called out (or
  one JSON object a line with ``--json``, for scripts).
* ``tspd events publish --endpoint ... --rate N --count N`` publishes realistic
  synthetic batches (shared prefixes, chained block hashes, evictions) with the
  real publisher, to test routers and consumers.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from typing import Any

import click
import trio
from rich.console import Console
from rich.markup import escape

from tspd.core.errors import ConfigError
from tspd.core.kv_config import KVEventsConfig
from tspd.core.kv_events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from tspd.core.kv_synth import SyntheticCache
from tspd.shell.kv_publisher import open_kv_publisher
from tspd.shell.kv_subscriber import (
    BatchesLost,
    EventSource,
    PublisherRestarted,
    ReceivedBatch,
    ReplayRequested,
    SubscriberItem,
    UndecodableBatch,
    open_kv_subscriber,
)

__all__ = ["events", "item_to_json", "render_item"]


@click.group()
def events() -> None:
    """Follow or generate KV-cache events (TokenSpeed/vLLM wire)."""


def _hash(h: BlockHash | None) -> int | str | None:
    return h.hex() if isinstance(h, bytes) else h


def _event_json(event: KVEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": [_hash(h) for h in event.block_hashes],
            "parent_block_hash": _hash(event.parent_block_hash),
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
        }
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": [_hash(h) for h in event.block_hashes]}
    return {"type": "AllBlocksCleared"}


def item_to_json(item: SubscriberItem) -> dict[str, Any]:
    """One subscriber item as a JSON-ready dict (``--json`` prints one per line)."""
    match item:
        case ReceivedBatch():
            return {
                "type": "batch",
                "source": item.source,
                "seq": item.seq,
                "replayed": item.replayed,
                "ts": item.batch.ts,
                "dp_rank": item.batch.dp_rank,
                "events": [_event_json(e) for e in item.batch.events],
            }
        case ReplayRequested():
            return {
                "type": "replay_requested",
                "source": item.source,
                "start_seq": item.start_seq,
                "attempt": item.attempt,
            }
        case BatchesLost():
            return {
                "type": "lost",
                "source": item.source,
                "first_missing": item.first_missing,
                "resumed_at": item.resumed_at,
                "count": item.count,
                "reason": item.reason,
            }
        case PublisherRestarted():
            return {
                "type": "restarted",
                "source": item.source,
                "last_seq": item.last_seq,
                "new_seq": item.new_seq,
            }
        case UndecodableBatch():
            return {
                "type": "undecodable",
                "source": item.source,
                "seq": item.seq,
                "error": item.error,
            }


def _short(h: BlockHash | None) -> str:
    if h is None:
        return "-"
    return h.hex()[:16] if isinstance(h, bytes) else f"{h:016x}"


def _event_line(event: KVEvent) -> str:
    if isinstance(event, BlockStored):
        hashes = ",".join(_short(h) for h in event.block_hashes)
        return (
            f"  [green]+ stored[/] {hashes} parent {_short(event.parent_block_hash)} "
            f"({len(event.token_ids)} tokens, block {event.block_size})"
        )
    if isinstance(event, BlockRemoved):
        return f"  [yellow]- removed[/] {','.join(_short(h) for h in event.block_hashes)}"
    assert isinstance(event, AllBlocksCleared)
    return "  [red]x all blocks cleared[/]"


def render_item(item: SubscriberItem, *, show_events: bool) -> list[str]:
    """Rich-markup lines for one subscriber item (the readable view)."""
    match item:
        case ReceivedBatch():
            stored = sum(isinstance(e, BlockStored) for e in item.batch.events)
            removed = sum(isinstance(e, BlockRemoved) for e in item.batch.events)
            origin = "[cyan]replay[/]" if item.replayed else "live"
            head = (
                f"{escape(item.source)} #{item.seq} {origin} dp={item.batch.dp_rank} "
                f"ts={item.batch.ts:.6f} events={len(item.batch.events)} "
                f"(+{stored} -{removed})"
            )
            if show_events:
                return [head, *(_event_line(e) for e in item.batch.events)]
            return [head]
        case ReplayRequested():
            return [
                f"[bold yellow]gap[/] {escape(item.source)}: replay requested from "
                f"#{item.start_seq} (attempt {item.attempt})"
            ]
        case BatchesLost():
            return [
                f"[bold red]lost[/] {escape(item.source)}: #{item.first_missing}.."
                f"#{item.resumed_at - 1} ({item.count} batches, {escape(item.reason)}); "
                "this view is incomplete"
            ]
        case PublisherRestarted():
            return [
                f"[bold magenta]restart[/] {escape(item.source)}: sequence #{item.new_seq} "
                f"after #{item.last_seq}; earlier state is stale"
            ]
        case UndecodableBatch():
            return [
                f"[bold red]undecodable[/] {escape(item.source)} #{item.seq}: {escape(item.error)}"
            ]


@events.command()
@click.argument("endpoint")
@click.option("--replay", "replay", default=None, help="The publisher's replay (ROUTER) address.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object a line.")
@click.option("--topic", default="", show_default=True, help="Subscription prefix.")
@click.option("--bind", is_flag=True, help="Bind ENDPOINT (for publishers that connect).")
@click.option("--catch-up", is_flag=True, help="Replay the publisher's buffer on joining.")
@click.option("--events/--no-events", "show_events", default=True, help="Print each event.")
@click.option(
    "--count", type=click.IntRange(min=1), default=None, help="Exit after this many batches."
)
@click.option("--duration", type=float, default=None, help="Exit after this many seconds.")
@click.option(
    "--dp-ranks",
    default=None,
    help="Follow these DP ranks (e.g. 0,1,2): each moves the TCP ports like the publisher.",
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="With --dp-ranks: the host that replaces a wildcard (*) in the endpoints.",
)
def tail(
    endpoint: str,
    replay: str | None,
    as_json: bool,
    topic: str,
    bind: bool,
    catch_up: bool,
    show_events: bool,
    count: int | None,
    duration: float | None,
    dp_ranks: str | None,
    host: str,
) -> None:
    """Follow the publisher at ENDPOINT and print what it sends."""
    console = Console(highlight=False, soft_wrap=True)

    def emit(item: SubscriberItem) -> None:
        if as_json:
            click.echo(json.dumps(item_to_json(item)))
        else:
            for line in render_item(item, show_events=show_events):
                console.print(line)

    if dp_ranks is None:
        sources = [EventSource(endpoint, replay, bind=bind)]
    else:
        if bind:
            raise click.UsageError("--bind follows one publisher; it cannot go with --dp-ranks")
        try:
            ranks = [int(r) for r in dp_ranks.split(",") if r.strip()]
            sources = EventSource.for_dp_ranks(endpoint, replay, ranks, host=host)
        except (ValueError, ConfigError) as exc:
            raise click.BadParameter(str(exc), param_hint="--dp-ranks") from None
    # Ctrl-C is the normal way to stop following.
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(_tail, sources, topic, catch_up, emit, count, duration)


async def _tail(
    sources: list[EventSource],
    topic: str,
    catch_up: bool,
    emit: Callable[[SubscriberItem], None],
    count: int | None,
    duration: float | None,
) -> None:
    batches = 0
    with trio.move_on_after(duration if duration is not None else math.inf):
        async with open_kv_subscriber(sources, topic=topic, catch_up=catch_up) as sub:
            async for item in sub:
                emit(item)
                if isinstance(item, ReceivedBatch):
                    batches += 1
                    if count is not None and batches >= count:
                        return


@events.command()
@click.option("--endpoint", required=True, help="PUB address (binds for * and ipc://).")
@click.option("--replay-endpoint", default=None, help="Replay ROUTER address (binds).")
@click.option(
    "--rate", type=float, default=100.0, show_default=True, help="Batches a second (0: max)."
)
@click.option("--count", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("--dp-rank", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--events-per-batch", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--topic", default="", show_default=True)
@click.option("--buffer-steps", type=click.IntRange(min=0), default=10_000, show_default=True)
@click.option("--block-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--linger",
    type=float,
    default=0.0,
    show_default=True,
    help="Keep serving replays this many seconds after the last batch.",
)
def publish(
    endpoint: str,
    replay_endpoint: str | None,
    rate: float,
    count: int,
    dp_rank: int,
    events_per_batch: int,
    topic: str,
    buffer_steps: int,
    block_size: int,
    seed: int,
    linger: float,
) -> None:
    """Publish a synthetic KV-event load with the real publisher."""
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=endpoint,
        replay_endpoint=replay_endpoint,
        topic=topic,
        buffer_steps=buffer_steps,
    )
    synth = SyntheticCache(seed=seed, block_size=block_size)
    try:
        stats = trio.run(_publish, config, dp_rank, synth, events_per_batch, rate, count, linger)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(
        f"published {stats['batches']} batches ({stats['events']} events) on "
        f"{stats['endpoint']}; dropped {stats['dropped']}; replays served {stats['replays']}"
    )


async def _publish(
    config: KVEventsConfig,
    dp_rank: int,
    synth: SyntheticCache,
    events_per_batch: int,
    rate: float,
    count: int,
    linger: float,
) -> dict[str, Any]:
    async with open_kv_publisher(config, dp_rank) as pub:
        start = trio.current_time()
        for i in range(count):
            await pub.apublish(synth.batch(events_per_batch))
            if rate > 0:
                await trio.sleep_until(start + (i + 1) / rate)
        await trio.sleep(linger)
    stats = pub.statistics()
    return {
        "batches": stats.batches_published,
        "events": stats.events_published,
        "dropped": stats.batches_dropped,
        "replays": stats.replay_requests_served,
        "endpoint": pub.endpoint,
    }
