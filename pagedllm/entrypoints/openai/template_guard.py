"""Chat templates rendered within a size and a time limit.

A chat template is a program, and a request can bring its own (``chat_template``), so
rendering one is work that grows with the request. Inside :func:`bounded`, templates
rendered on this thread (by pagedllm's renderer, :mod:`pagedllm.core.chat_template`, or by
transformers for a transformers tokenizer) are compiled into a sandbox that checks, *before*
building it, the size of every string or list an operation would make (``*``, ``+``,
``~``, ``%``, ``**``, calls, filters, the output), and a trace on the template's own
frames stops it past its deadline (a template loop that builds nothing still ends).
What goes over is a :class:`TemplateLimitError` (a ``ValueError``: the server answers
400). Outside :func:`bounded` templates render as they always do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from jinja2.compiler import CodeGenerator
from jinja2.runtime import str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pagedllm.core import chat_template
from pagedllm.entrypoints.openai.template_sizes import (
    TemplateLimitError,
    check_binop,
    check_ints,
    deep_size,
    predict_call,
    predict_filter,
    predict_format,
    too_big,
)

__all__ = ["TemplateLimitError", "bounded"]

logger = logging.getLogger("pagedllm.server")

# How often the trace looks at the process's memory, in seconds, and how much it may grow
# while one template renders (a backstop behind the size checks).
_RSS_CHECK_INTERVAL = 0.05
_RSS_GROWTH_LIMIT = 1 << 30
_TEMPLATE_FILE = "<template>"


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


def _check(value: Any, what: str = "a value") -> Any:
    budget = _budget()
    if budget is not None:
        size = deep_size(value, budget.max_chars)
        if size > budget.max_chars:
            raise too_big(what, size, budget.max_chars)
    return value


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
    """The chat-template sandbox with the size checks of this module."""

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
            check_binop(operator, left, right, budget.max_chars)
        return _check(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        if budget is not None:
            check_ints([*args, *kwargs.values()], budget.max_chars)
            predicted = predict_call(__obj, args, kwargs, budget.max_chars)
            if predicted > budget.max_chars:
                raise too_big("a string", predicted, budget.max_chars)
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
                    predicted = predict_format(fmt, (), args[0], budget.max_chars)
                else:
                    predicted = predict_format(fmt, args, kwargs, budget.max_chars)
                if predicted > budget.max_chars:
                    raise too_big("a string", predicted, budget.max_chars)
            return wrapped(*args, **kwargs)

        return functools.update_wrapper(checked, wrapped)


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
            check_ints(values, budget.max_chars)
            for value in values:
                _check(value, f"the input of the {name} filter")
            predicted = predict_filter(name, args, kwargs, budget.max_chars)
            if predicted > budget.max_chars:
                raise too_big(f"the output of the {name} filter", predicted, budget.max_chars)
        return _check(filter_fn(*args, **kwargs), f"the output of the {name} filter")

    return guarded


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


# ------------------------------------------------------------------ installing

_installed = False
_install_lock = threading.Lock()


@functools.cache
def _own_environment() -> GuardedEnvironment:
    return chat_template.build_environment(GuardedEnvironment, wrap_filter=_guard_filter)


@functools.lru_cache(maxsize=64)
def _compile_own(source: str) -> Any:
    return _own_environment().from_string(source)


def _own_guard(source: str) -> Any:
    return None if _budget() is None else _compile_own(source)


# pagedllm's own renderer compiles in the guarded environment while a thread renders
# inside bounded().
chat_template.guard = _own_guard


def _install() -> None:
    """transformers' renderer compiles templates into :class:`GuardedEnvironment` while a
    thread renders inside :func:`bounded`, where this process has imported transformers
    (a transformers tokenizer renders with it; importing it here would cost a start
    without one 0.6 s). pagedllm's own renderer is guarded from this module's import."""
    global _installed
    if _installed or "transformers" not in sys.modules:
        return
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

        @functools.cache
        def guarded_environment() -> GuardedEnvironment:
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
            return env

        @functools.lru_cache(maxsize=64)
        def compile_guarded(source: str) -> Any:
            return guarded_environment().from_string(source)

        def compile_template(source: str) -> Any:
            if _budget() is None:
                return original(source)
            return compile_guarded(source)

        utils._compile_jinja_template = compile_template
