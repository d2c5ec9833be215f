"""``python -m sparkguard`` is the same as the ``sparkguard`` command."""

import sys

from sparkguard.cli import main

sys.exit(main())
