"""A KV connector moves the KV cache of full prompt blocks between engines (prefill/decode
disaggregation: a prefill engine writes them, a decode engine reads them instead of
computing the prompt again). Registered with ``pagedllm_register_kv_connectors`` and
chosen by ``--kv-transfer-config '{"kv_connector": NAME, "kv_role": ...}'``.

A connector is a store of blocks by key: the engine names each full prompt block by a
stable chain hash of its tokens (and of everything before it, so equal keys mean equal
prefixes) and of the cache layout, and moves each block as one tensor
``[layers, 2 (key, value), block_size, kv heads, head dim]`` in host memory. Which blocks,
which slots of the cache, when: the engine's business, not the connector's.

Lifecycle: the engine builds one connector on its scheduler side (``side="scheduler"``:
:meth:`lookup` and :meth:`load`, when the role consumes) and one on each rank's model
runner (``side="worker"``: :meth:`save`, after the step that computed a prompt's last
token, when the role produces); :meth:`close` when the engine stops. A constructor raises
:class:`~pagedllm.core.errors.ConfigError` for what a user can fix (a missing setting, a
folder that is not writable), so that the engine refuses to start.

Failures are never fatal to a request: :meth:`load` returns the leading blocks it got
(a missing, short or late block ends them, with a warning), and the engine computes the
rest of the prompt; :meth:`save` logs what it could not write. Every call that waits on
something outside the process is bounded in time.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    import torch

ConnectorSide = Literal["scheduler", "worker"]


@dataclasses.dataclass(frozen=True, slots=True)
class KVBlockLayout:
    """One block's tensor as connectors move it: ``shape`` is ``(layers, 2, block_size,
    kv heads, head dim)``."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        import math

        import torch

        return math.prod(self.shape) * torch.tensor([], dtype=self.dtype).element_size()

    @property
    def tag(self) -> str:
        """Names the layout in keys, so that engines with other layouts never match."""
        return "x".join(map(str, self.shape)) + "-" + str(self.dtype).removeprefix("torch.")


class KVConnector(ABC):
    """Base of the KV connectors. ``config``: the engine's ``KVTransferConfig`` (its
    ``kv_role``, its ``kv_connector_extra_config``)."""

    #: The registered name (``kv_connector``).
    name: ClassVar[str] = ""

    def __init__(self, config: Any, layout: KVBlockLayout, side: ConnectorSide) -> None:
        self.config = config
        self.layout = layout
        self.side = side

    @abstractmethod
    def lookup(self, keys: Sequence[str]) -> int:
        """Scheduler side: how many of the leading ``keys`` this connector can load now
        (0 when the first is not there). Cheap: no block data is read."""

    @abstractmethod
    def load(self, keys: Sequence[str]) -> list[torch.Tensor]:
        """Scheduler side: the blocks of ``keys`` (host tensors of :attr:`layout`), in
        order; fewer (the leading ones it could get, with a warning) when one is missing,
        short or late. Never raises for a block it cannot get."""

    @abstractmethod
    def save(self, keys: Sequence[str], blocks: Sequence[torch.Tensor]) -> None:
        """Worker side: store ``blocks`` (host tensors of :attr:`layout`) under ``keys``;
        a block another engine stored already may be skipped. A block readable by
        :meth:`lookup` must be whole (write aside, then publish)."""

    def close(self) -> None:
        """The engine stops: release threads, sockets, processes."""
        return
