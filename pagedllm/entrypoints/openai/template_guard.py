"""Chat templates rendered within a size and a time limit.

A chat template is a program, and a request can bring its own (``chat_template``), so
rendering one is work that grows with the request. Inside :func:`bounded`, templates that
transformers renders on this thread are compiled into a sandbox that checks, *before*
building it, the size of every string or list an operation would make (``*``, ``+``,
``~``, ``%``, ``**``, calls, filters, the output), and a trace on the template's own
frames stops it past its deadline (a template loop that builds nothing still ends).
What goes over is a :class:`TemplateLimitError` (a ``ValueError``: the server answers
400). Outside :func:`bounded` transformers behaves as it always does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import re
import string
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from jinja2.compiler import CodeGenerator
from jinja2.runtime import str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment

logger = logging.getLogger("pagedllm.server")

# Exponents above this (with a base other than -1, 0, 1) make integers too big to print.
MAX_EXPONENT = 4096
# How often the trace looks at the process's memory, in seconds, and how much it may grow
# while one template renders (a backstop behind the size checks).
_RSS_CHECK_INTERVAL = 0.05
_RSS_GROWTH_LIMIT = 1 << 30
_TEMPLATE_FILE = "<template>"
_NUMBER = re.compile(r"\d+")


class TemplateLimitError(ValueError):
    """A chat template went over its size or time limit."""


@dataclasses.dataclass(slots=True)
class _Budget:
    max_chars: int
    timeout: float
    deadline: float
    rss_start: int
    next_rss_check: float


_local = threading.local()


def _budget() -> _Budget | None:
    return getattr(_local, "budget", None)


@contextlib.contextmanager
def bounded(max_chars: int, timeout: float) -> Iterator[None]:
    """Templates rendered on this thread inside the block stay within ``max_chars``
    characters (output and any value they build) and ``timeout`` seconds."""
    _install()
    now = time.monotonic()
    _local.budget = _Budget(max_chars, timeout, now + timeout, _rss(), now)
    previous = sys.gettrace()
    sys.settrace(_trace_calls)
    try:
        yield
    finally:
        sys.settrace(previous)
        _local.budget = None


# ------------------------------------------------------------------------ limits


def _too_big(what: str, size: int, budget: _Budget) -> TemplateLimitError:
    return TemplateLimitError(
        f"the chat template would build {what} of about {size} characters; the limit is "
        f"{budget.max_chars}"
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


def _check(value: Any, what: str = "a value") -> Any:
    budget = _budget()
    if budget is not None:
        size = deep_size(value, budget.max_chars)
        if size > budget.max_chars:
            raise _too_big(what, size, budget)
    return value


def _check_ints(args: Iterable[Any], budget: _Budget) -> None:
    for arg in args:
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > budget.max_chars:
            raise TemplateLimitError(
                f"the chat template passes {arg} where a size is expected; the limit is "
                f"{budget.max_chars}"
            )


def _predict_format(fmt: str, args: tuple[Any, ...], kwargs: dict[str, Any], budget: _Budget):
    """The most characters ``fmt.format(*args, **kwargs)`` can produce."""
    values = [*args, *kwargs.values()]
    _check_ints(values, budget)
    widest = max((deep_size(v, budget.max_chars) for v in values), default=0)
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


def _predict_percent(fmt: str, values: Any, budget: _Budget) -> int:
    """The most characters ``fmt % values`` can produce."""
    items = values if isinstance(values, tuple) else (values,)
    _check_ints(items, budget)
    widths = sum(int(n) for n in _NUMBER.findall(fmt))
    return len(fmt) + widths + deep_size(values, budget.max_chars) * max(fmt.count("%"), 1)


def _predict_call(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any], budget: _Budget):
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
            return _predict_format(owner, (), args[0], budget)
        return _predict_format(owner, args, kwargs, budget)
    return 0


class _GuardedCodeGenerator(CodeGenerator):
    """``a ~ b`` checks the size of the string it would make before making it."""

    def visit_Concat(self, node: Any, frame: Any) -> None:
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
            super().visit_Concat(node, frame)
            return
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class GuardedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat-template sandbox with the size checks of this module."""

    code_generator_class = _GuardedCodeGenerator
    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.finalize = _check_output
        self.concat = _checked_join  # type: ignore[assignment]

    @staticmethod
    def checked_concat(parts: tuple[Any, ...]) -> str:
        _check(parts, "a string")
        return str_join(parts)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        if budget is not None:
            _predict_binop(operator, left, right, budget)
        return _check(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        if budget is not None:
            _check_ints([*args, *kwargs.values()], budget)
            predicted = _predict_call(__obj, args, kwargs, budget)
            if predicted > budget.max_chars:
                raise _too_big("a string", predicted, budget)
        return _check(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt: str = value.__self__
        is_map = value.__name__ == "format_map"

        def checked(*args: Any, **kwargs: Any) -> str:
            budget = _budget()
            if budget is not None:
                if is_map and args and isinstance(args[0], dict):
                    predicted = _predict_format(fmt, (), args[0], budget)
                else:
                    predicted = _predict_format(fmt, args, kwargs, budget)
                if predicted > budget.max_chars:
                    raise _too_big("a string", predicted, budget)
            return wrapped(*args, **kwargs)

        return functools.update_wrapper(checked, wrapped)


def _predict_binop(operator: str, left: Any, right: Any, budget: _Budget) -> None:
    limit = budget.max_chars
    if operator == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, str | list | tuple) and isinstance(times, int):
                size = deep_size(seq, limit) * max(times, 0)
                if size > limit:
                    raise _too_big("a sequence", size, budget)
    elif operator == "+" and isinstance(left, str | list | tuple):
        size = deep_size(left, limit) + deep_size(right, limit)
        if size > limit:
            raise _too_big("a sequence", size, budget)
    elif operator == "%" and isinstance(left, str):
        size = _predict_percent(left, right, budget)
        if size > limit:
            raise _too_big("a string", size, budget)
    elif operator == "**":
        big_base = isinstance(left, int) and abs(left) > 1
        if big_base and isinstance(right, int) and right > MAX_EXPONENT:
            raise TemplateLimitError(
                f"the chat template raises to the power {right}; the limit is {MAX_EXPONENT}"
            )


def _check_output(value: Any) -> Any:
    return _check(value, "an output")


def _checked_join(chunks: Iterable[str]) -> str:
    """``"".join(chunks)``, stopping once the text passes the limit."""
    budget = _budget()
    if budget is None:
        return "".join(chunks)
    parts: list[str] = []
    size = 0
    for chunk in chunks:
        size += len(chunk)
        if size > budget.max_chars:
            raise TemplateLimitError(
                f"the chat template's output is longer than {budget.max_chars} characters"
            )
        parts.append(chunk)
    return "".join(parts)


def _guard_filter(name: str, filter_fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(filter_fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        if budget is not None:
            values = [*args, *kwargs.values()]
            _check_ints(values, budget)
            for value in values:
                _check(value, f"the input of the {name} filter")
            predicted = _predict_filter(name, args, kwargs, budget)
            if predicted > budget.max_chars:
                raise _too_big(f"the output of the {name} filter", predicted, budget)
        return _check(filter_fn(*args, **kwargs), f"the output of the {name} filter")

    return guarded


def _predict_filter(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], budget: _Budget):
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
        nodes = deep_size(args[0], budget.max_chars)
        return nodes * (1 + (indent if isinstance(indent, int) else len(str(indent))))
    if name == "format" and texts:
        return _predict_percent(texts[0], tuple(args[1:]) or kwargs, budget)
    if name == "join":
        values = [a for a in args if isinstance(a, list | tuple)]
        separator = next((a for a in args[1:] if isinstance(a, str)), "")
        if values:
            return deep_size(values[0], budget.max_chars) + len(separator) * len(values[0])
    return 0


# ------------------------------------------------------------------------ time


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _trace_calls(frame: Any, event: str, arg: Any) -> Any:
    if frame.f_code.co_filename != _TEMPLATE_FILE:
        return None
    _check_time()
    return _trace_lines


def _trace_lines(frame: Any, event: str, arg: Any) -> Any:
    if event == "line":
        _check_time()
    return _trace_lines


def _check_time() -> None:
    budget = _budget()
    if budget is None:
        return
    now = time.monotonic()
    if now > budget.deadline:
        raise TemplateLimitError(
            f"the chat template took longer than {budget.timeout:g} s to render"
        )
    if now >= budget.next_rss_check:
        budget.next_rss_check = now + _RSS_CHECK_INTERVAL
        if _rss() - budget.rss_start > _RSS_GROWTH_LIMIT:
            raise TemplateLimitError("the chat template used too much memory")


# ------------------------------------------------------------------ transformers

_installed = False
_install_lock = threading.Lock()


def _install() -> None:
    """Have transformers compile templates into :class:`GuardedEnvironment` while a
    thread renders inside :func:`bounded` (its own environment everywhere else)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        _installed = True
        try:
            from transformers.utils import chat_template_utils as utils
        except ImportError:
            return
        original = getattr(utils, "_compile_jinja_template", None)
        if original is None:
            logger.warning(
                "this transformers version compiles chat templates in a way pagedllm does "
                "not know; templates are bounded in time and output only"
            )
            return

        @functools.lru_cache(maxsize=64)
        def compile_guarded(source: str) -> Any:
            # transformers' environment (its filters, globals and extensions), taken from
            # an empty template: compiling the request's own there would run its
            # constant expressions unchecked.
            base = original("").environment
            env = GuardedEnvironment(
                trim_blocks=base.trim_blocks,
                lstrip_blocks=base.lstrip_blocks,
                keep_trailing_newline=base.keep_trailing_newline,
                extensions=[type(ext) for ext in base.extensions.values()],
            )
            env.globals.update(base.globals)
            env.tests.update(base.tests)
            env.filters.update({k: _guard_filter(k, f) for k, f in base.filters.items()})
            return env.from_string(source)

        def compile_template(source: str) -> Any:
            if _budget() is None:
                return original(source)
            return compile_guarded(source)

        utils._compile_jinja_template = compile_template
