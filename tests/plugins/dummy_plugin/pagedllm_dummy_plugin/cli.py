from pagedllm.entrypoints.cli.types import CLISubcommand


class HelloSubcommand(CLISubcommand):
    name = "dummy-hello"
    help = "Say hello (a subcommand added by a plugin)."

    def add_parser(self, subparsers, pm):
        parser = subparsers.add_parser(self.name, help=self.help)
        parser.add_argument("--who", default="world")
        return parser

    def run(self, args, pm):
        print(f"hello, {args.who}")
        return 0
