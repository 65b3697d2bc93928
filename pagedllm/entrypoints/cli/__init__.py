"""pagedllm's built-in CLI subcommands, registered like a plugin's would be."""

from pagedllm.core.hookspecs import hookimpl


@hookimpl
def pagedllm_register_cli_subcommands(registry):
    registry.add("chat", "pagedllm.entrypoints.cli.client:ChatSubcommand")
    registry.add("complete", "pagedllm.entrypoints.cli.client:CompleteSubcommand")
    registry.add("serve", "pagedllm.entrypoints.cli.serve:ServeSubcommand")
    registry.add("bench", "pagedllm.entrypoints.cli.bench:BenchSubcommand")
    registry.add("collect-env", "pagedllm.entrypoints.cli.collect_env:CollectEnvSubcommand")
    registry.add("run-batch", "pagedllm.entrypoints.cli.run_batch:RunBatchSubcommand")
    registry.add("plugins", "pagedllm.entrypoints.cli.plugins_cmd:PluginsSubcommand")
