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
