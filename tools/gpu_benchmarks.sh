#!/usr/bin/env bash
# The CUDA runs recorded in docs/BENCHMARKS.md, batched for one lease of a one-GPU machine:
#   tools/gpu_benchmarks.sh parity   # two-stage split on one GPU: A/B/A parity in every storage mode, resplit
#   tools/gpu_benchmarks.sh bench    # random Llama-3-8B-shaped bf16: throughput vs transformers, split follow-ups
#   tools/gpu_benchmarks.sh moe      # MoE experts in host RAM beside a GPU model: the placement test, then a
#                                    # Qwen3-30B-A3B-shaped model (12 of its 48 layers) with experts on GPU vs CPU
#   tools/gpu_benchmarks.sh decode   # the same model: decode modes at batch 1 and 8 vs the HBM roofline, K/V restore
# Wheels missing on the machine (gguf, platformdirs) are installed from .whl/ when present. Output goes to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/strata-gpu}"; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c "import torch, platform; print('torch', torch.__version__, 'python', platform.python_version(), 'cpus', __import__('os').cpu_count())" | tee -a "$OUT/machine.txt"

case "${1:-parity}" in
parity)
  [ -d /tmp/small ] || python3 tools/make_random_model.py /tmp/small --shape small --dtype bfloat16 --device cuda
  for mode in "" --deterministic; do  # the default (graphs, one GEMM) and the batch-invariant path
    for storage in ram disk tiered; do
      python3 tools/conversation_cache_parity.py --model /tmp/small --devices cuda:0,cuda:0 --layer-split 4,4 \
        --dtype bfloat16 --storage "$storage" --words 400 --max-tokens 24 $mode \
        --resplit cuda:0 --resplit cuda:0,cuda:0/2,6 2>&1 | grep -E "PASS|FAIL|Error|error" | tee -a "$OUT/parity.txt"
    done
  done
  ;;
bench)
  [ -d /tmp/l8b ] || python3 tools/make_random_model.py /tmp/l8b --shape llama3-8b --dtype bfloat16 --device cuda
  python3 tools/bench_throughput.py --model /tmp/l8b --device cuda:0 --dtype bfloat16 --prefill-chunk 2048 \
    --decode-tokens 128 2>&1 | grep -v "^INFO" | tee "$OUT/throughput.txt"
  ;;
decode)
  [ -d /tmp/l8b ] || python3 tools/make_random_model.py /tmp/l8b --shape llama3-8b --dtype bfloat16 --device cuda
  python3 tools/gpu_decode_bench.py --model /tmp/l8b --batches 1,8 --tokens 128 --restore-tokens 11000 2>&1 \
    | grep -v " INFO " | tee "$OUT/decode.txt"
  ;;
split)
  [ -d /tmp/l8b ] || python3 tools/make_random_model.py /tmp/l8b --shape llama3-8b --dtype bfloat16 --device cuda
  python3 tools/split_bench.py --model /tmp/l8b --devices cuda:0,cuda:0 --layer-split 16,16 --tokens 11000 \
    --turns 4 --json "$OUT/split.json" 2>&1 | grep -v " INFO " | tee "$OUT/split.txt"
  ;;
moe)
  python3 -m pytest -p no:cacheprovider -q -rs tests/test_moe_placement.py -k gpu_model 2>&1 | tail -3 \
    | tee "$OUT/moe_placement.txt"
  python3 tools/moe_bench.py --shape qwen3-30b-a3b --layers 12 --device cuda:0 --prompt-tokens 2048 \
    --prefill-chunk 2048 --decode-tokens 64 2>&1 | grep -v " INFO " | tee "$OUT/moe.txt"
  ;;
esac
