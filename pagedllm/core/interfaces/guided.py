"""The guided-decoding extension point (``--guided-decoding-backend``).

A backend compiles a constraint (JSON schema, regex, choices, grammar) once for the
engine's tokenizer; every request (every sequence of it) then gets its own matcher from
the compiled constraint. The engine keeps one bitmask for the batch, ``int32``
``[rows, ceil(vocab / 32)]``: bit ``t % 32`` of word ``t // 32`` set means token ``t`` is
allowed. Each matcher fills its row in place, so the whole batch is masked in one pass.
"""

from __future__ import annotations

import dataclasses
import pickle
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

ConstraintKind = Literal["json", "json_object", "regex", "choice", "grammar"]


@dataclasses.dataclass(frozen=True, slots=True)
class GuidedOptions:
    """The engine-wide settings (``--guided-decoding-*``) a backend compiles with."""

    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    # A request's own whitespace regex (vLLM's guided_whitespace_pattern), or None.
    whitespace_pattern: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class GuidedConstraint:
    """One request's constraint. ``spec`` is a JSON-schema string (``json``), a regex, a
    grammar (EBNF or Lark), or a tuple of choices, according to ``kind``;
    ``json_object`` has no spec."""

    kind: ConstraintKind
    spec: Any = None


class Grammar(ABC):
    """The per-sequence matcher state of a compiled constraint.

    Contract: :meth:`accept_token` returns ``False`` (and changes nothing) for a token the
    constraint forbids; :meth:`rollback` undoes the last ``num_tokens`` accepted ones;
    :meth:`fill_bitmask` writes the tokens allowed in the current state into row
    ``index`` of the batch bitmask (see the module docstring), the end-of-sequence token
    included once the constraint is satisfied; :meth:`is_terminated` is true once the
    output is complete and only the end of sequence may follow.
    """

    @abstractmethod
    def accept_token(self, token_id: int) -> bool: ...

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Accept several tokens; on a forbidden one, roll the accepted ones back."""
        for count, token in enumerate(token_ids):
            if not self.accept_token(token):
                if count:
                    self.rollback(count)
                return False
        return True

    @abstractmethod
    def rollback(self, num_tokens: int) -> None: ...

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None: ...

    @abstractmethod
    def is_terminated(self) -> bool: ...


class CompiledConstraint(ABC):
    """A constraint compiled for one tokenizer; shared by every request that uses it."""

    @abstractmethod
    def matcher(self) -> Grammar:
        """A fresh matcher at the start of the constraint."""

    def memory_size_bytes(self) -> int:
        """About how much memory this holds, which the engine's compile cache counts
        against ``--guided-decoding-cache-memory``. By default the length of its pickle;
        a backend that can measure its own structures overrides it. Called once, on a
        compile thread."""
        return len(pickle.dumps(self))


class GuidedBackend(ABC):
    """Compiles constraints for one tokenizer.

    Contract: :meth:`compile` raises ``ValueError`` whose message names what is wrong
    with an invalid schema, regex or grammar. It may be slow: the engine runs it in a
    worker process (killed past ``--guided-decoding-compile-timeout`` or
    ``--guided-decoding-compile-memory``) and caches its result per constraint. So the
    class must be importable by its module path, and what :meth:`compile` returns must go
    through :meth:`dump_compiled` in the worker and :meth:`load_compiled` in the engine
    (by default, pickle).
    """

    name: str = ""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)

    @abstractmethod
    def unsupported_reason(self, constraint: GuidedConstraint) -> str | None:
        """``None`` if this backend handles ``constraint``, else why not."""

    @abstractmethod
    def compile(self, constraint: GuidedConstraint, options: GuidedOptions) -> CompiledConstraint:
        """Compile ``constraint``."""

    def warm_up(self) -> None:
        """Prepare what every compile needs (e.g. the vocabulary), before the first
        compile's time limit starts. Optional."""
        return None

    def dump_compiled(self, compiled: CompiledConstraint) -> bytes:
        """``compiled`` as bytes, to leave the worker process."""
        return pickle.dumps(compiled)

    def load_compiled(self, data: bytes) -> CompiledConstraint:
        """The compiled constraint :meth:`dump_compiled` made ``data`` from."""
        return pickle.loads(data)
