"""The Trio shell: sockets, tasks, threads and timers around :mod:`tspd.core`."""

__all__: list[str] = []
