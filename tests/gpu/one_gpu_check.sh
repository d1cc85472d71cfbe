#!/usr/bin/env bash
# The one-GPU check of the GPU path, ready for a 10-minute slot on a machine with one CUDA GPU:
#
#     bash tests/gpu/one_gpu_check.sh            # about 3-6 minutes on a recent GPU
#     bash tests/gpu/one_gpu_check.sh --quick    # small sizes: a smoke run of the script (a minute)
#
# It runs tests/gpu/one_gpu_check.py (codec speed against a device memcpy, the feedback rules of every variant on
# real activations, a 1-stage bf16-mixed fit, meta-device materialization; its docstring says what each checks) and
# writes benchmarks/results/gpu_check.json. With two or more GPUs it also runs the NCCL pipeline tests
# (tests/gpu/test_nccl.py), which skip on one GPU. Exit status: the check's (0: every check passed, 1: one
# failed, 3: no CUDA device, 124: ran past its 540 s bound).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"

echo "== machine"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
else
    echo "nvidia-smi not found"
fi
gpus=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'GPUs', torch.cuda.device_count())"
if [ "$gpus" -lt 1 ]; then
    echo "no CUDA device visible to torch: nothing to check (a dry run of the script: python tests/gpu/one_gpu_check.py --device cpu --quick --out /tmp)"
    exit 3
fi

start=$(date +%s)
timeout 540 python tests/gpu/one_gpu_check.py "$@"
status=$?
case $status in
    0) echo "== all checks passed ($(( $(date +%s) - start )) s); figures in benchmarks/results/gpu_check.json" ;;
    1) echo "== some checks FAILED: their names are under \"failed\" in benchmarks/results/gpu_check.json" ;;
    124) echo "== the check ran past 540 s and was stopped (try --quick, or --parts codecs,feedback)" ;;
    *) echo "== the check ended with status $status" ;;
esac

if [ "$gpus" -ge 2 ]; then
    echo "== $gpus GPUs: the 2-stage NCCL pipeline tests"
    timeout 300 python -m pytest tests/gpu/test_nccl.py -x -q -p no:cacheprovider || status=$?
fi
exit $status
