"""``python -m duplexkit.cli``."""

import sys

from duplexkit.cli import main

sys.exit(main())
