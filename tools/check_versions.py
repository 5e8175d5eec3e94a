"""Check that each distribution's requirement on a sibling layer admits the sibling's version.

Usage: python check_versions.py DIST [DIST ...]
"""

import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    dists = sys.argv[1:]
    meta = {d: tomllib.loads((ROOT / "packages" / d / "pyproject.toml").read_text())["project"]
            for d in dists}
    problems = []
    for dist, project in meta.items():
        for line in project.get("dependencies", []):
            req = Requirement(line)
            if req.name in meta and meta[req.name]["version"] not in req.specifier:
                problems.append(f"{dist} requires {req}, but {req.name} is {meta[req.name]['version']}")
    for p in problems:
        print("check_versions:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
