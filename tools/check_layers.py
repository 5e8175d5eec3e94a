"""Check that a venv holds exactly the expected ferro distributions and that each one imports.

Usage: python check_layers.py EXPECTED_DISTS ALL_DISTS   (comma-separated distribution names)
Proves the layering: a user who installs one distribution gets its layers and nothing above them.
"""

import importlib
import importlib.metadata as md
import sys


def main() -> int:
    expected = set(sys.argv[1].split(","))
    everything = sys.argv[2].split(",")
    installed = set()
    for dist in everything:
        try:
            md.version(dist)
        except md.PackageNotFoundError:
            continue
        installed.add(dist)
    if installed != expected:
        print(f"check_layers: installed ferro dists {sorted(installed)}, expected {sorted(expected)}")
        return 1
    for dist in everything:
        name = dist.replace("-", "_")
        try:
            mod = importlib.import_module(name)
        except ImportError:
            if dist in expected:
                raise
            continue
        if dist not in expected:
            print(f"check_layers: {name} imports although {dist} is not installed")
            return 1
        print(f"check_layers: {name} {mod.__version__} imports alone with {sorted(expected)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
