"""Placements from core_pairs' matrix: the nearest and farthest pair of cores, and 8 cores
close together / spread over the groups the round trips form. Prints shell assignments."""
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
k = min(8, n)
seed = lo[1]
close = sorted(range(n), key=lambda j: (0 if j == seed else m[seed][j]))[:k]
spread, gi = [], [list(g) for g in groups]
while len(spread) < k and any(gi):
    for g in gi:
        if g and len(spread) < k:
            spread.append(g.pop(0))
print(f"NEAR={near} NEAR_NS={lo[0]:.0f} FAR={far} FAR_NS={hi[0]:.0f} "
      f"DISTINCT={1 if distinct else 0} NGROUPS={len(groups) if distinct else 1} "
      f"GROUPS='{';'.join(','.join(str(cpus[j]) for j in g) for g in groups)}' "
      f"CLOSE8={','.join(str(cpus[j]) for j in sorted(close))} "
      f"SPREAD8={','.join(str(cpus[j]) for j in sorted(spread))}")
