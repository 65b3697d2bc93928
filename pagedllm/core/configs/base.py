"""What every configuration object shares: it declares its own defaults, checks its own
values (when built, and again before it is frozen), and is frozen once validated."""

from __future__ import annotations

import copy
import dataclasses
import json
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


class Config:
    """The base of the config dataclasses.

    - :meth:`validate` normalizes the fields and raises :class:`ConfigError` naming the
      option of an invalid value; ``__post_init__`` runs it, so a config built directly
      (by a test, a plugin) is checked like one built from the engine arguments.
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
        """Normalize the fields' values; raise ``ConfigError`` naming an invalid one."""

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
