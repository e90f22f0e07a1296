"""``python -m expertcache``: the ``expertcache`` command (`expertcache.cli.main`)."""

import sys

from expertcache.cli import main

sys.exit(main())
