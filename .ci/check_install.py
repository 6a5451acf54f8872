"""Fail loudly when the venv lacks a package that the tests or the static checks need.

`make install` runs this after pip: every requirement of ubatch and of the extras it installed (dev, serve) must
be present at a version its specifier allows, so ruff, mypy and pytest see exactly what setup.cfg pins.
"""
from __future__ import annotations

import sys
from importlib import metadata

from packaging.requirements import Requirement

EXTRAS = set(sys.argv[1:]) or {"dev", "serve"}


def main() -> int:
    missing: list[str] = []
    for line in metadata.requires("ubatch") or []:
        req = Requirement(line)
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in EXTRAS):
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            missing.append(f"{req} (not installed)")
            continue
        if not req.specifier.contains(version, prereleases=True):
            missing.append(f"{req} (installed: {version})")
    if missing:
        print("make install: the venv does not hold what setup.cfg asks for:", *missing, sep="\n  ", file=sys.stderr)
        return 1
    print(f"make install: every requirement of ubatch[{','.join(sorted(EXTRAS))}] is installed as pinned")
    return 0


if __name__ == "__main__":
    sys.exit(main())
