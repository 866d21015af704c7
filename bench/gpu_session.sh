#!/usr/bin/env bash
# The stable GPU targets in one device call: bash bench/gpu_session.sh NAME...
# Each target's table goes to $OUT/NAME.md, stderr to $OUT/log. Targets, the wheels serve needs
# and how to compare two commits: bench/README.md; the figures: docs/performance.md.
set -uo pipefail
targets="tests latency-bf16 latency-fp8 latency-int4 throughput serve sched startup kv moe mla gpt-oss gpt-oss-120b hybrid tp profile kernels spec lora gemm serve-process"
if [ $# -eq 0 ]; then
  echo "usage: bash bench/gpu_session.sh NAME...   (NAME: $targets)" >&2
  exit 2
fi
for name in "$@"; do
  [[ " $targets " == *" $name "* ]] || { echo "unknown target: $name (targets: $targets)" >&2; exit 2; }
done
OUT=${OUT:-/tmp/kvship-bench}
mkdir -p "$OUT"
# Tables name the commit: BENCH_COMMIT, else a COMMIT file in the tree (an A/B checkout), else git.
if [ -z "${BENCH_COMMIT:-}" ] && [ -f COMMIT ]; then BENCH_COMMIT=$(cat COMMIT); fi
export BENCH_COMMIT=${BENCH_COMMIT:-} PYTHONPATH=$PWD/engine${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# The HTTP stack and the other wheels the GPU image lacks (bench/fetch_wheels.sh), when carried.
whl=${WHEELS:-.whl}
if compgen -G "$whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$whl"/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
# NVLink multicast stays off on the lent multi-GPU machines.
tp_env=(env NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1)
wanted=" $* "
bench() {  # name, time limit (s), command...
  local name=$1 limit=$2; shift 2
  [[ $wanted == *" $name "* ]] || return 0
  echo "== $name: $*" >>"$OUT/log"
  timeout "$limit" "$@" >"$OUT/$name.md" 2>>"$OUT/log"
  echo "== $name exit $?" | tee -a "$OUT/log"
  cat "$OUT/$name.md"
}
bench tests 580 env PYTHONPATH=$PWD/bench:$PYTHONPATH python3 -m pytest tests/engine tests/kernels tests/models \
  tests/loader -m gpu -q -p pytest_times -p no:cacheprovider --tb=short -rfE --durations=15
bench latency-bf16 200 python3 bench/latency.py --quantization none --no-hf
bench latency-fp8 200 python3 bench/latency.py --quantization fp8 --no-hf
bench latency-int4 300 python3 bench/latency.py --quantization int4 q4_k_m --no-hf
# every configuration in one process: each engine gives its memory back to the next
bench throughput 580 python3 bench/throughput.py --hf-prompts 0 --num-prompts 1000 --kv-cache-dtype auto fp8 \
  --quantization none fp8
bench serve 300 python3 bench/serve.py --concurrency 1 8 32 64
# the same with the engine's step loop in a process of its own, then in the server's again
bench serve-process 590 bash -c "python3 bench/serve.py --concurrency 1 8 32 64 --server-arg=--engine-process && \
  python3 bench/serve.py --concurrency 1 8 32 64"
# scheduling A/B: serving with prompts finishing one a step (serve's default join limit) then
# sharing whole steps; offline with each admission order
bench sched 590 bash -c "python3 bench/serve.py --concurrency 1 8 32 64 && \
  python3 bench/serve.py --concurrency 1 8 32 64 --server-arg=--prefill-join-tokens=8192 && \
  python3 bench/throughput.py --hf-prompts 0 --num-prompts 500 --schedule-policy shortest-prefill longest-output"
bench startup 300 python3 bench/startup.py --quantization none fp8
bench kv 300 python3 bench/kv_decode.py
bench moe 300 python3 bench/latency.py --shape qwen3-30b-a3b --quantization fp8 --no-hf
bench mla 400 bash -c "python3 bench/latency.py --shape deepseek-v2-lite --quantization none --no-hf && \
  python3 bench/latency.py --shape moonlight-16b-a3b --quantization none --no-hf"
bench gpt-oss 400 python3 bench/latency.py --shape gpt-oss-20b
bench gpt-oss-120b 550 python3 bench/latency.py --shape gpt-oss-120b
# the hybrid Gated DeltaNet shapes: 27B in bf16 and FP8, 35B-A3B in FP8, then batch-1 decode after a
# 32k prompt beside a dense 32B; each part bounded, so that one running long still leaves the others
bench hybrid 240 bash -c "for q in none fp8; do timeout 60 python3 bench/latency.py --shape qwen3.6-27b --quantization \$q \
  --output 128; done; timeout 45 python3 bench/latency.py --shape qwen3.6-35b-a3b --quantization fp8 --output 128; \
  timeout 75 python3 bench/latency.py --shape qwen3.6-27b --context 32768 --dense qwen3-32b --quantization fp8 --output 64"
bench tp 420 "${tp_env[@]}" python3 bench/tp_latency.py --tp 2 --timeout 130
# decode at batch 1 and 256, then a serving step: 63 decodes with a 1024-token prompt joining
bench profile 300 bash -c "python3 bench/profile_step.py --graphs --batch 1 && \
  python3 bench/profile_step.py --graphs --batch 256 && \
  python3 bench/profile_step.py --graphs --batch 63 --context 1024 --join 1024 --steps 8 --host"
bench kernels 300 python3 bench/kernels_gpu.py
bench spec 400 python3 bench/spec_decode.py --shape llama3-8b --acceptance 0.5 0.7 --batch 1 8 16 32 48 64
# the base engine, the LoRA one and the base again, each in its own process, after the kernel table
bench lora 300 python3 bench/lora.py --kernels
# cuBLAS's pick against TunableOp's and a split-K Triton GEMM's per shape (bench/gemm_tuning.py), then a 256-row decode step as
# the engine runs it, without and with TunableOp tuning every GEMM it meets
bench gemm 560 bash -c "timeout 300 python3 bench/gemm_tuning.py --triton; \
  timeout 100 python3 bench/profile_step.py --graphs --batch 256 --context 840 --steps 8 --top 12; \
  PYTORCH_TUNABLEOP_ENABLED=1 PYTORCH_TUNABLEOP_TUNING=1 PYTORCH_TUNABLEOP_FILENAME=/tmp/tunableop.csv \
  timeout 150 python3 bench/profile_step.py --graphs --batch 256 --context 840 --steps 8 --top 12"
