"""What every configuration object shares: it declares its own defaults and the valid
values of its fields (:func:`setting`), checks its own values (when built, and again
before it is frozen), and is frozen once validated."""

from __future__ import annotations

import copy
import dataclasses
import json
import numbers
from collections.abc import Callable
from typing import Any, ClassVar, Self

from pagedllm.core.errors import ConfigError


def format_value(value: Any) -> str:
    """An option's value as a user writes it (JSON for a dict or a list)."""
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value)


def require(condition: bool, option: str, value: Any, why: str) -> None:
    """Raise ``ConfigError`` naming ``option`` and its ``value`` unless ``condition``."""
    if not condition:
        raise ConfigError(f"{option}={format_value(value)} is invalid: {why}")


# The key of a field's :class:`Valid` in its ``dataclasses.field`` metadata.
VALID_KEY = "pagedllm.valid"

# A numeric bound: a number, or the name of another field whose value is the bound.
Bound = float | str | None


@dataclasses.dataclass(frozen=True, slots=True)
class Valid:
    """The valid values of a field, declared once where the field is: the config checks
    them, and the engine argument that feeds the field takes them from there (the
    command line's range check and ``--help``'s choices). ``None`` is never checked: it
    means "unset"."""

    # Inclusive range of a number (``min`` is exclusive with ``min_exclusive``). A bound
    # may name another field of the same object (``max="max_num_partial_prefills"``).
    min: Bound = None
    max: Bound = None
    min_exclusive: bool = False
    # Why an out-of-range value is invalid; derived from the bounds when not given.
    range_hint: str | None = None
    choices: tuple[Any, ...] | None = None


def setting(default: Any = dataclasses.MISSING, **valid: Any) -> Any:
    """A config field with a default (a list or dict is copied per instance) and its
    valid values (the keywords of :class:`Valid`)."""
    metadata = {VALID_KEY: Valid(**valid)}
    if isinstance(default, list | dict | set):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def out_of_range(spec: Any, value: Any, bound: Callable[[str], tuple[Any, str]]) -> str | None:
    """Why ``value`` is outside the range ``spec`` declares (its ``min``, ``max``,
    ``min_exclusive`` and ``range_hint``), or ``None`` when it is inside; ``bound(name)``
    gives the value of a bound that names a field, and how a message names it."""
    if spec.min is None and spec.max is None:
        return None
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return None  # a wrong type is a type check's message
    low, low_text = _bound(spec.min, bound)
    high, high_text = _bound(spec.max, bound)
    too_low = low is not None and (value <= low if spec.min_exclusive else value < low)
    too_high = high is not None and value > high
    if not (too_low or too_high):
        return None
    if spec.range_hint is not None:
        return spec.range_hint
    if low is not None and high is not None:
        if spec.min_exclusive:
            return f"must be in ({low_text}, {high_text}]"
        return f"must be between {low_text} and {high_text}"
    if low is not None and spec.min_exclusive:
        return f"must be more than {low_text}"
    if low is not None:
        return f"must be at least {low_text}"
    return f"must be at most {high_text}"


def _bound(bound: Bound, named: Callable[[str], tuple[Any, str]]) -> tuple[Any, str]:
    if isinstance(bound, str):
        return named(bound)
    return bound, format_value(bound)


def invalid_choice(option: str, value: Any, choices: Any) -> str:
    """The message for a value outside an option's choices (argparse's wording)."""
    return f"{option}: invalid choice {value!r} (choose from {', '.join(map(str, choices))})"


@dataclasses.dataclass(frozen=True, slots=True)
class ConfigOption:
    """A config field as the engine argument that feeds it sees it: its flag, default
    and valid values (see :meth:`Config.option`)."""

    config: type[Config]
    name: str
    default: Any
    valid: Valid | None

    def arg_valid(self) -> Valid | None:
        """:attr:`valid` with a bound that names a config field renamed to the engine
        argument that feeds it."""
        valid = self.valid
        if valid is None:
            return None
        names = self.config.arg_names
        return dataclasses.replace(
            valid,
            min=names.get(valid.min, valid.min) if isinstance(valid.min, str) else valid.min,
            max=names.get(valid.max, valid.max) if isinstance(valid.max, str) else valid.max,
        )


class Config:
    """The base of the config dataclasses.

    - :meth:`validate` checks every field against the valid values it declares
      (:func:`setting`), then the config's own rules (:meth:`check`, which may normalize
      the fields), raising :class:`ConfigError` naming the option of an invalid value;
      ``__post_init__`` runs it, so a config built directly (by a test, a plugin) is
      checked like one built from the engine arguments.
    - :meth:`from_args` builds one from the engine arguments of the same names (or the
      names in :attr:`arg_names`); an argument left ``None`` means "unset": the config's
      default applies.
    - :meth:`freeze` makes assigning a field raise ``FrozenInstanceError``; derive a
      changed copy with :meth:`replace`.
    """

    # Field -> engine argument, where the flag is spelled otherwise.
    arg_names: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check the fields' declared valid values, then :meth:`check`."""
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            valid = field.metadata.get(VALID_KEY)
            if valid is not None:
                self._check_valid(field.name, valid)
        self.check()

    def check(self) -> None:
        """The config's own rules beyond its fields' declared valid values: normalize
        the fields; raise ``ConfigError`` naming the option of an invalid value."""

    @classmethod
    def flag(cls, name: str) -> str:
        """The command-line option of field ``name`` (``--swap-space`` for ``swap_space_gib``)."""
        return "--" + cls.arg_names.get(name, name).replace("_", "-")

    def _check_valid(self, name: str, valid: Valid) -> None:
        value = getattr(self, name)
        if value is None:
            return
        if valid.choices is not None:
            for item in value if isinstance(value, list | tuple) else [value]:
                if item not in valid.choices:
                    raise ConfigError(invalid_choice(self.flag(name), item, valid.choices))

        def bound(other: str) -> tuple[Any, str]:
            limit = getattr(self, other)
            return limit, f"{self.flag(other)} ({format_value(limit)})"

        why = out_of_range(valid, value, bound)
        require(why is None, self.flag(name), value, why or "")

    @classmethod
    def option(cls, name: str) -> ConfigOption:
        """Field ``name`` as the engine argument that feeds it declares it:
        ``arg(of=CacheConfig.option("gpu_memory_utilization"), ...)`` takes its default
        and valid values from here instead of restating them."""
        field = cls.__dataclass_fields__[name]  # type: ignore[attr-defined]
        return ConfigOption(
            config=cls,
            name=name,
            default=cls.default(name),
            valid=field.metadata.get(VALID_KEY),
        )

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen", False):
            raise dataclasses.FrozenInstanceError(
                f"cannot assign {type(self).__name__}.{name}: the configuration is frozen "
                "once validated (derive a changed copy with .replace())"
            )
        object.__setattr__(self, name, value)

    def freeze(self) -> Self:
        """Freeze this config and the configs it holds; returns it."""
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, field.name)
            if isinstance(value, Config):
                value.freeze()
        object.__setattr__(self, "_frozen", True)
        return self

    @property
    def frozen(self) -> bool:
        return self.__dict__.get("_frozen", False)

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes`` (validated), frozen if this one is."""
        changed = dataclasses.replace(self, **changes)  # type: ignore[type-var]
        return changed.freeze() if self.frozen else changed

    @classmethod
    def default(cls, name: str) -> Any:
        """The default of field ``name`` (a fresh copy of a list or dict)."""
        field = cls.__dataclass_fields__[name]  # type: ignore[attr-defined]
        if field.default_factory is not dataclasses.MISSING:
            return field.default_factory()
        return field.default

    @classmethod
    def from_args(cls, args: Any, **values: Any) -> Self:
        """This config from the engine arguments ``args``: each field takes the argument
        of its name (see :attr:`arg_names`) unless that is ``None`` (unset) or the field
        is given in ``values`` (a value computed from several options)."""
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        if unknown:
            raise TypeError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
        kwargs = {}
        for field in dataclasses.fields(cls):  # type: ignore[arg-type]
            if not field.init:
                continue
            if field.name in values:
                kwargs[field.name] = values[field.name]
                continue
            name = cls.arg_names.get(field.name, field.name)
            value = getattr(args, name, None)
            if value is not None:
                # (a copy: the config must not share a list or dict with the caller's args)
                kwargs[field.name] = copy.copy(value) if isinstance(value, list | dict) else value
        return cls(**kwargs)
