import json
import uuid

from pagedllm.core.interfaces import DeltaMessage, ExtractedToolCalls, ToolCall, ToolParser


class CallLineToolParser(ToolParser):
    """Lines of the form ``CALL name {json arguments}``; everything else is content."""

    def extract_tool_calls(self, model_output, request):
        calls, content = [], []
        for line in model_output.splitlines():
            if line.startswith("CALL "):
                name, _, args = line[5:].partition(" ")
                try:
                    json.loads(args or "{}")
                except json.JSONDecodeError:
                    content.append(line)
                    continue
                calls.append(ToolCall(f"call_{uuid.uuid4().hex[:8]}", name, args or "{}"))
            else:
                content.append(line)
        text = "\n".join(content) or None
        return ExtractedToolCalls(bool(calls), calls, text)

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
        return DeltaMessage(content=delta_text)
