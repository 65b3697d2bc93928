"""The ``outlines`` guided-decoding backend: regular languages (JSON schemas turned into
regexes, regexes, choices) compiled by ``outlines_core`` into a token-level automaton
over the tokenizer's vocabulary. Grammars are not regular; ``auto`` sends them to
another backend."""

from __future__ import annotations

import json
import pickle
import re
from typing import Any

import torch

from pagedllm.core.interfaces import (
    CompiledConstraint,
    Grammar,
    GuidedBackend,
    GuidedConstraint,
    GuidedOptions,
)
from pagedllm.plugins.guided.common import (
    JSON_OBJECT,
    choice_regex,
    token_bytes_vocabulary,
    without_additional_properties,
)

# Rollback depth kept per matcher (speculative decoding would need it).
MAX_ROLLBACK = 32
# Memory an index holds per byte of its pickle (see OutlinesCompiled.memory_size_bytes).
INDEX_MEMORY_PER_PICKLED_BYTE = 3.5


# Keywords outlines_core's schema-to-regex conversion ignores; a schema using them goes
# to a backend that enforces them rather than yield output that fails validation.
UNENFORCED_KEYWORDS = frozenset(
    {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
)


def _keywords(node: Any) -> set[str]:
    """Every key used anywhere in a JSON schema (property names included, harmlessly
    conservative)."""
    if isinstance(node, dict):
        found = set(node)
        for value in node.values():
            found |= _keywords(value)
        return found
    if isinstance(node, list):
        return set().union(*(_keywords(v) for v in node)) if node else set()
    return set()


class OutlinesMatcher(Grammar):
    def __init__(self, index: Any) -> None:
        from outlines_core import Guide

        self.guide = Guide(index, max_rollback=MAX_ROLLBACK)
        self.accepted = 0

    def accept_token(self, token_id: int) -> bool:
        if not self.guide.accepts_tokens([token_id]):
            return False
        self.guide.advance(token_id, return_tokens=False)
        self.accepted += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.guide.rollback_state(num_tokens)
            self.accepted -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        row = bitmask[index]
        self.guide.write_mask_into(row.data_ptr(), row.numel(), row.element_size())

    def is_terminated(self) -> bool:
        # A final state that allows nothing more than the end of sequence.
        if not self.guide.is_finished():
            return False
        return len(self.guide.get_tokens()) <= 1


class OutlinesCompiled(CompiledConstraint):
    def __init__(self, index: Any) -> None:
        self.index = index

    def matcher(self) -> Grammar:
        return OutlinesMatcher(self.index)

    def memory_size_bytes(self) -> int:
        # outlines_core does not measure its index. Its pickle (the serialized transition
        # maps) undercounts the hash maps in memory, whose tables grow by powers of two:
        # on SmolLM2's vocabulary, resident memory grew by 1.6 to 3.5 times the pickle's
        # length over regexes and schemas of 0.3 to 58 MB. The upper end is the estimate,
        # so that the cache stays within its bound.
        return int(len(pickle.dumps(self.index)) * INDEX_MEMORY_PER_PICKLED_BYTE)


class OutlinesBackend(GuidedBackend):
    name = "outlines"

    def __init__(self, tokenizer, vocab_size, eos_token_ids) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        self._vocabulary: Any = None

    def unsupported_reason(self, constraint: GuidedConstraint) -> str | None:
        if constraint.kind == "grammar":
            return "outlines compiles regular languages only (JSON schema, regex, choice)"
        if constraint.kind == "json":
            found = sorted(_keywords(json.loads(constraint.spec)) & UNENFORCED_KEYWORDS)
            if found:
                return f"outlines does not enforce the JSON-schema keywords {', '.join(found)}"
        return None

    def vocabulary(self) -> Any:
        if self._vocabulary is None:
            from outlines_core import Vocabulary

            if not self.eos_token_ids:
                raise ValueError("outlines needs an end-of-sequence token; the model has none")
            tokens = token_bytes_vocabulary(self.tokenizer, set(self.eos_token_ids))
            self._vocabulary = Vocabulary(self.eos_token_ids[0], tokens)
        return self._vocabulary

    def warm_up(self) -> None:
        self.vocabulary()

    def regex(self, constraint: GuidedConstraint, options: GuidedOptions) -> str:
        from outlines_core.json_schema import build_regex_from_schema

        if constraint.kind == "regex":
            return constraint.spec
        if constraint.kind == "choice":
            return choice_regex(constraint.spec)
        schema = json.loads(constraint.spec) if constraint.kind == "json" else JSON_OBJECT
        if options.disable_additional_properties:
            schema = without_additional_properties(schema)
        whitespace = options.whitespace_pattern
        if whitespace is None and options.disable_any_whitespace:
            whitespace = ""
        try:
            return build_regex_from_schema(json.dumps(schema), whitespace_pattern=whitespace)
        except Exception as exc:  # outlines_core raises its own error types
            raise ValueError(f"invalid JSON schema: {exc}") from None

    def compile(self, constraint: GuidedConstraint, options: GuidedOptions) -> CompiledConstraint:
        from outlines_core import Index

        reason = self.unsupported_reason(constraint)
        if reason is not None:
            raise ValueError(reason)
        regex = self.regex(constraint, options)
        try:
            index = Index(regex, self.vocabulary())
        except Exception as exc:  # invalid regex, or one no token sequence can match
            what = "regex" if constraint.kind == "regex" else constraint.kind
            try:  # Python's parser says where a malformed pattern goes wrong
                re.compile(regex)
            except re.error as syntax:
                raise ValueError(f"invalid {what} {regex!r}: {syntax}") from None
            raise ValueError(f"invalid {what} {regex!r}: {exc}") from None
        return OutlinesCompiled(index)
