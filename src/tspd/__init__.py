"""tspd: the control plane of prefill/decode disaggregated LLM serving, on Trio.

Layers (imports go one way only):

* :mod:`tspd.core` -- sans-IO: wire codecs, cache contracts and manifests, transfer
  planning, room state machines and tables, KV-event encoding. No trio, zmq,
  mooncake or clock.
* :mod:`tspd.engines` -- transfer engines (Mooncake, in-process) behind one small
  protocol; :mod:`tspd.log` -- logging with per-peer rate limits.
* :mod:`tspd.shell` -- the Trio shell: peers, bootstrap server, KV-event publisher
  and subscriber, sockets, tasks, threads, timers.
* :mod:`tspd.hosts` -- embedding in asyncio and plain-thread hosts.
* :mod:`tspd.layouts` -- cache transfer contracts for real model shapes;
  :mod:`tspd.keys` -- CURVE keys for secure mode.
* :mod:`tspd.sim` -- the deterministic whole-cluster simulator.
* :mod:`tspd.testing` -- public test helpers (only tests import it).
* :mod:`tspd.demo`, :mod:`tspd.bench`, :mod:`tspd.cli` -- the ``tspd`` command,
  its demo and its benchmarks.

Every module lists its API in ``__all__``; a name outside it (and every name with a
leading underscore) is internal. ``tests/core/test_public_surface.py`` checks it.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
