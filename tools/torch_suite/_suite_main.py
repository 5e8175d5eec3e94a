"""The command line of run_suite.py: pick tests, run them with unittest, record and compare
outcomes (kept apart from run_suite.py, which every spawned rank imports)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import unittest
from pathlib import Path

HERE = Path(__file__).resolve().parent


class Recorder(unittest.TextTestResult):
    """unittest's result, also keeping ``{test name: {"outcome", "seconds", "detail"}}``."""

    #: where each outcome is written as soon as it is known (a run cut short keeps them)
    partial: Path | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, dict] = {}
        self._t0 = 0.0

    def startTest(self, test):
        self._t0 = time.monotonic()
        super().startTest(test)

    def _note(self, test, outcome: str, detail: str = "") -> None:
        name = test.id().rsplit(".", 1)[-1]
        self.outcomes[name] = {"outcome": outcome,
                               "seconds": round(time.monotonic() - self._t0, 2),
                               "detail": detail[-1500:]}
        if self.partial is not None:
            self.partial.write_text(json.dumps({"tests": self.outcomes}, indent=1,
                                               sort_keys=True) + "\n")

    def addSuccess(self, test):
        super().addSuccess(test)
        self._note(test, "passed")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._note(test, "failed", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self._note(test, "failed", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._note(test, "skipped", str(reason))

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._note(test, "passed", "expected failure")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._note(test, "failed", "unexpected success")


def select(cls, names: list[str], patterns: list[str]) -> unittest.TestSuite:
    every = unittest.TestLoader().getTestCaseNames(cls)
    unknown = [n for n in names if n not in every]
    if unknown:
        raise SystemExit(f"run_suite: no such tests: {unknown}")
    chosen = [n for n in every if (not names and not patterns) or n in names
              or any(p in n for p in patterns)]
    return unittest.TestSuite(cls(n) for n in chosen)


def counts(outcomes: dict[str, dict]) -> dict[str, int]:
    c = {"passed": 0, "failed": 0, "skipped": 0}
    for o in outcomes.values():
        c[o["outcome"]] += 1
    return c


def differences(got: dict[str, dict], expected: dict[str, dict]) -> list[str]:
    """One line per test whose outcome here differs from ``expected``'s."""
    lines = []
    for name in sorted(set(got) & set(expected)):
        a, b = expected[name]["outcome"], got[name]["outcome"]
        if a != b:
            why = got[name]["detail"].strip().splitlines()[-1:] or [""]
            lines.append(f"{name}: expected {a}, got {b}  {why[0][:160]}")
    return lines


def main(cls, mode: str) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, help="write the outcomes here (JSON)")
    ap.add_argument("--expected", type=Path, help="compare with this outcomes file")
    ap.add_argument("-k", action="append", default=[], dest="patterns",
                    help="run the tests whose name contains this (repeatable)")
    ap.add_argument("-q", action="store_true", help="one character per test")
    ap.add_argument("names", nargs="*", help="exact test names (default: all)")
    args = ap.parse_args()
    suite = select(cls, args.names, args.patterns)
    if args.out:
        Recorder.partial = args.out.with_suffix(".partial.json")
    runner = unittest.TextTestRunner(stream=sys.stderr, resultclass=Recorder,
                                     verbosity=1 if args.q else 2)
    result = runner.run(suite)
    got = result.outcomes
    c = counts(got)
    summary = {"backend": mode, "world_size": int(os.environ["WORLD_SIZE"]), **c}
    print(json.dumps(summary))
    record = {"summary": summary, "tests": got}
    status = 0 if c["failed"] == 0 else 1
    if args.expected:
        expected = json.loads(args.expected.read_text())["tests"]
        diff = differences(got, expected)
        record["differences"] = diff
        print(f"{len(diff)} differences from {args.expected.name}:")
        for line in diff:
            print("  " + line)
        regressed = [n for n in got if n in expected and expected[n]["outcome"] == "passed"
                     and got[n]["outcome"] != "passed"]
        status = 1 if regressed else 0
    if args.out:
        args.out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        Recorder.partial.unlink(missing_ok=True)
    return status
