"""The engine step (schedule → execute → update → output) at the engine level: a failure
in any stage fails only its own requests, and their KV blocks come back."""

from __future__ import annotations

import pytest
from tiny_models import make_checkpoint

from pagedllm import LLM, SamplingParams
from pagedllm.core.errors import InvalidRequestError

BAD = [11, 12, 13]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model = make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")
    return LLM(str(model), dtype="float32", disable_log_stats=True, num_gpu_blocks_override=64)


def _run(engine):
    finished = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished, engine.take_failures()


def _is_bad(request):
    return request.prompt_token_ids[: len(BAD)] == BAD


def test_a_failing_step_fails_only_its_requests(llm, monkeypatch):
    engine = llm.llm_engine
    execute = engine.runner.execute

    def faulty(scheduler_output, token_mask=None):
        assert all(item.block_ids for item in scheduler_output.scheduled)
        if any(_is_bad(item.request) for item in scheduler_output.scheduled):
            raise RuntimeError("injected")
        return execute(scheduler_output, token_mask)

    monkeypatch.setattr(engine.runner, "execute", faulty)
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=4, n=2)
    engine.add_request("bad", {"prompt_token_ids": [*BAD, 14]}, params)
    finished, failures = _run(engine)
    assert set(failures) == {"bad"} and str(failures["bad"]) == "injected"
    assert not finished
    # The next requests run normally.
    monkeypatch.setattr(engine.runner, "execute", execute)
    engine.add_request("good", {"prompt_token_ids": [5, 6, 7]}, params)
    finished, failures = _run(engine)
    assert not failures and len(finished["good"].outputs) == 2
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_an_output_failure_fails_one_request_and_its_siblings(llm, monkeypatch):
    engine = llm.llm_engine
    on_token = engine.output_processor.on_token

    def faulty(seq, token, logprobs_row):
        if _is_bad(seq.request) and seq.request.num_output_tokens == 2:
            raise RuntimeError("output broke")
        return on_token(seq, token, logprobs_row)

    monkeypatch.setattr(engine.output_processor, "on_token", faulty)
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=6, min_tokens=6, n=3)
    engine.add_request("bad", {"prompt_token_ids": [*BAD, 14]}, params)
    engine.add_request("good", {"prompt_token_ids": [5, 6, 7]}, params)
    finished, failures = _run(engine)
    assert set(failures) == {"bad"} and set(finished) == {"good"}
    assert [len(c.token_ids) for c in finished["good"].outputs] == [6, 6, 6]
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_invalid_requests_name_the_field_and_queue_nothing(llm):
    engine = llm.llm_engine
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("x", {"prompt_token_ids": [10**9]}, SamplingParams())
    assert info.value.param == "prompt" and "outside the vocabulary" in str(info.value)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("x", [5], SamplingParams(), priority=3)
    assert info.value.param == "priority"
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests
