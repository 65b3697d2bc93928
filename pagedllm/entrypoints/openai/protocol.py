"""Request bodies of the OpenAI API with vLLM's extra sampling fields.

These models check the shape of a body; the sampling fields' values are checked once, by
:class:`SamplingParams` (its :class:`InvalidRequestError` names the field). Unknown
top-level fields are ignored, as vLLM does (clients send OpenAI fields pagedllm does not
serve); :meth:`OpenAIModel.ignored_fields` names them, and the server warns of them and
names them in a response header. Fields that belong to
capabilities pagedllm does not have yet are accepted only at their neutral values and
refused otherwise, by name.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictInt,
    field_validator,
    model_validator,
)

from pagedllm.core.sampling import GuidedDecodingParams, RequestOutputKind, SamplingParams
from pagedllm.entrypoints.openai.legacy_functions import (
    function_messages_as_tools,
    functions_as_tools,
    uses_functions,
)
from pagedllm.entrypoints.openai.structured_outputs import GUIDED_FIELDS, structured_fields

if TYPE_CHECKING:
    from pagedllm.core.sampling.defaults import SamplingDefaults

# Far above any sensible request; a bound keeps absurd values from being attempted.
MAX_N = 128


# Token ids are JSON integers: true, 1.0 and "1" are refused, not read as ids.
TokenIds = list[StrictInt]


# Longest request id (the body's request_id, or the X-Request-Id header) accepted.
MAX_REQUEST_ID_LENGTH = 256
_SURROGATE = re.compile("[\ud800-\udfff]")


# The request fields beam search reads (the others must keep their defaults).
BEAM_SEARCH_FIELDS = frozenset(
    {
        "model", "n", "best_of", "max_tokens", "ignore_eos", "temperature", "length_penalty",
        "include_stop_str_in_output", "use_beam_search", "prompt", "request_id", "user",
        "priority", "truncate_prompt_tokens", "add_special_tokens", "skip_special_tokens",
        "spaces_between_special_tokens", "stream", "echo",
    }
)  # fmt: skip


# Why an ignored field does nothing, where that is worth saying.
IGNORED_FIELD_NOTES = {"reasoning_effort": "pagedllm has no reasoning budget"}


class OpenAIModel(BaseModel):
    # NaN and infinities (which Python's JSON parser accepts) are refused like any other
    # invalid number.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    def ignored_fields(self) -> list[str]:
        """The body's fields this model does not know (ignored), sorted."""
        return sorted(self.model_extra or ())

    @model_validator(mode="before")
    @classmethod
    def _refuse_lone_surrogates(cls, data: Any) -> Any:
        where = find_lone_surrogate(data)
        if where is not None:
            raise ValueError(
                f"{where or 'the body'} contains a lone UTF-16 surrogate, which is not valid "
                f"Unicode text"
            )
        return data


def find_lone_surrogate(value: Any, path: str = "") -> str | None:
    """The path of the first string (key or value) in ``value`` holding a lone UTF-16
    surrogate (JSON's ``"\\ud800"`` escape decodes to one), or None."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            here = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and _SURROGATE.search(key):
                return here
            found = find_lone_surrogate(item, here)
            if found is not None:
                return found
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = find_lone_surrogate(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


def check_request_id(value: str | None, name: str) -> str | None:
    """A client-chosen request id: at most MAX_REQUEST_ID_LENGTH printable characters."""
    if value is None:
        return None
    if len(value) > MAX_REQUEST_ID_LENGTH:
        raise ValueError(f"{name} is longer than {MAX_REQUEST_ID_LENGTH} characters")
    if not value.isprintable():
        raise ValueError(f"{name} contains control or non-printable characters")
    return value


class StreamOptions(OpenAIModel):
    # Only a body's top-level fields are ignored (and reported) when unknown.
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class SamplingFields(OpenAIModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    n: int = Field(1, le=MAX_N)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM's extras
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: Annotated[TokenIds, Field(min_length=1)] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    priority: int = 0
    request_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # Guided decoding (vLLM's extra fields, or OpenAI's response_format).
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's newer spelling of guided_*
    response_format: dict[str, Any] | None = None
    logits_processors: list[Any] | None = None

    @field_validator("request_id")
    @classmethod
    def _request_id(cls, value: str | None) -> str | None:
        return check_request_id(value, "request_id")

    @model_validator(mode="after")
    def _refuse_unbuilt(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        if self.length_penalty != 1.0 and not self.use_beam_search:
            raise ValueError("length_penalty only applies to beam search (use_beam_search)")
        if self.use_beam_search:
            self._check_beam_search()
        self.guided_decoding()  # refuses conflicting or malformed constraints
        if self.logits_processors:
            raise ValueError("logits_processors: custom logits processors are not supported")
        return self

    def _check_beam_search(self) -> None:
        if isinstance(self, ChatCompletionRequest):
            raise ValueError("use_beam_search is served on /v1/completions")
        if self.stream:
            raise ValueError("use_beam_search: beam search does not stream")
        if getattr(self, "echo", False):
            raise ValueError("use_beam_search: echo is not supported with beam search")
        others = sorted(
            name
            for name in self.model_fields_set - BEAM_SEARCH_FIELDS
            if name in type(self).model_fields
            and getattr(self, name) != type(self).model_fields[name].default
        )
        if others:
            raise ValueError(f"use_beam_search: {others} do not apply to beam search")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")

    def guided_decoding(self) -> GuidedDecodingParams | None:
        """The constraint the request asks for: ``response_format`` (``json_object``,
        ``json_schema``; ``text`` is none), ``structured_outputs`` or a ``guided_*`` field."""
        response = self.response_format
        json_schema = json_object = None
        if response is not None:
            kind = response.get("type")
            if kind == "json_object":
                json_object = True
            elif kind == "json_schema":
                spec = response.get("json_schema")
                if not isinstance(spec, dict):
                    raise ValueError("response_format json_schema needs a 'json_schema' object")
                json_schema = spec.get("schema", spec.get("json_schema"))
                if not isinstance(json_schema, dict):
                    raise ValueError("response_format json_schema needs a 'schema' object")
            elif kind != "text":
                raise ValueError(
                    f"response_format type {kind!r} is not supported (use text, json_object "
                    f"or json_schema)"
                )
        structured: dict[str, Any] = {}
        if self.structured_outputs is not None:
            guided = [name for name in GUIDED_FIELDS if getattr(self, name) is not None]
            structured = structured_fields(self.structured_outputs, guided)
        given = [
            name
            for name, value in (
                ("response_format", json_schema or json_object),
                ("structured_outputs", structured or None),
                ("guided_json", self.guided_json),
                ("guided_regex", self.guided_regex),
                ("guided_choice", self.guided_choice),
                ("guided_grammar", self.guided_grammar),
            )
            if value is not None
        ]
        if len(given) > 1:
            raise ValueError(f"only one kind of guided decoding at a time; got {', '.join(given)}")
        if not given:
            if self.guided_decoding_backend or self.guided_whitespace_pattern:
                raise ValueError(
                    "guided_decoding_backend/guided_whitespace_pattern need a constraint "
                    "(guided_json, guided_regex, guided_choice, guided_grammar or "
                    "response_format)"
                )
            return None
        guided_json = self.guided_json if self.guided_json is not None else json_schema
        if isinstance(guided_json, BaseModel):
            guided_json = guided_json.model_dump()
        if structured:
            return GuidedDecodingParams(**structured, backend=self.guided_decoding_backend)
        return GuidedDecodingParams(
            json=guided_json,
            regex=self.guided_regex,
            choice=self.guided_choice,
            grammar=self.guided_grammar,
            json_object=json_object,
            backend=self.guided_decoding_backend,
            whitespace_pattern=self.guided_whitespace_pattern,
        )

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        defaults: SamplingDefaults,
    ) -> SamplingParams:
        """The engine's SamplingParams; unset fields take the model's generation defaults
        (then OpenAI's), and ``max_tokens`` its cap."""
        return defaults.sampling_params(
            n=self.n,
            best_of=self.best_of,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            bad_words=self.bad_words,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            guided_decoding=self.guided_decoding(),
        )


class CompletionRequest(SamplingFields):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[TokenIds, Field(min_length=1)]
        | Annotated[list[Annotated[TokenIds, Field(min_length=1)]], Field(min_length=1)]
    )
    # 0 only with echo: the prompt is scored and nothing is generated.
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    suffix: str | None = None
    add_special_tokens: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_shape(cls, value: Any) -> Any:
        # (before the union's own checks, whose messages name every arm)
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and any(item == [] for item in value):
            raise ValueError(f"prompt[{value.index([])}] must not be empty")
        if isinstance(value, list):
            items = [i for item in value for i in (item if isinstance(item, list) else [item])]
            wrong = next((i for i in items if isinstance(i, bool | float)), None)
            if wrong is not None:
                raise ValueError(f"prompt: token ids must be integers, got {wrong!r}")
        return value

    @model_validator(mode="after")
    def _refuse_suffix(self) -> CompletionRequest:
        if self.suffix is not None:
            raise ValueError("suffix: insertion (fill-in-the-middle) is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 only with echo, to score a prompt)")
        return self


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    # (vLLM's: options of the model's multimodal processor for this request's images)
    mm_processor_kwargs: dict[str, Any] | None = None

    # The request asked the deprecated way (functions/function_call): see .legacy_functions.
    _legacy_functions: bool = PrivateAttr(False)

    @model_validator(mode="wrap")
    @classmethod
    def _functions_as_tools(cls, data: Any, handler: Any) -> ChatCompletionRequest:
        legacy = isinstance(data, dict) and uses_functions(data)
        if isinstance(data, dict):
            if legacy:
                data = functions_as_tools(data)
            if "messages" in data:
                data = dict(data, messages=function_messages_as_tools(data["messages"]))
        request = handler(data)
        request._legacy_functions = legacy
        return request

    @property
    def legacy_functions(self) -> bool:
        """Whether the reply takes the deprecated ``function_call`` shape."""
        return self._legacy_functions

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        return self


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # (the image processor's options: an image's token count may depend on them)
    mm_processor_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: TokenIds


Role = Literal["system", "user", "assistant", "tool", "developer"]
