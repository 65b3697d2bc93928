"""Sampling: per-request parameters, the batched metadata of one step, and the sampler."""

from pagedllm.core.sampling.guided_params import GuidedDecodingParams
from pagedllm.core.sampling.metadata import SamplingMetadata
from pagedllm.core.sampling.params import (
    RequestOutputKind,
    SamplingParams,
    SamplingType,
)
from pagedllm.core.sampling.sampler import (
    LogprobsLists,
    LogprobsRow,
    Sampler,
    SamplerOutput,
    compute_prompt_logprobs,
)

__all__ = [
    "GuidedDecodingParams",
    "LogprobsLists",
    "LogprobsRow",
    "RequestOutputKind",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingParams",
    "SamplingType",
    "compute_prompt_logprobs",
]
