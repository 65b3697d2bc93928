"""Whether the forward pass now running is recorded into a graph (CUDA graphs): then no
layer may take a data-dependent path (host synchronisation, shapes from values). Layers
with such a path (the mixture-of-experts' per-expert gather) take a static one instead
while :func:`recording_static_shapes` is active."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_state = threading.local()


def static_shapes() -> bool:
    """Whether the forward pass being traced must have static shapes and no syncs."""
    return getattr(_state, "active", False)


@contextlib.contextmanager
def recording_static_shapes() -> Iterator[None]:
    previous = static_shapes()
    _state.active = True
    try:
        yield
    finally:
        _state.active = previous
