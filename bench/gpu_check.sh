#!/usr/bin/env bash
# GPU checks (issue 23): the paths a CPU machine cannot run, in one script for one GPU, under 8 minutes.
#
#   1. set-up as README says, but on the machine's own CUDA torch (a venv with --system-site-packages: nothing
#      pulls torch; wheels for an offline machine are taken from ./.whl when that folder exists);
#   2. the warm launcher's fork after `import torch` with CUDA present: the child must still initialise CUDA;
#   3. a one-rank nccl comm-check through `ctl up`;
#   4. a `python` job whose rank uses CUDA (nccl all-reduce on rankctl's world group, a bf16 matmul);
#   5. a bf16 train job on one GPU through `ctl up`: tokens/s and model FLOPs utilisation.
#
#   bash bench/gpu_check.sh                 # on a machine with a GPU; exit 0 only when every check passed
#   GPU_CHECK_CPU=1 bash bench/gpu_check.sh # the same plumbing on CPU (gloo, fp32): checks the script itself
# Env: PYTHON (the interpreter holding the CUDA torch; default python3), PEAK_TFLOPS (default 989, dense bf16 of
# an H100/H200 SXM), OUT (where logs go; default a temporary folder), GPU_VENV (default /tmp/rankctl-gpu-venv).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d -t rankctl-gpu-XXXXXX)}
VENV=${GPU_VENV:-/tmp/rankctl-gpu-venv}
CPU=${GPU_CHECK_CPU:-0}
mkdir -p "$OUT"
work=$(mktemp -d -t rankctl-gpu-jobs-XXXXXX)
start=$SECONDS
step() { printf '\n== [%3ds] %s\n' $((SECONDS - start)) "$*"; }

step "set-up: venv on $($PY -c 'import sys; print(sys.executable)') with its own torch"
$PY - <<'PYEOF'
import torch
print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, devices {torch.cuda.device_count()}")
PYEOF
if [ "$CPU" != 1 ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true; fi
[ -x "$VENV/bin/python" ] || $PY -m venv --system-site-packages "$VENV"
pip_from=(); [ -d "$REPO/.whl" ] && pip_from=(--no-index --find-links "$REPO/.whl")
install=("$VENV/bin/pip" install -q --disable-pip-version-check "${pip_from[@]}" -e "$REPO[worker]")
# the build needs setuptools>=77: the interpreter's own when it has one, else pip's isolated build
"${install[@]}" --no-build-isolation >"$OUT/pip.log" 2>&1 || "${install[@]}" >>"$OUT/pip.log" 2>&1 \
  || { tail -20 "$OUT/pip.log"; exit 1; }
CTL="$VENV/bin/ctl"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
if [ "$CPU" = 1 ]; then backend=gloo; dtype=fp32; else backend=nccl; dtype=bf16; fi

step "fork after import torch (the warm launcher's hardware facts, then fork)"
GPU_CHECK_CPU=$CPU "$VENV/bin/python" "$REPO/bench/gpu/fork_check.py" 2>&1 | tee "$OUT/fork.log"

step "one-rank $backend comm-check through ctl up"
cat >"$work/comm.yaml" <<YAML
name: gpu-comm-check
kind: comm-check
resources: {nodes: 1, slots_per_node: 1}
backend: $backend
comm_check: {size_bytes: 16777216, iters: 5, warmup: 2}
YAML
"$CTL" up "$work/comm.yaml" 2>"$OUT/comm.err" | tee "$OUT/comm.log" || { tail -30 "$OUT/comm.err"; exit 1; }

step "a python job that uses CUDA, through ctl up"
mkdir -p "$work/py"
cp "$REPO/bench/gpu/cuda_job.py" "$work/py/"
cat >"$work/python.yaml" <<YAML
name: gpu-python
kind: python
resources: {nodes: 1, slots_per_node: 1}
backend: $backend
python: {entrypoint: cuda_job.py, workdir: py}
YAML
"$CTL" up "$work/python.yaml" --json >"$OUT/python.json" 2>"$OUT/python.err" || { tail -30 "$OUT/python.err"; exit 1; }
job=$("$VENV/bin/python" -c 'import json,sys; print(json.load(open(sys.argv[1]))["state"])' "$OUT/python.json")
echo "python job: $job"

step "bf16 train job on one GPU through ctl up (tokens/s, MFU)"
if [ "$CPU" = 1 ]; then L=2; H=128; NH=4; T=128; GB=8; MB=4; STEPS=5; else L=12; H=1024; NH=16; T=1024; GB=32; MB=16; STEPS=40; fi
cat >"$work/train.yaml" <<YAML
name: gpu-train
kind: train
resources: {nodes: 1, slots_per_node: 1}
backend: $backend
model: {layers: $L, hidden: $H, heads: $NH, seq_len: $T, vocab: 256}
train: {steps: $STEPS, global_batch: $GB, micro_batch: $MB, lr: 3.0e-4, warmup: 4, dtype: $dtype, data: "builtin:pydoc"}
YAML
"$CTL" up "$work/train.yaml" --json >"$OUT/train.json" 2>"$OUT/train.err" || { tail -30 "$OUT/train.err"; exit 1; }
"$VENV/bin/python" "$REPO/bench/gpu/mfu.py" "$OUT/train.json" "$work/train.yaml" --peak-tflops "${PEAK_TFLOPS:-989}" --dtype "$dtype" \
  | tee "$OUT/mfu.log"

step "all GPU checks passed in $((SECONDS - start)) s (logs: $OUT)"
rm -rf "$work"
