"""A name claimed twice costs only that name (DESIGN.md, "The plugin system").

Upgrading pagedllm must not break an installed plugin: a plugin that registers, without
``override=True``, a name pagedllm later ships itself loses that name to the built-in (a
warning names both packages) and keeps everything else; with ``override=True`` it takes
the name. Two third-party plugins claiming one name both load; the name is refused when
used, naming both. Checked in every registry, and end to end with plugins installed by
pip and the ``pagedllm`` command run as a user runs it.
"""

from __future__ import annotations

import json
import logging
import shutil
import types
from pathlib import Path

import httpx
import pytest
from conftest import env_with_site, pip_install_target, run_cli, write_plugin_project
from openai_server import BASE_ARGS, RemoteServer
from tiny_models import make_checkpoint

from pagedllm.core.args.validate import resolve_device
from pagedllm.core.errors import PluginError
from pagedllm.core.hookspecs import REGISTRATION_HOOKS
from pagedllm.core.plugins import PluginStatus, Registry, make_plugin_manager

KINDS = list(REGISTRATION_HOOKS)


def _plugin(tag: str, registrations: dict[str, list[tuple[str, bool]]], target: str = "") -> object:
    """A plugin module whose hooks register ``(name, override)`` pairs per registry kind,
    each pointing at ``target`` (by default a class of a module named after ``tag``,
    imported only when used)."""
    target = target or f"plugin_{tag}_targets:Thing"
    lines = ["from pagedllm import hookimpl"]
    for kind, names in registrations.items():
        lines += ["@hookimpl", f"def {REGISTRATION_HOOKS[kind]}(registry):"]
        lines += [f"    registry.add({n!r}, {target!r}, override={o})" for n, o in names]
    module = types.ModuleType(f"plugin_{tag}")
    exec(compile("\n".join(lines) + "\n", f"<plugin {tag}>", "exec"), module.__dict__)
    return module


def _builtin_names() -> dict[str, tuple[str, str]]:
    """Kind -> (one of pagedllm's own names, the built-in plugin registering it)."""
    pm = make_plugin_manager(env={})
    out = {}
    for kind in KINDS:
        for entry in pm.registry(kind):
            if pm.info(entry.source).builtin:
                out[kind] = (entry.name, entry.source)
                break
    return out


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_plugin_claiming_builtin_names_costs_only_those_names(caplog):
    builtin = _builtin_names()
    assert len(builtin) >= 9, builtin  # every kind pagedllm fills itself
    regs = {
        kind: [(f"new_{kind}", False)] + ([(builtin[kind][0], False)] if kind in builtin else [])
        for kind in KINDS
    }
    pm = make_plugin_manager(env={})
    pm.register(_plugin("a", regs), "a", distribution="pagedllm-plugin-a")
    warnings = []
    for kind in KINDS:
        registry = pm.registry(kind)  # (before the fix: PluginError "registered by both")
        assert registry.entry(f"new_{kind}").source == "a", kind
        if kind in builtin:
            name, source = builtin[kind]
            entry = registry.entry(name)
            assert entry.source == source and entry.replaced == ["a"], kind
            assert not entry.target_path.startswith("plugin_a"), kind
            warnings += [w for w in _warnings(caplog) if f"{kind} name {name!r}" in w]
    assert pm.info("a").status is PluginStatus.LOADED
    assert len(warnings) == len(builtin)
    for warning in warnings:
        assert "(package pagedllm)" in warning and "(package pagedllm-plugin-a)" in warning
        assert "override=True" in warning


def test_an_override_takes_a_builtin_name_in_every_registry(caplog):
    builtin = _builtin_names()
    regs = {kind: [(name, True)] for kind, (name, _) in builtin.items()}
    pm = make_plugin_manager(env={})
    pm.register(_plugin("b", regs), "b", distribution="pagedllm-plugin-b")
    for kind, (name, source) in builtin.items():
        entry = pm.registry(kind).entry(name)
        assert entry.source == "b" and entry.replaced == [source], kind
        assert entry.target_path == "plugin_b_targets:Thing"
        assert any(
            f"{kind} name {name!r}" in w
            and "(package pagedllm)" in w
            and "(package pagedllm-plugin-b)" in w
            for w in _warnings(caplog)
        ), kind


def test_two_plugins_claiming_one_name_lose_only_that_name(caplog):
    pm = make_plugin_manager(env={})
    for tag in ("c1", "c2"):
        regs = {kind: [(f"shared_{kind}", False), (f"{tag}_{kind}", False)] for kind in KINDS}
        pm.register(_plugin(tag, regs), tag, distribution=f"pagedllm-plugin-{tag}")
    for kind in KINDS:
        registry = pm.registry(kind)
        assert registry.entry(f"c1_{kind}").source == "c1"
        assert registry.entry(f"c2_{kind}").source == "c2"
        assert f"shared_{kind}" in registry.names()  # listed, so that choosing it explains
        with pytest.raises(PluginError) as excinfo:
            registry.load(f"shared_{kind}")
        message = str(excinfo.value)
        assert f"{kind} name 'shared_{kind}'" in message
        assert "(package pagedllm-plugin-c1)" in message
        assert "(package pagedllm-plugin-c2)" in message
        assert "PAGEDLLM_DISABLED_PLUGINS=c1" in message
    assert {pm.info("c1").status, pm.info("c2").status} == {PluginStatus.LOADED}
    assert sum("refused when used" in w for w in _warnings(caplog)) == len(KINDS)
    # --device auto does without the disputed device (it would fail to import if tried).
    pm = make_plugin_manager(env={})
    for tag in ("c1", "c2"):
        pm.register(_plugin(tag, {"devices": [("shared", False)]}), tag)
    assert pm.registry("devices").conflict("shared") is not None
    assert resolve_device("auto", pm).name == "cpu"


def test_plugins_with_the_same_hook_code_are_told_apart():
    """Attribution is by code object identity: two plugins whose hooks are the same text
    (equal code objects) are two claimants, not one."""
    regs = {"tool_parsers": [("same", False)]}
    pm = make_plugin_manager(env={})
    pm.register(_plugin("x", regs, "m:T"), "x", distribution="pkg-x")
    pm.register(_plugin("y", regs, "m:T"), "y", distribution="pkg-y")
    entry = pm.registry("tool_parsers").entry("same")
    assert {entry.source, *entry.conflicts} == {"x", "y"}


def test_resolution_does_not_depend_on_the_loading_order():
    for order in (["builtin", "plain"], ["plain", "builtin"]):
        registry = Registry("devices")
        registry.packages = {"builtin": "pagedllm", "plain": "pkg", "over": "pkg2"}
        for source in order:
            registry.current_source = source
            registry.add("x", f"{source}:T")
        assert registry.entry("x").source == "builtin" and registry.entry("x").replaced == ["plain"]
        registry.current_source = "over"
        registry.add("x", "over:T", override=True)
        assert registry.entry("x").source == "over"
        assert sorted(registry.entry("x").replaced) == ["builtin", "plain"]
        assert registry.conflict("x") is None


def test_two_overrides_of_one_name_are_refused_when_used():
    registry = Registry("devices")
    registry.current_source = "one"
    registry.add("x", "a:B", override=True)
    registry.current_source = "two"
    registry.add("x", "c:D", override=True)  # (before the fix: an error right here)
    with pytest.raises(PluginError, match="'x' is registered by both plugin 'one' and plugin"):
        registry.load("x")


# ------------------------------------------------- installed by pip, run as a user runs it

PLUGIN_A = {
    "__init__.py": """
        from pagedllm import hookimpl

        # Written when pagedllm had no Starcoder2, hermes parser or collect-env of its own:
        # no override=True.
        @hookimpl
        def pagedllm_register_models(registry):
            registry.add("Starcoder2ForCausalLM", "plugin_a.models:Starcoder2ForCausalLM")
            registry.add("PluginAForCausalLM", "plugin_a.models:PluginAForCausalLM")

        @hookimpl
        def pagedllm_register_tool_parsers(registry):
            registry.add("hermes", "plugin_a.parsers:AToolParser")
            registry.add("a_tool", "plugin_a.parsers:AToolParser")

        @hookimpl
        def pagedllm_register_cli_subcommands(registry):
            registry.add("collect-env", "plugin_a.cli:AHello")
            registry.add("a-hello", "plugin_a.cli:AHello")
        """,
    "models.py": """
        import sys

        from pagedllm.plugins.models.llama import LlamaForCausalLM
        from pagedllm.plugins.models.starcoder2 import Starcoder2ForCausalLM as Builtin

        class Starcoder2ForCausalLM(Builtin):
            def __init__(self, *args, **kwargs):
                print("plugin-a built Starcoder2ForCausalLM", file=sys.stderr, flush=True)
                super().__init__(*args, **kwargs)

        class PluginAForCausalLM(LlamaForCausalLM):
            def __init__(self, *args, **kwargs):
                print("plugin-a built PluginAForCausalLM", file=sys.stderr, flush=True)
                super().__init__(*args, **kwargs)
        """,
    "parsers.py": """
        from pagedllm.plugins.parsers.tool.formats import HermesToolParser

        class AToolParser(HermesToolParser):
            pass
        """,
    "cli.py": """
        from pagedllm.core.interfaces import CLISubcommand

        class AHello(CLISubcommand):
            name = "a-hello"
            help = "Plugin A says hello."

            def add_parser(self, subparsers, pm):
                return subparsers.add_parser(self.name, help=self.help)

            def run(self, args, pm):
                print("hello from plugin A")
                return 0
        """,
}

PLUGIN_B = {
    "__init__.py": """
        from pagedllm import hookimpl

        @hookimpl
        def pagedllm_register_models(registry):
            registry.add(
                "Starcoder2ForCausalLM", "plugin_b.models:Starcoder2ForCausalLM", override=True
            )
        """,
    "models.py": PLUGIN_A["models.py"].replace("plugin-a", "plugin-b"),
}


def _plugin_c(tag: str) -> dict[str, str]:
    return {
        "__init__.py": f"""
            from pagedllm import hookimpl

            @hookimpl
            def pagedllm_register_models(registry):
                registry.add("SharedForCausalLM", "plugin_{tag}.models:PluginAForCausalLM")

            @hookimpl
            def pagedllm_register_devices(registry):
                registry.add("shared_dev", "plugin_{tag}.no_such_module:Device")

            @hookimpl
            def pagedllm_register_tool_parsers(registry):
                registry.add("shared_tool", "plugin_{tag}.parsers:AToolParser")

            @hookimpl
            def pagedllm_register_cli_subcommands(registry):
                registry.add("shared-cmd", "plugin_{tag}.cli:Shared")
                registry.add("{tag}-hello", "plugin_{tag}.cli:Hello")
            """,
        "models.py": PLUGIN_A["models.py"],
        "parsers.py": PLUGIN_A["parsers.py"],
        "cli.py": PLUGIN_A["cli.py"]
        + f"""
        class Hello(AHello):
            name = "{tag}-hello"

            def run(self, args, pm):
                print("hello from plugin {tag}")
                return 0

        class Shared(AHello):
            name = "shared-cmd"

            def run(self, args, pm):
                print("shared-cmd of plugin {tag}")
                return 0
        """,
    }


@pytest.fixture(scope="module")
def sites(tmp_path_factory) -> dict[str, Path]:
    """Sites holding plugin A; plugin B; plugins C1 and C2, each installed by pip."""
    root = tmp_path_factory.mktemp("plugin_projects")

    def project(dist: str, entry: str, package: str, files: dict[str, str]) -> Path:
        return write_plugin_project(root, dist, entry, package, files)

    return {
        "a": pip_install_target(
            root / "site_a", project("pagedllm-plugin-a", "a", "plugin_a", PLUGIN_A)
        ),
        "b": pip_install_target(
            root / "site_b", project("pagedllm-plugin-b", "b", "plugin_b", PLUGIN_B)
        ),
        "c": pip_install_target(
            root / "site_c",
            project("pagedllm-plugin-c1", "c1", "plugin_c1", _plugin_c("c1")),
            project("pagedllm-plugin-c2", "c2", "plugin_c2", _plugin_c("c2")),
        ),
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A tiny Starcoder2, and tiny Llamas whose configs name the plugins' architectures."""
    root = tmp_path_factory.mktemp("collision_models")
    llama = make_checkpoint(root / "llama", "llama")
    out = {"starcoder2": make_checkpoint(root / "starcoder2", "starcoder2")}
    for architecture in ("PluginAForCausalLM", "SharedForCausalLM"):
        directory = shutil.copytree(llama, root / architecture)
        config = json.loads((directory / "config.json").read_text())
        config["architectures"] = [architecture]
        (directory / "config.json").write_text(json.dumps(config))
        out[architecture] = directory
    return out


def _run_batch(model: Path, tmp_path: Path, env: dict[str, str]):
    """``pagedllm run-batch`` of one completion; the process and the response's status."""
    source = tmp_path / "in.jsonl"
    body = {"prompt": "Once upon a time", "max_tokens": 3}
    line = {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": body}
    source.write_text(json.dumps(line) + "\n")
    output = tmp_path / "out.jsonl"
    output.unlink(missing_ok=True)
    result = run_cli(
        "run-batch", "-i", str(source), "-o", str(output), "--model", str(model), *BASE_ARGS,
        env=env, timeout=300,
    )  # fmt: skip
    status = None
    if result.returncode == 0:
        status = json.loads(output.read_text())["response"]["status_code"]
    return result, status


def _names_both(text: str, *packages: str) -> bool:
    return all(f"(package {package})" in text for package in packages)


def test_installed_plugin_claiming_builtin_names_keeps_everything_else(
    sites, checkpoints, tmp_path
):
    env = env_with_site(sites["a"])

    report = run_cli("plugins", "--json", env=env)
    # (Before the fix: exit 2, "registered by both", and nothing listed.)
    assert report.returncode == 0, report.stderr
    data = json.loads(report.stdout)
    assert next(p for p in data["plugins"] if p["name"] == "a")["status"] == "loaded"
    entries = {(kind, e["name"]): e for kind, rows in data["registries"].items() for e in rows}
    for kind, name, builtin in (
        ("models", "Starcoder2ForCausalLM", "pagedllm.models"),
        ("tool_parsers", "hermes", "pagedllm.parsers"),
        ("cli_subcommands", "collect-env", "pagedllm.cli"),
    ):
        entry = entries[kind, name]
        assert (entry["plugin"], entry["package"], entry["replaced"]) == (
            builtin,
            "pagedllm",
            ["a"],
        ), entry
        assert any(
            f"{kind} name {name!r}" in c and _names_both(c, "pagedllm", "pagedllm-plugin-a")
            for c in data["collisions"]
        ), data["collisions"]
        # The warning on stderr names both packages too.
        assert any(
            f"{kind} name {name!r}" in line and _names_both(line, "pagedllm", "pagedllm-plugin-a")
            for line in report.stderr.splitlines()
        ), report.stderr
    for kind, name in (
        ("models", "PluginAForCausalLM"),
        ("tool_parsers", "a_tool"),
        ("cli_subcommands", "a-hello"),
    ):
        assert entries[kind, name]["plugin"] == "a"

    text = run_cli("plugins", env=env)
    assert text.returncode == 0, text.stderr
    assert "Names claimed by more than one plugin:" in text.stdout
    assert "kept over a" in text.stdout

    hello = run_cli("a-hello", env=env)
    assert hello.returncode == 0, hello.stderr
    assert hello.stdout.strip() == "hello from plugin A"
    listing = run_cli("--help", env=env)
    assert listing.returncode == 0 and "a-hello" in listing.stdout, listing.stderr
    # collect-env is still pagedllm's own.
    collect = run_cli("collect-env", env=env)
    assert collect.returncode == 0, collect.stderr
    assert "hello from plugin A" not in collect.stdout and "PyTorch" in collect.stdout

    # The plugin's other architecture runs, through its class.
    result, status = _run_batch(checkpoints["PluginAForCausalLM"], tmp_path, env)
    assert result.returncode == 0 and status == 200, result.stderr
    assert "plugin-a built PluginAForCausalLM" in result.stderr

    # serve: the built-in Starcoder2 serves, with the plugin's tool parser.
    log = tmp_path / "serve.log"
    server = RemoteServer(
        checkpoints["starcoder2"],
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "a_tool",
        log_path=log,
        env=env,
    )
    try:
        server.start().wait_ready()
        response = httpx.post(
            server.url + "/v1/completions",
            json={"model": str(checkpoints["starcoder2"]), "prompt": "hi", "max_tokens": 3},
            timeout=120,
        )
        assert response.status_code == 200, response.text
    finally:
        server.stop()
    text = server.log_text()
    assert "plugin-a built" not in text
    assert "models name 'Starcoder2ForCausalLM'" in text
    assert _names_both(text, "pagedllm", "pagedllm-plugin-a")


def test_installed_plugin_overriding_a_builtin_gets_the_name(sites, checkpoints, tmp_path):
    env = env_with_site(sites["b"])
    report = run_cli("plugins", "--json", env=env)
    assert report.returncode == 0, report.stderr
    data = json.loads(report.stdout)
    entry = next(e for e in data["registries"]["models"] if e["name"] == "Starcoder2ForCausalLM")
    assert (entry["plugin"], entry["override"], entry["replaced"]) == (
        "b",
        True,
        ["pagedllm.models"],
    )
    assert any(
        "models name 'Starcoder2ForCausalLM'" in line
        and _names_both(line, "pagedllm", "pagedllm-plugin-b")
        for line in report.stderr.splitlines()
    ), report.stderr

    result, status = _run_batch(checkpoints["starcoder2"], tmp_path, env)
    assert result.returncode == 0 and status == 200, result.stderr
    assert "plugin-b built Starcoder2ForCausalLM" in result.stderr


def test_two_installed_plugins_claiming_one_name_are_refused_only_when_it_is_used(
    sites, checkpoints, tmp_path
):
    env = env_with_site(sites["c"])
    report = run_cli("plugins", "--json", env=env)
    # Nobody can use the disputed names: like a failed plugin, a non-zero exit.
    assert report.returncode == 1, report.stderr
    data = json.loads(report.stdout)
    statuses = {p["name"]: p["status"] for p in data["plugins"]}
    assert statuses["c1"] == statuses["c2"] == "loaded"
    for kind, name in (
        ("models", "SharedForCausalLM"),
        ("devices", "shared_dev"),
        ("tool_parsers", "shared_tool"),
        ("cli_subcommands", "shared-cmd"),
    ):
        entry = next(e for e in data["registries"][kind] if e["name"] == name)
        assert {entry["plugin"], *entry["conflicts"]} == {"c1", "c2"}
        assert any(
            f"{kind} name {name!r}" in line
            and _names_both(line, "pagedllm-plugin-c1", "pagedllm-plugin-c2")
            for line in report.stderr.splitlines()
        ), report.stderr

    for tag in ("c1", "c2"):
        hello = run_cli(f"{tag}-hello", env=env)
        assert hello.returncode == 0, hello.stderr
        assert hello.stdout.strip() == f"hello from plugin {tag}"
    listing = run_cli("--help", env=env)
    assert listing.returncode == 0, listing.stderr
    assert "c1-hello" in listing.stdout and "shared-cmd" not in listing.stdout

    refusals = [
        run_cli("shared-cmd", env=env),
        run_cli("serve", "m", "--tool-call-parser", "shared_tool", env=env),
        run_cli("serve", "m", "--device", "shared_dev", env=env),
        _run_batch(checkpoints["SharedForCausalLM"], tmp_path, env)[0],
    ]
    for result, name in zip(
        refusals, ["shared-cmd", "shared_tool", "shared_dev", "SharedForCausalLM"], strict=True
    ):
        assert result.returncode == 2, result.stderr
        error = result.stderr.strip().splitlines()[-1]
        assert f"name {name!r} is registered by both" in error, result.stderr
        assert _names_both(error, "pagedllm-plugin-c1", "pagedllm-plugin-c2"), error
        assert "Traceback" not in result.stderr

    # Disabling one of them makes the name usable again.
    one = env_with_site(sites["c"], PAGEDLLM_DISABLED_PLUGINS="c2")
    ok = run_cli("shared-cmd", env=one)
    assert ok.returncode == 0 and ok.stdout.strip() == "shared-cmd of plugin c1", ok.stderr
