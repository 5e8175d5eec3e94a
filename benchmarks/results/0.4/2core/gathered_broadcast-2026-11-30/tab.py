"""`python tab.py FILE.jsonl`: each cell's median (min-max) over the launches of each mode,
and the messages a rank sent in the cell's first call, by mode."""

import collections
import json
import sys


def median(values: list) -> float:
    return sorted(values)[len(values) // 2]


def main(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    cells = collections.defaultdict(list)
    for row in rows:
        for key, value in row.items():
            if key not in ("n", "mode"):
                cells[(row["n"], key, row["mode"])].append(value)
    keys = sorted({(n, k) for n, k, _ in cells if not k.startswith("sends")},
                  key=lambda t: (t[0], t[1].split()[-2], t[1].split()[0], int(t[1].split()[-1])))
    modes = sorted({m for _, _, m in cells})
    print("n cell", *modes, "| sends", *modes)
    for n, k in keys:
        got = [cells.get((n, k, m)) for m in modes]
        print(n, k, *[f"{median(v)}({min(v)}-{max(v)})" if v else "-" for v in got], "|",
              *[cells.get((n, "sends " + k, m), ["-"])[0] for m in modes])


if __name__ == "__main__":
    main(sys.argv[1])
