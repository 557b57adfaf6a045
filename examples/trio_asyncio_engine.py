"""An asyncio engine started under trio-asyncio, reaching tspd through the bridge.

The engine's code is ordinary asyncio; only its entry point changed, from
``asyncio.run(main())`` to ``run_aio_host(main)`` (Trio outside, the asyncio code
on trio-asyncio's loop). Run it: ``python examples/trio_asyncio_engine.py``. Everything stays on
127.0.0.1: a bootstrap server, one Prefill and one Decode rank whose KV is copied
by fake transfer engines (``tspd.testing.local_pd.LocalPD``), a KV-event publisher and
a subscriber. The engine registers a few requests on both sides, polls, hands
each prompt's KV over, sees ``RemotePrefillDone`` on Decode with the bytes
intact, publishes the prompts' prefix blocks and reads them back. Exits 0 and
prints a summary line when every check held.
"""

from __future__ import annotations

import sys

from asyncio_engine import engine

from tspd.hosts.aio import run_aio_host
from tspd.testing.local_pd import LocalPD


def main() -> str:
    """Was ``asyncio.run(engine(...))``; ``run_aio_host`` hands ``engine`` the bridge."""
    pd = LocalPD()
    try:
        return run_aio_host(
            engine, pd, "trio-asyncio engine", name="the example's trio-asyncio bridge"
        )
    finally:
        pd.close()  # after the bridge exited the peers that registered the arenas


if __name__ == "__main__":
    print(main())
    sys.exit(0)
