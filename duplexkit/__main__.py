"""``python -m duplexkit``: the ``duplexkit`` command (:func:`duplexkit.cli.main`)."""

import sys

from duplexkit.cli import main

if __name__ == "__main__":
    sys.exit(main())
