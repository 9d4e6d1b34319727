#!/usr/bin/env bash
# The CUDA runs recorded in docs/BENCHMARKS.md, batched for one lease of a one-GPU machine:
#   tools/gpu_benchmarks.sh parity   # two-stage split on one GPU: A/B/A parity in every storage mode, resplit
#   tools/gpu_benchmarks.sh bench    # random Llama-3-8B-shaped bf16: throughput vs transformers, split follow-ups
#   tools/gpu_benchmarks.sh moe      # MoE experts in host RAM beside a GPU model: the placement test, the grouped
#                                    # experts' GPU tests, A/B/A parity with experts on the CPU (ram, disk, tiered,
#                                    # restart) and on the GPU, then a Qwen3-30B-A3B-shaped model (12 of its 48
#                                    # layers): grouped experts + graphs, the --deterministic loop, experts on the CPU
#   tools/gpu_benchmarks.sh moeswitch # that shape cut to 4 layers, experts in host RAM: two 16K-token conversations
#                                    # taking turns, cache off vs on
#   tools/gpu_benchmarks.sh int4     # the same model with --gpu-weights int4: the CUDA tests, then decode at batch 1
#                                    # and 8 against bf16 in the same run, prefill, logits vs bf16
#   tools/gpu_benchmarks.sh serve    # the same model behind `strata serve --parallel 8`: 8 openai-SDK streams
#   tools/gpu_benchmarks.sh hybrid   # hybrids on CUDA: fla-core's delta rule vs PyTorch's, A/B/A parity on a small
#                                    # Qwen3.5, and a Qwen3.5-9B-shaped model's switch-back at 16K tokens
#   tools/gpu_benchmarks.sh decode   # the same model: decode modes at batch 1 and 8 vs the HBM roofline, K/V restore
#   tools/gpu_benchmarks.sh spec     # speculation on CUDA: the captured step's attention row by row at each length
#                                    # bucket, every GPU test, A/B/A parity with prompt lookup on (ram, disk, tiered,
#                                    # restart), then prompt lookup on the 8B-shaped model (tools/spec_bench.py:
#                                    # token-identical answers, tok/s with and without)
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
        --resplit cuda:0 --resplit cuda:0,cuda:0/2,6 2>&1 | grep --line-buffered -E "PASS|FAIL|Error|error" | tee -a "$OUT/parity.txt"
    done
  done
  ;;
bench)
  [ -d /tmp/l8b ] || python3 tools/make_random_model.py /tmp/l8b --shape llama3-8b --dtype bfloat16 --device cuda
  python3 tools/bench_throughput.py --model /tmp/l8b --device cuda:0 --dtype bfloat16 --prefill-chunk 2048 \
    --decode-tokens 128 2>&1 | grep --line-buffered -v "^INFO" | tee "$OUT/throughput.txt"
  ;;
decode)
  [ -d /tmp/l8b ] || python3 tools/make_random_model.py /tmp/l8b --shape llama3-8b --dtype bfloat16 --device cuda
  python3 tools/gpu_decode_bench.py --model /tmp/l8b --batches 1,8 --tokens 128 --restore-tokens 11000 2>&1 \
    | grep --line-buffered -v " INFO " | tee "$OUT/decode.txt"
  ;;
split)
  [ -d /tmp/l8b ] || python3 tools/make_random_model.py /tmp/l8b --shape llama3-8b --dtype bfloat16 --device cuda
  python3 tools/split_bench.py --model /tmp/l8b --devices cuda:0,cuda:0 --layer-split 16,16 --tokens 11000 \
    --turns 4 --json "$OUT/split.json" 2>&1 | grep --line-buffered -v " INFO " | tee "$OUT/split.txt"
  ;;
moe)
  python3 -m pytest -p no:cacheprovider -q -rs tests/test_moe_placement.py -k gpu_model 2>&1 | tail -3 \
    | tee "$OUT/moe_placement.txt"
  python3 -m pytest -p no:cacheprovider -q -rs tests/test_moe_grouped.py tests/test_graph_decode.py 2>&1 | tail -8 \
    | tee "$OUT/moe_grouped.txt"
  small=$(python3 -c "import torch; from tools.moe_bench import write_model; print(write_model('/tmp/moe', 'small', None, torch.bfloat16, 'cuda'))")
  for storage in ram disk tiered; do  # experts in host RAM (4-bit, on the CPU) beside the GPU's attention
    python3 tools/conversation_cache_parity.py --model "$small" --devices cuda:0 --dtype bfloat16 --moe-experts cpu \
      --storage "$storage" --restart --words 300 --max-tokens 16 2>&1 | grep --line-buffered -E "PASS|FAIL|Error|error" \
      | sed "s/^/experts cpu: /" | tee -a "$OUT/moe_parity.txt"
  done
  python3 tools/conversation_cache_parity.py --model "$small" --devices cuda:0 --dtype bfloat16 --storage tiered \
    --restart --words 300 --max-tokens 16 2>&1 | grep --line-buffered -E "PASS|FAIL|Error|error" | sed "s/^/experts gpu: /" \
    | tee -a "$OUT/moe_parity.txt"
  python3 tools/moe_bench.py --shape qwen3-30b-a3b --layers 12 --device cuda:0 --prompt-tokens 2048 \
    --prefill-chunk 2048 --decode-tokens 64 2>&1 | grep --line-buffered -v " INFO " | tee "$OUT/moe.txt"
  ;;
moeswitch)
  m4=$(python3 -c "import torch; from tools.moe_bench import write_model; print(write_model('/tmp/moe', 'qwen3-30b-a3b', 4, torch.bfloat16, 'cuda'))")
  python3 tools/hybrid_switch_bench.py --model "$m4" --device cuda:0 --moe-experts cpu --tokens 16384 \
    --cache-mib 16384 2>&1 | grep --line-buffered -v " INFO " | tee "$OUT/moe_switch.txt"
  ;;
int4)
  [ -d /tmp/l8b ] || python3 tools/make_random_model.py /tmp/l8b --shape llama3-8b --dtype bfloat16 --device cuda
  python3 -m pytest -p no:cacheprovider -q -rs tests/test_gpu_weights.py 2>&1 | tail -15 | tee "$OUT/int4_tests.txt"
  python3 tools/gpu_decode_bench.py --model /tmp/l8b --batches 1,8 --tokens 64 --restore-tokens 0 \
    --gpu-weights bf16,int4 2>&1 | grep --line-buffered -v " INFO " | tee "$OUT/int4.txt"
  ;;
serve)
  [ -d /tmp/l8b ] || python3 tools/make_random_model.py /tmp/l8b --shape llama3-8b --dtype bfloat16 --device cuda
  python3 tools/serve_parallel_bench.py --model /tmp/l8b --streams 8 --tokens 256 2>&1 \
    | grep --line-buffered -v " INFO " | tee "$OUT/serve8.txt"
  ;;
hybrid)
  python3 tools/deltanet_bench.py --tokens 16384 2>&1 | grep --line-buffered -v " INFO " | tee "$OUT/deltanet.txt"
  make="from tools.hybrid_switch_bench import make_model; import sys; make_model('qwen3_5', *sys.argv[1:])"
  [ -d /tmp/q35small ] || python3 -c "$make" /tmp/q35small
  for storage in ram disk tiered; do
    python3 tools/conversation_cache_parity.py --model /tmp/q35small --devices cuda:0 --dtype float32 \
      --storage "$storage" --restart --words 400 --max-tokens 16 --checkpoint-tokens 256 2>&1 \
      | grep --line-buffered -E "PASS|FAIL|Error|error" | tee -a "$OUT/hybrid_parity.txt"
  done
  [ -d /tmp/q35-9b ] || python3 -c "$make" /tmp/q35-9b qwen3.5-9b cuda
  for fla in "" --no-fla; do
    python3 tools/hybrid_switch_bench.py --model /tmp/q35-9b --device cuda:0 --tokens 16384 --cache-mib 16384 \
      $fla 2>&1 | grep --line-buffered -v " INFO " | tee -a "$OUT/hybrid_switch.txt"
  done
  ;;
spec)
  timeout 120 python3 - <<'PY' 2>&1 | tee "$OUT/spec_attention.txt"
import torch
from engine.model.graph_verify import attention_alike
for length in (256, 1024, 4096, 16384, 32768, 65536):
    rows = [r for r in (1, 2, 4, 8, 9, 16, 18) if r * length <= 18 * 65536]
    print("attention alike at", length, "positions, rows", rows, ":",
          attention_alike(rows, length, 32, 8, 128, torch.bfloat16, torch.device("cuda:0")), flush=True)
PY
  timeout 400 python3 -m pytest -p no:cacheprovider -v -rs -m gpu --continue-on-collection-errors tests/ 2>&1 | grep -E "PASSED|FAILED|SKIPPED|ERROR|Error|passed|failed" \
    | tee "$OUT/spec_tests.txt"
  [ -d /tmp/small ] || python3 tools/make_random_model.py /tmp/small --shape small --dtype bfloat16 --device cuda
  for storage in ram disk tiered; do
    python3 tools/conversation_cache_parity.py --model /tmp/small --devices cuda:0 --dtype bfloat16 --storage "$storage" \
      --spec prompt-lookup --restart --words 400 --max-tokens 48 2>&1 | grep --line-buffered -E "PASS|FAIL|Error|error" \
      | tee -a "$OUT/spec_parity.txt"
  done
  [ -d /tmp/l8b ] || python3 tools/make_random_model.py /tmp/l8b --shape llama3-8b --dtype bfloat16 --device cuda
  python3 tools/spec_bench.py --model /tmp/l8b --rounds 3 --max-tokens 256 2>&1 | grep --line-buffered -v " INFO " \
    | tee "$OUT/spec.txt"
  ;;
esac
