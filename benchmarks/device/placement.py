"""Placements from core_pairs' matrix: the nearest and farthest pair of cores, whether they
differ (DISTINCT: the farthest over 1.3x the nearest), and the groups the round trips form (a
record: cores below the midpoint of the two from a group's first). Prints shell assignments."""
import sys

lines = open(sys.argv[1]).read().split("\n")
cpus = [int(x) for x in lines[0].split(":")[1].split()]
n = len(cpus)
m = [[0.0] * n for _ in range(n)]
for i in range(n):
    row = lines[1 + i].split()
    for j in range(n):
        if j > i:
            m[i][j] = m[j][i] = float(row[j])
pairs = [(m[i][j], i, j) for i in range(n) for j in range(i + 1, n)]
lo, hi = min(pairs), max(pairs)
near = f"{cpus[lo[1]]},{cpus[lo[2]]}"
far = f"{cpus[hi[1]]},{cpus[hi[2]]}"
# groups: cores whose round trip is below the midpoint of the nearest and farthest pair
cut = (lo[0] + hi[0]) / 2
groups, left = [], list(range(n))
while left:
    g = [left[0]] + [j for j in left[1:] if m[left[0]][j] < cut]
    groups.append(g)
    left = [j for j in left if j not in g]
distinct = hi[0] > 1.3 * lo[0]
print(f"NEAR={near} NEAR_NS={lo[0]:.0f} FAR={far} FAR_NS={hi[0]:.0f} "
      f"DISTINCT={1 if distinct else 0} NGROUPS={len(groups) if distinct else 1} "
      f"GROUPS='{';'.join(','.join(str(cpus[j]) for j in g) for g in groups)}'")
