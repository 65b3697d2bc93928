"""The scheduler contract (``SchedulerInterface``, the ``schedulers`` registry behind
``--scheduler-cls``) and the step extensions (``StepExtension``, ``--step-extensions``):
a third party's scheduler and extension, reached the way a user reaches them."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types

import pytest
from conftest import DUMMY_PLUGIN, env_with_site, pip_install_target, run_cli
from core.test_scheduler import TOK, add, make_scheduler, step
from tiny_models import make_checkpoint

from pagedllm import LLM, SamplingParams
from pagedllm.core.engine_args import EngineArgs
from pagedllm.core.errors import ConfigError
from pagedllm.core.hookspecs import hookimpl
from pagedllm.core.interfaces import SchedulerInterface, StepExtension
from pagedllm.core.plugins import make_plugin_manager
from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import Scheduler

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
PROMPT = {"prompt_token_ids": [10, 20, 30, 40, 50, 60, 70]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def build(model, **kwargs):
    kwargs.setdefault("num_gpu_blocks_override", 64)
    return LLM(str(model), dtype="float32", disable_log_stats=True, **kwargs)


class DelegatingScheduler(SchedulerInterface):
    """A scheduler written against the contract alone (no Scheduler subclass): it hands
    every call to the built-in one, and counts the steps."""

    steps = 0

    def __init__(self, config, kv_manager, max_model_len, *, extensions=()):
        self.inner = Scheduler(config, kv_manager, max_model_len, extensions=extensions)
        self.requests = self.inner.requests

    @property
    def num_preemptions(self):
        return self.inner.num_preemptions

    def add_request(self, request):
        self.inner.add_request(request)

    def finish_requests(self, request_ids, status):
        return self.inner.finish_requests(request_ids, status)

    def schedule(self):
        type(self).steps += 1
        return self.inner.schedule()

    def token_mask(self, output):
        return self.inner.token_mask(output)

    def update_from_output(self, output, result):
        return self.inner.update_from_output(output, result)

    def has_unfinished_requests(self):
        return self.inner.has_unfinished_requests()

    @property
    def num_waiting(self):
        return self.inner.num_waiting

    @property
    def num_running(self):
        return self.inner.num_running


class NotAScheduler:
    pass


def _scheduler_plugin() -> types.ModuleType:
    module = types.ModuleType("scheduler_plugin")

    @hookimpl
    def pagedllm_register_schedulers(registry):
        registry.add("delegating", DelegatingScheduler)
        registry.add("broken", NotAScheduler)

    module.pagedllm_register_schedulers = pagedllm_register_schedulers
    return module


def test_scheduler_cls_takes_a_registered_name_and_the_contract_is_enough(checkpoint):
    pm = make_plugin_manager(extra_plugins=[("scheduler_plugin", _scheduler_plugin())])
    assert pm.registry("schedulers").load("default") is Scheduler
    reference = build(checkpoint).generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0]
    for name in ("delegating", f"{__name__}.DelegatingScheduler"):
        DelegatingScheduler.steps = 0
        llm = build(checkpoint, plugin_manager=pm, scheduler_cls=name)
        assert type(llm.llm_engine.scheduler) is DelegatingScheduler
        out = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == reference.token_ids and DelegatingScheduler.steps >= 6
    assert type(build(checkpoint, scheduler_cls="default").llm_engine.scheduler) is Scheduler


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "nope",
            r"--scheduler-cls nope: no scheduler of that name \(registered: broken, "
            r"default, delegating",
        ),
        (
            "broken",
            r"--scheduler-cls broken: .*NotAScheduler.*not a subclass of "
            r"pagedllm.core.interfaces.scheduler.SchedulerInterface",
        ),
        (
            f"{__name__}.NotAScheduler",
            r"not a subclass of pagedllm.core.scheduler.Scheduler "
            r"\(nor of pagedllm.core.interfaces.scheduler.SchedulerInterface",
        ),
    ],
)
def test_a_scheduler_that_is_not_one_is_refused_by_name(name, message):
    pm = make_plugin_manager(extra_plugins=[("scheduler_plugin", _scheduler_plugin())])
    with pytest.raises(ConfigError, match=message):
        EngineArgs(model="no/such-model", scheduler_cls=name).create_engine_config(pm)


class Recorder(StepExtension):
    """Records which requests its per-request hooks see."""

    name = "recorder"

    @classmethod
    def from_engine(cls, engine):
        return cls()

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def add_request(self, request):
        self.calls.append(("add", request.request_id))

    def admit(self, request):
        self.calls.append(("admit", request.request_id))
        return True

    def check_token(self, request, token):
        self.calls.append(("token", request.request_id))
        return RequestStatus.FINISHED_STOPPED if request.num_output_tokens >= 2 else None

    def request_finished(self, request):
        self.calls.append(("finished", request.request_id))


def test_per_request_hooks_see_only_the_requests_that_carry_the_extensions_state():
    recorder = Recorder()
    sched = make_scheduler(extensions=[recorder])
    plain = add(sched, "plain", 4, max_tokens=4)
    sched.waiting.remove({plain})
    del sched.requests["plain"]
    plain.features["recorder"] = True
    sched.add_request(plain)  # (now carrying the extension's state)
    other = add(sched, "other", 4, max_tokens=4)
    finished: list = []
    while sched.has_unfinished_requests():
        step(sched, finished=finished)
    assert {rid for _, rid in recorder.calls} == {"plain"}
    assert recorder.calls == [
        ("add", "plain"),
        ("admit", "plain"),
        ("token", "plain"),
        ("token", "plain"),
        ("finished", "plain"),
    ]
    assert plain.output_token_ids == [TOK, TOK] and plain.status is RequestStatus.FINISHED_STOPPED
    assert len(other.output_token_ids) == 4


def test_two_extensions_that_add_tokens_to_verify_are_refused():
    class Drafts(Recorder):
        def extra_tokens(self, request, budget):
            return 1

    class More(Drafts):
        name = "more"

    with pytest.raises(ConfigError, match=r"\['recorder', 'more'\] all add tokens to verify"):
        make_scheduler(extensions=[Drafts(), More()])


_GENERATE = """
import json, sys
from pagedllm import LLM, SamplingParams
kwargs = json.loads(sys.argv[2])
llm = LLM(sys.argv[1], dtype="float32", disable_log_stats=True, num_gpu_blocks_override=64,
          **kwargs)
params = SamplingParams(temperature=0.0, max_tokens=6)
out = llm.generate({"prompt_token_ids": [10, 20, 30, 40]}, params, use_tqdm=False)[0]
cap = llm.llm_engine.extensions.get("dummy_cap")
print(json.dumps([len(out.outputs[0].token_ids), out.outputs[0].finish_reason,
                  out.outputs[0].stop_reason, cap and cap.stats["computed_tokens"]]))
"""


def test_the_dummy_plugins_step_extension_takes_effect_through_its_flag(checkpoint, tmp_path):
    """Installed with pip, registered through its entry point: off until
    --step-extensions names it, then every request stops after its first two tokens, and
    its runner side (built on every rank, also tensor-parallel ones) counts the tokens the
    model computed: the 4-token prompt, then the first output token."""
    site = pip_install_target(tmp_path / "site", DUMMY_PLUGIN)
    env = env_with_site(site)

    def generate(**kwargs):
        result = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(_GENERATE), str(checkpoint), json.dumps(kwargs)],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    assert generate() == [6, "length", None, None]  # registered, but not named: off
    assert generate(step_extensions=["dummy_cap"]) == [2, "stop", "dummy_cap", 5]
    two_ranks = {"step_extensions": ["dummy_cap"], "tensor_parallel_size": 2}
    assert generate(**two_ranks) == [2, "stop", "dummy_cap", 5]
    refused = run_cli("serve", str(checkpoint), "--step-extensions", "nope", env=env)
    assert refused.returncode != 0
    assert "--step-extensions nope: no step extension of that name" in refused.stderr
    assert "dummy_cap" in refused.stderr and "guided" in refused.stderr


def test_an_unknown_step_extension_is_refused_before_loading(pm):
    with pytest.raises(ConfigError, match=r"--step-extensions nope: no step extension of that"):
        EngineArgs(model="no/such-model", step_extensions=["nope"]).create_engine_config(pm)


class Declines(Recorder):
    """An extension this configuration cannot run."""

    name = "declines"

    @classmethod
    def from_engine(cls, engine):
        return None


def test_a_named_extension_the_configuration_cannot_run_is_refused(checkpoint):
    plugin = types.ModuleType("declining_plugin")

    @hookimpl
    def pagedllm_register_step_extensions(registry):
        registry.add("declines", Declines)
        registry.add("recorder", Recorder)

    plugin.pagedllm_register_step_extensions = pagedllm_register_step_extensions
    pm = make_plugin_manager(extra_plugins=[("declining_plugin", plugin)])
    with pytest.raises(ConfigError, match="--step-extensions declines: this configuration"):
        build(checkpoint, plugin_manager=pm, step_extensions=["declines"])
    llm = build(checkpoint, plugin_manager=pm)  # registered but not named: off
    assert "recorder" not in llm.llm_engine.extensions
    llm = build(checkpoint, plugin_manager=pm, step_extensions=["recorder"])
    assert type(llm.llm_engine.extensions["recorder"]) is Recorder
    out = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6  # (it carries no request's state: no per-request call)
