#!/usr/bin/env bash
# Prepare the GPU kit on a development machine (needs the package registry; the GPU machine has
# none). Downloads, into a git-ignored folder of the checkout, the wheels of every runtime
# dependency the GPU machine lacks, with their own dependencies, for CPython $PY_VERSION on
# manylinux x86_64, plus a wheel of the project itself and a SOURCE file that run.sh uses to
# notice a wheel older than the checkout. See docs/gpu.md.
#
#   tests/gpu/prepare.sh                       # -> .gpu-wheels/ for CPython 3.12
#   PY_VERSION=3.11 WHEEL_DIR=.gpu-wheels-py311 tests/gpu/prepare.sh   # a local dry run of run.sh
#
# Environment: PY_VERSION (default 3.12), WHEEL_DIR (default <checkout>/.gpu-wheels),
# PYTHON (the interpreter whose pip downloads and builds; default python3),
# MAX_MIB (the folder's size limit, default 40: the device tool carries 64 MiB in all, the
# working tree included).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY_VERSION=${PY_VERSION:-3.12}
WHEEL_DIR=${WHEEL_DIR:-$ROOT/.gpu-wheels}
PYTHON=${PYTHON:-python3}
MAX_MIB=${MAX_MIB:-40}
case $WHEEL_DIR in /*) ;; *) WHEEL_DIR=$ROOT/$WHEEL_DIR ;; esac

t0=$(date +%s)
cd "$ROOT"
if ! git check-ignore -q "$WHEEL_DIR/x.whl"; then
    echo "prepare.sh: $WHEEL_DIR is not git-ignored; add it to .gitignore first" >&2
    exit 2
fi

# What the GPU machine already has (its own builds; never replaced): torch, numpy, and the
# packages its image ships. Everything else the project needs at run time is downloaded with its
# whole dependency tree. typer, psutil, nvidia-ml-py, pytest and pytest-timeout are there too,
# but small: their wheels come along as a fallback (pip uses one only where the machine's own
# version does not satisfy pyproject.toml). Version specifiers are pyproject.toml's own.
mapfile -t REQS < <("$PYTHON" - "$ROOT/pyproject.toml" <<'EOF'
import re
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
skip = {"torch", "numpy"}  # the GPU machine's own builds
test = {"pytest", "pytest-timeout"}  # not ruff: no linting there
for req in project["dependencies"] + project["optional-dependencies"]["test"]:
    name = re.split(r"[<>=!~ \[;]", req, maxsplit=1)[0].lower()
    if name in skip or (req in project["optional-dependencies"]["test"] and name not in test):
        continue
    print(req)
EOF
)
echo "prepare.sh: CPython $PY_VERSION wheels for: ${REQS[*]}"

rm -rf "$WHEEL_DIR"
mkdir -p "$WHEEL_DIR"
# --platform matches tags exactly: name every manylinux level a wheel may carry (greenlet, for
# one, ships manylinux_2_24/_2_28 only). The GPU machine's glibc is newer than 2.28.
platforms=()
for p in manylinux1_x86_64 manylinux2010_x86_64 manylinux2014_x86_64 manylinux_2_17_x86_64 \
    manylinux_2_24_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64; do
    platforms+=(--platform "$p")
done
abi=cp${PY_VERSION/./}
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-cache-dir \
    --only-binary=:all: --python-version "$PY_VERSION" --implementation cp --abi "$abi" \
    --abi abi3 --abi none "${platforms[@]}" -d "$WHEEL_DIR" "${REQS[@]}"

# The project itself: a pure-Python wheel built from this checkout.
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
"$PYTHON" -m pip wheel --quiet --disable-pip-version-check --no-cache-dir --no-deps \
    -w "$build" "$ROOT" >/dev/null
cp "$build"/edo_monitor-*.whl "$WHEEL_DIR"/
rm -rf "$ROOT/build" "$ROOT"/*.egg-info

# A fingerprint of the package sources the wheel was built from (run.sh recomputes it).
bash "$ROOT/tests/gpu/fingerprint.sh" >"$WHEEL_DIR/SOURCE"

size_b=$(du -sb "$WHEEL_DIR" | cut -f1)
tree_b=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null \
    | tail -1 | cut -f1)
echo "prepare.sh: $(find "$WHEEL_DIR" -name '*.whl' | wc -l) wheels in $WHEEL_DIR:"
(cd "$WHEEL_DIR" && ls -1 ./*.whl | sed 's|^\./|  |')
printf 'prepare.sh: wheel folder %.1f MiB; working tree %.1f MiB; together %.1f MiB of 64 MiB\n' \
    "$(echo "$size_b / 1048576" | bc -l)" "$(echo "$tree_b / 1048576" | bc -l)" \
    "$(echo "($size_b + $tree_b) / 1048576" | bc -l)"
if ((size_b > MAX_MIB * 1048576)); then
    echo "prepare.sh: the wheel folder is over MAX_MIB=$MAX_MIB MiB" >&2
    exit 1
fi
echo "prepare.sh: done in $(($(date +%s) - t0)) s; carry '$(realpath --relative-to="$ROOT" \
    "$WHEEL_DIR")' (see docs/gpu.md)"
