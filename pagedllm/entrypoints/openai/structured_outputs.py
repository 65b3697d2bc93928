"""vLLM's ``structured_outputs`` request field (its ``StructuredOutputsParams``, which
replaced the ``guided_*`` fields), read into ``GuidedDecodingParams`` fields."""

from __future__ import annotations

from typing import Any

# Keys that name the constraint, or the pattern JSON whitespace must match: passed on as is.
CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
PASSED_KEYS = (*CONSTRAINT_KEYS, "whitespace_pattern")
# Options the server sets for every request (--guided-decoding-<name>); a request may only
# leave them false.
SERVER_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties")
# The guided_* fields that spell the same things.
GUIDED_FIELDS = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_whitespace_pattern",
)


def structured_fields(value: dict[str, Any], guided_given: list[str]) -> dict[str, Any]:
    """The ``GuidedDecodingParams`` fields ``structured_outputs`` asks for (unset keys are
    left out). ``guided_given``: the ``guided_*`` fields the request also sets."""
    if guided_given:
        raise ValueError(
            "structured_outputs and guided_* spell the same constraint; give one or the "
            f"other (got structured_outputs and {', '.join(guided_given)})"
        )
    unknown = sorted(set(value) - {*PASSED_KEYS, *SERVER_OPTIONS})
    if unknown:
        raise ValueError(
            f"structured_outputs: unknown key(s) {', '.join(unknown)} (valid: "
            f"{', '.join((*PASSED_KEYS, *SERVER_OPTIONS))})"
        )
    for name in SERVER_OPTIONS:
        if value.get(name) not in (None, False):
            flag = "--guided-decoding-" + name.replace("_", "-")
            raise ValueError(
                f"structured_outputs.{name} is not supported per request; start the server "
                f"with {flag}"
            )
    fields = {key: value[key] for key in PASSED_KEYS if value.get(key) is not None}
    if fields.get("json_object") is False:
        del fields["json_object"]
    if not any(key in fields for key in CONSTRAINT_KEYS):
        raise ValueError(
            f"structured_outputs needs one of {', '.join(CONSTRAINT_KEYS[:-1])} "
            f"(got {', '.join(sorted(value)) or 'none'})"
        )
    return fields
