"""tspd: the control plane of prefill/decode disaggregated LLM serving, on Trio.

Layers (imports go one way only):

* :mod:`tspd.core` -- sans-IO: wire codecs, cache contracts and manifests, transfer
  planning, room state machines and tables, KV-event encoding. No trio, zmq,
  mooncake or clock.
* :mod:`tspd.shell` -- the Trio shell: sockets, tasks, threads, timers.
* :mod:`tspd.engines` -- transfer engines (Mooncake) behind one small protocol.
* :mod:`tspd.layouts` -- cache transfer contracts for real model shapes.
* :mod:`tspd.testing` -- public test helpers.
* :mod:`tspd.cli` -- the ``tspd`` command.
"""

__version__ = "0.1.0"
