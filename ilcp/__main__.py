"""``python -m ilcp train ...`` / ``eval ...`` / ``serve RUN`` (see `ilcp.cli`)."""

import sys

from ilcp.cli import main

if __name__ == "__main__":
    sys.exit(main())
