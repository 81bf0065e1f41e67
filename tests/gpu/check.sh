#!/usr/bin/env bash
# The GPU questions in one command, for a session that is lent a CUDA machine (one GPU is enough).
# Runs in <= 10 minutes of run time on a machine with fewer than 4 GPUs (each section has its own limit below) and
# never the whole suite (CI runs that); with 4 GPUs or more, the real 2 x 2 tensor-parallel tests add <= 4 minutes. Writes $OUT/summary.txt first, one line per section as it ends (PASS / FAIL / INFO / TIMEOUT / ERROR),
# and every section's output to $OUT/details.txt, so a run cut short still reports what finished.
#
# Installs nothing it can import already: the package runs from this checkout (PYTHONPATH), with the torch,
# Lightning and pytest of the machine. FairScale, which the lent machines lack, comes from .whl/ if present:
#   here:     bash tests/gpu/prepare.sh          (puts the FairScale wheel into .whl/, git-ignored locally)
#   device:   run(command="bash tests/gpu/check.sh", carry=[".whl"], timeout_s=570)
# Elsewhere: OUT=/tmp/gpu-check bash tests/gpu/check.sh
# CHECK_DEVICE=cpu CHECK_QUICK=1 runs every section on the CPU with tiny sizes (tests/gpu/test_check.py does, in
# CI, so that this script cannot rot); its figures mean nothing there.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp/gpu-check}"
mkdir -p "$out"
summary="$out/summary.txt"
details="$out/details.txt"
: >"$summary"
: >"$details"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python=${PYTHON:-python3}

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$python" -m pip install -q --no-index --no-deps --target /tmp/gpu-check-site .whl/*.whl >>"$details" 2>&1 &&
        export PYTHONPATH="$PYTHONPATH:/tmp/gpu-check-site"
fi

{
    echo "GPU check of lightning_stability $(git rev-parse --short HEAD 2>/dev/null || echo '(no git)'), $(date -u '+%Y-%m-%d %H:%M UTC')"
    "$python" - <<'EOF' 2>&1
import lightning, torch
from lightning_stability import _compat
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA"
cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
print(f"{gpu} (capability {cap}), torch {torch.__version__} (CUDA {torch.version.cuda}), lightning {lightning.__version__}")
oldest, newest = _compat.TORCH_TESTED
if _compat.torch_minor(torch.__version__) < oldest:
    print(f"NOTE: torch {torch.__version__} is older than the oldest this package declares (torch>={'.'.join(map(str, oldest))})")
EOF
} >>"$summary"
cat "$summary"

# run NAME LIMIT_S 'COMMAND': the section's output goes to details; its summary line is written by the command
# itself (tests/gpu/check.py --summary, or the pytest wrapper below), or here when it timed out or died.
run() {
    local name=$1 limit=$2 cmd=$3
    local before start rc
    before=$(wc -l <"$summary")
    start=$(date +%s)
    echo "===== $name (limit ${limit}s): $cmd" >>"$details"
    timeout --kill-after=10 "$limit" bash -c "$cmd" >>"$details" 2>&1
    rc=$?
    if [ "$(wc -l <"$summary")" -eq "$before" ]; then
        if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
            echo "$name: TIMEOUT after ${limit}s (see details.txt)" >>"$summary"
        else
            echo "$name: ERROR rc=$rc after $(($(date +%s) - start)) s (see details.txt)" >>"$summary"
        fi
    fi
    tail -1 "$summary"
}

pytest_section() { # NAME ARGS...: pytest, its last line as the summary line
    local name=$1 log
    shift
    log=$(mktemp)
    "$python" -m pytest -q -rs -p no:cacheprovider "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    local verdict=PASS
    [ "$rc" -ne 0 ] && verdict=FAIL
    echo "$name: $verdict $(tail -1 "$log")" >>"$summary"
    return "$rc"
}

device=${CHECK_DEVICE:-cuda}
if [ -n "${CHECK_QUICK:-}" ]; then
    steps=12 timing="--steps 6 --warmup 2 --repeats 1" gn_model="--d-model 64 --layers 2 --repeats 3"
else
    steps=30 timing="--steps 30 --warmup 5 --repeats 4" gn_model="--d-model 1024 --repeats 20"
fi
check() { "$python" -m tests.gpu.check "$@" --device "$device" --summary "$summary"; }
export -f pytest_section check
export summary python device steps timing gn_model

# 1. host syncs of the full gpt stack, bf16 + fused AdamW and fp16 + LossScaleTuner (torch's sync detector)
run syncs 100 'check syncs --steps $steps'
# 2. fp16 on tensor cores with init_scale="auto": the scale found, no update lost, the loss falls
run fp16auto 50 'check fp16auto --steps $steps'
# 3. the CUDA-only tests: StableFSDPStrategy on the GPU (NCCL, native backend), the FairScale backend, the
#    scaler with CPU-offloaded gradients, the Tensor-Core check
run gpu-tests 150 'pytest_section gpu-tests tests/gpu tests/amp/test_diagnostics.py --ignore=tests/gpu/test_check.py'
# 4. step-time ratio against a bare Trainer and kernel launches per step (~20-50 ms bare step on an H100)
run overhead 120 'check overhead $timing'
# 5. the norm benchmark on CUDA: the per-parameter .item() loop against one fused norm
run grad-norm 60 '"$python" -m benchmarks.grad_norm --device $device $gn_model | tee /tmp/gn.txt &&
    { echo "grad-norm: INFO (the last lines of its table)"; tail -6 /tmp/gn.txt | sed "s/^/  /"; } >>"$summary"'

# 6. tensor parallelism on one GPU (a TP plan on a 1-GPU mesh splits nothing): our norms of DTensors on a 1 x 1
#    CUDA mesh, every placement; GradientNormMonitor's host syncs over DTensor parameters; the planner's TP advice
run tp 60 'check tp --steps $steps'
# 7. PrecursorMonitor with every early action against the same Trainer without it, bf16 + fused AdamW: host syncs, keys
run precursors 60 'check precursors --steps $steps'
# 8. with 4 GPUs or more: the 2 x 2 (data x tensor parallel) tests of tests/distributed on the GPUs, with NCCL
gpus=0
[ "$device" = cuda ] && gpus=$("$python" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "$gpus" -ge 4 ]; then
    run tp-2x2 240 'export TP_ACCELERATOR=gpu; pytest_section tp-2x2 tests/distributed/test_tensor_parallel.py \
        -k "dp2xtp2 or accumulation or replica"'
else
    echo "tp-2x2: INFO not run: $gpus CUDA device(s) here, the 2 x 2 tensor-parallel tests need 4" | tee -a "$summary"
fi

echo "----- summary ($summary)"
cat "$summary"
