"""The guided-decoding extension point (``--guided-decoding-backend``)."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

ConstraintKind = Literal["json", "json_object", "regex", "choice", "grammar"]


@dataclasses.dataclass(frozen=True, slots=True)
class GuidedConstraint:
    """One request's constraint. ``spec`` is a JSON-schema string, a regex, a grammar, or
    a tuple of choices, according to ``kind``."""

    kind: ConstraintKind
    spec: Any


class Grammar(ABC):
    """The per-request matcher state of a compiled constraint.

    Contract: :meth:`accept_tokens` returns ``False`` (and changes nothing) for a token
    the constraint forbids; :meth:`rollback` undoes the last ``num_tokens`` accepted
    ones; :meth:`fill_bitmask` writes the allowed tokens of the current state into row
    ``index`` of a batch bitmask.
    """

    @abstractmethod
    def accept_tokens(self, token_ids: Sequence[int]) -> bool: ...

    @abstractmethod
    def rollback(self, num_tokens: int) -> None: ...

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None: ...

    @abstractmethod
    def is_terminated(self) -> bool: ...


class GuidedBackend(ABC):
    """Compiles constraints for one tokenizer.

    Contract: :meth:`compile` raises ``ValueError`` whose message names what is wrong
    with an invalid schema, regex or grammar; it may be slow and is run off the engine
    loop, and its result is cached by the caller per constraint.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, options: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.options = options

    @abstractmethod
    def unsupported_reason(self, constraint: GuidedConstraint) -> str | None:
        """``None`` if this backend handles ``constraint``, else why not."""

    @abstractmethod
    def compile(self, constraint: GuidedConstraint) -> Grammar:
        """A fresh matcher for ``constraint``."""
