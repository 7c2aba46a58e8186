"""The command line (`python -m tpedu`): parser, checks before launch, commands.

- tpedu.cli.parser: `build_parser()`, every subcommand and flag
- tpedu.cli.checks: the one-line errors (exit code 2) raised before any rank starts
- tpedu.cli.commands: hello, commbench, train, generate, reshard, and `main`
"""
