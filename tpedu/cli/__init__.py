"""Lessons 02–14: the command line (`python -m tpedu`): parser, checks before launch, commands.

- tpedu.cli.parser: `build_parser()`, every subcommand and flag
- tpedu.cli.checks: the one-line errors (exit code 2) raised before any rank starts
- tpedu.cli.commands: hello, commbench (lesson 02), train (07; 11–14 with --pp, --dp and
  checkpoints), generate (07), dryrun (13), reshard (14), `main`
"""
