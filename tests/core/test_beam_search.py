"""Beam search: ``LLM.beam_search`` keeps transformers' best beams
(``generate(num_beams=...)``), and the completions API's ``use_beam_search`` returns them
as choices."""

from __future__ import annotations

import pytest
import torch
import transformers
from openai_server import RemoteServer, assert_openai_error, start_servers
from tiny_models import make_checkpoint

from pagedllm import LLM, BeamSearchParams

PROMPTS = [[1, 5, 9, 23, 42, 77, 30], [1, 7, 7, 7, 33, 100, 12, 64, 8, 19]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("beam") / "qwen2", "qwen2", seed=1)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def _hf_beams(model, prompt, width, new_tokens, **kwargs):
    out = model.generate(
        torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
        max_new_tokens=new_tokens, do_sample=False, early_stopping=False,
        output_scores=True, return_dict_in_generate=True, pad_token_id=0, **kwargs,
    )  # fmt: skip
    return [s[len(prompt) :].tolist() for s in out.sequences], getattr(
        out, "sequences_scores", None
    )


@pytest.mark.parametrize("width", [1, 3, 4])
def test_best_beams_equal_transformers(checkpoint, reference, width):
    llm = LLM(str(checkpoint), dtype="float32", disable_log_stats=True)
    params = BeamSearchParams(beam_width=width, max_tokens=8, ignore_eos=True)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        beams, scores = _hf_beams(reference, prompt, width, 8, min_new_tokens=8, eos_token_id=None)
        assert [s.output_tokens for s in output.sequences] == beams
        assert all(s.tokens[: len(prompt)] == prompt for s in output.sequences)
        # transformers' score is the cumulative logprob over the generated length.
        if scores is not None:  # (one beam: transformers searches greedily, without scores)
            ours = torch.tensor([s.cum_logprob / 8 for s in output.sequences])
            torch.testing.assert_close(ours, scores.float(), rtol=0, atol=1e-4)
        assert all(s.text and s.finish_reason == "length" for s in output.sequences)
    engine = llm.llm_engine
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    # The steps shared the prompt's KV through the prefix cache, the partial last block
    # of each parent beam too (copied on write): the first step computes the prompts,
    # each later one a single token per beam (8 steps; a prompt has `width` beams from
    # the second on).
    stats = engine.kv_manager.total_prefix_cache_stats
    assert stats.queries - stats.hits == sum(map(len, PROMPTS)) + 7 * width * len(PROMPTS)


def test_eos_ends_beams(checkpoint):
    """A beam that picks EOS is set aside as finished (it then competes with the live
    ones by the length-normalized score)."""
    llm = LLM(str(checkpoint), dtype="float32", disable_log_stats=True)
    eos = llm.llm_engine.loaded.eos_token_ids[0]
    params = BeamSearchParams(beam_width=4, max_tokens=30)
    (output,) = llm.beam_search({"prompt_token_ids": PROMPTS[0]}, params)
    for beam in output.sequences:
        out = beam.output_tokens
        assert eos not in out[:-1]
        assert (beam.finish_reason == "stop") == (out[-1] == eos)
    scores = [b.cum_logprob / (len(b.tokens) - (b.tokens[-1] == eos)) for b in output.sequences]
    assert scores == sorted(scores, reverse=True)
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    remote = RemoteServer(
        checkpoint, "--dtype", "float32", log_path=tmp_path_factory.mktemp("log") / "s.log"
    )
    start_servers(remote)
    yield remote
    remote.stop()


def test_completions_use_beam_search(server, reference, checkpoint):
    with server.http() as http:
        body = {"prompt": PROMPTS[1], "max_tokens": 6, "ignore_eos": True, "n": 2}
        reply = http.post("/v1/completions", json={**body, "use_beam_search": True, "best_of": 4})
        assert reply.status_code == 200, reply.text
        choices = reply.json()["choices"]
        beams, _ = _hf_beams(reference, PROMPTS[1], 4, 6, min_new_tokens=6, eos_token_id=None)
        tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
        assert [c["text"] for c in choices] == [tokenizer.decode(b) for b in beams[:2]]
        assert [c["index"] for c in choices] == [0, 1]
        assert reply.json()["usage"]["completion_tokens"] == 12
        for bad, word in [
            ({"stream": True}, "stream"),
            ({"top_p": 0.5}, "top_p"),
            ({"logprobs": 2}, "logprobs"),
        ]:
            reply = http.post("/v1/completions", json={**body, "use_beam_search": True, **bad})
            assert_openai_error(reply, 400, word)
        chat = {"messages": [{"role": "user", "content": "hi"}], "use_beam_search": True}
        assert_openai_error(http.post("/v1/chat/completions", json=chat), 400, "completions")
        assert_openai_error(
            http.post("/v1/completions", json={**body, "length_penalty": 0.5}), 400, "beam"
        )


def test_a_small_cache_evicts_tails_and_keeps_the_beams(checkpoint):
    """Eight beams in a cache of eight 8-token blocks, steps of at most 16 tokens: kept
    tails are evicted and recomputed as blocks run short, and the beams are those of a
    roomy cache."""
    params = BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    roomy = LLM(str(checkpoint), dtype="float32", disable_log_stats=True)
    expected = [[s.output_tokens for s in o.sequences] for o in roomy.beam_search(prompts, params)]
    small = LLM(
        str(checkpoint),
        dtype="float32",
        disable_log_stats=True,
        num_gpu_blocks_override=8,
        block_size=8,
        max_model_len=32,
        max_num_batched_tokens=16,
    )
    outputs = small.beam_search(prompts, params)
    assert [[s.output_tokens for s in o.sequences] for o in outputs] == expected
    manager = small.llm_engine.kv_manager
    assert manager.num_free_blocks == manager.num_blocks
