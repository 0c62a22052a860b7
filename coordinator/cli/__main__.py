"""`python -m coordinator.cli ...`: the `meshrl` command without its console script (tests, benches, a checkout)."""

import sys

from coordinator.cli import app

if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
