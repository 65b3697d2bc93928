"""The declaration of one option: :func:`arg` puts an :class:`ArgMeta` on a dataclass field.

Everything the command line, ``--help`` and validation need to know about an option is
declared here, next to its default: its group, choices, numeric range, the values
pagedllm supports among the valid ones, and why it refuses the others. An option that
feeds a config field takes its range and choices from that field's declaration
(``arg(of=CacheConfig.option("block_size"), ...)``), so they are declared once. Code
that needs to know whether a user set an option compares with :func:`declared_default`,
not a literal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

from pagedllm.core.configs.base import Bound, ConfigOption

# (an option's value as a user writes it: the configs format their errors with it too)
from pagedllm.core.configs.base import format_value as format_value

META_KEY = "pagedllm"

BoolStyle = Literal["optional", "store_true"]

# The ArgMeta fields an option feeding a config field takes from the config's declaration.
_VALID_FIELDS = ("min", "max", "min_exclusive", "range_hint", "choices")


@dataclasses.dataclass(frozen=True, slots=True)
class ArgMeta:
    """What the CLI and the checks need to know about one dataclass field."""

    group: str
    help: str
    choices: tuple[Any, ...] | None = None
    # Choices are the names in this plugin registry (plus ``extra_choices``).
    registry: str | None = None
    extra_choices: tuple[str, ...] = ()
    # Validate registry choices after parsing instead of in argparse (used where a
    # later option, such as --tool-parser-plugin, can add names).
    validate_after_parse: bool = False
    # A value with a dot or a colon is a class path (checked where it is imported), not
    # a registry name.
    class_path: bool = False
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
    # A vLLM switch that turns off something pagedllm never does: accepted, and when set
    # logged with this text (why setting it changes nothing).
    no_op: str | None = None
    metavar: str | None = None
    # Not shown as a flag (set only from Python).
    cli: bool = True
    # Each use of the flag adds its values to the list (``--middleware A --middleware B``).
    append: bool = False
    # Inclusive range of a number (``min`` is exclusive with ``min_exclusive``). A bound
    # may name another field (``max="max_num_partial_prefills"``). ``None`` values are
    # not checked: they mean "unset". An option that feeds a config field takes these and
    # ``choices`` from the config's declaration (``arg(of=...)``), never restating them.
    min: Bound = None
    max: Bound = None
    min_exclusive: bool = False
    # Why an out-of-range value is invalid; derived from the bounds when not given.
    range_hint: str | None = None
    # The valid values pagedllm honours (the declared default always is); any other is
    # refused with ``unsupported``, a format string that may use {option}, {value} and
    # {supported} (the supported values joined by "or").
    supported: tuple[Any, ...] | None = None
    unsupported: str | None = None

    def __post_init__(self) -> None:
        if (self.supported is None) != (self.unsupported is None):
            raise TypeError("arg(): supported= and unsupported= are declared together")


def arg(
    default: Any = dataclasses.MISSING,
    *,
    group: str,
    help: str,
    of: ConfigOption | None = None,
    **meta: Any,
) -> Any:
    """A dataclass field carrying CLI metadata; mutable defaults are copied per instance.

    ``of=SomeConfig.option(name)``: the option feeds that config field, and takes its
    range and choices from the field's declaration (so the command line checks what the
    config checks), and its default unless ``default`` is given (``None``: unset, the
    value is computed where the config is built). Without ``default`` or ``of``, the
    default is ``None``.
    """
    if of is not None:
        restated = sorted(set(_VALID_FIELDS) & set(meta))
        if restated:
            raise TypeError(
                f"arg(of={of.config.__name__}.option({of.name!r})): {', '.join(restated)} "
                "are declared on the config field, not restated here"
            )
        if of.valid is not None:
            valid = of.arg_valid()
            meta.update({name: getattr(valid, name) for name in _VALID_FIELDS})
        if default is dataclasses.MISSING:
            default = of.default
    if default is dataclasses.MISSING:
        default = None
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


def declared_default(cls: type | Any, name: str) -> Any:
    """The default declared for field ``name`` of the dataclass ``cls`` (or instance)."""
    return field_default(cls.__dataclass_fields__[name])


def is_default(instance: Any, name: str) -> bool:
    """Whether ``instance.name`` still holds the declared default (the user left it out)."""
    return getattr(instance, name) == declared_default(instance, name)


def option_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")
