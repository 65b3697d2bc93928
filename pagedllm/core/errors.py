"""Errors a user can cause or meet; each message names the thing and what to do."""


class PagedLLMError(Exception):
    """Base of pagedllm's user-facing errors."""


class ConfigError(PagedLLMError, ValueError):
    """An option has a value pagedllm cannot use; the message names it."""


class PluginError(PagedLLMError, RuntimeError):
    """A plugin is broken or conflicts with another; the message says which and how."""


class NotBuiltError(PagedLLMError):
    """A capability that this version of pagedllm does not have yet."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine failed while computing this request (the engine itself goes on)."""


class InvalidRequestError(PagedLLMError, ValueError):
    """A request the engine refuses; ``param`` names the offending field (an OpenAI
    request field or ``SamplingParams`` attribute), or is None when it is the request as
    a whole. Entry points map it to their own error (the server: a 400 with ``param``)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


class EngineSleepingError(RuntimeError):
    """The engine is asleep (``--enable-sleep-mode``) or falling asleep: it takes no
    request until woken (``LLM.wake_up()``, ``POST /wake_up``). The server answers 503."""
