# What each call of the lent machine starts with (sourced by run_peers.sh, study_allreduce.sh,
# study_split.sh, after setting NAME and DEFAULT_BUDGET): P (the carried .devpay), R (results,
# /tmp/$NAME, emptied), the budget clock (el: seconds since the start; BUDGET, else
# DEFAULT_BUDGET) and pack (R as $OUT/$NAME.tgz, what comes back).
set -u
P=$PWD/.devpay; R=/tmp/$NAME; rm -rf "$R"; mkdir -p "$R"
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
T0=$(date +%s); BUDGET=${BUDGET:-$DEFAULT_BUDGET}
el() { echo $(( $(date +%s) - T0 )); }
pack() { tar czf "$OUT/$NAME.tgz" -C "$R" . 2>/dev/null; }
PY=${PY:-python3}
