#!/usr/bin/env bash
# Execute lesson notebooks in the full profile on an offline GPU host and collect them in $OUT.
# Usage (on the host, from the repo root, with the wheels of shared/tools/gpu-host-wheels.sh in .whl):
#   bash tools/gpu_notebooks.sh [NOTEBOOK ...]      (default: every lesson)
set -uo pipefail
out=${OUT:-executed}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 AMP_LESSONS_REQUIRE_PROVENANCE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'
status=0
for nb in "${@:-notebooks/[0-9][0-9]_*.ipynb}"; do
  for f in $nb; do
    start=$(date +%s)
    python3 -m amp_lessons run-notebooks --profile full --no-progress --out "$out" "$f" || status=1
    echo "$(basename "$f"): $(( $(date +%s) - start )) s"
  done
done
exit $status
