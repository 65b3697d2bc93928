"""A reasoning parser for a made-up model convention: the chat template opens
``[THINK]`` at the end of the prompt; the model reasons, writes ``[/THINK]``, then
answers."""

from __future__ import annotations

from pagedllm.core.interfaces import DeltaMessage, ReasoningParser

OPEN, CLOSE = "[THINK]", "[/THINK]"


# [docs:reasoning_parser]
class ThinkTagReasoningParser(ReasoningParser):
    """Reasoning runs from the start of the output to ``[/THINK]`` when the prompt ends
    with ``[THINK]``; without that, the whole output is the answer."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.sent_reasoning = self.sent_content = 0  # characters already streamed

    def prompt_opens_reasoning(self, prompt):
        return prompt.rstrip().endswith(OPEN)

    def split(self, text: str) -> tuple[str, str]:
        """``(reasoning, content)`` of an output."""
        if not self.starts_in_reasoning:
            return "", text
        reasoning, closed, content = text.partition(CLOSE)
        return reasoning, content if closed else ""

    def is_reasoning_end(self, token_ids):
        # An empty output ends the reasoning only when there was none to begin with.
        if not self.starts_in_reasoning:
            return True
        return CLOSE in self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def extract_reasoning_content(self, model_output, request):
        reasoning, content = self.split(model_output)
        return reasoning or None, content or None

    def extract_reasoning_content_streaming(
        self,
        previous_text,
        current_text,
        delta_text,
        previous_token_ids,
        current_token_ids,
        delta_token_ids,
    ):
        reasoning, content = self.split(current_text)
        if self.starts_in_reasoning and CLOSE not in current_text:
            # Hold back a tail that may be the start of [/THINK].
            for size in range(min(len(CLOSE) - 1, len(reasoning)), 0, -1):
                if reasoning.endswith(CLOSE[:size]):
                    reasoning = reasoning[:-size]
                    break
        return self._send(reasoning, content)

    def flush_streaming(self, final_text):
        return self._send(*self.split(final_text))

    def _send(self, reasoning: str, content: str) -> DeltaMessage | None:
        new_reasoning = reasoning[self.sent_reasoning :]
        new_content = content[self.sent_content :]
        self.sent_reasoning += len(new_reasoning)
        self.sent_content += len(new_content)
        if not new_reasoning and not new_content:
            return None
        return DeltaMessage(content=new_content or None, reasoning_content=new_reasoning or None)


# [/docs:reasoning_parser]
