"""``pagedllm chat`` and ``pagedllm complete``: clients of a running server.

Both use the official ``openai`` client, as vLLM's do: ``-q`` sends one message and prints
the reply; otherwise lines are read from stdin (prompt ``> ``) and each reply is streamed
to stdout until EOF or Ctrl-C. ``chat`` keeps the conversation's history.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from abc import abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from pagedllm.entrypoints.cli.types import CLISubcommand

if TYPE_CHECKING:
    from openai import OpenAI

    from pagedllm.core.plugins import PluginManager

# Sent when neither --api-key nor OPENAI_API_KEY is set (the client needs some key).
PLACEHOLDER_API_KEY = "EMPTY"


class ClientError(Exception):
    """A problem reported as one line on stderr, exit code 1."""


class _ClientSubcommand(CLISubcommand):
    quick_metavar: ClassVar[str]
    quick_help: ClassVar[str]
    banner: ClassVar[str]

    def add_parser(
        self, subparsers: argparse._SubParsersAction, pm: PluginManager
    ) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(self.name, help=self.help, description=self.help)
        parser.add_argument(
            "--url",
            default="http://localhost:8000/v1",
            help="URL of the running OpenAI-compatible API server (default: %(default)s)",
        )
        parser.add_argument(
            "--model-name",
            default=None,
            help="Model to use; by default the first one the server lists.",
        )
        parser.add_argument(
            "--api-key",
            default=None,
            help="API key; overrides the OPENAI_API_KEY environment variable.",
        )
        parser.add_argument(
            "-q", "--quick", default=None, metavar=self.quick_metavar, help=self.quick_help
        )
        parser.add_argument(
            "--max-tokens",
            type=int,
            default=None,
            help="Most tokens per reply (default: the server's default).",
        )
        self.add_own_args(parser)
        pm.hook.pagedllm_add_cli_args(parser=parser, subcommand=self.name)
        return parser

    def add_own_args(self, parser: argparse.ArgumentParser) -> None:
        """Options only this client has."""

    def run(self, args: argparse.Namespace, pm: PluginManager) -> int:
        import openai

        quiet_http_logs()
        try:
            client = openai.OpenAI(
                api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or PLACEHOLDER_API_KEY,
                base_url=args.url,
                max_retries=0,
            )
            model = args.model_name or first_model(client)
            print(f"Using model: {model}", file=sys.stderr)
            if args.quick is not None:
                self.send(client, model, args, args.quick)
                return 0
            print(self.banner, file=sys.stderr)
            self.interact(client, model, args)
        except KeyboardInterrupt:
            print(file=sys.stderr)
        except openai.APIConnectionError as exc:
            return fail(self.name, connection_message(args.url, exc))
        except openai.APIError as exc:
            return fail(self.name, api_error_message(exc))
        except ClientError as exc:
            return fail(self.name, str(exc))
        return 0

    def interact(self, client: OpenAI, model: str, args: argparse.Namespace) -> None:
        """Send each line of stdin until EOF; a refused request is reported and skipped."""
        import openai

        while True:
            try:
                line = input("> ")
            except EOFError:
                print()
                return
            if not line.strip():
                continue
            try:
                self.send(client, model, args, line)
            except openai.APIStatusError as exc:
                print(f"error: {api_error_message(exc)}", file=sys.stderr)

    @abstractmethod
    def send(self, client: OpenAI, model: str, args: argparse.Namespace, text: str) -> str:
        """Send ``text``, stream the reply to stdout and return it."""


class ChatSubcommand(_ClientSubcommand):
    name = "chat"
    help = "Generate chat completions via the running API server."
    quick_metavar = "MESSAGE"
    quick_help = "Send MESSAGE, print the reply and exit."
    banner = "Please enter a message for the chat model (Ctrl-D to quit):"

    def add_own_args(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--system-prompt",
            default=None,
            help="System prompt added to the chat, for models that support one.",
        )

    def run(self, args: argparse.Namespace, pm: PluginManager) -> int:
        self.conversation: list[dict[str, str]] = []
        if args.system_prompt is not None:
            self.conversation.append({"role": "system", "content": args.system_prompt})
        return super().run(args, pm)

    def send(self, client: OpenAI, model: str, args: argparse.Namespace, text: str) -> str:
        self.conversation.append({"role": "user", "content": text})
        try:
            stream = client.chat.completions.create(
                model=model,
                messages=self.conversation,
                stream=True,
                **token_limit(args, "max_completion_tokens"),
            )
            reply = print_stream(
                chunk.choices[0].delta.content for chunk in stream if chunk.choices
            )
        except BaseException:
            self.conversation.pop()  # a failed turn is not part of the history
            raise
        self.conversation.append({"role": "assistant", "content": reply})
        return reply


class CompleteSubcommand(_ClientSubcommand):
    name = "complete"
    help = "Generate text completions for prompts via the running API server."
    quick_metavar = "PROMPT"
    quick_help = "Send PROMPT, print the completion and exit."
    banner = "Please enter a prompt to complete (Ctrl-D to quit):"

    def send(self, client: OpenAI, model: str, args: argparse.Namespace, text: str) -> str:
        stream = client.completions.create(
            model=model, prompt=text, stream=True, **token_limit(args, "max_tokens")
        )
        return print_stream(chunk.choices[0].text for chunk in stream if chunk.choices)


def print_stream(pieces: Any) -> str:
    """Print the text pieces as they come, then a newline; return the whole text."""
    parts = []
    try:
        for piece in pieces:
            if piece:
                sys.stdout.write(piece)
                sys.stdout.flush()
                parts.append(piece)
    finally:
        sys.stdout.write("\n")
        sys.stdout.flush()
    return "".join(parts)


def token_limit(args: argparse.Namespace, field: str) -> dict[str, int]:
    return {field: args.max_tokens} if args.max_tokens is not None else {}


def quiet_http_logs() -> None:
    """The HTTP client logs every request at INFO; a CLI shows only problems."""
    for name in ("httpx", "httpx2", "openai"):
        logging.getLogger(name).setLevel(logging.WARNING)


def first_model(client: OpenAI) -> str:
    models = client.models.list().data
    if not models:
        raise ClientError("the server lists no models; pass --model-name")
    return models[0].id


def connection_message(url: str, exc: Exception) -> str:
    cause = exc.__cause__ or exc
    detail = str(cause).strip() or type(cause).__name__
    return f"cannot connect to the API server at {url} ({detail}); is it running?"


def api_error_message(exc: Exception) -> str:
    status = getattr(exc, "status_code", None)
    body = getattr(exc, "body", None)
    message = body.get("message") if isinstance(body, dict) else None
    message = message or getattr(exc, "message", None) or str(exc)
    return f"the server answered {status}: {message}" if status else f"the server: {message}"


def fail(command: str, message: str) -> int:
    print(f"pagedllm {command}: error: {message}", file=sys.stderr)
    return 1
