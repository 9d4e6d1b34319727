#!/usr/bin/env bash
# The two-GPU run (nvidia-h200-x2): parity across cuda:0,cuda:1 in every storage mode, a conversation parked on
# the two-GPU split resumed on one GPU, and the follow-up table on a Llama-3-70B-shaped bf16 model split across
# both GPUs. Output goes to $OUT. The 70B weights (~141 GB) exceed the machine's 128 GiB disk: they are written to
# /dev/shm (RAM-backed, 256 GiB on that machine) and loaded from there.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/strata-gpu2}"; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"

case "${1:-parity}" in
parity)
  [ -d /tmp/small ] || python3 tools/make_random_model.py /tmp/small --shape small --dtype bfloat16 --device cuda
  for storage in ram disk tiered; do
    python3 tools/conversation_cache_parity.py --model /tmp/small --devices cuda:0,cuda:1 --layer-split auto \
      --dtype bfloat16 --storage "$storage" --words 400 --max-tokens 24 --resplit cuda:0 \
      2>&1 | grep -E "PASS|FAIL|Error|error" | tee -a "$OUT/parity.txt"
  done
  ;;
table)
  [ -d /dev/shm/l70b ] || python3 tools/make_random_model.py /dev/shm/l70b --shape llama3-70b --dtype bfloat16 \
    --device cuda
  python3 tools/split_bench.py --model /dev/shm/l70b --devices cuda:0,cuda:1 --layer-split auto --tokens 11000 \
    --turns 4 --json "$OUT/split70b.json" 2>&1 | grep -v " INFO " | tee "$OUT/split70b.txt"
  ;;
esac
