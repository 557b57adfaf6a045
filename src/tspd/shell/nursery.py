"""Exception-group manners for the nurseries tspd owns.

A peer's ``open_*`` context manager runs its tasks in a nursery of its own. When
one internal task fails, Trio wraps the error in an exception group; callers
should see the one error that happened, not the library's task structure. These
helpers unwrap a group of exactly one exception (recursively) and leave real
multi-error groups alone (docs/architecture.md#cancellation-policy).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["single_error"]


def _only(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


@contextmanager
def single_error() -> Iterator[None]:
    """Re-raise a one-exception group from the body as that exception."""
    try:
        yield
    except BaseExceptionGroup as group:
        only = _only(group)
        if only is group:
            raise
        # Keep the error's own cause (e.g. the OSError behind a bind failure).
        raise only from only.__cause__
