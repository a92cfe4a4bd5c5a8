# Sourced by the device scripts (benchmarks/h200_session*.sh) with their arguments: the output folder (the
# first), the environment, and what identifies the run, written into that folder: the date, the commit
# and the files that differ from it (a device copy's git metadata may be older than its work tree), the GPU.
set -u
out=${1:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/benchmarks/scripts
date -u > "$out/date.txt"
git rev-parse HEAD > "$out/commit.txt" 2>/dev/null
git status --short > "$out/tree.txt" 2>/dev/null
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$out/gpu.txt" 2>&1
