"""Lessons 02–14: the command line (`python -m tpedu`): parser, checks before launch, commands.

- tpedu.cli.parser: `build_parser()`, every subcommand and flag
- tpedu.cli.checks: the one-line errors (exit code 2) raised before any rank starts
- tpedu.cli.commands: hello, commbench (lesson 02), train, generate (07, 12), reshard (13), `main`
"""
