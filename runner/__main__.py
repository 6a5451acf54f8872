"""``python -m runner generate|bench ...`` (see runner/entrypoints/cli.py)."""
import sys

from runner.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
