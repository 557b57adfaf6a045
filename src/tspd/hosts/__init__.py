"""Embedding tspd in hosts that are not Trio programs.

* :mod:`tspd.hosts.guest` -- asyncio hosts that keep ``asyncio.run()``: Trio runs
  as a guest on the host's loop (:func:`~tspd.hosts.guest.open_trio_guest`).
* :mod:`tspd.hosts.aio` -- asyncio hosts that can start under trio-asyncio
  (:func:`~tspd.hosts.aio.run_aio_host`).
* :mod:`tspd.hosts.threads` -- plain-thread hosts: a Trio loop in a background
  thread and thread-safe facades that never wait for a transfer
  (:func:`~tspd.hosts.threads.open_trio_thread`).

The two asyncio bridges share :class:`~tspd.hosts.bridge.TrioBridge`, so engine
code is written once. Trio hosts need none of this: they use
``tspd.shell`` directly (``examples/trio_engine.py``).
"""
