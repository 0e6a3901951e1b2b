"""``python -m duplexkit``: the ``duplexkit`` command (:func:`duplexkit.cli.main`, through
:mod:`duplexkit._entry`, which holds a stop signal during the CLI's import)."""

import sys

from duplexkit._entry import main

if __name__ == "__main__":
    sys.exit(main())
