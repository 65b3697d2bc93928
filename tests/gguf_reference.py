"""transformers as the reference for a real GGUF file: its own GGUF reading (dequantized,
float32) and greedy decoding compared with pagedllm's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pagedllm import SamplingParams


def hf_gguf_model(path: Path, config: Any, model_cls: Any) -> Any:
    """The model transformers builds from ``path``. (``from_pretrained(gguf_file=...)``
    needs ``accelerate``, which is not installed; ``load_gguf_checkpoint`` is what it
    calls to dequantize and un-permute the tensors.)"""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = model_cls(config)
    loaded = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
    model = model_cls(config).float().eval()
    state = {k: torch.as_tensor(v) for k, v in loaded["tensors"].items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model


def assert_greedy_parity(
    llm: Any, model: Any, prompt_ids: list[list[int]], new_tokens: int, tolerance: float
) -> None:
    """Greedy tokens identical to ``model.generate`` and the chosen tokens' logprobs
    within ``tolerance``."""
    params = SamplingParams(
        temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, logprobs=1
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    for ids, output in zip(prompt_ids, outputs, strict=True):
        with torch.no_grad():
            result = model.generate(
                torch.tensor([ids]),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        expected = result.sequences[0, len(ids) :].tolist()
        completion = output.outputs[0]
        assert completion.token_ids == expected
        for step, (logits, token) in enumerate(zip(result.logits, expected, strict=True)):
            logprob = torch.log_softmax(logits[0].float(), dim=-1)[token].item()
            assert abs(completion.logprobs[step][token].logprob - logprob) < tolerance, step
