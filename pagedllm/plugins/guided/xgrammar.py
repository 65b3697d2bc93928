"""The ``xgrammar`` guided-decoding backend: JSON schemas, JSON objects, regexes,
choices and context-free grammars (EBNF, or Lark), compiled by ``xgrammar`` into a
pushdown automaton with per-state token masks."""

from __future__ import annotations

import json
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
    without_additional_properties,
)

# Lark's rule syntax ("name: ..."/"?name: ..."), which EBNF ("name ::= ...") never uses.
_LARK_RULE = re.compile(r"^\s*[?!]?[a-z_][a-z_0-9]*\s*:(?!:)", re.M)


class XGrammarMatcher(Grammar):
    def __init__(self, compiled: Any) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)

    def accept_token(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, index)

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


class XGrammarCompiled(CompiledConstraint):
    def __init__(self, compiled: Any, serialized_size: int = 0) -> None:
        self.compiled = compiled
        # The length of the JSON it was loaded from (0: compiled in this process).
        self.serialized_size = serialized_size

    def matcher(self) -> Grammar:
        return XGrammarMatcher(self.compiled)

    def memory_size_bytes(self) -> int:
        # xgrammar's own count is right for a grammar compiled here, but one loaded from
        # JSON (from a compile worker) holds a copy of the whole grammar's automaton per
        # rule, which that count leaves out: a depth-200 nested schema on SmolLM2's
        # vocabulary counts 1.06 MB, while loading it kept 14.8 MB and its JSON is 16.1 MB.
        # The JSON's length is the closer (and not smaller) measure there.
        return max(int(self.compiled.memory_size_bytes), self.serialized_size)


class XGrammarBackend(GuidedBackend):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size, eos_token_ids) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        self._info: Any = None
        self._compiler: Any = None

    def unsupported_reason(self, constraint: GuidedConstraint) -> str | None:
        return None

    def tokenizer_info(self) -> Any:
        if self._info is None:
            import xgrammar as xgr

            from pagedllm.core.tokenizer import JSONTokenizer

            tokenizer = self.tokenizer
            if isinstance(tokenizer, JSONTokenizer):  # xgrammar reads transformers' own
                tokenizer = tokenizer.to_transformers()
            self._info = xgr.TokenizerInfo.from_huggingface(
                tokenizer,
                vocab_size=self.vocab_size,
                stop_token_ids=list(self.eos_token_ids) or None,
            )
        return self._info

    def compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            # The engine caches compiled constraints itself.
            self._compiler = xgr.GrammarCompiler(self.tokenizer_info(), cache_enabled=False)
        return self._compiler

    def warm_up(self) -> None:
        self.compiler()

    def dump_compiled(self, compiled: CompiledConstraint) -> bytes:
        assert isinstance(compiled, XGrammarCompiled)
        return compiled.compiled.serialize_json().encode()

    def load_compiled(self, data: bytes) -> CompiledConstraint:
        import xgrammar as xgr

        grammar = xgr.CompiledGrammar.deserialize_json(data.decode(), self.tokenizer_info())
        return XGrammarCompiled(grammar, serialized_size=len(data))

    def compile(self, constraint: GuidedConstraint, options: GuidedOptions) -> CompiledConstraint:
        compiler = self.compiler()
        any_whitespace = not options.disable_any_whitespace
        try:
            if constraint.kind == "json":
                schema = json.loads(constraint.spec)
                if options.disable_additional_properties:
                    schema = without_additional_properties(schema)
                compiled = compiler.compile_json_schema(
                    json.dumps(schema), any_whitespace=any_whitespace
                )
            elif constraint.kind == "json_object":
                # OpenAI's json_object is an object; the builtin JSON grammar also allows
                # arrays, strings and numbers at the top.
                compiled = compiler.compile_json_schema(
                    json.dumps(JSON_OBJECT), any_whitespace=any_whitespace
                )
            elif constraint.kind == "regex":
                compiled = compiler.compile_regex(constraint.spec)
            elif constraint.kind == "choice":
                compiled = compiler.compile_regex(choice_regex(constraint.spec))
            elif _LARK_RULE.search(constraint.spec):
                compiled = compiler.compile_lark(constraint.spec)
            else:
                compiled = compiler.compile_grammar(constraint.spec)
        except (RuntimeError, ValueError) as exc:
            what = {"json": "JSON schema", "grammar": "grammar"}.get(constraint.kind, "regex")
            raise ValueError(f"invalid {what}: {_first_line(exc)}") from None
        return XGrammarCompiled(compiled)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
