"""An ``argparse`` parser with the conveniences of vLLM's command line.

- ``--help=GROUP``, ``--help=arg-name``, ``--help=keyword`` and ``--help=listgroup``;
- ``--config FILE.yaml`` reads options from YAML (options on the command line win), also
  from the ``vllm:`` section of a deployment file that has other tools' sections;
- ``--some_option`` is the same as ``--some-option``;
- an on/off option also takes a value: ``--enable-chunked-prefill false``,
  ``--enforce-eager=1`` (``true``/``false``/``1``/``0``, any case);
- JSON options can be given key by key: ``--rope-scaling.rope_type dynamic``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

HELP_PREFIX = "--help="

# The section of a deployment file (the template of vLLM's deployment guide) that holds
# the server's options, beside other tools' sections (``docker:``).
CONFIG_SECTION = "vllm"

_SWITCH_VALUES = {"true": True, "1": True, "false": False, "0": False}

logger = logging.getLogger("pagedllm.config")


class FlexibleArgumentParser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)
        # Dests of options whose value is a JSON object (for dotted keys).
        self.json_dests: set[str] = set()

    # ------------------------------------------------------------------ parsing

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        args = list(sys.argv[1:] if args is None else args)
        own, rest = self._split_at_subcommand(args)
        for token in own:
            if token.startswith(HELP_PREFIX):
                self.print_keyword_help(token[len(HELP_PREFIX) :])
                self.exit(0)
        own = self._normalise_underscores(own)
        own = self._expand_config_file(own)
        own = self._switch_values(own)
        own = self._merge_dotted_json(own)
        return super().parse_known_args(own + rest, namespace)

    def _split_at_subcommand(self, args: list[str]) -> tuple[list[str], list[str]]:
        """Arguments for this parser, and from the first subcommand name on."""
        names = self._subcommand_names()
        if not names:
            return args, []
        for i, token in enumerate(args):
            if token in names:
                return args[:i], args[i:]
        return args, []

    def _subcommand_names(self) -> set[str]:
        names: set[str] = set()
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                names.update(action.choices)
        return names

    def _option_actions(self) -> dict[str, argparse.Action]:
        return {opt: a for a in self._actions for opt in a.option_strings}

    def _normalise_underscores(self, args: list[str]) -> list[str]:
        known = self._option_actions()
        out = []
        for token in args:
            if token.startswith("--") and "_" in token:
                name, sep, value = token.partition("=")
                base, dot, rest = name.partition(".")
                dashed = base.replace("_", "-")
                if dashed in known and base not in known:
                    token = dashed + dot + rest + sep + value
            out.append(token)
        return out

    def _expand_config_file(self, args: list[str]) -> list[str]:
        """Replace ``--config FILE`` by the options it holds, placed first so the
        command line overrides them."""
        if "--config" not in self._option_actions():
            return args
        config_path = None
        rest = []
        i = 0
        while i < len(args):
            token = args[i]
            if token == "--config":
                if i + 1 >= len(args):
                    self.error("argument --config: expected a YAML file path")
                config_path = args[i + 1]
                i += 2
                continue
            if token.startswith("--config="):
                config_path = token.split("=", 1)[1]
                i += 1
                continue
            rest.append(token)
            i += 1
        if not config_path:
            return args
        return self.config_file_args(config_path) + rest

    def config_file_args(self, path: str) -> list[str]:
        import yaml  # (30 ms of every start otherwise; only --config needs it)

        file = Path(path)
        try:
            data = yaml.safe_load(file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            self.error(f"argument --config: file {path!r} does not exist")
        except yaml.YAMLError as exc:
            self.error(f"argument --config: {path!r} is not valid YAML: {exc}")
        if data is None:
            return []
        if not isinstance(data, dict):
            self.error(f"argument --config: {path!r} must hold a mapping of option: value")
        actions = self._option_actions()
        data = self._config_section(path, data, actions)
        positional = {a.dest: a for a in self._actions if not a.option_strings}
        out: list[str] = []
        for key, value in data.items():
            option = "--" + str(key).replace("_", "-")
            action = actions.get(option)
            if action is None:
                # ``model`` in a config file fills the positional model of ``serve``.
                pos = positional.get(str(key).replace("-", "_"))
                if pos is None and key == "model":
                    pos = positional.get("model_tag")
                if pos is not None and value is not None:
                    out.append(str(value))
                    continue
                self.error(f"argument --config: {path!r} has an unknown option {key!r}")
            out.extend(_yaml_value_args(option, action, value))
        return out

    def _switch_values(self, args: list[str]) -> list[str]:
        """Rewrite ``--switch VALUE`` and ``--switch=VALUE`` (an on/off option given a
        value, as vLLM's older command line and its own messages write it) as the option
        alone: ``--switch``, ``--no-switch``, or for an option with no ``--no-`` form
        (off by default), nothing, and no earlier ``--switch`` either.

        A following word that is not a switch value is left alone (a positional model).
        """
        actions = self._option_actions()
        out: list[str] = []
        i = 0
        while i < len(args):
            token = args[i]
            name, eq, text = token.partition("=")
            action = actions.get(name) if token.startswith("--") else None
            if not isinstance(action, argparse._StoreTrueAction | argparse.BooleanOptionalAction):
                out.append(token)
                i += 1
                continue
            if eq:
                i += 1
            elif i + 1 < len(args) and args[i + 1].lower() in _SWITCH_VALUES:
                text = args[i + 1]
                i += 2
            else:
                out.append(token)
                i += 1
                continue
            on = _SWITCH_VALUES.get(text.lower())
            if on is None:
                self.error(f"argument {name}: expected true or false (or 1 or 0), got {text!r}")
            if name.startswith("--no-"):
                on = not on
            positive = action.option_strings[0]
            if on:
                out.append(positive)
            elif isinstance(action, argparse.BooleanOptionalAction):
                out.append("--no-" + positive[2:])
            else:
                # Off is the default of an option with no --no- form.
                out = [t for t in out if t not in action.option_strings]
        return out

    def _config_section(
        self, path: str, data: dict[Any, Any], actions: dict[str, argparse.Action]
    ) -> dict[Any, Any]:
        """The options of a config file: the file itself, or its ``vllm:`` section where
        it has one beside other tools' sections (as the deployment template does)."""
        section = data.get(CONFIG_SECTION)
        if not isinstance(section, dict) or "--" + CONFIG_SECTION in actions:
            return data
        others = [str(key) for key in data if key != CONFIG_SECTION]
        misplaced = [k for k in others if "--" + k.replace("_", "-") in actions]
        if misplaced:
            self.error(
                f"argument --config: {path!r} has options both in its {CONFIG_SECTION!r} "
                f"section and outside it ({', '.join(misplaced)}); put them in the section"
            )
        if others:
            logger.info(
                "--config %s: reading the options under %r; the other sections (%s) are "
                "for other tools",
                path,
                CONFIG_SECTION,
                ", ".join(others),
            )
        return section

    def _merge_dotted_json(self, args: list[str]) -> list[str]:
        if not self.json_dests:
            return args
        actions = self._option_actions()
        merged: dict[str, dict[str, Any]] = {}
        out: list[str] = []
        i = 0
        while i < len(args):
            token = args[i]
            name, eq, inline = token.partition("=")
            base, dot, path = name.partition(".")
            action = actions.get(base) if token.startswith("--") and dot else None
            if action is None or action.dest not in self.json_dests:
                out.append(token)
                i += 1
                continue
            if eq:
                raw = inline
                i += 1
            elif i + 1 < len(args):
                raw = args[i + 1]
                i += 2
            else:
                self.error(f"argument {name}: expected a value")
            target = merged.setdefault(base, {})
            keys = path.split(".")
            for key in keys[:-1]:
                target = target.setdefault(key, {})
            target[keys[-1]] = _json_or_string(raw)
        if not merged:
            return out
        # Merge with a whole-object value given for the same option.
        final: list[str] = []
        i = 0
        while i < len(out):
            token = out[i]
            name, eq, inline = token.partition("=")
            if name in merged and (eq or i + 1 < len(out)):
                raw = inline if eq else out[i + 1]
                i += 1 if eq else 2
                try:
                    whole = json.loads(raw)
                except json.JSONDecodeError:
                    self.error(f"argument {name}: expected a JSON object, got {raw!r}")
                if isinstance(whole, dict):
                    merged[name] = _deep_merge(whole, merged[name])
                continue
            final.append(token)
            i += 1
        for name, value in merged.items():
            final.extend([name, json.dumps(value)])
        return final

    # --------------------------------------------------------------- --help=

    def print_keyword_help(self, keyword: str) -> None:
        keyword = keyword.strip()
        groups = [g for g in self._action_groups if g._group_actions]
        if keyword == "listgroup":
            print("Argument groups (use --help=GROUP to see one):")
            for group in groups:
                print(f"  {group.title}")
            return
        for group in groups:
            if group.title and group.title.lower() == keyword.lower():
                self._print_actions(group.title, group.description, group._group_actions)
                return
        wanted = "--" + keyword.lstrip("-").replace("_", "-")
        for action in self._actions:
            if wanted in action.option_strings:
                self._print_actions(None, None, [action])
                return
        needle = keyword.lower()
        matches = [
            a
            for a in self._actions
            if a.option_strings
            and (
                any(needle in o.lower() for o in a.option_strings)
                or needle in (a.help or "").lower()
            )
        ]
        if not matches:
            print(
                f"No argument group or argument matches {keyword!r}. "
                f"Use --help=listgroup to see the groups."
            )
            return
        self._print_actions(f"Arguments matching {keyword!r}", None, matches)

    def _print_actions(
        self, title: str | None, description: str | None, actions: list[argparse.Action]
    ) -> None:
        formatter = self._get_formatter()
        formatter.start_section(title)
        formatter.add_text(description)
        formatter.add_arguments(actions)
        formatter.end_section()
        print(formatter.format_help().rstrip())

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _yaml_value_args(option: str, action: argparse.Action, value: Any) -> list[str]:
    if isinstance(action, argparse.BooleanOptionalAction | argparse._StoreTrueAction):
        # (``--option=VALUE`` is checked and rewritten with the command line's values.)
        return [] if value is None else [f"{option}={value}"]
    if value is None:
        return []
    if isinstance(value, dict):
        return [option, json.dumps(value)]
    if isinstance(value, list):
        if action.nargs in ("+", "*"):
            return [option, *[json.dumps(v) if isinstance(v, dict) else str(v) for v in value]]
        out: list[str] = []
        for item in value:
            out.extend([option, str(item)])
        return out
    if isinstance(value, bool):
        return [option, str(value).lower()]
    return [option, str(value)]


def _json_or_string(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out
