"""A tiny LLaVA's memory: its KV cache is sized without the encoder-output cache's bytes
(``PAGEDLLM_ENCODER_CACHE_ROWS`` rows of the text model's hidden size), and the encoder
cache stays within its rows however many image requests are cancelled."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

pytest.importorskip("PIL")

from tiny_llava import IMAGE_SIZE, NUM_IMAGE_TOKENS, llava_llm, make_image

from pagedllm import SamplingParams
from pagedllm.features.multimodal import DEFAULT_CACHE_ROWS

PROMPT = "USER: <image>\nWhat? ASSISTANT:"
# A KV-cache space small enough that the block count is not capped by max_num_seqs.
SPACE_GIB = 0.015


def block_bytes(llava_checkpoint: Path, block_size: int) -> int:
    """One KV block of the text model in float32: keys and values of every layer."""
    text = transformers.AutoConfig.from_pretrained(llava_checkpoint).text_config
    head_dim = text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers * 2 * text.num_key_value_heads * head_dim * block_size * 4


@pytest.mark.parametrize("rows", [None, 20000])
def test_the_kv_cache_leaves_room_for_the_encoder_cache(llava_checkpoint, monkeypatch, rows):
    monkeypatch.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", str(SPACE_GIB))
    if rows is not None:
        monkeypatch.setenv("PAGEDLLM_ENCODER_CACHE_ROWS", str(rows))
    llm = llava_llm(llava_checkpoint, num_gpu_blocks_override=None)
    engine = llm.llm_engine
    step = engine.config.scheduler_config.max_num_batched_tokens
    cache_rows = max(rows or DEFAULT_CACHE_ROWS, step)
    hidden = transformers.AutoConfig.from_pretrained(llava_checkpoint).text_config.hidden_size
    reserved = cache_rows * hidden * 4  # (float32 rows of the text model's width)
    per_block = block_bytes(llava_checkpoint, 8)
    budget = int(SPACE_GIB * 2**30)
    num_blocks = engine.kv_manager.num_blocks
    assert num_blocks == (budget - reserved) // per_block
    assert budget // per_block - num_blocks >= reserved // per_block > 0
    llm.llm_engine.shutdown()


def test_bad_encoder_cache_rows_are_refused(llava_checkpoint, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_ENCODER_CACHE_ROWS", "lots")
    with pytest.raises(Exception, match="PAGEDLLM_ENCODER_CACHE_ROWS"):
        llava_llm(llava_checkpoint)


def test_the_profiled_step_encodes_an_image_of_the_largest_size(llava_checkpoint):
    # (a device that measures its peak, CUDA's, runs this before sizing the KV cache)
    llm = llava_llm(llava_checkpoint)
    engine = llm.llm_engine
    extension = engine.extensions["multimodal"]
    payload = extension.profile_payload()
    assert payload[0] == "image" and tuple(payload[1].shape[-2:]) == (IMAGE_SIZE, IMAGE_SIZE)
    output = type(extension).profile_on_rank(payload, engine.executor.worker)
    hidden = transformers.AutoConfig.from_pretrained(llava_checkpoint).text_config.hidden_size
    assert tuple(output.shape) == (NUM_IMAGE_TOKENS, hidden)
    layout, _ = engine.executor.kv_cache_layout(engine.loaded)
    throwaway = engine.executor.profile(
        layout, block_size=8, num_tokens=64, num_seqs=2, max_model_len=256,
        extensions={"multimodal": payload},
    )  # fmt: skip
    assert throwaway > 0
    engine.shutdown()


@pytest.mark.parametrize("reuse", [True, False])
def test_cancelled_image_requests_leave_the_encoder_cache_within_its_rows(
    llava_checkpoint, monkeypatch, reuse
):
    monkeypatch.setenv("PAGEDLLM_ENCODER_CACHE_ROWS", "60")
    llm = llava_llm(
        llava_checkpoint, max_num_batched_tokens=64, disable_mm_preprocessor_cache=not reuse
    )
    engine = llm.llm_engine
    (runner,) = [e for e in engine.runner.extensions if e.name == "multimodal"]
    assert runner.cache.max_rows == 64  # (--max-num-batched-tokens is the floor)
    params = SamplingParams(max_tokens=50, min_tokens=50, temperature=0.0)
    for kind in range(6):
        image = make_image(kind)
        prompt = {"prompt": PROMPT, "multi_modal_data": {"image": image}}
        engine.add_request(f"r{kind}", prompt, params)
        engine.step()  # (its image is encoded and its prompt computed)
        engine.abort_request(f"r{kind}")
        assert runner.cache.rows <= runner.cache.max_rows
    assert runner.num_encoded == 6
    assert len(runner.cache.entries) == runner.cache.max_rows // NUM_IMAGE_TOKENS
    assert engine.kv_manager.usage == 0
    engine.shutdown()
