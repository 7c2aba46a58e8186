"""Course infrastructure: `python -m tpedu`, the command line (tpedu/cli)."""

import sys

from tpedu.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
