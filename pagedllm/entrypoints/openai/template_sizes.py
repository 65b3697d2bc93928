"""How big a chat template's values and output can get: sizes measured, and predicted
*before* an operation builds them (``*``, ``+``, ``%``, ``**``, ``str`` methods, filters),
so that :mod:`.template_guard` refuses what would go over its limit without making it."""

from __future__ import annotations

import re
import string
from collections.abc import Iterable
from typing import Any

# Exponents above this (with a base other than -1, 0, 1) make integers too big to print.
MAX_EXPONENT = 4096
_NUMBER = re.compile(r"\d+")


class TemplateLimitError(ValueError):
    """A chat template went over its size or time limit."""


def too_big(what: str, size: int, limit: int) -> TemplateLimitError:
    """The error for a value of ``size`` characters, over ``limit``."""
    return TemplateLimitError(
        f"the chat template would build {what} of about {size} characters; the limit is {limit}"
    )


def deep_size(value: Any, limit: int) -> int:
    """About how many characters ``value`` prints as (strings, and containers summed);
    stops counting once past ``limit``."""
    total = 0
    stack = [value]
    seen: set[int] = set()
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str | bytes):
            total += len(item) + 2
        elif isinstance(item, bool) or item is None:
            total += 5
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 2
        elif isinstance(item, float):
            total += 24
        elif isinstance(item, list | tuple | set | frozenset | dict):
            if id(item) in seen:
                continue
            seen.add(id(item))
            total += 2 * len(item) + 2
            if isinstance(item, dict):
                stack.extend(item.keys())
                stack.extend(item.values())
            else:
                stack.extend(item)
        else:
            total += 8
    return total


def check_ints(args: Iterable[Any], limit: int) -> None:
    """Integers used as sizes (widths, repeats) may not pass ``limit``."""
    for arg in args:
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > limit:
            raise TemplateLimitError(
                f"the chat template passes {arg} where a size is expected; the limit is {limit}"
            )


def predict_format(fmt: str, args: tuple[Any, ...], kwargs: dict[str, Any], limit: int) -> int:
    """The most characters ``fmt.format(*args, **kwargs)`` can produce."""
    values = [*args, *kwargs.values()]
    check_ints(values, limit)
    widest = max((deep_size(v, limit) for v in values), default=0)
    total = 0
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return len(fmt)
    for literal, field, spec, _ in fields:
        total += len(literal)
        if field is None:
            continue
        widths = [int(n) for n in _NUMBER.findall(spec or "")]
        if "{" in (spec or ""):  # a nested field takes its width from the arguments
            widths += [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
        total += max([widest, *widths])
    return total


def predict_percent(fmt: str, values: Any, limit: int) -> int:
    """The most characters ``fmt % values`` can produce."""
    items = values if isinstance(values, tuple) else (values,)
    check_ints(items, limit)
    widths = sum(int(n) for n in _NUMBER.findall(fmt))
    return len(fmt) + widths + deep_size(values, limit) * max(fmt.count("%"), 1)


def predict_call(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any], limit: int) -> int:
    """The size of a ``str`` method's result when it can outgrow its inputs, else 0."""
    owner = getattr(obj, "__self__", None)
    name = getattr(obj, "__name__", "")
    if not isinstance(owner, str):
        return 0
    if name == "replace" and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        count = owner.count(old) if old else len(owner) + 1
        if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
            count = min(count, args[2])
        return len(owner) + count * max(len(new) - len(old), 0)
    if name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        return len(owner) + owner.count("\t") * (tab if isinstance(tab, int) else 8)
    if name in ("format", "format_map"):
        if name == "format_map" and args and isinstance(args[0], dict):
            return predict_format(owner, (), args[0], limit)
        return predict_format(owner, args, kwargs, limit)
    return 0


def check_binop(operator: str, left: Any, right: Any, limit: int) -> None:
    """Refuse ``left operator right`` when its result would pass ``limit``."""
    if operator == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, str | list | tuple) and isinstance(times, int):
                size = deep_size(seq, limit) * max(times, 0)
                if size > limit:
                    raise too_big("a sequence", size, limit)
    elif operator == "+" and isinstance(left, str | list | tuple):
        size = deep_size(left, limit) + deep_size(right, limit)
        if size > limit:
            raise too_big("a sequence", size, limit)
    elif operator == "%" and isinstance(left, str):
        size = predict_percent(left, right, limit)
        if size > limit:
            raise too_big("a string", size, limit)
    elif operator == "**":
        big_base = isinstance(left, int) and abs(left) > 1
        if big_base and isinstance(right, int) and right > MAX_EXPONENT:
            raise TemplateLimitError(
                f"the chat template raises to the power {right}; the limit is {MAX_EXPONENT}"
            )


def predict_filter(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], limit: int) -> int:
    """The size of a filter's result when it can outgrow its inputs, else 0."""
    texts = [a for a in args if isinstance(a, str)]
    if name == "replace" and len(texts) >= 3:
        value, old, new = texts[-3:]
        count = value.count(old) if old else len(value) + 1
        return len(value) + count * max(len(new) - len(old), 0)
    if name == "indent" and texts:
        width = kwargs.get("width", args[-1] if len(args) > 1 else 4)
        pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 4
        return len(texts[0]) + (texts[0].count("\n") + 1) * pad
    if name in ("tojson", "pprint") and args:
        indent = kwargs.get("indent") or 0
        nodes = deep_size(args[0], limit)
        return nodes * (1 + (indent if isinstance(indent, int) else len(str(indent))))
    if name == "format" and texts:
        return predict_percent(texts[0], tuple(args[1:]) or kwargs, limit)
    if name == "join":
        values = [a for a in args if isinstance(a, list | tuple)]
        separator = next((a for a in args[1:] if isinstance(a, str)), "")
        if values:
            return deep_size(values[0], limit) + len(separator) * len(values[0])
    return 0
