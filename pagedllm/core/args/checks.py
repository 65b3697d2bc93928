"""The checks every declared option gets, each one loop over a dataclass's fields.

Each returns one message per problem, naming the flag the user gave (a deprecated alias
by its own name, checked against the declaration of the option it stands for), so a
caller can report them all at once. Values given on the command line were parsed
already; these also catch values given from Python (``LLM(model, seed="abc")``).
"""

from __future__ import annotations

import dataclasses
import os
import reprlib
import typing
from collections.abc import Callable, Sequence
from typing import Any

from pagedllm.core.args.annotations import describe_type, has_str, value_matches
from pagedllm.core.args.spec import (
    ArgMeta,
    field_default,
    field_meta,
    format_value,
    option_name,
)
from pagedllm.core.configs.base import invalid_choice, out_of_range

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80


def check_field_types(instance: Any) -> list[str]:
    """One message per field whose value does not fit the field's declared type, naming
    the field, the value and the type (``seed='abc' is not an int or None``).

    A path object given for a string field is converted to ``str``, and a ``torch.dtype``
    to its name (``torch.bfloat16`` -> ``"bfloat16"``, as vLLM's ``LLM(dtype=...)``).
    """
    hints = typing.get_type_hints(type(instance))
    problems = []
    for field in dataclasses.fields(instance):
        if not field.init or field.name not in hints:
            continue
        annotation = hints[field.name]
        value = getattr(instance, field.name)
        if isinstance(value, os.PathLike) and has_str(annotation):
            value = os.fspath(value)
            setattr(instance, field.name, value)
        if _is_torch_dtype(value) and has_str(annotation):
            value = str(value).removeprefix("torch.")
            setattr(instance, field.name, value)
        if not value_matches(value, annotation):
            problems.append(f"{field.name}={_REPR.repr(value)} is not {describe_type(annotation)}")
    return problems


def _is_torch_dtype(value: Any) -> bool:
    # (By name: checking options must not import torch.)
    kind = type(value)
    return kind.__module__ == "torch" and kind.__name__ == "dtype"


def _declared_fields(instance: Any) -> list[tuple[dataclasses.Field, ArgMeta, str]]:
    """Each declared field with the meta that governs its value, and the note naming
    what it is an alias of: a deprecated alias (``alias_of``) is checked by the
    declaration of the option it stands for, under its own name."""
    fields = {field.name: field for field in dataclasses.fields(instance)}
    out = []
    for field in fields.values():
        meta = field_meta(field)
        if meta is None:
            continue
        note = ""
        if meta.alias_of is not None and meta.alias_of in fields:
            target = field_meta(fields[meta.alias_of])
            if target is None:
                continue
            note = f" (a deprecated alias of {option_name(meta.alias_of)})"
            meta = target
        out.append((field, meta, note))
    return out


def apply_deprecated_aliases(instance: Any) -> list[str]:
    """Copy deprecated aliases onto the fields that replaced them; return the warnings."""
    warnings_out = []
    for field in dataclasses.fields(instance):
        meta = field_meta(field)
        if meta is None or meta.deprecated is None:
            continue
        value = getattr(instance, field.name)
        if value == field_default(field):
            continue
        warnings_out.append(f"{option_name(field.name)} is deprecated: {meta.deprecated}")
        if meta.alias_of is not None:
            setattr(instance, meta.alias_of, value)
    return warnings_out


def _is_off(value: Any) -> bool:
    """``None`` and ``False`` both mean a switch is off (``--no-enable-lora`` is fine)."""
    return value is None or value is False


def refused_fields(instance: Any) -> list[str]:
    """One message per field set to a non-default value whose feature is unbuilt or removed.

    Call this before :func:`apply_deprecated_aliases` copies an alias onto its target.
    """
    problems = []
    for field, meta, note in _declared_fields(instance):
        if meta.unbuilt is None and meta.removed is None:
            continue
        value = getattr(instance, field.name)
        default = field_default(field)
        if value == default or (_is_off(value) and _is_off(default)):
            continue
        option = option_name(field.name)
        if meta.removed is not None:
            problems.append(f"{option}{note} was removed: {meta.removed}")
        else:
            problems.append(
                f"{option}={format_value(value)}{note} is not supported by pagedllm yet: "
                f"{meta.unbuilt}"
            )
    return problems


def no_op_fields(instance: Any) -> list[str]:
    """One note per switch set that turns off something pagedllm never does (``no_op``)."""
    notes = []
    for field in dataclasses.fields(instance):
        meta = field_meta(field)
        if meta is None or meta.no_op is None:
            continue
        value = getattr(instance, field.name)
        default = field_default(field)
        if value == default or (_is_off(value) and _is_off(default)):
            continue
        notes.append(f"{option_name(field.name)} changes nothing in pagedllm: {meta.no_op}")
    return notes


def invalid_choices(
    instance: Any, registry_choices: Callable[[str], Sequence[str]] | None = None
) -> list[str]:
    """One message per value outside the field's choices (argparse checks only the CLI).

    ``registry_choices(name)`` lists the names in a plugin registry.
    """
    problems = []
    for field, meta, _ in _declared_fields(instance):
        value = getattr(instance, field.name)
        if value is None:
            continue
        if meta.registry is not None:
            names = registry_choices(meta.registry) if registry_choices is not None else ()
            valid = [*meta.extra_choices, *names]
        elif meta.choices is not None:
            valid = list(meta.choices)
        else:
            continue
        values = value if isinstance(value, list | tuple) else [value]
        for item in values:
            if meta.class_path and isinstance(item, str) and ("." in item or ":" in item):
                continue
            if item not in valid:
                problems.append(invalid_choice(option_name(field.name), item, valid))
    return problems


def _out_of_range(instance: Any, meta: ArgMeta, value: Any) -> str | None:
    """Why ``value`` is outside the declared range, or ``None`` when it is inside."""

    def bound(name: str) -> tuple[Any, str]:
        limit = getattr(instance, name)
        return limit, f"{option_name(name)} ({format_value(limit)})"

    return out_of_range(meta, value, bound)


def invalid_values(instance: Any) -> list[str]:
    """One message per value outside its declared range (``is invalid``), or valid but
    not among the values pagedllm supports (the declared ``unsupported`` refusal).

    ``None`` is never checked: for these options it means "unset".
    """
    problems = []
    for field, meta, note in _declared_fields(instance):
        value = getattr(instance, field.name)
        if value is None:
            continue
        option = option_name(field.name)
        why = _out_of_range(instance, meta, value)
        if why is not None:
            problems.append(f"{option}={format_value(value)}{note} is invalid: {why}")
            continue
        if meta.supported is None or meta.unsupported is None:
            continue
        if value == field_default(field) or value in meta.supported:
            continue
        problems.append(
            meta.unsupported.format(
                option=option + note,
                value=format_value(value),
                supported=" or ".join(map(format_value, meta.supported)),
            )
        )
    return problems
