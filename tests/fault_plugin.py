"""A pagedllm plugin that injects faults, for the robustness tests.

The tests install it the way a user installs a plugin (a distribution with an entry
point, on ``PYTHONPATH``; see :func:`install`) so that a real ``pagedllm serve`` loads
it. Its faults fire only for prompts that start with one of the marker token-id
sequences below, so the same server serves ordinary requests normally:

- ``FAIL_STEP``: the model step that computes the request raises (every request of that
  step fails; the engine goes on);
- ``FAIL_OUTPUT``: turning the request's new token into output raises (that request
  alone fails);
- ``KILL_LOOP``: the engine loop itself gets a ``BaseException`` (the loop dies and the
  server must exit non-zero);

and two guided-decoding backends misbehave while compiling: ``sleepy`` never finishes,
``hungry`` allocates memory without end (each writes its process id to
``$FAULT_DIR/<name>.pid`` first). It also adds a route ``/health/details``, which an API
key must protect although it starts with an open route's path.
"""

from __future__ import annotations

from pathlib import Path

from conftest import make_distribution

FAIL_STEP = [11, 12, 13, 14]
FAIL_OUTPUT = [21, 22, 23, 24]
KILL_LOOP = [31, 32, 33, 34]

SOURCE = '''
import os
import time

from pagedllm import hookimpl
from pagedllm.core.interfaces import GuidedBackend

FAIL_STEP = {fail_step!r}
FAIL_OUTPUT = {fail_output!r}
KILL_LOOP = {kill_loop!r}


class InjectedDeath(BaseException):
    """Not an Exception: nothing in the engine may swallow it."""


def _starts(request, marker):
    return list(request.prompt_token_ids[: len(marker)]) == marker


@hookimpl
def pagedllm_engine_started(engine):
    execute = engine.runner.execute
    on_token = engine.output_processor.on_token

    def faulty_execute(scheduler_output, *args, **kwargs):
        for item in scheduler_output.scheduled:
            if _starts(item.request, FAIL_STEP):
                raise RuntimeError("injected step failure")
            if _starts(item.request, KILL_LOOP):
                raise InjectedDeath("injected engine-loop death")
        return execute(scheduler_output, *args, **kwargs)

    def faulty_on_token(seq, token, logprobs_row):
        if _starts(seq.request, FAIL_OUTPUT):
            raise RuntimeError("injected output failure")
        return on_token(seq, token, logprobs_row)

    engine.runner.execute = faulty_execute
    engine.output_processor.on_token = faulty_on_token


@hookimpl
def pagedllm_add_api_routes(app, engine):
    @app.get("/health/details")
    async def details():
        return {{"secret": "only with the key"}}


def _record_pid(name):
    directory = os.environ.get("FAULT_DIR")
    if directory:
        with open(os.path.join(directory, name + ".pid"), "w") as f:
            f.write(str(os.getpid()))


class SleepyBackend(GuidedBackend):
    name = "sleepy"

    def unsupported_reason(self, constraint):
        return None

    def compile(self, constraint, options):
        _record_pid("sleepy")
        while True:
            time.sleep(0.05)


class HungryBackend(GuidedBackend):
    name = "hungry"

    def unsupported_reason(self, constraint):
        return None

    def compile(self, constraint, options):
        _record_pid("hungry")
        hoard = []
        while True:
            hoard.append(bytearray(16 * 2**20))
            time.sleep(0.01)


@hookimpl
def pagedllm_register_guided_backends(registry):
    registry.add("sleepy", SleepyBackend)
    registry.add("hungry", HungryBackend)
'''


def install(site: Path) -> Path:
    """Write the plugin as an installed distribution into ``site`` (put it on
    ``PYTHONPATH``)."""
    source = SOURCE.format(fail_step=FAIL_STEP, fail_output=FAIL_OUTPUT, kill_loop=KILL_LOOP)
    return make_distribution(
        site, "pagedllm-fault-plugin", {"faults": "pagedllm_faults"}, {"pagedllm_faults": source}
    )
