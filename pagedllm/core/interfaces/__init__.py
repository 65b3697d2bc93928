"""The extension-point ABCs that plugins implement."""

from pagedllm.core.interfaces.attention import AttentionBackend
from pagedllm.core.interfaces.cli import CLISubcommand
from pagedllm.core.interfaces.device import Device, KVCacheMemory
from pagedllm.core.interfaces.executor import Executor
from pagedllm.core.interfaces.extension import RunnerExtension, StepExtension, StepOutcome
from pagedllm.core.interfaces.guided import (
    CompiledConstraint,
    Grammar,
    GuidedBackend,
    GuidedConstraint,
    GuidedOptions,
)
from pagedllm.core.interfaces.kv_connector import KVBlockLayout, KVConnector
from pagedllm.core.interfaces.loader import ModelLoader
from pagedllm.core.interfaces.model import ModelArchitecture
from pagedllm.core.interfaces.multimodal import (
    MultiModalItem,
    MultiModalProcessor,
    ProcessedPrompt,
    SupportsMultiModal,
    content_hash,
)
from pagedllm.core.interfaces.parsers import (
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    ReasoningParser,
    ToolCall,
    ToolParser,
    new_tool_call_id,
)
from pagedllm.core.interfaces.quantization import (
    EmbeddingMethod,
    LinearMethod,
    MoEMethod,
    QuantizationConfig,
)
from pagedllm.core.interfaces.scheduler import SchedulerInterface

__all__ = [
    "AttentionBackend",
    "CLISubcommand",
    "CompiledConstraint",
    "DeltaMessage",
    "DeltaToolCall",
    "Device",
    "EmbeddingMethod",
    "Executor",
    "ExtractedToolCalls",
    "Grammar",
    "GuidedBackend",
    "GuidedConstraint",
    "GuidedOptions",
    "KVBlockLayout",
    "KVCacheMemory",
    "KVConnector",
    "LinearMethod",
    "MoEMethod",
    "ModelArchitecture",
    "ModelLoader",
    "MultiModalItem",
    "MultiModalProcessor",
    "ProcessedPrompt",
    "QuantizationConfig",
    "ReasoningParser",
    "RunnerExtension",
    "SchedulerInterface",
    "StepExtension",
    "StepOutcome",
    "SupportsMultiModal",
    "ToolCall",
    "ToolParser",
    "content_hash",
    "new_tool_call_id",
]
