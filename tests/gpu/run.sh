#!/usr/bin/env bash
# Run the GPU kit on a machine with CUDA and no network, in at most 8 minutes (docs/gpu.md):
#
#   1. a venv with --system-site-packages (the machine's own torch), the project installed from
#      the wheels prepare.sh downloaded (--no-index --find-links), checked against the checkout;
#   2. pytest -m gpu tests/gpu (junit xml), incident snapshots included (test_gpu_snapshots.py:
#      the OOM observer's snapshot, the allocator history's frames and its cost per step);
#   3. the main example (examples/train_embedding.py) on CUDA with its default budget;
#   4. the overhead benchmark (benchmarks/overhead.py) on CUDA, shortened;
#   5. the row cache against a sparse table on CUDA (benchmarks/row_cache_cuda.py), 1 M rows;
#   6. edo-monitor daemon for a few seconds, stopped by SIGTERM, its rows beside nvidia-smi.
#
#   tests/gpu/run.sh [RESULTS_DIR]      # default: $OUT, else <checkout>/gpu-results
#
# Everything goes to RESULTS_DIR, flat (the device tool returns at most 8 files, 2 folders deep):
# summary.txt, setup.log (the environment at its end), pytest.log, junit.xml, example.log,
# overhead.log, rowcache.log, daemon.log.
# Environment: PYTHON (default python3: the interpreter that has torch), WHEEL_DIR (default
# <checkout>/.gpu-wheels), VENV (default a fresh temporary folder), BUDGET_S (total seconds,
# default 540), SETUP_S, PYTEST_S, EXAMPLE_S, BENCH_S, ROWCACHE_S (each part's limit: 120, 240,
# 90, 150, 90).
# Exit status: 0 when every part passed, else 1.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
RESULTS=${1:-${OUT:-$ROOT/gpu-results}}
PYTHON=${PYTHON:-python3}
WHEEL_DIR=${WHEEL_DIR:-$ROOT/.gpu-wheels}
BUDGET_S=${BUDGET_S:-540}
SETUP_S=${SETUP_S:-120} PYTEST_S=${PYTEST_S:-240} EXAMPLE_S=${EXAMPLE_S:-90} BENCH_S=${BENCH_S:-150}
ROWCACHE_S=${ROWCACHE_S:-90}
DAEMON_S=${DAEMON_S:-30}
case $WHEEL_DIR in /*) ;; *) WHEEL_DIR=$ROOT/$WHEEL_DIR ;; esac
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
WORK=$(mktemp -d /tmp/edo-gpu.XXXXXX)
VENV=${VENV:-$WORK/venv}
SUMMARY=$RESULTS/summary.txt
T0=$(date +%s)
FAILED=0
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 EDO_DB=$WORK/default.db
cd "$ROOT"
: >"$SUMMARY"

say() { echo "$*" | tee -a "$SUMMARY"; }
left_s() { echo $((BUDGET_S - ($(date +%s) - T0))); }

# part NAME MAX_S LOG CMD...: run CMD under `timeout` (MAX_S, or what is left of BUDGET_S if less),
# output to LOG; one line in the summary with the exit status and the seconds it took.
part() {
    local name=$1 max_s=$2 log=$3
    shift 3
    local limit
    limit=$(left_s)
    ((limit > max_s)) && limit=$max_s
    if ((limit < 10)); then
        say "$(printf '%-9s SKIPPED  (time budget of %s s spent)' "$name" "$BUDGET_S")"
        FAILED=1
        return 1
    fi
    local t rc
    t=$(date +%s)
    echo "\$ $*" >>"$log"
    timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    local verdict=ok
    if ((rc == 124 || rc == 137)); then
        verdict="TIMEOUT after ${limit} s"
    elif ((rc != 0)); then
        verdict="FAILED"
    fi
    ((rc != 0)) && FAILED=1
    say "$(printf '%-9s %-8s rc=%-3s %4d s  -> %s' "$name" "${verdict%% *}" "$rc" \
        $(($(date +%s) - t)) "$(basename "$log")")"
    [[ $verdict == TIMEOUT* ]] && say "          $verdict"
    return "$rc"
}

say "edo-monitor GPU kit, $(date -u +%Y-%m-%dT%H:%M:%SZ), checkout $ROOT"
say "results in $RESULTS; python $($PYTHON -c 'import sys; print(sys.version.split()[0])')"

# ---------------------------------------------------------------- 1. environment
setup() {
    set -e
    if [[ ! -d $WHEEL_DIR ]]; then
        echo "no wheel folder $WHEEL_DIR: run tests/gpu/prepare.sh on a development machine and" \
            "carry the folder (docs/gpu.md)"
        return 3
    fi
    # hermetic: no pip configuration of this machine (indexes, find-links, constraints) applies
    export PIP_CONFIG_FILE=/dev/null
    unset PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_CONSTRAINT PIP_REQUIREMENT
    "$PYTHON" -m venv --system-site-packages "$VENV"
    # When $PYTHON is itself a venv's (the H200 image: /opt/torch/.venv), --system-site-packages
    # reaches the base interpreter's packages, not that venv's torch: a .pth adds them (after ours).
    "$PYTHON" -c 'import site; print("\n".join(site.getsitepackages()))' \
        >"$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_parent_site.pth"
    local pip=("$VENV/bin/python" -m pip install --no-index --find-links "$WHEEL_DIR"
        --disable-pip-version-check --no-cache-dir --no-compile)
    if [[ $(cat "$WHEEL_DIR/SOURCE" 2>/dev/null) == $(bash "$ROOT/tests/gpu/fingerprint.sh") ]]; then
        echo "the project's wheel matches the checkout's sources: installing it"
        "${pip[@]}" edo-monitor
    else
        echo "WARNING: the project's wheel in $WHEEL_DIR was built from other sources than this" \
            "checkout's; installing the checkout instead (no build isolation)"
        "${pip[@]}" --no-build-isolation "$ROOT"
    fi
    # pytest and pytest-timeout: the machine's own when it has them, else from the wheels
    "${pip[@]}" "pytest>=8" "pytest-timeout>=2.3"
    "$VENV/bin/python" -m pip check | head -20 || echo "WARNING: pip check reports the above"
}
export ROOT PYTHON WHEEL_DIR VENV WORK
export -f setup
part setup "$SETUP_S" "$RESULTS/setup.log" bash -c setup || {
    say "setup failed: see setup.log"
    tail -5 "$RESULTS/setup.log"
    exit 1
}
PY=("$VENV/bin/python" -P)  # -P: import the installed package, not the checkout's folder

{
    echo "== torch and CUDA"
    "${PY[@]}" - <<'EOF'
import edo_monitor, sqlalchemy, textual, torch
print("edo_monitor", edo_monitor.__version__, "from", edo_monitor.__file__)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device 0:", p.name, p.total_memory, "bytes,", p.multi_processor_count, "SMs")
print("sqlalchemy", sqlalchemy.__version__, "textual", textual.__version__)
EOF
    echo "== nvidia-smi"
    timeout 20 nvidia-smi || echo "(no nvidia-smi)"
    echo "== pip list"
    "$VENV/bin/python" -m pip list --disable-pip-version-check 2>&1
} >>"$RESULTS/setup.log" 2>&1
CUDA=$("${PY[@]}" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
say "$(grep -m1 '^torch ' "$RESULTS/setup.log")"

# ---------------------------------------------------------------- 2. the GPU tests
part pytest "$PYTEST_S" "$RESULTS/pytest.log" "${PY[@]}" -m pytest -m gpu tests/gpu -v -rA \
    -p no:cacheprovider --timeout 150 --junitxml="$RESULTS/junit.xml" -o junit_family=xunit2
rc=$?
# pytest 5 = nothing collected/selected: a failure here too
((rc == 5)) && say "          pytest collected no test"
tally=$(grep -E '^=+ .*(passed|failed|skipped|error).* in [0-9.]+s' "$RESULTS/pytest.log" | tail -1)
say "          ${tally:-no pytest summary line}"
grep -m1 'allocator history cost' "$RESULTS/pytest.log" | sed 's/^/          /' | tee -a "$SUMMARY"
grep -E '^(SKIPPED|FAILED|ERROR) ' "$RESULTS/pytest.log" | sed 's/^/          /' | head -40 \
    | tee -a "$SUMMARY"

# ---------------------------------------------------------------- 3. the main example
# Without CUDA (a dry run of this script) parts 3 and 4 run on the CPU, to check the plumbing.
DEVICE=cuda EXAMPLE_ARGS="" BENCH_ARGS="--seconds 60 --steady-s 6 --writer-samples 50000"
if ((!CUDA)); then
    DEVICE=cpu EXAMPLE_ARGS="--steps 5"
    BENCH_ARGS="--batch 256 --seconds 8 --steady-s 0 --writer-samples 5000"
    say "no CUDA device: a dry run, the example and the benchmark shortened and on the CPU"
fi
example() {
    local rc=0
    # shellcheck disable=SC2086
    "$VENV/bin/python" -P examples/train_embedding.py --device "$DEVICE" --db "$WORK/example.db" \
        $EXAMPLE_ARGS || rc=$?
    echo "== train_embedding.py exit status $rc (1 = it stopped with an out-of-memory error)"
    echo "== edo-monitor show latest (what the history database holds)"
    "$VENV/bin/edo-monitor" show latest --db "$WORK/example.db" </dev/null || true
    return "$rc"
}
export DEVICE EXAMPLE_ARGS
export -f example
part example "$EXAMPLE_S" "$RESULTS/example.log" bash -c example
grep -E '^(device|steps|peak in use|min free|events|action) ' "$RESULTS/example.log" \
    | sed 's/^/          /' | tee -a "$SUMMARY"

# ---------------------------------------------------------------- 4. the overhead benchmark
# shellcheck disable=SC2086
part overhead "$BENCH_S" "$RESULTS/overhead.log" "${PY[@]}" benchmarks/overhead.py --device "$DEVICE" \
    $BENCH_ARGS --block-s 1.5 --enqueue-calls 20000 --dir "$WORK/overhead"
sed -n '/^| *mode/,/^$/p' "$RESULTS/overhead.log" | head -12 | sed 's/^/          /' \
    | tee -a "$SUMMARY"

# ---------------------------------------------------------------- 5. the row cache on CUDA
ROWCACHE_ARGS="--sizes 1000000 --warmup 150 --steps 30"
((!CUDA)) && ROWCACHE_ARGS="--device cpu --sizes 20000 --cache-rows 2000 --batch 512 --warmup 20 --steps 5"
# without -P: the script imports its sibling row_cache_timing.py (edo_monitor is the installed one)
# shellcheck disable=SC2086
part rowcache "$ROWCACHE_S" "$RESULTS/rowcache.log" "$VENV/bin/python" benchmarks/row_cache_cuda.py \
    $ROWCACHE_ARGS
grep -E '^\| [0-9]|^lookahead' "$RESULTS/rowcache.log" | sed 's/^/          /' | tee -a "$SUMMARY"

# ---------------------------------------------------------------- 6. the system-wide daemon
daemon_check() {
    local db=$WORK/daemon.db rc=0
    "$VENV/bin/edo-monitor" daemon --db "$db" --interval 0.5 &
    local pid=$!
    sleep 5
    kill -TERM "$pid"
    wait "$pid" || rc=$?
    echo "== edo-monitor daemon exit status $rc (0: stopped cleanly by SIGTERM)"
    echo "== its last sample (device_samples), then nvidia-smi"
    "$VENV/bin/edo-monitor" sql --db "$db" "SELECT device_index, device_uuid, \
device_total_bytes, device_used_bytes, utilization_gpu_fraction, process_count FROM \
device_samples WHERE time_s = (SELECT max(time_s) FROM device_samples) ORDER BY device_index" \
        </dev/null || rc=1
    timeout 20 nvidia-smi --query-gpu=index,uuid,memory.total,memory.used,utilization.gpu \
        --format=csv || true
    return "$rc"
}
export -f daemon_check
if ((CUDA)); then
    part daemon "$DAEMON_S" "$RESULTS/daemon.log" bash -c daemon_check
    grep -E 'exit status|GPU\(s\)' "$RESULTS/daemon.log" | sed 's/^/          /' | tee -a "$SUMMARY"
else
    say "daemon    SKIPPED  (no CUDA device: a dry run)"
fi

say "total $(($(date +%s) - T0)) s of $BUDGET_S; $([[ $FAILED == 0 ]] && echo ALL OK || echo FAILURES)"
rm -rf "$WORK"
exit "$FAILED"
