"""The request log of the OpenAI server (``--enable-log-requests``, ``--max-log-len``) and
what makes a client's text safe to put in a log line."""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import TYPE_CHECKING, Any

from pagedllm.core.args.checks import apply_deprecated_aliases
from pagedllm.core.errors import ConfigError

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.cli_args import FrontendArgs


@dataclasses.dataclass(slots=True)
class RequestLog:
    """``--enable-log-requests`` / ``--max-log-len``: each request the engine accepted is
    logged once, with its prompt, token ids and sampling parameters (each capped at
    ``max_len``). Nothing is logged by default, and nothing of a refused request ever:
    request contents are user data."""

    enabled: bool = False
    max_len: int | None = None
    logger: logging.Logger = dataclasses.field(
        default_factory=lambda: logging.getLogger("pagedllm.server")
    )

    @classmethod
    def for_options(cls, options: FrontendArgs, logger: logging.Logger) -> RequestLog:
        enabled = options.enable_log_requests and not options.disable_log_requests
        return cls(enabled, options.max_log_len, logger)

    def accepted(
        self, request_id: str, text: str | None, token_ids: list[int], params: Any
    ) -> None:
        if not self.enabled:
            return
        shown_ids: Any = token_ids
        params_text = repr(params)
        if self.max_len is not None:
            text = None if text is None else text[: self.max_len]
            shown_ids = token_ids[: self.max_len]
            params_text = params_text[: self.max_len]
        self.logger.info(
            "received request %s: prompt: %s, prompt_token_ids: %s, params: %s",
            for_log(request_id),
            for_log(repr(text)),
            shown_ids,
            for_log(params_text),
        )


def check_request_logging(options: FrontendArgs, logger: logging.Logger) -> None:
    """Refuse ``--enable-log-requests`` beside its deprecated opposite; warn of the flags
    that change nothing here."""
    if options.enable_log_requests and options.disable_log_requests:
        raise ConfigError(
            "--enable-log-requests and --disable-log-requests contradict each other; give "
            "one (--disable-log-requests is deprecated: requests are not logged unless "
            "--enable-log-requests is given)"
        )
    for warning in apply_deprecated_aliases(options):
        logger.warning("%s", warning)
    if options.max_log_len is not None and not options.enable_log_requests:
        logger.warning(
            "--max-log-len %s changes nothing without --enable-log-requests (no request is logged)",
            options.max_log_len,
        )


# Characters that could forge or garble a log line: controls (newlines, terminal escape
# sequences), line and paragraph separators, bidirectional overrides.
_UNSAFE_IN_LOGS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def for_log(text: str) -> str:
    """``text`` with every character that could forge or garble a log line escaped."""
    return _UNSAFE_IN_LOGS.sub(lambda m: m.group().encode("unicode_escape").decode(), text)
