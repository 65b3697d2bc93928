"""A tool-call parser for a made-up model convention: one call per line."""

from __future__ import annotations

import json

from pagedllm.core.interfaces import (
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    new_tool_call_id,
)


# [docs:tool_parser]
def parse_call(line: str) -> tuple[str, str] | None:
    """``(name, JSON arguments)`` of a ``CALL name {json}`` line, or None."""
    if not line.startswith("CALL "):
        return None
    name, _, arguments = line[5:].strip().partition(" ")
    arguments = arguments.strip() or "{}"
    try:
        if not name or not isinstance(json.loads(arguments), dict):
            return None
    except json.JSONDecodeError:
        return None
    return name, arguments


class CallLineToolParser(ToolParser):
    """Lines of the form ``CALL name {json arguments}`` are tool calls; every other line
    is content. Streaming holds back the line being written until it is complete."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.sent_upto = 0  # characters of the output already sent
        self.num_calls = 0
        self.content_sent = False

    def extract_tool_calls(self, model_output, request):
        calls, content = [], []
        for line in model_output.split("\n"):
            parsed = parse_call(line)
            if parsed is None:
                content.append(line)
            else:
                calls.append(ToolCall(new_tool_call_id(), *parsed))
        text = "\n".join(content) if calls else model_output
        return ExtractedToolCalls(bool(calls), calls, text or None)

    def extract_tool_calls_streaming(
        self,
        previous_text,
        current_text,
        delta_text,
        previous_token_ids,
        current_token_ids,
        delta_token_ids,
        request,
    ):
        end = current_text.rfind("\n") + 1  # complete lines only
        return self._send(current_text[self.sent_upto : end], final=False, upto=end)

    def flush_streaming(self, final_text):
        return self._send(final_text[self.sent_upto :], final=True, upto=len(final_text))

    def _send(self, text: str, final: bool, upto: int) -> DeltaMessage | None:
        if not final and not text:
            return None
        self.sent_upto = upto
        # Complete lines end with a newline; at the end, the last line is complete too.
        lines = text.split("\n") if final else text.split("\n")[:-1]
        message = DeltaMessage()
        content = []
        for line in lines:
            parsed = parse_call(line)
            if parsed is None:
                content.append(line)
                continue
            message.tool_calls.append(
                DeltaToolCall(self.num_calls, new_tool_call_id(), *parsed, type="function")
            )
            self.num_calls += 1
        if content:
            # Content lines are joined by newlines, as extract_tool_calls joins them.
            prefix = "\n" if self.content_sent else ""
            message.content = prefix + "\n".join(content)
            self.content_sent = True
        return message if message.content or message.tool_calls else None


# [/docs:tool_parser]
