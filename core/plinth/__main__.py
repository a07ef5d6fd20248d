"""``python -m plinth``: the ``plinth`` command, for environments without its script on PATH."""

import sys

from plinth.cli import main

if __name__ == "__main__":
    sys.exit(main())
