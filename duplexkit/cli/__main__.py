"""``python -m duplexkit.cli``."""

import sys

from duplexkit.cli import main

if __name__ == "__main__":
    sys.exit(main())
