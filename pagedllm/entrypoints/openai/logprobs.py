"""Logprobs in the shapes of the OpenAI API: chat's ``{"content": [...]}``, the legacy
completions' parallel lists, and vLLM's ``prompt_logprobs``."""

from __future__ import annotations

from typing import Any

from pagedllm.core.outputs import Logprob, RequestOutput

# JSON has no -inf: a token the model rules out is reported at this logprob.
_FLOOR = -9999.0


class LogprobFormatter:
    """Writes tokens as text (or as ``token_id:{id}`` with ``return_tokens_as_token_ids``)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def token_text(self, token_id: int, logprob: Logprob | None, as_ids: bool) -> str:
        if as_ids:
            return f"token_id:{token_id}"
        if logprob is None:
            return self.tokenizer.decode([token_id]) if self.tokenizer else ""
        return logprob.decoded_token if logprob.decoded_token is not None else ""

    def chat(
        self,
        token_ids: list[int],
        positions: list[dict[int, Logprob]],
        top: int,
        as_ids: bool,
    ) -> dict[str, Any]:
        """A chat choice's (or chunk's) ``logprobs``: each token with its ``top`` best."""
        content = []
        for token_id, position in zip(token_ids, positions, strict=False):
            chosen = position[token_id]
            text = self.token_text(token_id, chosen, as_ids)
            ranked = sorted(position.items(), key=lambda kv: kv[1].rank or 0)[:top]
            content.append(
                {
                    "token": text,
                    "logprob": max(chosen.logprob, _FLOOR),
                    "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [
                        {
                            "token": (t := self.token_text(tid, lp, as_ids)),
                            "logprob": max(lp.logprob, _FLOOR),
                            "bytes": list(t.encode("utf-8")),
                        }
                        for tid, lp in ranked
                        if lp.rank is not None and lp.rank <= top
                    ],
                }
            )
        return {"content": content}

    def completion(
        self,
        token_ids: list[int],
        positions: list[dict[int, Logprob] | None],
        top: int,
        text_offset: int,
        as_ids: bool,
    ) -> dict[str, Any]:
        """A completion choice's ``logprobs``; offsets count from ``text_offset``."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        offset = text_offset
        for token_id, position in zip(token_ids, positions, strict=False):
            if position is None:  # the first prompt token has no logprob
                text = self.token_text(token_id, None, as_ids)
                tokens.append(text)
                token_logprobs.append(None)
                top_logprobs.append(None)
            else:
                chosen = position[token_id]
                text = self.token_text(token_id, chosen, as_ids)
                tokens.append(text)
                token_logprobs.append(max(chosen.logprob, _FLOOR))
                top_logprobs.append(
                    {
                        self.token_text(tid, lp, as_ids): max(lp.logprob, _FLOOR)
                        for tid, lp in position.items()
                        if tid == token_id or (lp.rank is not None and lp.rank <= top)
                    }
                )
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }


def prompt_logprobs_json(output: RequestOutput) -> list[Any] | None:
    """vLLM's ``prompt_logprobs``: per prompt position, token id -> logprob, rank, text."""
    if output.prompt_logprobs is None:
        return None
    return [
        None
        if position is None
        else {
            str(token_id): {
                "logprob": lp.logprob,
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for token_id, lp in position.items()
        }
        for position in output.prompt_logprobs
    ]
