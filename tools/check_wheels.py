"""Check built wheels: every .py under src/ is in its wheel, and each .pyx became an extension.

Usage: python check_wheels.py DIST_DIR DIST [DIST ...]
"""

import importlib.machinery
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def check(dist_dir: Path, dist: str) -> list[str]:
    name = dist.replace("-", "_")
    wheels = sorted(dist_dir.glob(f"{name}-*.whl"))
    if not wheels:
        return [f"{dist}: no wheel in {dist_dir}"]
    members = set(zipfile.ZipFile(wheels[-1]).namelist())
    src = ROOT / "packages" / dist / "src"
    problems = []
    for py in src.rglob("*.py"):
        rel = py.relative_to(src).as_posix()
        if rel not in members:
            problems.append(f"{dist}: {rel} missing from {wheels[-1].name}")
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    for pyx in src.rglob("*.pyx"):
        stem = pyx.relative_to(src).with_suffix("").as_posix()
        if not any(m.startswith(stem) and m.endswith(suffixes) for m in members):
            problems.append(f"{dist}: extension {stem} missing from {wheels[-1].name}")
    return problems


def main() -> int:
    dist_dir = Path(sys.argv[1])
    problems = [p for dist in sys.argv[2:] for p in check(dist_dir, dist)]
    for p in problems:
        print("check_wheels:", p)
    if not problems:
        print(f"check_wheels: {len(sys.argv) - 2} wheels complete")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
