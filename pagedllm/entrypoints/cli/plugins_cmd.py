"""``pagedllm plugins``: every plugin, every registry, and where each entry came from."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from pagedllm.core.hookspecs import REGISTRATION_HOOKS
from pagedllm.core.interfaces import CLISubcommand

if TYPE_CHECKING:
    from pagedllm.core.plugins import PluginManager


def plugins_report(pm: PluginManager) -> dict[str, Any]:
    """Plugins and registries as plain data (also used by ``collect-env``)."""
    registries = {}
    collisions = []
    for kind in REGISTRATION_HOOKS:
        registry = pm.registry(kind)
        registries[kind] = [
            {
                "name": entry.name,
                "target": entry.target_path,
                "plugin": entry.source,
                "package": registry.packages.get(entry.source),
                "override": entry.override,
                "replaced": list(entry.replaced),
                "conflicts": list(entry.conflicts),
            }
            for entry in registry
        ]
        collisions.extend(registry.collisions())
    plugins = [
        {
            "name": info.name,
            "value": info.value,
            "distribution": info.distribution,
            "version": info.version,
            "status": info.status.value,
            "error": info.error,
        }
        for info in pm.plugins
    ]
    return {"plugins": plugins, "registries": registries, "collisions": collisions}


def format_plugins_report(report: dict[str, Any]) -> str:
    lines = ["Plugins (entry-point group 'pagedllm'):"]
    for plugin in report["plugins"]:
        origin = plugin["distribution"] or "-"
        if plugin["version"]:
            origin += f" {plugin['version']}"
        lines.append(
            f"  {plugin['name']:<28} {plugin['status']:<24} {origin:<24} {plugin['value']}"
        )
        if plugin["error"]:
            lines.extend("      " + line for line in plugin["error"].rstrip().splitlines())
    for kind, entries in report["registries"].items():
        lines.append("")
        lines.append(f"{kind}:")
        if not entries:
            lines.append("  (none)")
        for entry in entries:
            note = ""
            if entry["conflicts"]:
                note = f"  (CONFLICT: also {', '.join(entry['conflicts'])}; refused when used)"
            elif entry["replaced"]:
                how = "overrides" if entry["override"] else "kept over"
                note = f"  ({how} {', '.join(entry['replaced'])})"
            lines.append(
                f"  {entry['name']:<24} {entry['target']:<56} from {entry['plugin']}{note}"
            )
    if report["collisions"]:
        lines.append("")
        lines.append("Names claimed by more than one plugin:")
        lines.extend(f"  {message}" for message in report["collisions"])
    return "\n".join(lines)


class PluginsSubcommand(CLISubcommand):
    name = "plugins"
    help = "List installed plugins and what each registered."

    def add_parser(
        self, subparsers: argparse._SubParsersAction, pm: PluginManager
    ) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(self.name, help=self.help, description=self.help)
        parser.add_argument("--json", action="store_true", help="Print JSON instead of text.")
        pm.hook.pagedllm_add_cli_args(parser=parser, subcommand=self.name)
        return parser

    def run(self, args: argparse.Namespace, pm: PluginManager) -> int:
        report = plugins_report(pm)
        print(json.dumps(report, indent=2) if args.json else format_plugins_report(report))
        # A broken install (a plugin that failed, a name nobody can use) is a non-zero exit.
        unusable = any(e["conflicts"] for entries in report["registries"].values() for e in entries)
        return 1 if pm.failed() or unusable else 0
