"""The plugin system: entry points, registries, allow/block lists, conflicts, failures."""

from __future__ import annotations

import importlib.metadata
import json
import types

import pytest
from conftest import clean_env, make_distribution, run_cli

from pagedllm import hookimpl
from pagedllm.core.errors import PluginError
from pagedllm.core.interfaces import Device, ToolParser
from pagedllm.core.plugins import PluginStatus, Registry, _dist_identity, make_plugin_manager

BUILTIN_DEVICES = {"cpu", "cuda", "xpu", "neuron", "tpu"}


def test_builtin_plugins_register_through_entry_points(pm):
    infos = {p.name: p for p in pm.plugins}
    assert infos["pagedllm.devices"].distribution == "pagedllm"
    assert infos["pagedllm.devices"].status is PluginStatus.LOADED
    devices = pm.registry("devices")
    assert BUILTIN_DEVICES <= set(devices.names())
    assert devices.entry("cpu").source == "pagedllm.devices"
    assert {"auto", "safetensors", "pt", "npcache", "dummy"} <= set(pm.choices("load_formats"))


def test_plugins_carry_their_package_and_version(pm):
    for plugin, package in (("dummy", "pagedllm-dummy-plugin"), ("pagedllm.models", "pagedllm")):
        info = pm.info(plugin)
        assert (info.distribution, info.version) == (
            package,
            importlib.metadata.version(package),
        )


def test_a_package_identity_is_read_from_its_metadata_headers(tmp_path):
    """Name and Version come from the header lines; the long description after the first
    blank line is not read as headers, whatever it holds."""
    info = tmp_path / "some_pkg-2.1.dist-info"
    info.mkdir()
    body = "Name: not-this\nVersion: 9.9\n" * 50
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: Some-Pkg\nVersion: 2.1\nSummary: s\n\n{body}"
    )
    dist = importlib.metadata.PathDistribution(info)
    assert _dist_identity(dist) == ("Some-Pkg", "2.1") == (dist.name, dist.version)


def test_third_party_plugin_registers_each_kind(pm):
    assert pm.info("dummy").distribution == "pagedllm-dummy-plugin"
    expected = {
        "devices": "dummydev",
        "load_formats": "dummyfmt",
        "quantization_methods": "dummyq",
        "tool_parsers": "dummy_tool",
        "cli_subcommands": "dummy-hello",
    }
    for kind, name in expected.items():
        entry = pm.registry(kind).entry(name)
        assert entry.source == "dummy", kind
        # Lazy: a string target, imported and type-checked on first use.
        assert isinstance(entry.target, str)
    device_cls = pm.load("devices", "dummydev")
    assert issubclass(device_cls, Device) and device_cls.is_available()
    assert issubclass(pm.load("tool_parsers", "dummy_tool"), ToolParser)


def test_registries_are_fresh_per_manager():
    first = make_plugin_manager(env={})
    second = make_plugin_manager(env={})
    assert first.registry("devices") is not second.registry("devices")


def test_allow_list_filters_third_party_plugins_only():
    pm = make_plugin_manager(env={"PAGEDLLM_PLUGINS": "someone-else"})
    assert pm.info("dummy").status is PluginStatus.NOT_ALLOWED
    assert "dummydev" not in pm.registry("devices")
    assert BUILTIN_DEVICES <= set(pm.choices("devices"))

    pm = make_plugin_manager(env={"PAGEDLLM_PLUGINS": "dummy"})
    assert pm.info("dummy").status is PluginStatus.LOADED
    assert "dummydev" in pm.registry("devices")


def test_block_list_disables_any_plugin():
    pm = make_plugin_manager(env={"PAGEDLLM_DISABLED_PLUGINS": "dummy, pagedllm.devices"})
    assert pm.info("dummy").status is PluginStatus.DISABLED
    assert pm.info("pagedllm.devices").status is PluginStatus.DISABLED
    assert pm.choices("devices") == []
    assert "dummyq" not in pm.registry("quantization_methods")


def _device_plugin(name: str, *, override: bool = False) -> types.SimpleNamespace:
    @hookimpl
    def pagedllm_register_devices(registry):
        registry.add(name, "pagedllm_dummy_plugin.device:DummyDevice", override=override)

    return types.SimpleNamespace(pagedllm_register_devices=pagedllm_register_devices)


def test_a_builtin_name_registered_again_stays_builtin(caplog):
    """(Every registry, packages named, installed plugins: test_plugin_collisions.py.)"""
    pm = make_plugin_manager(env={}, extra_plugins=[("clash", _device_plugin("cpu"))])
    entry = pm.registry("devices").entry("cpu")
    assert entry.source == "pagedllm.devices" and entry.replaced == ["clash"]
    assert pm.info("clash").status is PluginStatus.LOADED
    assert "devices name 'cpu'" in caplog.text and "'clash'" in caplog.text


def test_override_replaces_whatever_the_order():
    pm = make_plugin_manager(env={}, extra_plugins=[("mine", _device_plugin("cpu", override=True))])
    entry = pm.registry("devices").entry("cpu")
    assert entry.source == "mine" and entry.replaced == ["pagedllm.devices"]

    # The override registered first still wins over a later plain registration.
    registry = Registry("devices")
    registry.current_source = "first"
    registry.add("x", "a:B", override=True)
    registry.current_source = "second"
    registry.add("x", "c:D")
    assert registry.entry("x").source == "first"
    assert registry.entry("x").replaced == ["second"]


def test_invalid_targets_are_refused_with_the_plugin_named():
    registry = Registry("devices", "pagedllm.core.interfaces.device:Device")
    registry.current_source = "bad"
    with pytest.raises(PluginError, match="invalid devices name"):
        registry.add("has space", "a:B")
    registry.add("missing", "no_such_module_xyz:Thing")
    with pytest.raises(PluginError, match="'bad'.*cannot be imported"):
        registry.load("missing")
    registry.add("wrongtype", "pagedllm.core.interfaces.parsers:ToolParser")
    with pytest.raises(PluginError, match="not a subclass of .*Device"):
        registry.load("wrongtype")
    with pytest.raises(KeyError, match="registered: missing, wrongtype"):
        registry.entry("nope")


def test_plugin_whose_hook_raises_is_reported(caplog):
    @hookimpl
    def pagedllm_register_devices(registry):
        raise RuntimeError("kaboom in registration")

    plugin = types.SimpleNamespace(pagedllm_register_devices=pagedllm_register_devices)
    pm = make_plugin_manager(env={}, extra_plugins=[("explodes", plugin)])
    devices = pm.registry("devices")
    assert "cpu" in devices
    assert pm.info("explodes").status is PluginStatus.FAILED
    assert "kaboom in registration" in pm.info("explodes").error
    assert "kaboom in registration" in caplog.text

    strict = make_plugin_manager(env={}, extra_plugins=[("explodes", plugin)], strict=True)
    with pytest.raises(PluginError, match="kaboom in registration"):
        strict.registry("devices")


BROKEN_MODULE = """
raise ImportError("this plugin is broken on purpose")
"""


def test_broken_plugin_is_reported_with_traceback(tmp_path):
    site = make_distribution(
        tmp_path / "site",
        "broken-plugin",
        {"broken": "broken_plugin_mod"},
        {"broken_plugin_mod": BROKEN_MODULE},
    )
    env = clean_env(PYTHONPATH=str(site))
    result = run_cli("plugins", "--json", env=env)
    assert result.returncode == 1, result.stderr  # plugins exits non-zero when one failed
    assert "Traceback" in result.stderr
    assert "this plugin is broken on purpose" in result.stderr
    report = json.loads(result.stdout)
    broken = next(p for p in report["plugins"] if p["name"] == "broken")
    assert broken["status"] == "failed" and "broken on purpose" in broken["error"]
    # Everything else still works.
    assert any(d["name"] == "cpu" for d in report["registries"]["devices"])
    assert run_cli("collect-env", env=env).returncode == 0

    strict = run_cli("plugins", env=clean_env(PYTHONPATH=str(site), PAGEDLLM_STRICT_PLUGINS="1"))
    assert strict.returncode == 2
    assert "broken on purpose" in strict.stderr and "failed to import" in strict.stderr


def test_plugin_file_registers_a_tool_parser(tmp_path, pm):
    plugin_file = tmp_path / "my_parser.py"
    plugin_file.write_text(
        "from pagedllm import hookimpl\n"
        "@hookimpl\n"
        "def pagedllm_register_tool_parsers(registry):\n"
        "    registry.add('from_file', 'pagedllm_dummy_plugin.tool_parser:CallLineToolParser')\n"
    )
    assert "from_file" not in pm.registry("tool_parsers")
    info = pm.load_plugin_file(plugin_file)
    assert info.status is PluginStatus.LOADED
    assert pm.registry("tool_parsers").entry("from_file").source == info.name
    with pytest.raises(PluginError, match="does not exist"):
        pm.load_plugin_file(tmp_path / "nope.py")


# ------------------------------------------------------------ hook contracts are loud


def _typo_plugin() -> types.SimpleNamespace:
    @hookimpl
    def pagedllm_register_device(registry):  # missing the final "s"
        registry.add("typo_dev", "pagedllm_dummy_plugin.device:DummyDevice")

    @hookimpl
    def pagedllm_register_tool_parsers(registry):
        registry.add("typo_tool", "pagedllm_dummy_plugin.tool_parser:CallLineToolParser")

    return types.SimpleNamespace(
        pagedllm_register_device=pagedllm_register_device,
        pagedllm_register_tool_parsers=pagedllm_register_tool_parsers,
    )


def test_misspelled_hook_fails_the_plugin_naming_the_hook(caplog):
    pm = make_plugin_manager(env={}, extra_plugins=[("typo", _typo_plugin())])
    info = pm.info("typo")
    assert info.status is PluginStatus.FAILED
    assert "'pagedllm_register_device'" in info.error
    assert "did you mean 'pagedllm_register_devices'" in info.error
    assert "'typo'" in caplog.text and "'pagedllm_register_device'" in caplog.text
    # Failed means unavailable: its correctly spelled hooks are not called either.
    assert "typo_tool" not in pm.registry("tool_parsers")
    assert "typo_dev" not in pm.registry("devices")
    assert "cpu" in pm.registry("devices")

    with pytest.raises(PluginError, match="'typo'.*unknown hook 'pagedllm_register_device'"):
        make_plugin_manager(env={}, extra_plugins=[("typo", _typo_plugin())], strict=True)


def test_hook_function_without_hookimpl_marker_fails_the_plugin():
    def pagedllm_register_devices(registry):
        registry.add("unmarked", "pagedllm_dummy_plugin.device:DummyDevice")

    plugin = types.SimpleNamespace(pagedllm_register_devices=pagedllm_register_devices)
    pm = make_plugin_manager(env={}, extra_plugins=[("unmarked", plugin)])
    info = pm.info("unmarked")
    assert info.status is PluginStatus.FAILED
    assert "'pagedllm_register_devices' without marking it with @hookimpl" in info.error


TYPO_MODULE = """
from pagedllm import hookimpl

@hookimpl
def pagedllm_register_load_format(registry):
    registry.add("typofmt", "pagedllm.plugins.loaders.dummy:DummyLoader")
"""


def test_installed_plugin_with_a_misspelled_hook_is_reported_failed(tmp_path):
    site = make_distribution(
        tmp_path / "site",
        "typo-plugin",
        {"typo": "typo_plugin_mod"},
        {"typo_plugin_mod": TYPO_MODULE},
    )
    result = run_cli("plugins", "--json", env=clean_env(PYTHONPATH=str(site)))
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    typo = next(p for p in report["plugins"] if p["name"] == "typo")
    assert typo["status"] == "failed"
    assert "unknown hook 'pagedllm_register_load_format'" in typo["error"]
    assert "did you mean 'pagedllm_register_load_formats'" in typo["error"]
    assert not any(e["name"] == "typofmt" for e in report["registries"]["load_formats"])

    strict = run_cli("plugins", env=clean_env(PYTHONPATH=str(site), PAGEDLLM_STRICT_PLUGINS="1"))
    assert strict.returncode == 2
    assert "pagedllm_register_load_format" in strict.stderr


def test_registration_runs_through_pluggy_hook_callers():
    """Registration hooks are called through pluggy: a hook wrapper sees (and may add to)
    every registration, and hook-call monitoring and tracing see the call."""
    seen = []

    @hookimpl(wrapper=True)
    def pagedllm_register_devices(registry):
        seen.append(("before", len(registry)))
        result = yield
        seen.append(("after", sorted(registry.names())))
        registry.add("wrapped", "pagedllm_dummy_plugin.device:DummyDevice")
        return result

    @hookimpl(hookwrapper=True)
    def pagedllm_register_tool_parsers(registry):
        outcome = yield
        seen.append(("old-style", outcome.exception is None, "hermes" in registry))

    wrapper = types.SimpleNamespace(
        pagedllm_register_devices=pagedllm_register_devices,
        pagedllm_register_tool_parsers=pagedllm_register_tool_parsers,
    )
    pm = make_plugin_manager(env={}, extra_plugins=[("wrapper", wrapper)])
    calls = []
    pm.pm.add_hookcall_monitoring(
        lambda name, impls, kwargs: calls.append((name, [i.plugin_name for i in impls])),
        lambda outcome, name, impls, kwargs: None,
    )
    traced = []
    pm.pm.trace.root.setwriter(traced.append)
    undo_tracing = pm.pm.enable_tracing()

    devices = pm.registry("devices")
    assert seen[0] == ("before", 0)
    assert seen[1][0] == "after" and {"cpu", "cuda"} <= set(seen[1][1])
    entry = devices.entry("wrapped")
    assert entry.source == "wrapper"
    assert devices.entry("cpu").source == "pagedllm.devices"
    names = [name for name, _ in calls]
    assert names == ["pagedllm_register_devices"]
    assert {"wrapper", "pagedllm.devices"} <= set(calls[0][1])
    assert any("pagedllm_register_devices" in line for line in traced)

    pm.registry("tool_parsers")
    assert seen[-1] == ("old-style", True, True)
    undo_tracing()


def test_plugin_file_with_a_misspelled_hook_is_an_error(tmp_path, pm):
    plugin_file = tmp_path / "typo_parser.py"
    plugin_file.write_text(
        "from pagedllm import hookimpl\n"
        "@hookimpl\n"
        "def pagedllm_register_tool_parser(registry):\n"
        "    registry.add('typo', 'pagedllm_dummy_plugin.tool_parser:CallLineToolParser')\n"
    )
    with pytest.raises(PluginError, match="unknown hook 'pagedllm_register_tool_parser'"):
        pm.load_plugin_file(plugin_file)
    assert "typo" not in pm.registry("tool_parsers")
