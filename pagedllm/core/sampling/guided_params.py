"""``GuidedDecodingParams``: what a request's output must match (vLLM's API)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pagedllm.core.interfaces.guided import GuidedConstraint

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclasses.dataclass(slots=True)
class GuidedDecodingParams:
    """Exactly one of ``json`` (a JSON schema, as a dict or a string), ``regex``,
    ``choice`` (a list of strings), ``grammar`` (EBNF or Lark) or ``json_object`` (any
    JSON object). ``backend`` names a guided-decoding backend for this request (default:
    ``--guided-decoding-backend``); ``whitespace_pattern`` is the regex JSON whitespace
    must match (outlines only)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    backend: str | None = None
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "guided decoding takes exactly one of json, regex, choice, grammar, "
                f"json_object; got {', '.join(given) or 'none'}"
            )
        if self.structural_tag is not None:
            raise ValueError("guided decoding with structural_tag is not supported")
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError("guided json must be a JSON schema (a dict or a JSON string)")
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple) or not self.choice:
                raise ValueError("guided choice must be a non-empty list of strings")
            if not all(isinstance(c, str) for c in self.choice):
                raise ValueError("guided choice must contain only strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"guided {name} must be a non-empty string")

    @staticmethod
    def from_optional(
        json: str | dict | None = None,
        regex: str | None = None,
        choice: list[str] | None = None,
        grammar: str | None = None,
        json_object: bool | None = None,
        backend: str | None = None,
        whitespace_pattern: str | None = None,
        structural_tag: str | None = None,
    ) -> GuidedDecodingParams | None:
        """``None`` when nothing is constrained, else the params (vLLM's helper)."""
        if all(v in (None, False) for v in (json, regex, choice, grammar, json_object)):
            if structural_tag is None:
                return None
        return GuidedDecodingParams(
            json=json,
            regex=regex,
            choice=choice,
            grammar=grammar,
            json_object=json_object,
            backend=backend,
            whitespace_pattern=whitespace_pattern,
            structural_tag=structural_tag,
        )

    def constraint(self) -> GuidedConstraint:
        """The backend-neutral constraint (a JSON schema as a canonical string)."""
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"guided json is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise ValueError("guided json must be a JSON schema object")
            _refuse_external_refs(schema)
            # Key order is kept: it is the order the properties are generated in.
            return GuidedConstraint("json", json.dumps(schema))
        if self.regex is not None:
            return GuidedConstraint("regex", self.regex)
        if self.choice is not None:
            return GuidedConstraint("choice", tuple(self.choice))
        if self.grammar is not None:
            return GuidedConstraint("grammar", self.grammar)
        return GuidedConstraint("json_object")


# Keywords that point at another schema; those whose values are data, not schemas; and
# those whose values map names (which may be anything, "$ref" too) to schemas.
_REF_KEYWORDS = ("$ref", "$dynamicRef", "$recursiveRef")
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
_SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


def _refuse_external_refs(node: Any) -> None:
    """Refuse a reference that is not a pointer into the schema itself (``#...``): a
    backend would fetch it (a file or a URL on the server) or silently drop the
    constraint; none is ever fetched."""
    if isinstance(node, list):
        for item in node:
            _refuse_external_refs(item)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in _REF_KEYWORDS and isinstance(value, str) and not value.startswith("#"):
            raise ValueError(
                f"guided json: {key} {value!r} is not a local reference; only pointers into "
                f"the schema itself ('#', '#/$defs/...') are allowed, and no schema is fetched"
            )
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for schema in value.values():
                _refuse_external_refs(schema)
        elif key not in _DATA_KEYWORDS:
            _refuse_external_refs(value)


def as_guided_params(value: Any) -> GuidedDecodingParams | None:
    """``SamplingParams.guided_decoding`` as given: the params, a dict of their fields,
    or None."""
    if value is None or isinstance(value, GuidedDecodingParams):
        return value
    if isinstance(value, dict):
        unknown = set(value) - {f.name for f in dataclasses.fields(GuidedDecodingParams)}
        if unknown:
            raise ValueError(f"guided_decoding: unknown field(s) {sorted(unknown)}")
        return GuidedDecodingParams(**value)
    raise ValueError(f"guided_decoding must be a GuidedDecodingParams, got {type(value).__name__}")
