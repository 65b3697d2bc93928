"""A guided-decoding backend for ``choice`` constraints only: the output is exactly one
of the choices, spelled the way the tokenizer spells it. Other constraint kinds fall
back to the next backend."""

from __future__ import annotations

import torch

from pagedllm.core.interfaces import CompiledConstraint, Grammar, GuidedBackend


# [docs:guided_backend]
class ChoiceMatcher(Grammar):
    """Where one sequence is: the tokens it accepted so far."""

    def __init__(self, compiled: CompiledChoices) -> None:
        self.compiled = compiled
        self.accepted: list[int] = []
        self.ended = False  # the end of sequence was accepted

    def _complete(self) -> bool:
        return tuple(self.accepted) in self.compiled.sequences

    def allowed(self) -> set[int]:
        if self.ended:
            return set()
        n = len(self.accepted)
        allowed = {
            seq[n]
            for seq in self.compiled.sequences
            if len(seq) > n and list(seq[:n]) == self.accepted
        }
        if self._complete():
            allowed.update(self.compiled.eos_token_ids)
        return allowed

    def accept_token(self, token_id):
        if token_id not in self.allowed():
            return False
        if token_id in self.compiled.eos_token_ids and self._complete():
            self.ended = True
        else:
            self.accepted.append(token_id)
        return True

    def rollback(self, num_tokens):
        for _ in range(num_tokens):
            if self.ended:
                self.ended = False
            else:
                self.accepted.pop()

    def fill_bitmask(self, bitmask, index):
        # Bit t % 32 of int32 word t // 32; the engine zeroed the row.
        words = [0] * bitmask.shape[1]
        for token in self.allowed():
            words[token // 32] |= 1 << (token % 32)
        signed = [w - (1 << 32) if w >= 1 << 31 else w for w in words]
        bitmask[index] = torch.tensor(signed, dtype=torch.int32)

    def is_terminated(self):
        only_eos = self.allowed() <= set(self.compiled.eos_token_ids)
        return self.ended or (self._complete() and only_eos)


class CompiledChoices(CompiledConstraint):
    """The token ids of every choice. Pickled from the compile worker to the engine."""

    def __init__(self, sequences: tuple[tuple[int, ...], ...], eos_token_ids: tuple[int, ...]):
        self.sequences = sequences
        self.eos_token_ids = eos_token_ids

    def matcher(self):
        return ChoiceMatcher(self)


class ChoiceBackend(GuidedBackend):
    name = "dummy_choice"

    def unsupported_reason(self, constraint):
        if constraint.kind != "choice":
            return f"dummy_choice compiles choice constraints only, not {constraint.kind}"
        return None

    def compile(self, constraint, options):
        sequences = []
        for choice in constraint.spec:
            ids = self.tokenizer.encode(choice, add_special_tokens=False)
            if not ids:
                raise ValueError(f"choice {choice!r} has no tokens")
            sequences.append(tuple(ids))
        return CompiledChoices(tuple(sequences), self.eos_token_ids)


# [/docs:guided_backend]
