"""``python -m cluster.cli``: the ``hourglass`` program."""

import sys

from cluster.cli import app

sys.exit(app())
