"""What a field's type annotation means for a value: does a value fit it, and how to
name it in a message (``int | None`` -> "an int or None")."""

from __future__ import annotations

import collections.abc
import numbers
import types
import typing
from typing import Any, Literal


def is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def is_callable_type(annotation: Any) -> bool:
    return annotation is collections.abc.Callable or (
        typing.get_origin(annotation) is collections.abc.Callable
    )


def strip_optional(annotation: Any) -> Any:
    """The type a command-line value has: ``None`` and callables (which only Python
    callers can give, e.g. ``hf_overrides``) are left out of a union."""
    if is_union(annotation):
        args = [
            a
            for a in typing.get_args(annotation)
            if a is not type(None) and not is_callable_type(a)
        ]
        if len(args) == 1:
            return args[0]
        return annotation
    return annotation


def is_bool(annotation: Any) -> bool:
    return strip_optional(annotation) is bool


def is_list(annotation: Any) -> bool:
    return typing.get_origin(strip_optional(annotation)) in (list, tuple)


def is_dict(annotation: Any) -> bool:
    base = strip_optional(annotation)
    return base is dict or typing.get_origin(base) is dict


def has_str(annotation: Any) -> bool:
    if is_union(annotation):
        return any(a is str for a in typing.get_args(annotation))
    return annotation is str


def value_matches(value: Any, annotation: Any) -> bool:
    """Whether ``value`` fits ``annotation``, accepting what a Python caller reasonably
    passes: an int for a float, a tuple for a list, one item for a list of such items."""
    if annotation is Any:
        return True
    if annotation is None or annotation is type(None):
        return value is None
    if is_union(annotation):
        return any(value_matches(value, a) for a in typing.get_args(annotation))
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
    if is_callable_type(annotation):
        return callable(value)
    if origin in (list, tuple) or annotation in (list, tuple):
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        item = args[0] if len(args) == 1 or origin is list else Any
        if isinstance(value, list | tuple):
            return all(value_matches(v, item) for v in value)
        return item is not Any and value_matches(value, item)
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
    if is_union(annotation):
        args = typing.get_args(annotation)
        # None last: "an int or None".
        args = sorted(args, key=lambda a: a is type(None))
        names = [describe_type(a) for a in args]
        return ", ".join(names[:-1]) + " or " + names[-1]
    if annotation in _TYPE_NAMES:
        return _TYPE_NAMES[annotation]
    if is_callable_type(annotation):
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
