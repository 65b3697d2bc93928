"""Declarative command-line arguments derived from dataclass fields.

Every engine or server option is one dataclass field declared with :func:`arg`, which
records its help text, its group (the config object it feeds), its choices, its range,
the values pagedllm supports and whether the feature behind it exists yet (see
:mod:`pagedllm.core.args.spec`). :func:`add_dataclass_args` turns those fields into
``argparse`` options, so the flag, its default, its type and its documentation live in
one place; the checks on the values are in :mod:`pagedllm.core.args.checks`.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Sequence
from typing import Any

from pagedllm.core.args.annotations import is_bool as _is_bool
from pagedllm.core.args.annotations import is_dict as _is_dict
from pagedllm.core.args.annotations import is_list as _is_list
from pagedllm.core.args.annotations import strip_optional as _strip_optional
from pagedllm.core.args.checks import (
    apply_deprecated_aliases,
    check_field_types,
    invalid_choices,
    invalid_values,
    refused_fields,
)

# (the option parsers live in args/parsers.py; named in __all__ for the callers of argspec)
from pagedllm.core.args.parsers import (
    human_int,
    json_dict,
    json_or_key_values,
    optional_int,
    optional_str,
)
from pagedllm.core.args.spec import (
    META_KEY,
    ArgMeta,
    BoolStyle,
    arg,
    declared_default,
    field_default,
    field_meta,
    format_value,
    is_default,
    option_name,
)

__all__ = [
    "META_KEY",
    "ArgInfo",
    "ArgMeta",
    "BoolStyle",
    "add_dataclass_args",
    "apply_deprecated_aliases",
    "arg",
    "check_field_types",
    "dataclass_kwargs",
    "declared_default",
    "field_default",
    "field_meta",
    "format_value",
    "human_int",
    "invalid_choices",
    "invalid_values",
    "is_default",
    "json_dict",
    "json_or_key_values",
    "non_default_fields",
    "option_name",
    "optional_int",
    "optional_str",
    "refused_fields",
]


# ---------------------------------------------------------------------------- parsers


def _none_or(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``None`` on the command line unsets an optional value, as in vLLM (and in its YAML
    files: ``quantization: None``)."""

    def parse_or_none(text: str) -> Any:
        return None if text in ("None", "none") else parse(text)

    parse_or_none.__name__ = getattr(parse, "__name__", "value")
    return parse_or_none


def _items_of(parse: Callable[[str], Any], choices: list[Any]) -> Callable[[str], list[Any]]:
    """One command-line value of a list option with choices: one item, or several
    separated by commas (``--collect-detailed-traces model,worker``)."""

    def items(text: str) -> list[Any]:
        values = [parse(part.strip()) for part in text.split(",")]
        for value in values:
            if value not in choices:
                raise argparse.ArgumentTypeError(
                    f"invalid choice: {value!r} (choose from {', '.join(map(str, choices))})"
                )
        return values

    return items


class _ItemsAction(argparse.Action):
    """Stores the items of every value as one list; ``None`` alone unsets the option."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        items = [item for value in values for item in value if item is not None]
        setattr(namespace, self.dest, items or None)


def _is_optional(annotation: Any) -> bool:
    return type(None) in typing.get_args(annotation)


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
        elif meta.no_op:
            help_text = f"{help_text} [accepted; changes nothing: {meta.no_op}]"
        if _is_bool(annotation):
            if meta.bool_style == "store_true":
                kwargs["action"] = "store_true"
            else:
                kwargs["action"] = argparse.BooleanOptionalAction
        else:
            parse = meta.parse or _scalar_parser(annotation)
            choices = _choices(meta, registry_choices)
            if _is_optional(annotation) and (choices is not None or not _is_list(annotation)):
                parse = _none_or(parse)
                choices = None if choices is None else [*choices, None]
            kwargs["type"] = parse
            if choices is not None and _is_list(annotation) and not meta.append:
                kwargs["type"] = _items_of(parse, choices)
                kwargs["action"] = _ItemsAction
                kwargs["metavar"] = "{" + ",".join(map(str, choices)) + "}"
                choices = None
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
