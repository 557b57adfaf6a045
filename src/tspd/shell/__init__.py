"""The Trio shell: sockets, tasks, threads and timers around :mod:`tspd.core`."""
