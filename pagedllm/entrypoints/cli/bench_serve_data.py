"""Prompts for ``pagedllm bench serve``: a ShareGPT file, or the synthetic datasets of
:mod:`pagedllm.entrypoints.cli.bench_data` (decoded to text for the chat endpoint).

Token counts come from a local tokenizer (``--tokenizer``) or, by default, from the
server's ``/tokenize`` and ``/detokenize`` endpoints.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Protocol

from pagedllm.entrypoints.cli.bench_serve_client import BenchError, RequestInput, ServerInfo

# Upper bound of the vocabulary-size search on a server's /detokenize.
_MAX_VOCAB = 1 << 22


class Tokenizer(Protocol):
    def vocab_size(self) -> int: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, token_ids: list[int]) -> str: ...


class LocalTokenizer:
    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        file = Path(path)
        if file.suffix == ".gguf" and not file.is_file():
            raise BenchError(f"--tokenizer {path}: no such file")
        try:
            if file.suffix == ".gguf":  # the tokenizer inside a GGUF file
                self.tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
            else:
                self.tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as exc:
            raise BenchError(f"--tokenizer {path}: cannot load it: {exc}") from exc

    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)


class ServerTokenizer:
    """The server's ``/tokenize`` and ``/detokenize`` (vLLM's extra endpoints)."""

    def __init__(self, server: ServerInfo, model: str) -> None:
        self.server = server
        self.model = model

    def _detokenize(self, token_ids: list[int]) -> str | None:
        response = self.server.post("/detokenize", {"model": self.model, "tokens": token_ids})
        if response.status_code == 404 and not token_ids[1:]:
            raise BenchError("the server has no /detokenize endpoint; pass --tokenizer")
        return response.json().get("prompt") if response.status_code == 200 else None

    def vocab_size(self) -> int:
        if self._detokenize([0]) is None:
            raise BenchError("the server's /detokenize refuses token 0; pass --tokenizer")
        low, high = 1, _MAX_VOCAB  # token low-1 is valid; high is not (or is the cap)
        while low < high:
            middle = (low + high) // 2
            if self._detokenize([middle]) is not None:
                low = middle + 1
            else:
                high = middle
        if low >= _MAX_VOCAB:
            raise BenchError("cannot find the vocabulary size from /detokenize; pass --tokenizer")
        return low

    def encode(self, text: str) -> list[int]:
        payload = {"model": self.model, "prompt": text, "add_special_tokens": False}
        response = self.server.post("/tokenize", payload)
        if response.status_code != 200:
            raise BenchError(f"/tokenize: HTTP {response.status_code}: {response.text[:300]}")
        return response.json()["tokens"]

    def decode(self, token_ids: list[int]) -> str:
        text = self._detokenize(token_ids)
        if text is None:
            raise BenchError("/detokenize refused a random prompt")
        return text


def sharegpt_requests(
    args: Any, tokenizer: Tokenizer, max_model_len: int, rng: random.Random
) -> list[RequestInput]:
    """First human turn as the prompt, the reply's length (or --sharegpt-output-len) as
    the output length; conversations too short or too long for the model are skipped."""
    path = args.dataset_path
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BenchError(f"--dataset-path {path}: cannot read a JSON dataset: {exc}") from exc
    if not isinstance(data, list):
        raise BenchError(f"--dataset-path {path}: expected a list of conversations")
    conversations = [
        turns
        for item in data
        if isinstance(item, dict)
        and len(turns := item.get("conversations") or item.get("conversation") or []) >= 2
    ]
    rng.shuffle(conversations)
    fixed = args.sharegpt_output_len
    requests: list[RequestInput] = []
    for turns in conversations:
        if len(requests) == args.num_prompts:
            break
        prompt = str(turns[0].get("value", ""))
        prompt_len = len(tokenizer.encode(prompt))
        output_len = fixed or len(tokenizer.encode(str(turns[1].get("value", ""))))
        if prompt_len < 4 or output_len < 4 or prompt_len + output_len > max_model_len:
            continue
        requests.append(RequestInput(prompt, prompt_len, output_len))
    if not requests:
        raise BenchError(f"--dataset-path {path}: no usable conversations")
    return [requests[i % len(requests)] for i in range(args.num_prompts)]
