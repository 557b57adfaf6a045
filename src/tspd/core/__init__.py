"""The sans-IO core of tspd.

Nothing in this package performs I/O, awaits, starts threads or reads a clock: time
comes in as an argument and actions go out as data. It imports none of trio, zmq or
mooncake (``tests/core/test_layering.py`` enforces this).
"""

__all__: list[str] = []
