"""``python -m runner generate|bench ...`` (see runner/cli.py)."""
import sys

from runner.cli import main

if __name__ == "__main__":
    sys.exit(main())
