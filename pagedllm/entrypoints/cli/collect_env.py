"""``pagedllm collect-env``: what to paste into a bug report."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
from typing import TYPE_CHECKING, Any

from pagedllm import __version__
from pagedllm.entrypoints.cli.plugins_cmd import format_plugins_report, plugins_report
from pagedllm.entrypoints.cli.types import CLISubcommand

if TYPE_CHECKING:
    from pagedllm.core.plugins import PluginManager

_PACKAGES = (
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "pluggy",
    "fastapi",
    "uvicorn",
    "pydantic",
    "gguf",
    "numpy",
    "openai",
    "prometheus-client",
    "triton",
    "outlines",
    "xgrammar",
)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _devices(pm: PluginManager) -> list[dict[str, Any]]:
    registry = pm.registry("devices")
    out = []
    for entry in registry:
        row: dict[str, Any] = {"name": entry.name, "plugin": entry.source}
        try:
            cls = registry.load(entry.name)
            reason = cls.unavailable_reason()
        except Exception as exc:  # a broken device plugin must not hide the others
            row.update(available=False, reason=f"error: {exc}")
            out.append(row)
            continue
        row.update(available=reason is None, runs_models=cls.runs_models, priority=cls.priority)
        if reason is None:
            try:
                row["details"] = cls().describe()
            except Exception as exc:
                row["details"] = {"error": str(exc)}
        else:
            row["reason"] = reason
        out.append(row)
    return out


def collect_env(pm: PluginManager) -> dict[str, Any]:
    import torch

    return {
        "pagedllm": __version__,
        "python": sys.version.replace("\n", " "),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "torch_build": {
            "version": torch.__version__,
            "cuda": torch.version.cuda,
            "debug": torch.version.debug,
            "num_threads": torch.get_num_threads(),
        },
        "packages": {name: _version(name) for name in _PACKAGES},
        "devices": _devices(pm),
        "environment": {
            k: v
            for k, v in sorted(os.environ.items())
            if k.startswith(("PAGEDLLM_", "CUDA_", "OMP_", "HF_", "TRANSFORMERS_"))
            and "TOKEN" not in k
        },
        **plugins_report(pm),
    }


def format_env(env: dict[str, Any]) -> str:
    lines = [
        f"pagedllm version : {env['pagedllm']}",
        f"Python           : {env['python']}",
        f"Platform         : {env['platform']}",
        f"PyTorch          : {env['torch_build']['version']} "
        f"(CUDA {env['torch_build']['cuda'] or 'none'}, "
        f"{env['torch_build']['num_threads']} threads)",
        "",
        "Packages:",
    ]
    for name, version in env["packages"].items():
        lines.append(f"  {name:<20} {version or 'not installed'}")
    lines += ["", "Devices:"]
    for dev in env["devices"]:
        if dev["available"]:
            state = "available" + ("" if dev.get("runs_models") else " (no model runner yet)")
        else:
            state = f"unavailable: {dev.get('reason')}"
        lines.append(f"  {dev['name']:<8} {state}  [plugin {dev['plugin']}]")
        for key, value in (dev.get("details") or {}).items():
            if key != "name":
                lines.append(f"      {key}: {value}")
    lines += ["", "Environment variables:"]
    if env["environment"]:
        lines.extend(f"  {k}={v}" for k, v in env["environment"].items())
    else:
        lines.append("  (none relevant set)")
    lines += ["", format_plugins_report(env)]
    return "\n".join(lines)


class CollectEnvSubcommand(CLISubcommand):
    name = "collect-env"
    help = "Collect environment information for bug reports."

    def add_parser(
        self, subparsers: argparse._SubParsersAction, pm: PluginManager
    ) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(self.name, help=self.help, description=self.help)
        parser.add_argument("--json", action="store_true", help="Print JSON instead of text.")
        pm.hook.pagedllm_add_cli_args(parser=parser, subcommand=self.name)
        return parser

    def run(self, args: argparse.Namespace, pm: PluginManager) -> int:
        print("Collecting environment information...", file=sys.stderr)
        env = collect_env(pm)
        print(json.dumps(env, indent=2) if args.json else format_env(env))
        return 0
