#!/bin/bash
# The lent machine's two virtualenvs, from .devpay (prepare.sh): /tmp/fv (ferro, Open MPI,
# mpi4py) and /tmp/impi (Intel MPI's trimmed runtime, mpi4py). The machine's python3 is itself
# a virtualenv's, so `--system-site-packages` would not see its numpy: a .pth file gives each
# of ours the host's packages. Usage: bash .devpay/venvs.sh [python]  (made once: skipped when
# both exist).
set -eu
P=$(cd "$(dirname "$0")" && pwd)
PY=${1:-python3}
[ -x /tmp/impi/bin/mpiexec ] && [ -x /tmp/fv/bin/python ] && exit 0
SITE=$($PY -c "import numpy, os; print(os.path.dirname(os.path.dirname(numpy.__file__)))")
for v in fv impi; do
  $PY -m venv /tmp/$v
  echo "$SITE" > "$(/tmp/$v/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz_host.pth"
done
/tmp/fv/bin/pip install -q --no-index --no-deps "$P"/whl/*.whl
/tmp/impi/bin/pip install -q --no-index --no-deps "$P"/whl/mpi4py-*.whl
tar xJf "$P/impi_trim.tar.xz" -C /tmp/impi
