"""``python -m kvlab ...``: the same as the ``kvlab`` command (``kvlab.cli``)."""

import sys

from kvlab.cli import main

sys.exit(main())
