#!/usr/bin/env bash
# Every H200 figure of docs/benchmarks.md in one device call (device time is scarce):
#   bash bench/fetch_wheels.sh            # once, on a dev machine: the HTTP stack for serve.py
#   device run, carry [".whl"]:  bash bench/gpu_session.sh tests latency throughput-8b
#   second device run:            bash bench/gpu_session.sh throughput-qwen3 serve startup
#   2 GPUs (nvidia-h200-x2):      bash bench/gpu_session.sh tp tp-profile, then tp-throughput
#   kernel profiles:              bash bench/gpu_session.sh profile   (profile-b1: batch 1 only)
#   GEMV settings sweep:          bash bench/gpu_session.sh gemv
#   KV-cache dtypes:              bash bench/gpu_session.sh kv-tests throughput-8b-fp8 kv-decode
#   perplexity by KV dtype through the Triton path (needs the bundled model, 94 MB: more than a
#   call carries), rotary kernel tests, the engine's KV dtypes in CUDA graphs: kv-ppl kv-rotary kv-graphs
#   decode attention settings per KV layout, FP8 GEMV: bash bench/gpu_session.sh kv-sweep fp8-gemv latency-fp8
#   FP8 pages read as packed values against the FP8 query, in the engine (KV-bound decode, the step's
#   kernels): bash bench/gpu_session.sh kv-read-ab
#   Qwen3-30B-A3B offline throughput: bash bench/gpu_session.sh throughput-moe
#   quantized experts (GPU tests, batch-1 by format): bash bench/gpu_session.sh moe-tests latency-moe-q
#   integer one-row GEMV (tests, settings sweep, batch 1): bash bench/gpu_session.sh int-gemv-tests int-gemv latency-int
#   programmatic dependent launch off and on (KVSHIP_PDL), batch 1: bash bench/gpu_session.sh pdl-ab
#   block-wise FP8 weights (a scale per 128 x 128 block) through W8A8 and the group GEMM: GPU tests,
#   the GEMM against the bf16 expansion it replaces, the kernel tests of the rotary/int4 pages, then
#   offline throughput bf16 / fp8-block (300 prompts): fp8-block-tests fp8-block-gemm kv-quant-tests throughput-fp8-block
#   4-bit GEMV on the tensor cores for 2-8 rows (tests, sweeps, a batch-4 step off and on), every
#   pairs-kernel setting per projection: bash bench/gpu_session.sh mma-tests mma-gemv mma-ab pairs-all
#   the sweep's best pairs settings for FP8 and Q4_K's layout, batch 1 without and with them: pairs-best
#   quantized-weight GPU tests, batch 1 by format, the batch-4 int4 step: final-verify latency-formats profile-int4-b4
#   DeepSeek-V2's latent attention in Triton and CUDA graphs (kernel and model GPU tests, then
#   batch 1 of the V2-Lite and Moonlight shapes, where V2-Lite's step goes): mla-tests latency-mla profile-mla
#   the rotary + latent store in one kernel (kernel tests, graphs), DeepSeek's projections in the one-row GEMV
#   (sweep, then batch 1 without and with its settings): mla-quick gemv-deepseek
#   DeepSeek-V3's routing in one kernel (its GPU tests, Moonlight's batch 1): noaux-route
#   the decode graphs' inputs in one launch against a base tree (build/base): graph-inputs
#   the gate/up GEMV's activation in its epilogue (tests, batch 1 with and without, the A3B shape): gated-gemv
#   the attention loops' hoisted page offsets (a32a309; bench/sass_attention.py counts their instructions on any
#   machine): attention GPU tests, the kernels' table, KV-bound decode by KV dtype, batch 1: attn-offsets
#   DeepSeek's absorbed per-head products in one launch each against bmm (tests, the products, batch 1 of
#   V2-Lite and Moonlight in this tree and build/base): absorbed
#   DeepSeek's MoE glue (router GEMV, scaling in the routing kernel, shared experts added in the down
#   kernel) against build/base: deepseek-glue
#   the latent-attention decode's launch settings, never tuned on a GPU: mla-sweep (mla-sweep-quick: 12)
#   the one-row GEMV with its weight tiles through shared memory on the tensor cores (bf16, FP8): tc-gemv
#   per-row FP8 W8A8 in Triton against torch._scaled_mm (tests, tile sweep): fp8-rowwise; then, with the
#   sweep's tiles in fp8_matmul.ROWWISE_GEMM_SHAPES, offline throughput against build/base: fp8-rowwise-ab
#   the prefill kernel's lazy softmax (tests, tiles at 2k-8k without and with it): prefill-lazy
#   the A3B's attention weights read into L2 during the experts, a probe for its batch-1 step: l2-prefetch;
#   then in the engine (KVSHIP_L2_WARM), A3B batch 1 off and on alternated: l2-warm-ab
#   kernel tests changed after 2026-12-02's last device call (q/k norm in the rotary store, int4 heads
#   under 32 channels, MoE models in CUDA graphs): bash bench/gpu_session.sh gpu-verify
#   throughput by KV and weight dtype (two passes each: one tree's single runs spread by 7%), then where
#   the FP8-weight run's time goes, and FP8 weights at
#   2-16 rows (dequantizing GEMM against W8A8): bash bench/gpu_session.sh rotary-tests throughput-all
#   throughput-profile fp8-small-batch
# (the five together outrun one call's 10 minutes). Tables go to $OUT/*.md, stderr to $OUT/log.
# The tables name the commit from `git rev-parse`, which on the device machine's copy was stale
# (it printed ef31dd7 for later trees): start the call with KVSHIP_COMMIT=<this tree's commit>.
set -uo pipefail
OUT=${OUT:-/tmp/kvship-bench}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/engine${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
wanted=" ${*:-tests latency throughput-8b throughput-qwen3 serve startup profile} "
bench() {  # name, time limit (s), command...
  local name=$1 limit=$2; shift 2
  [[ $wanted == *" $name "* ]] || return 0
  echo "== $name: $*" >>"$OUT/log"
  timeout "$limit" "$@" >"$OUT/$name.md" 2>>"$OUT/log"
  echo "== $name exit $?" | tee -a "$OUT/log"
  cat "$OUT/$name.md"
}
deepseek_ab() {  # batch 1 of V2-Lite and Moonlight in this tree, then in build/base (a tree and its BASE file)
  local shape
  for shape in deepseek-v2-lite moonlight-16b-a3b; do
    python3 bench/latency.py --shape $shape --quantization none --no-hf || return
  done
  (cd build/base && export KVSHIP_COMMIT=$(cat BASE) PYTHONPATH=$PWD/engine:$PYTHONPATH &&
    for shape in deepseek-v2-lite moonlight-16b-a3b; do
      python3 bench/latency.py --shape $shape --quantization none --no-hf || exit
    done)
}
export -f deepseek_ab
bench tests 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_engine.py tests/test_models.py \
  tests/test_kernels.py tests/test_sampler.py
bench latency 150 python3 bench/latency.py
bench structured 200 python3 bench/structured_overhead.py
bench latency-nohf 100 python3 bench/latency.py --no-hf
bench gemv 200 python3 bench/gemv_sweep.py
bench gemv-more 300 python3 bench/gemv_sweep.py --more
bench profile-moe 200 python3 bench/profile_step.py --graphs --batch 1 --shape qwen3-30b-a3b
bench profile-int4 200 python3 bench/profile_step.py --graphs --batch 1 --quantization int4
bench profile-int4-nopdl 200 env KVSHIP_PDL=0 python3 bench/profile_step.py --graphs --batch 1 --quantization int4
bench profile-fp8 200 python3 bench/profile_step.py --graphs --batch 1 --quantization fp8
bench profile-gemma 200 python3 bench/profile_step.py --graphs --batch 1 --shape gemma2-9b
bench gpu-verify 240 python3 -m pytest -q -p no:cacheprovider --tb=short "tests/test_kv_quant.py::test_rotary_store_kernel" \
  "tests/test_kv_quant.py::test_decode_kernel_packed" "tests/test_kv_quant.py::test_decode_kernel" \
  "tests/test_fused_moe.py::test_moe_model_in_cuda_graphs_matches_transformers" tests/test_models.py -k "not phi4_mini"
bench gemv-tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "gemv or linear_dispatch"
bench latency-gemma 200 python3 bench/latency.py --shape gemma2-9b --no-hf
bench latency-phi4 200 python3 bench/latency.py --shape phi4 --no-hf
bench throughput-8b 240 python3 bench/throughput.py --hf-prompts 8 --hf-batch 8
bench kv-tests 400 python3 -m pytest -q -s -p no:cacheprovider tests/test_kv_quant.py tests/test_kv_quant_engine.py -k "not perplexity and not greedy_agrees and not prefix_hits"
bench throughput-8b-fp8 240 python3 bench/throughput.py --kv-cache-dtype fp8 --hf-prompts 0
bench kv-decode 290 python3 bench/kv_decode.py
bench kv-read-ab 560 bash -c "python3 bench/kv_decode.py --kv auto fp8 fp8:fp8q && \
  KVSHIP_PDL=0 python3 bench/profile_step.py --graphs --batch 32 --context 8000 --steps 8 --kv-cache-dtype fp8 --top 6 && \
  KVSHIP_PDL=0 python3 bench/profile_step.py --graphs --batch 32 --context 8000 --steps 8 --kv-cache-dtype fp8 --top 6 \
  --fp8-read fp8q"
bench kv-ppl 200 python3 bench/kv_perplexity.py
bench kv-graphs 500 python3 -m pytest -q -s -p no:cacheprovider --tb=short tests/test_kv_quant_engine.py -k gpu_kernels
bench kv-rotary 150 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_kernels.py -k "rotary or rotation"
bench rotary-tests 150 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_kv_quant.py tests/test_kernels.py \
  -k "rotary or rotation or mixed or decode_kernel or prefill"
bench throughput-all 560 bash -c "python3 bench/throughput.py --hf-prompts 0 --passes 2 && \
  python3 bench/throughput.py --hf-prompts 0 --kv-cache-dtype fp8 --passes 2 && \
  python3 bench/throughput.py --hf-prompts 0 --kv-cache-dtype fp8 --quantization fp8 --passes 2"
bench throughput-profile 200 python3 bench/throughput.py --hf-prompts 0 --kv-cache-dtype fp8 --quantization fp8 \
  --num-prompts 300 --profile 25
bench fp8-small-batch 300 python3 bench/quant_gemv_sweep.py --formats fp8 --kernels pairs --quick --tokens 2 4 8 16
bench kv-sweep 300 python3 bench/kv_attention_sweep.py
bench int-gemv-tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_quant_gemv.py tests/test_quantized_weights.py \
  -k "pairs or kernel_matches or word_gemv"
bench int-gemv 300 python3 bench/quant_gemv_sweep.py --formats "int4 g128" "int4 g32" int8 --quick
bench latency-int 200 python3 bench/latency.py --quantization none int4 int4-g32 int8 --no-hf
bench mma-tests 200 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_quant_gemv_mma.py \
  tests/test_quant_gemv.py tests/test_kernels.py -k "mma or pdl or graph or pairs"
bench mma-gemv 300 python3 bench/quant_gemv_sweep.py --formats "int4 g128" --kernels pairs mma --all --tokens 2 4 8
bench pairs-all 300 python3 bench/quant_gemv_sweep.py --formats "int4 g32" fp8 --kernels pairs --all
bench mma-ab 200 bash -c "KVSHIP_PDL=0 KVSHIP_MMA_GEMV=0 python3 bench/profile_step.py --graphs --batch 4 --quantization int4 --top 8 && \
  KVSHIP_PDL=0 KVSHIP_MMA_GEMV=1 python3 bench/profile_step.py --graphs --batch 4 --quantization int4 --top 8"
bench pairs-best 600 bash -c "python3 bench/quant_gemv_sweep.py --formats fp8 'int4 g32' --kernels pairs --all \
  --best-json $OUT/best.json && python3 bench/latency.py --quantization fp8 int4-g32 int4 --no-hf && \
  python3 bench/latency.py --quantization fp8 int4-g32 int4 --no-hf --settings $OUT/best.json"
bench final-verify 240 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_quant_gemv_mma.py \
  tests/test_quantized_weights.py tests/test_kernels.py -k "mma or quant or pdl or graph or linear or gemv"
bench latency-formats 200 python3 bench/latency.py --quantization none fp8 int4 int4-g32 --no-hf
bench profile-int4-b4 120 env KVSHIP_PDL=0 python3 bench/profile_step.py --graphs --batch 4 --quantization int4 --top 8
bench pdl-ab 330 bash -c "KVSHIP_PDL=0 python3 bench/latency.py --quantization none fp8 int4 --no-hf && \
  KVSHIP_PDL=1 python3 bench/latency.py --quantization none fp8 int4 --no-hf"
bench fp8-block-tests 200 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_fp8_matmul.py \
  tests/test_quantized_weights.py -k "fp8 or kernel_matches or dense"
bench fp8-block-gemm 300 python3 bench/fp8_gemm.py --rows 2 16 64 256 512 1024
bench kv-quant-tests 300 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_kv_quant.py -k "rotary or int4 or decode"
bench throughput-fp8-block 400 bash -c "python3 bench/throughput.py --hf-prompts 0 --num-prompts 300 && \
  python3 bench/throughput.py --hf-prompts 0 --num-prompts 300 --quantization fp8-block"
bench latency-moe 150 python3 bench/latency.py --shape qwen3-30b-a3b --quantization none --no-hf
bench mla-tests 420 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_mla_attention.py \
  tests/test_models_deepseek.py -k "(gpu or cuda or not deepseek) and not compile"
bench mla-quick 240 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_mla_attention.py \
  tests/test_models_deepseek.py -k "(not deepseek and not compile) or (gpu_decode_in_cuda_graphs and (lite or v3) and not halves) or (gpu_fp8_latent and not e5m2)"
bench gemv-deepseek 400 bash -c "python3 bench/gemv_sweep.py --deepseek --best-json $OUT/gemv-deepseek.json && \
  python3 bench/latency.py --shape deepseek-v2-lite --quantization none --no-hf && \
  python3 bench/latency.py --shape deepseek-v2-lite --quantization none --no-hf --settings $OUT/gemv-deepseek.json && \
  python3 bench/latency.py --shape moonlight-16b-a3b --quantization none --no-hf --settings $OUT/gemv-deepseek.json"
bench mla-rest 300 bash -c "python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_models_deepseek.py \
  -k '(gpu_decode_in_cuda_graphs and v3 and not halves) or (gpu_fp8_latent and not e5m2)' && \
  python3 bench/latency.py --shape deepseek-v2-lite --quantization none --no-hf"
bench noaux-route 400 bash -c "python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_fused_moe.py \
  -k 'noaux or route_kernel' && python3 bench/latency.py --shape moonlight-16b-a3b --quantization none --no-hf"
bench attn-offsets 560 bash -c "python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_kernels.py \
  tests/test_kv_quant.py tests/test_attention_window.py -k 'decode or prefill or paged or window' && \
  python3 bench/kernels_gpu.py && python3 bench/kv_decode.py && \
  python3 bench/latency.py --quantization none fp8 --no-hf --output 128"
# the decode graphs' inputs staged in one launch (this tree) against the tree in build/base (made on the dev
# machine: git archive BASE engine bench | tar -x -C build/base; carried), batch 1 both, in one call
bench graph-inputs 590 bash -c "python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_graph_inputs.py \
  tests/test_gpu_engine.py && python3 bench/latency.py --quantization none fp8 --no-hf --output 128 && \
  cd build/base && KVSHIP_COMMIT=\$(cat BASE) PYTHONPATH=\$PWD/engine:\$PYTHONPATH python3 bench/latency.py --quantization none fp8 --no-hf \
  --output 128"
# the gate/up GEMV writing act(gate) * up from its epilogue (quantized weights, batch 1): its GPU tests,
# batch 1 with it and without (KVSHIP_GATED_GEMV), then the A3B shape (the inputs staged in one launch)
bench gated-gemv 590 bash -c "python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_quant_gemv.py \
  tests/test_quantized_weights.py -k 'gated or pairs' && \
  KVSHIP_GATED_GEMV=1 python3 bench/latency.py --quantization fp8 int4 --no-hf --output 128 && \
  KVSHIP_GATED_GEMV=0 python3 bench/latency.py --quantization fp8 int4 --no-hf --output 128 && \
  python3 bench/latency.py --shape qwen3-30b-a3b --quantization none --no-hf --output 128"
# DeepSeek's absorbed per-head products in one launch each (kernels/gemv.py head_matmul): kernel and model GPU
# tests, the products against bmm, then batch 1 of V2-Lite and Moonlight in this tree and in build/base
bench absorbed 590 bash -c "python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_kernels.py \
  tests/test_mla_attention.py tests/test_models_deepseek.py -k 'head or (mla and not compile) or \
  (gpu_decode_in_cuda_graphs and (lite or v3) and not halves)' && python3 bench/gemv_sweep.py --absorbed && \
  deepseek_ab"
# DeepSeek's MoE glue at one token: the router's float32 GEMV in one launch, the routed scaling in the
# routing kernel, the shared experts' output added in the down kernel (tests, then batch 1 of V2-Lite and
# Moonlight in this tree and in build/base)
bench deepseek-glue 590 bash -c "python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_kernels.py \
  tests/test_fused_moe.py tests/test_models_deepseek.py -k 'float_linear or head or matches_reference or noaux \
  or fused_moe_in_cuda_graph or moe_model_in_cuda_graphs or (gpu_decode_in_cuda_graphs and v3)' && deepseek_ab"
# the latent-attention kernels with programmatic dependent launch: their GPU tests, then batch 1 of V2-Lite and
# Moonlight (128 tokens) in this tree and in build/base
bench mla-pdl 250 bash -c "python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_mla_attention.py \
  -k 'not compile' && for shape in deepseek-v2-lite moonlight-16b-a3b; do \
  python3 bench/latency.py --shape \$shape --quantization none --no-hf --output 128 && \
  (cd build/base && KVSHIP_COMMIT=\$(cat BASE) PYTHONPATH=\$PWD/engine:\$PYTHONPATH \
  python3 bench/latency.py --shape \$shape --quantization none --no-hf --output 128) || exit; done"
# the latent-attention decode's launch settings (bench/mla_sweep.py; --quick: 12 settings)
bench mla-sweep 500 python3 bench/mla_sweep.py
bench mla-sweep-quick 150 python3 bench/mla_sweep.py --quick
# the one-row GEMV on the tensor cores, its weight tiles streamed through shared memory (a probe)
bench tc-gemv 330 python3 bench/tc_gemv_sweep.py
# offline throughput, 1000 prompts: bf16 and FP8 (W8A8) weights in this tree, FP8 in build/base, then FP8 + fp8 KV here
bench fp8-rowwise-ab 590 bash -c "python3 bench/throughput.py --hf-prompts 0 --quantization none fp8 && \
  (cd build/base && KVSHIP_COMMIT=\$(cat BASE) PYTHONPATH=\$PWD/engine:\$PYTHONPATH \
  python3 bench/throughput.py --hf-prompts 0 --quantization fp8) && \
  python3 bench/throughput.py --hf-prompts 0 --quantization fp8 --kv-cache-dtype fp8"
# Qwen3-30B-A3B batch 1: the next layer's q/k/v and o weights read into L2 on a side stream while the experts stream
bench l2-prefetch 200 python3 bench/l2_prefetch.py
# the same in the engine (KVSHIP_L2_WARM: programs of the read, 0 off): its GPU test, then A3B batch 1 off, on, off, on
bench l2-warm-ab 560 bash -c "python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_l2_warm.py && \
  for w in 0 32 0 32; do KVSHIP_L2_WARM=\$w python3 bench/latency.py --shape qwen3-30b-a3b --quantization none \
  --no-hf --output 128 || exit; done"
# the causal prefill kernel's tiles without and with the lazy softmax at 2k/4k/8k (its GPU tests first)
bench prefill-lazy 400 bash -c "python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_kernels.py \
  tests/test_kv_quant.py -k 'prefill or lazy' && python3 bench/kernels_gpu.py --prefill-sweep"
# GPU tests written on a CPU-only day (2026-12-05), not yet run: the fused-MoE tests with the dead
# expert's NaN weights and graph replays counted (Mixtral too), the in-situ FP8 loading peak
bench cpu-day-gpu-tests 400 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_fused_moe.py \
  tests/test_quantized_weights.py -k "gpu or cuda or graph or loading_peak"
# per-row FP8 W8A8: the group GEMM's PER_ROW form (GPU tests), then against torch._scaled_mm over a grid of tiles
bench fp8-rowwise 520 bash -c "python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_fp8_matmul.py && \
  python3 bench/fp8_gemm.py --rowwise --rows 2 8 16 64 128 256 512"
# V2-Lite's TTFT (prompt 512) in this tree and in build/base, alternated twice
bench ttft-ab 330 bash -c "for i in 1 2; do python3 bench/latency.py --shape deepseek-v2-lite --quantization none \
  --no-hf --output 16 && (cd build/base && KVSHIP_COMMIT=\$(cat BASE) PYTHONPATH=\$PWD/engine:\$PYTHONPATH \
  python3 bench/latency.py --shape deepseek-v2-lite --quantization none --no-hf --output 16); done"
bench profile-mla 200 env KVSHIP_PDL=0 python3 bench/profile_step.py --graphs --batch 1 --shape deepseek-v2-lite --top 14
bench profile-moonlight 200 env KVSHIP_PDL=0 python3 bench/profile_step.py --graphs --batch 1 --shape moonlight-16b-a3b \
  --top 24
bench latency-mla 300 bash -c "python3 bench/latency.py --shape deepseek-v2-lite --quantization none --no-hf && \
  python3 bench/latency.py --shape moonlight-16b-a3b --quantization none --no-hf"
bench fp8-gemv 240 python3 bench/quant_gemv_sweep.py --formats fp8 --quick
bench latency-fp8 280 python3 bench/latency.py --quantization none fp8 int8 --no-hf
bench moe-tests 250 python3 -m pytest -q -p no:cacheprovider tests/test_fused_moe.py tests/test_quantized_moe.py \
  tests/test_loader_gguf_moe.py tests/test_quantized_weights.py tests/test_kv_quant.py \
  -k "not perplexity and not greedy_agrees and not prefix_hits and not insitu_quantization_of_the_bundled"
bench latency-moe-q 300 python3 bench/latency.py --shape qwen3-30b-a3b --quantization none int8 int4-g32 --no-hf
bench throughput-moe 290 python3 bench/throughput.py --shape qwen3-30b-a3b --hf-prompts 0
bench throughput-qwen3 200 python3 bench/throughput.py --shape qwen3-0.6b --num-prompts 256 --hf-prompts 8 --hf-batch 8
bench serve 240 python3 bench/serve.py --concurrency 1 8 32 64
bench startup 300 python3 bench/startup.py --quantization none fp8
bench profile-b1 150 python3 bench/profile_step.py --graphs --batch 1
bench profile 300 bash -c "python3 bench/profile_step.py --graphs --batch 1 && python3 bench/profile_step.py --graphs --batch 256"
bench tp-profile 200 env NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
  python3 bench/profile_step.py --graphs --batch 1 --tp 2
bench tp-throughput 560 env NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
  python3 bench/throughput.py --tp 1 2 --hf-prompts 0
bench tp 420 env NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
  python3 bench/tp_latency.py --tp 2 --timeout 130
