"""Serving a small ASGI app (Starlette) with hypercorn on Trio, the way tspd's HTTP
endpoints do: the bootstrap server and the metrics endpoint.

The listening socket is bound by the caller first (:func:`bind_tcp`), so a port that
cannot be bound fails before any task starts, with the caller's own message, and
``port=0`` yields the real port at once; hypercorn then adopts the descriptor and
closes it when it stops.
"""

from __future__ import annotations

import logging
import socket
from functools import partial
from typing import Any, NoReturn, TypeVar, cast

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from tspd.shell.nursery import single_error

__all__ = ["bind_tcp", "serve_asgi"]

T = TypeVar("T")


def bind_tcp(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (IPv6 when ``host`` has a ``:``); raises
    the ``OSError`` for the caller to turn into its own message."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


async def serve_asgi(
    app: object,
    sock: socket.socket,
    *,
    logger: logging.Logger,
    what: str,
    started: T,
    url: str,
    task_status: trio.TaskStatus[T] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Serve ``app`` on the bound ``sock`` until cancelled; report ``started`` through
    ``task_status`` once hypercorn listens. hypercorn's own errors go to
    ``logger``'s ``.http`` child; access logs are off."""
    config = HypercornConfig()
    config.bind = [f"fd://{sock.detach()}"]
    config.accesslog = None
    config.errorlog = logger.getChild("http")
    config.graceful_timeout = 0.5
    with single_error():
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(hypercorn_serve, cast(Any, app), config))
            logger.info("%s listening on %s", what, url)
            task_status.started(started)
            await trio.sleep_forever()
    raise AssertionError(f"unreachable: the {what} returns only by cancellation")
