"""A one-process Prefill/Decode pair on loopback, for trying a host integration.

Before an engine wires tspd to its real KV cache, it can check its host
integration -- asyncio bridge, background thread, plain Trio -- against
:class:`LocalPD`: one Prefill rank and one Decode rank (TP 1) whose KV lives in
two host arenas, copied by fake transfer engines on a private
:class:`~tspd.testing.fake_engine.FakeFabric`, a bootstrap server, and a KV-event
publisher with a subscriber following it, all on ``127.0.0.1``. Every piece is an
ordinary Trio async context manager from ``tspd.shell``, so a host starts them
with its bridge's ``enter`` exactly as it would the real ones; the helpers here
only supply configurations, fill a prompt's KV with the interop pattern and
check what arrived. The examples in ``examples/`` and the host tests use it.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import final

from tspd.core.commands import Event, RemotePrefillDone
from tspd.core.contract import CacheContract
from tspd.core.decode import DecodeConfig
from tspd.core.interop import bootstrap_token_and_candidates
from tspd.core.kv_config import KVEventsConfig
from tspd.core.kv_events import BlockStored, KVEvent, chain_block_hashes
from tspd.core.manifest import BlockManifest, build_manifest
from tspd.core.prefill import PrefillConfig
from tspd.core.schedule import ProducerSchedule
from tspd.shell.arena import BlockMismatch, HostArena, fill_room, verify_room
from tspd.shell.bootstrap import BootstrapServer, open_bootstrap_server
from tspd.shell.decode import DecodePeer, DecodeSettings, open_decode_peer
from tspd.shell.kv_publisher import KVEventPublisher, open_kv_publisher
from tspd.shell.kv_subscriber import EventSource, KVEventSubscriber, open_kv_subscriber
from tspd.shell.ports import free_port
from tspd.shell.prefill import PrefillPeer, PrefillSettings, RemoteDecodeRow, open_prefill_peer
from tspd.shell.steps import StepCounter
from tspd.testing.fake_engine import AsyncFakeEngine, FakeFabric
from tspd.testing.layouts import PageAllocator, multi_layer_contract

__all__ = ["LocalPD", "Prompt"]

#: Tokens per page of the local contract (also the KV-event block size).
PAGE_TOKENS = 4

#: Layers of the local contract (one producer step each when streaming layerwise).
LAYERS = 2


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request's prompt on the Prefill side: its hand-over row and its tokens."""

    rid: str
    room: int
    row: RemoteDecodeRow
    token_ids: tuple[int, ...]


@final
class LocalPD:
    """Configurations and KV helpers for one Prefill and one Decode rank in one process.

    Create it, enter the context managers it hands out (bootstrap server first,
    then the peers; the subscriber before the publisher, which connects to it),
    and :meth:`close` it after they exited. ``seed`` makes the KV pattern and the
    bootstrap tokens reproducible.
    """

    def __init__(self, *, host: str = "127.0.0.1", num_pages: int = 64, seed: int = 7) -> None:
        self.host = host
        self.seed = seed
        self.contract: CacheContract = multi_layer_contract(
            layers=LAYERS, num_pages=num_pages, heads=2, head_dim=4, page_tokens=PAGE_TOKENS
        )
        self.fabric = FakeFabric()
        self.prefill_arena = HostArena.for_contract(self.contract)
        self.decode_arena = HostArena.for_contract(self.contract)
        self._prefill_pages = PageAllocator(self.contract)
        self._decode_pages = PageAllocator(self.contract)
        self.events_endpoint = f"tcp://{host}:{free_port(host)}"
        self.replay_endpoint = f"tcp://{host}:{free_port(host)}"

    # -- services -----------------------------------------------------------------

    def bootstrap_server(self) -> AbstractAsyncContextManager[BootstrapServer]:
        """The Prefill instance's bootstrap server (an ephemeral port on ``host``)."""
        return open_bootstrap_server(self.host)

    @property
    def schedule(self) -> ProducerSchedule:
        """The producer schedule of a layerwise Prefill rank: one step per layer."""
        return ProducerSchedule.from_contract(self.contract, LAYERS)

    def prefill_peer(
        self,
        bootstrap_addr: str,
        *,
        bootstrap_timeout: float = 30.0,
        step_counter: StepCounter | None = None,
    ) -> AbstractAsyncContextManager[PrefillPeer]:
        """The Prefill rank, registering with ``bootstrap_addr``; with
        ``step_counter`` it streams layerwise, each chunk waiting for the forward's
        producer steps (:attr:`schedule`) on that counter."""
        config = PrefillConfig(
            tp_size=1,
            tp_rank=0,
            contract=self.contract,
            arena_base=self.prefill_arena.base,
            transfer_workers=2,
            bootstrap_timeout=bootstrap_timeout,
            layerwise=self.schedule if step_counter is not None else None,
        )
        settings = PrefillSettings(host=self.host, bootstrap_addr=bootstrap_addr)
        engine = AsyncFakeEngine(self.host, fabric=self.fabric)
        return open_prefill_peer(
            config, engine, self.prefill_arena, settings=settings, step_counter=step_counter
        )

    def decode_peer(self) -> AbstractAsyncContextManager[DecodePeer]:
        """The Decode rank."""
        config = DecodeConfig(
            tp_size=1,
            tp_rank=0,
            contract=self.contract,
            arena_base=self.decode_arena.base,
            session_id="",
            endpoint=self.host,
            port=1,
        )
        engine = AsyncFakeEngine(self.host, fabric=self.fabric)
        settings = DecodeSettings(host=self.host)
        return open_decode_peer(config, engine, self.decode_arena, settings=settings)

    def subscriber(self) -> AbstractAsyncContextManager[KVEventSubscriber]:
        """A router-side subscriber bound at :attr:`events_endpoint`, catching up by
        replay on whatever it missed before the publisher connected."""
        source = EventSource(self.events_endpoint, self.replay_endpoint, name="engine", bind=True)
        return open_kv_subscriber([source], catch_up=True)

    def publisher(self) -> AbstractAsyncContextManager[KVEventPublisher]:
        """The engine's KV-event publisher, connecting to the subscriber, with replay."""
        config = KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint=self.events_endpoint,
            replay_endpoint=self.replay_endpoint,
        )
        return open_kv_publisher(config)

    # -- KV helpers ---------------------------------------------------------------

    def prompt(self, rid: str, room: int, prompt_len: int) -> Prompt:
        """Allocate ``rid``'s pages on the Prefill side, write its prompt's KV (the
        interop pattern for ``room``) and return what its hand-over needs."""
        tables = self._prefill_pages.allocate(prompt_len)
        manifest = build_manifest(self.contract, tables, 0, prompt_len)
        fill_room(self.prefill_arena, self.contract, manifest, seed=self.seed, room=room)
        token, candidates = bootstrap_token_and_candidates(self.seed, room, 2)
        token_ids = tuple((room * 31 + i) % 50_000 for i in range(prompt_len))
        return Prompt(rid, room, RemoteDecodeRow(rid, tables, token, candidates), token_ids)

    def preallocation(self, room: int, prompt_len: int) -> BlockManifest:
        """Allocate a request's pages on the Decode side; the manifest to pre-allocate."""
        tables = self._decode_pages.allocate(prompt_len)
        return build_manifest(self.contract, tables, 0, prompt_len)

    def expected_token(self, room: int) -> int:
        """The bootstrap token a Decode rank must see for ``room``."""
        return bootstrap_token_and_candidates(self.seed, room, 2)[0]

    def verify(self, room: int, manifest: BlockManifest) -> list[BlockMismatch]:
        """Blocks of ``room`` on the Decode side that differ from what was sent."""
        return verify_room(self.decode_arena, self.contract, manifest, seed=self.seed, room=room)

    def check_outcome(self, rid: str, event: Event, room: int, manifest: BlockManifest) -> None:
        """Raise ``SystemExit`` naming what went wrong unless ``rid`` finished with
        ``RemotePrefillDone``, the expected bootstrap token and intact KV."""
        if not isinstance(event, RemotePrefillDone):
            raise SystemExit(f"Decode failed {rid}: {event}")
        if event.bootstrap_token != self.expected_token(room):
            raise SystemExit(f"{rid}: wrong bootstrap token {event.bootstrap_token}")
        if self.verify(room, manifest):
            raise SystemExit(f"{rid}: the KV that arrived differs from what was sent")

    @staticmethod
    def stored_events(prompt: Prompt) -> list[KVEvent]:
        """The ``BlockStored`` events a prefix cache emits for ``prompt``'s full blocks."""
        hashes = chain_block_hashes(prompt.token_ids, PAGE_TOKENS)
        events: list[KVEvent] = []
        parent: int | None = None
        for index, block in enumerate(hashes):
            tokens = prompt.token_ids[index * PAGE_TOKENS : (index + 1) * PAGE_TOKENS]
            events.append(BlockStored((block,), parent, tokens, PAGE_TOKENS))
            parent = block
        return events

    def close(self) -> None:
        """Free both arenas (after the peers that registered them exited)."""
        self.prefill_arena.close()
        self.decode_arena.close()
