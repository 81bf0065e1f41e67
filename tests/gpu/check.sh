#!/usr/bin/env bash
# The GPU checks, as one prepared script for a session that is lent a CUDA machine (the device tool).
# Everything here is skipped or impossible on the CPU-only CI. Writes its logs under ${OUT:-/tmp/gpu-check}.
#   bash tests/gpu/check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp/gpu-check}"
mkdir -p "$out"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print(torch.__version__, torch.cuda.get_device_name())"
pip install --quiet -e ".[test,fairscale]" 2>&1 | tail -1
# 1. CUDA-only tests: FairScale FSDP backend, the scaler with CPU-offloaded gradients, the Tensor-Core check
python -m pytest -q tests/gpu tests/amp/test_diagnostics.py -rs 2>&1 | tee "$out/pytest_gpu.txt" | tail -5
# 2. the whole suite on a machine with CUDA (GPU-aware paths switch on where tests pick the device)
python -m pytest -q -x tests 2>&1 | tee "$out/pytest_all.txt" | tail -3
# 3. the norm benchmark on the GPU, where a per-tensor .item() loop pays a device sync each
python -m benchmarks.grad_norm --device cuda --d-model 1024 2>&1 | tee "$out/bench_grad_norm_cuda.txt" | tail -8
