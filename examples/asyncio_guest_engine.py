"""An asyncio engine that keeps ``asyncio.run()`` and runs tspd as a Trio guest.

Run it: ``python examples/asyncio_guest_engine.py``. The engine itself is
``asyncio_engine.engine`` (shared with ``trio_asyncio_engine.py``): a bootstrap
server, one Prefill and one Decode rank and a KV-event publisher and subscriber on
127.0.0.1. Exits 0 and prints a summary line when every check held.
"""

from __future__ import annotations

import asyncio
import sys

from asyncio_engine import engine

from tspd.hosts.guest import open_trio_guest
from tspd.testing.local_pd import LocalPD


async def main() -> str:
    pd = LocalPD()
    try:
        async with open_trio_guest(name="the example's Trio guest") as guest:
            return await engine(guest, pd, "asyncio guest engine")
    finally:
        pd.close()


if __name__ == "__main__":
    print(asyncio.run(main()))
    sys.exit(0)
