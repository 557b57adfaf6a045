"""Embedding tspd in hosts that are not Trio programs.

* :mod:`tspd.hosts.guest` -- asyncio hosts that keep ``asyncio.run()``: Trio runs
  as a guest on the host's loop (:func:`~tspd.hosts.guest.open_trio_guest`).
* :mod:`tspd.hosts.aio` -- asyncio hosts that can start under trio-asyncio
  (:func:`~tspd.hosts.aio.run_aio_host`).
* :mod:`tspd.hosts.threads` -- plain-thread hosts: a Trio loop in a background
  thread and thread-safe facades that never wait for a transfer
  (:func:`~tspd.hosts.threads.open_trio_thread`).

The two asyncio bridges share :class:`~tspd.hosts.bridge.TrioBridge`, so engine
code is written once; all three hold long-lived services (peers, bootstrap
server, KV-event publisher and subscriber) with
:class:`~tspd.hosts.services.ServiceNursery` and close them newest first.
:mod:`tspd.testing.local_pd` stands up a one-process Prefill/Decode pair on
loopback (fake engines) to try an integration against. Trio hosts need none of this: they use
``tspd.shell`` directly. ``examples/`` has one engine per host kind.

Importing this package does not import trio-asyncio: :mod:`tspd.hosts.aio`
loads it only when a bridge opens, because it patches asyncio process-wide and
guest mode cannot start on the loop it installs.
"""

__all__: list[str] = []
