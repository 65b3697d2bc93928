"""Declarative command-line arguments derived from dataclass fields.

Every engine or server option is one dataclass field declared with :func:`arg`, which
records its help text, its group (the config object it feeds), its choices and whether
the feature behind it exists yet. :func:`add_dataclass_args` turns those fields into
``argparse`` options, so the flag, its default, its type and its documentation live in
one place.
"""

from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import json
import numbers
import os
import re
import reprlib
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, Literal

META_KEY = "pagedllm"

BoolStyle = Literal["optional", "store_true"]


@dataclasses.dataclass(frozen=True, slots=True)
class ArgMeta:
    """What the CLI needs to know about one dataclass field."""

    group: str
    help: str
    choices: tuple[Any, ...] | None = None
    # Choices are the names in this plugin registry (plus ``extra_choices``).
    registry: str | None = None
    extra_choices: tuple[str, ...] = ()
    # Validate registry choices after parsing instead of in argparse (used where a
    # later option, such as --tool-parser-plugin, can add names).
    validate_after_parse: bool = False
    aliases: tuple[str, ...] = ()
    nargs: str | None = None
    # Parses one command-line string into the field's value.
    parse: Callable[[str], Any] | None = None
    bool_style: BoolStyle = "optional"
    # Accepted by the parser, refused at start-up when set to a non-default value.
    unbuilt: str | None = None
    # Accepted with a warning; the text says what replaced it.
    deprecated: str | None = None
    # With ``deprecated``: a non-default value is copied onto this other field.
    alias_of: str | None = None
    # Accepted by the parser (so the user gets a useful message) but refused when set:
    # the text says what replaced it.
    removed: str | None = None
    metavar: str | None = None
    # Not shown as a flag (set only from Python).
    cli: bool = True
    # Each use of the flag adds its values to the list (``--middleware A --middleware B``).
    append: bool = False


def arg(
    default: Any = None,
    *,
    group: str,
    help: str,
    **meta: Any,
) -> Any:
    """A dataclass field carrying CLI metadata; mutable defaults are copied per instance."""
    metadata = {META_KEY: ArgMeta(group=group, help=help, **meta)}
    if isinstance(default, list | dict | set):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def field_meta(field: dataclasses.Field) -> ArgMeta | None:
    return field.metadata.get(META_KEY)


def field_default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def option_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


# ---------------------------------------------------------------------------- parsers


_HUMAN_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def human_int(text: str) -> int:
    """``1k`` = 1000, ``1K`` = 1024, ``25.6k`` = 25600; plain integers as they are."""
    text = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG]?)", text)
    if not match:
        raise argparse.ArgumentTypeError(
            f"expected an integer, optionally with a k/m/g/K/M/G suffix, got {text!r}"
        )
    number, suffix = match.groups()
    value = float(number) * _HUMAN_SUFFIXES.get(suffix, 1)
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens")
    return int(value)


def json_dict(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def optional_str(text: str) -> str | None:
    """``None``/``none`` on the command line means no value."""
    return None if text in ("None", "none", "") else text


def optional_int(text: str) -> int | None:
    return None if text in ("None", "none") else int(text)


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _is_callable_type(annotation: Any) -> bool:
    return annotation is collections.abc.Callable or (
        typing.get_origin(annotation) is collections.abc.Callable
    )


def _strip_optional(annotation: Any) -> Any:
    """The type a command-line value has: ``None`` and callables (which only Python
    callers can give, e.g. ``hf_overrides``) are left out of a union."""
    if _is_union(annotation):
        args = [
            a
            for a in typing.get_args(annotation)
            if a is not type(None) and not _is_callable_type(a)
        ]
        if len(args) == 1:
            return args[0]
        return annotation
    return annotation


def _scalar_parser(annotation: Any) -> Callable[[str], Any]:
    base = _strip_optional(annotation)
    origin = typing.get_origin(base)
    if origin in (list, tuple):
        inner = typing.get_args(base)
        return _scalar_parser(inner[0]) if inner else str
    if origin is dict or base is dict:
        return json_dict
    if base is int:
        return int
    if base is float:
        return float
    return str


def _is_bool(annotation: Any) -> bool:
    return _strip_optional(annotation) is bool


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(_strip_optional(annotation)) in (list, tuple)


def _is_dict(annotation: Any) -> bool:
    base = _strip_optional(annotation)
    return base is dict or typing.get_origin(base) is dict


def format_value(value: Any) -> str:
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value)


# ----------------------------------------------------------------------- the builder


@dataclasses.dataclass(slots=True)
class ArgInfo:
    """One option as registered on a parser, kept for ``--help=`` and YAML configs."""

    dest: str
    option: str
    group: str
    help: str
    default: Any
    is_bool: bool
    bool_style: BoolStyle
    is_list: bool
    is_dict: bool
    aliases: tuple[str, ...]


def add_dataclass_args(
    parser: argparse.ArgumentParser,
    cls: type,
    registry_choices: Callable[[str], Sequence[str]] | None = None,
    *,
    skip: Sequence[str] = (),
) -> list[ArgInfo]:
    """Add one option per annotated field of ``cls`` (grouped by ``ArgMeta.group``)."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, argparse._ArgumentGroup] = {}
    infos: list[ArgInfo] = []
    for field in dataclasses.fields(cls):
        meta = field_meta(field)
        if meta is None or not meta.cli or field.name in skip:
            continue
        annotation = hints[field.name]
        default = field_default(field)
        group = groups.get(meta.group)
        if group is None:
            group = groups[meta.group] = _find_or_add_group(parser, meta.group)
        option = option_name(field.name)
        names = [option, *meta.aliases]
        kwargs: dict[str, Any] = {"dest": field.name, "default": default}
        help_text = meta.help
        if meta.deprecated:
            help_text = f"[DEPRECATED] {meta.deprecated}. {help_text}".strip()
        elif meta.removed:
            help_text = f"[REMOVED] {help_text} Now: {meta.removed}."
        elif meta.unbuilt:
            help_text = f"{help_text} [not supported by pagedllm yet]"
        if _is_bool(annotation):
            if meta.bool_style == "store_true":
                kwargs["action"] = "store_true"
            else:
                kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = meta.parse or _scalar_parser(annotation)
            choices = _choices(meta, registry_choices)
            if choices is not None:
                if meta.validate_after_parse:
                    kwargs["metavar"] = "{" + ",".join(map(str, choices)) + "}"
                else:
                    kwargs["choices"] = choices
            if meta.append:
                # argparse copies the default list before appending to it.
                kwargs["action"] = "append"
            elif meta.nargs:
                kwargs["nargs"] = meta.nargs
            elif _is_list(annotation):
                kwargs["nargs"] = "+"
            if meta.metavar:
                kwargs["metavar"] = meta.metavar
        kwargs["help"] = f"{help_text} (default: {format_value(default)})"
        group.add_argument(*names, **kwargs)
        infos.append(
            ArgInfo(
                dest=field.name,
                option=option,
                group=meta.group,
                help=help_text,
                default=default,
                is_bool=_is_bool(annotation),
                bool_style=meta.bool_style,
                is_list=_is_list(annotation),
                is_dict=_is_dict(annotation),
                aliases=meta.aliases,
            )
        )
    json_dests = getattr(parser, "json_dests", None)
    if json_dests is not None:
        json_dests.update(info.dest for info in infos if info.is_dict)
    return infos


def _choices(
    meta: ArgMeta, registry_choices: Callable[[str], Sequence[str]] | None
) -> list[Any] | None:
    if meta.registry is not None:
        names = list(registry_choices(meta.registry)) if registry_choices else []
        return [*meta.extra_choices, *[n for n in names if n not in meta.extra_choices]]
    if meta.choices is not None:
        return list(meta.choices)
    return None


def _find_or_add_group(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def dataclass_kwargs(cls: type, namespace: argparse.Namespace) -> dict[str, Any]:
    """The field values of ``cls`` found in a parsed namespace."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    return {k: v for k, v in vars(namespace).items() if k in names}


def non_default_fields(instance: Any) -> dict[str, Any]:
    """Fields whose value differs from the declared default."""
    changed = {}
    for field in dataclasses.fields(instance):
        value = getattr(instance, field.name)
        if value != field_default(field):
            changed[field.name] = value
    return changed


# ------------------------------------------------------------- checks on the values


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80


def _value_matches(value: Any, annotation: Any) -> bool:
    """Whether ``value`` fits ``annotation``, accepting what a Python caller reasonably
    passes: an int for a float, a tuple for a list, one item for a list of such items."""
    if annotation is Any:
        return True
    if annotation is None or annotation is type(None):
        return value is None
    if _is_union(annotation):
        return any(_value_matches(value, a) for a in typing.get_args(annotation))
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return value in typing.get_args(annotation)
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if _is_callable_type(annotation):
        return callable(value)
    if origin in (list, tuple) or annotation in (list, tuple):
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        item = args[0] if len(args) == 1 or origin is list else Any
        if isinstance(value, list | tuple):
            return all(_value_matches(v, item) for v in value)
        return item is not Any and _value_matches(value, item)
    if origin is dict or annotation is dict:
        return isinstance(value, collections.abc.Mapping)
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True  # an annotation this check does not understand is not checked


_TYPE_NAMES = {bool: "a bool", int: "an int", float: "a number", str: "a string"}
_PLURAL_NAMES = {bool: "bools", int: "ints", float: "numbers", str: "strings"}


def describe_type(annotation: Any) -> str:
    """``int | None`` -> ``an int or None``, ``list[str]`` -> ``a list of strings``."""
    if annotation is Any:
        return "any value"
    if annotation is None or annotation is type(None):
        return "None"
    if _is_union(annotation):
        args = typing.get_args(annotation)
        # None last: "an int or None".
        args = sorted(args, key=lambda a: a is type(None))
        names = [describe_type(a) for a in args]
        return ", ".join(names[:-1]) + " or " + names[-1]
    if annotation in _TYPE_NAMES:
        return _TYPE_NAMES[annotation]
    if _is_callable_type(annotation):
        return "a callable"
    origin = typing.get_origin(annotation)
    if origin in (list, tuple) or annotation in (list, tuple):
        args = typing.get_args(annotation)
        item = args[0] if args else Any
        kind = "list" if (origin or annotation) is list else "tuple"
        if item is Any:
            return f"a {kind}"
        return f"a {kind} of {_PLURAL_NAMES.get(item, describe_type(item))}"
    if origin is dict or annotation is dict:
        return "a dict"
    if origin is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(annotation)))
    return f"a {getattr(annotation, '__name__', annotation)}"


def _annotation_has_str(annotation: Any) -> bool:
    if _is_union(annotation):
        return any(a is str for a in typing.get_args(annotation))
    return annotation is str


def check_field_types(instance: Any) -> list[str]:
    """One message per field whose value does not fit the field's declared type, naming
    the field, the value and the type (``seed='abc' is not an int or None``).

    Values given on the command line were converted by the parser already; this catches
    Python callers (``LLM(model, seed="abc")``). A path object given for a string field
    is converted to ``str``.
    """
    hints = typing.get_type_hints(type(instance))
    problems = []
    for field in dataclasses.fields(instance):
        if not field.init or field.name not in hints:
            continue
        annotation = hints[field.name]
        value = getattr(instance, field.name)
        if isinstance(value, os.PathLike) and _annotation_has_str(annotation):
            value = os.fspath(value)
            setattr(instance, field.name, value)
        if not _value_matches(value, annotation):
            problems.append(f"{field.name}={_REPR.repr(value)} is not {describe_type(annotation)}")
    return problems


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

    A deprecated alias (``alias_of``) of such a field is refused under its own name, the
    flag the user typed; call this before :func:`apply_deprecated_aliases` copies it.
    """
    fields = {field.name: field for field in dataclasses.fields(instance)}
    problems = []
    for field in fields.values():
        meta = field_meta(field)
        if meta is None:
            continue
        note = ""
        if meta.alias_of is not None and meta.alias_of in fields:
            note = f" (a deprecated alias of {option_name(meta.alias_of)})"
            meta = field_meta(fields[meta.alias_of])
            if meta is None:
                continue
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
