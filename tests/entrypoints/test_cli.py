"""The ``pagedllm`` command, run as a user runs it (a subprocess per call)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import clean_env, run_cli

SEED_SUBCOMMANDS = ["chat", "complete", "serve", "bench", "collect-env", "run-batch"]


def test_top_level_help_and_version():
    result = run_cli("--help")
    assert result.returncode == 0
    for name in [*SEED_SUBCOMMANDS, "plugins", "dummy-hello"]:
        assert name in result.stdout
    version = run_cli("-v")
    assert version.returncode == 0 and version.stdout.startswith("pagedllm ")


def test_a_subcommand_builds_its_own_parser_alone():
    """``pagedllm SUBCOMMAND`` builds (and imports) that subcommand's parser only; a
    mistyped name still gets the whole list to choose from."""
    script = (
        "import sys\n"
        "from pagedllm.entrypoints.cli.main import main\n"
        "try:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('LOADED' if 'pagedllm.entrypoints.cli.bench_serve' in sys.modules else 'NOT')"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=clean_env()
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--max-num-seqs" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "NOT"
    wrong = run_cli("srve")
    assert wrong.returncode == 2
    for name in SEED_SUBCOMMANDS:
        assert name in wrong.stderr, wrong.stderr


def test_plugin_subcommand_and_cli_args_hook():
    result = run_cli("dummy-hello", "--who", "tester")
    assert result.returncode == 0 and result.stdout.strip() == "hello, tester"
    serve_help = run_cli("serve", "--help").stdout
    assert "--dummy-greeting" in serve_help


def test_serve_help_lists_plugin_choices():
    serve_help = run_cli("serve", "--help").stdout
    for name in ("dummydev", "dummyfmt", "dummyq", "dummy_tool"):
        assert name in serve_help, name
    assert "--help=ModelConfig" in serve_help  # the tip on keyword help


def test_collect_env_reports_devices_and_plugins():
    result = run_cli("collect-env", "--json")
    assert result.returncode == 0, result.stderr
    env = json.loads(result.stdout)
    devices = {d["name"]: d for d in env["devices"]}
    assert devices["cpu"]["available"] and devices["cpu"]["details"]["cores"] >= 1
    for name in ("cuda", "xpu", "neuron", "tpu"):
        assert name in devices
        assert devices[name]["available"] or devices[name]["reason"]
    assert env["packages"]["torch"].startswith("2.13.0")
    plugins = {p["name"]: p for p in env["plugins"]}
    assert plugins["dummy"]["distribution"] == "pagedllm-dummy-plugin"
    assert {"name": "dummyq", "plugin": "dummy"}.items() <= next(
        e for e in env["registries"]["quantization_methods"] if e["name"] == "dummyq"
    ).items()
    text = run_cli("collect-env")
    assert text.returncode == 0 and "Devices:" in text.stdout and "dummydev" in text.stdout


def test_plugins_lists_every_registry_with_sources():
    result = run_cli("plugins")
    assert result.returncode == 0, result.stderr
    for kind in (
        "devices:",
        "load_formats:",
        "quantization_methods:",
        "models:",
        "tool_parsers:",
        "reasoning_parsers:",
        "guided_backends:",
    ):
        assert kind in result.stdout
    lines = result.stdout.splitlines()
    dummyfmt = next(line for line in lines if line.strip().startswith("dummyfmt"))
    assert "pagedllm_dummy_plugin.loader:JsonWeightsLoader" in dummyfmt
    assert dummyfmt.rstrip().endswith("from dummy")


def test_serve_refuses_unbuilt_and_unavailable(tmp_path):
    ep = run_cli("serve", "some-model", "--enable-prompt-embeds")
    assert ep.returncode == 2
    assert "--enable-prompt-embeds=True is not supported by pagedllm yet" in ep.stderr
    # -tp 2 / -pp 2 on a model that is not there: refused before any worker process starts.
    for flag in ("-tp", "-pp"):
        ranks = run_cli("serve", "some-model", flag, "2")
        assert ranks.returncode == 2
        assert "does not download models" in ranks.stderr
        assert "parallelism" not in ranks.stderr

    cuda = run_cli("serve", "some-model", "--device", "cuda")
    assert cuda.returncode == 2 and "--device cuda" in cuda.stderr

    twice = run_cli("serve", "model-a", "--model", "model-b")
    assert twice.returncode == 2 and "given twice" in twice.stderr

    auto_tools = run_cli("serve", "m", "--enable-auto-tool-choice")
    assert "--enable-auto-tool-choice requires --tool-call-parser" in auto_tools.stderr

    lora = run_cli("serve", "m", "--lora-modules", "a=/x")
    assert lora.returncode == 2 and "--lora-modules needs --enable-lora" in lora.stderr
    lora = run_cli("serve", "m", "--enable-lora", "--lora-modules", "no-equals-sign")
    assert lora.returncode == 2 and "use name=path" in lora.stderr

    # A server option's declared range, checked before anything loads.
    cap = run_cli("serve", "m", "--max-sequences-per-request", "0")
    assert cap.returncode == 2
    assert "--max-sequences-per-request=0 is invalid: must be at least 1" in cap.stderr


def test_request_logging_flags_are_checked_at_start_up():
    both = run_cli("serve", "m", "--enable-log-requests", "--disable-log-requests")
    assert both.returncode == 2
    assert "--enable-log-requests and --disable-log-requests contradict" in both.stderr
    # The deprecated flag, and a cap on logs that are off, are warned of (then the model
    # that is not there is refused).
    old = run_cli("serve", "m", "--disable-log-requests", "--max-log-len", "5")
    assert "--disable-log-requests is deprecated" in old.stderr
    assert "--max-log-len 5 changes nothing without --enable-log-requests" in old.stderr
    negative = run_cli("serve", "m", "--enable-log-requests", "--max-log-len", "-1")
    assert negative.returncode == 2 and "--max-log-len=-1 is invalid" in negative.stderr


def test_tool_call_parser_names_from_registry_and_plugin_file(tmp_path):
    unknown = run_cli("serve", "m", "--tool-call-parser", "nope")
    assert unknown.returncode == 2
    assert "invalid choice 'nope'" in unknown.stderr and "dummy_tool" in unknown.stderr

    plugin_file = tmp_path / "parser_plugin.py"
    plugin_file.write_text(
        "from pagedllm import hookimpl\n"
        "@hookimpl\n"
        "def pagedllm_register_tool_parsers(registry):\n"
        "    registry.add('filetool', 'pagedllm_dummy_plugin.tool_parser:CallLineToolParser')\n"
    )
    ok = run_cli(
        "serve",
        "m",
        "--tool-parser-plugin",
        str(plugin_file),
        "--tool-call-parser",
        "filetool",
        "--enable-auto-tool-choice",
    )
    # The name is valid; what stops this server is only that model 'm' does not exist.
    assert ok.returncode != 0 and "'m'" in ok.stderr, ok.stderr
    assert "filetool" not in ok.stderr, ok.stderr


def test_client_subcommands_report_a_closed_server():
    for argv in (
        ["chat", "--url", "http://127.0.0.1:9/v1", "-q", "hi"],
        ["complete", "--url", "http://127.0.0.1:9/v1", "-q", "hi"],
        ["bench", "serve", "--port", "9"],
    ):
        result = run_cli(*argv)
        assert result.returncode == 1, argv
        assert "cannot connect" in result.stderr and "Traceback" not in result.stderr, argv
    missing = run_cli("run-batch")
    assert missing.returncode == 2 and "-i/--input-file is required" in missing.stderr
