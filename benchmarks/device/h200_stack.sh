#!/usr/bin/env bash
# The project's GPU stages on the offline H200 machine (vLLM + Ray, the kernel, EP), stage by stage.
#   bash benchmarks/device/h200_stack.sh STAGE...     (from the project root; logs under $OUT or runs/h200)
# The vLLM / Ray / RL stages need the bundles built here first (../shared/device): .gpu-vllm/ and
# .gpu-ray/ (carry both); the kernel stages (kernel_tests, bench, tune) run without them.
# Stages: versions | rollout (tests/rollout/test_rollout_gpu.py) | sync_tests (tests/rollout/test_rollout_sync_gpu.py: the CUDA IPC
# weight sync) | async_gpu (tests/rl/test_rl_async_gpu.py: async RL over ipc at k = 0 and 1, bitwise, a rollout worker killed mid-queue; ~4-6 min) | bench_sync (benchmarks/bench_weight_sync.py; SYNC_ARGS overrides its arguments) | consistency_tests (gpu tests of the
# consistency issue) | invariance | consistency (the CLI, 8 layers H=1024 E=64 k=8 bf16) | bitwise (run.numerics=bitwise: divergence + consistency at two shapes) | bitwise_families (the same for the tiny OLMoE and Mixtral) | dsv3 (consistency for the tiny DeepSeek-V3, MLA off) | q30b (configs/qwen3_30b_a3b_1gpu.yaml: make-model --device cuda, then Q30B_STEPS LoRA steps) | rl_megamoe |
# rl_reference | kernel_tests (the op's bf16 GPU tests + the trainer's) | kernel_tests_fp32 (the op's fp32
# and TMA-weight GPU tests) | gpu_tests (both of those and the trainer's, as 8 concurrent pytest processes) | bench (bench_moe.py; carry .whl with the
# Liger wheel; BENCH_ARGS overrides its shapes/tokens) | tune (tune_moe.py: stage split, tile
# variants) | router (megamoe.router's GPU tests and router_probe.py) | profile (one training step under torch.profiler: kernels and gaps) | host (host_path.py: host time per layer, one-call latency vs a CUDA graph) | probe (the Gluon
# GEMM1 prototype's check and timing, the backward's per-item timeline, the E=256 GPU tests) | ep (multigpu EP tests + bench_ep.py; needs 2 GPUs). docs/CONTRIBUTING.md: costs.
set -u
cd "$(dirname "$0")/../.."
RUNS=runs/h200; LOG="${OUT:-$RUNS}"; mkdir -p "$RUNS" "$LOG"
# the bundles, where carried (the kernel stages need neither; the vLLM, Ray and RL stages fail without)
for b in .gpu-vllm .gpu-ray; do
  if [ -f "$b/env.sh" ]; then source "$b/env.sh"; else echo "($b not carried: stages that need it will fail)"; fi
done
PY=python3
read -r -a RL_ARGS <<< "${RL_ARGS:-}"   # extra overrides for the RL stages, e.g. RL_ARGS="run.steps=4"
# The project's metadata (the vllm.general_plugins entry point vLLM loads the hook through); the
# packages themselves are imported from the working tree, which comes first on the path.
$PY -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/mmsite . >/dev/null || exit 1
export PYTHONPATH="$PWD:${PYTHONPATH:-}:/tmp/mmsite" PYTHONUNBUFFERED=1
# Consistency engines run eager (no torch.compile / CUDA graphs: minutes less per engine, same op order
# on both sides of each pair).
ENGINE='{gpu_memory_utilization: 0.3, attention_config: {backend: TRITON_ATTN}, enforce_eager: true}'
for stage in "$@"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  t0=$(date +%s)
  case "$stage" in
    versions) $PY -c "import torch, triton, vllm, ray, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"; rc=$? ;;
    rollout) timeout 420 $PY -m pytest -p no:cacheprovider -q -s -m gpu tests/rollout/test_rollout_gpu.py; rc=$? ;;
    sync_tests) timeout 500 $PY -m pytest -p no:cacheprovider -q -s -rA -m gpu tests/rollout/test_rollout_sync_gpu.py \
        > "$LOG/sync_tests.log" 2>&1; rc=$?; grep -E "^\[sync\]|^(PASSED|FAILED|ERROR)|passed|failed|Error" "$LOG/sync_tests.log" | tail -30 ;;
    async_gpu) timeout 540 $PY -m pytest -p no:cacheprovider -q -s -rA -m gpu tests/rl/test_rl_async_gpu.py \
        > "$LOG/async_gpu.log" 2>&1; rc=$?; grep -E "^\[async-gpu|^(PASSED|FAILED|ERROR)|passed|failed|Error" "$LOG/async_gpu.log" | tail -40 ;;
    bench_sync) read -r -a SYNC <<< "${SYNC_ARGS:---models h200_rl qwen3_dims --reps 5}"
      timeout 540 $PY benchmarks/bench_weight_sync.py "${SYNC[@]}" --out "$LOG/bench_weight_sync.md"; rc=$? ;;
    consistency_tests) timeout 420 $PY -m pytest -p no:cacheprovider -q -s -m gpu tests/rl/test_consistency.py tests/rl/test_consistency_invariance.py; rc=$? ;;
    invariance) timeout 300 $PY -m pytest -p no:cacheprovider -q -s -m gpu tests/rl/test_consistency_invariance.py; rc=$? ;;
    consistency) timeout 480 $PY -m rl.cli consistency --config configs/tiny.yaml model.dtype=bfloat16 \
        model.make.layers=8 model.make.hidden=1024 model.make.experts=64 model.make.topk=8 \
        model.make.intermediate=512 rollout.max_tokens=16 rollout.max_model_len=128 trainer.max_seq_len=128 \
        rollout.kv_cache_bytes=1073741824 "rollout.engine_kwargs=$ENGINE" --device cuda --prompts 32 \
        --impls megamoe,reference,stock --out "$RUNS/consistency-h200-bf16"; rc=$?
      cp "$RUNS"/consistency-h200-bf16/*.json "$LOG"/ ;;
    bitwise) # run.numerics=bitwise: the divergence tool (an eager engine: every op of every layer) on a 2-layer
      # model, then `consistency` (the engine's decode in CUDA graphs) at two shapes; BW_SHAPES overrides them
      rc=0; $PY -m rl.cli make-model --out "$RUNS/bw-tiny" --overwrite --hidden 256 --experts 16 --intermediate 128 \
        > /dev/null || rc=1
      timeout 240 $PY -m rl.cli divergence --model "$RUNS/bw-tiny" --numerics bitwise --prompts 4 --max-tokens 8 \
        > "$LOG/bitwise-divergence.txt" 2>&1 || rc=1
      grep -E "^divergence|first op|^(L0\.|L1\.|logits|logprobs|final)|Error" "$LOG/bitwise-divergence.txt" | head -80
      for shape in ${BW_SHAPES:-4,256,16,2,128 8,1024,64,8,512}; do IFS=, read -r nl hd ne tk im <<< "$shape"
        timeout 300 $PY -m rl.cli consistency --config configs/tiny.yaml run.numerics=bitwise model.dtype=bfloat16 \
          model.make.layers=$nl model.make.hidden=$hd model.make.experts=$ne model.make.topk=$tk model.make.intermediate=$im \
          rollout.max_tokens=16 rollout.max_model_len=128 trainer.max_seq_len=128 rollout.kv_cache_bytes=1073741824 \
          "rollout.engine_kwargs={gpu_memory_utilization: 0.3}" --device cuda --prompts 32 --impls megamoe \
          --out "$RUNS/bw-consistency-$nl" > "$LOG/bitwise-consistency-$nl.log" 2>&1 || rc=1
        echo "--- consistency bitwise layers=$nl H=$hd E=$ne k=$tk I=$im"; tail -20 "$LOG/bitwise-consistency-$nl.log"
      done ;;
    dsv3) # the tiny DeepSeek-V3 (configs/tiny_deepseek_v3.yaml, bf16): megamoe and stock, sampler vs trainer. The bundle
      # has no MLA prefill backend (RESULTS.md, 2026-12-03), so the engine runs vLLM's non-MLA DeepSeek attention
      # (VLLM_MLA_DISABLE=1, vLLM's own switch: K/V decompressed, V padded to the QK head size); the MoE layers,
      # what this compares, are the same either way
      VLLM_MLA_DISABLE=1 timeout 300 $PY -m rl.cli consistency --config configs/tiny_deepseek_v3.yaml model.dtype=bfloat16 \
        rollout.max_tokens=16 rollout.max_model_len=128 trainer.max_seq_len=128 "rollout.engine_kwargs=$ENGINE" \
        --device cuda --prompts 16 --impls megamoe,stock --out "$RUNS/consistency-dsv3" > "$LOG/consistency-dsv3.log" 2>&1; rc=$?
      tail -30 "$LOG/consistency-dsv3.log" ;;
    bitwise_families) # run.numerics=bitwise `consistency` for the tiny OLMoE and Mixtral (make-model defaults, bf16)
      rc=0; for arch in olmoe mixtral; do
        timeout 240 $PY -m rl.cli consistency --config configs/tiny.yaml run.numerics=bitwise model.dtype=bfloat16 \
          model.make.arch=$arch rollout.max_tokens=16 rollout.max_model_len=128 trainer.max_seq_len=128 \
          "rollout.engine_kwargs={gpu_memory_utilization: 0.3}" --device cuda --prompts 16 --impls megamoe \
          --out "$RUNS/bw-consistency-$arch" > "$LOG/bitwise-consistency-$arch.log" 2>&1 || rc=1
        echo "--- consistency bitwise $arch"; tail -12 "$LOG/bitwise-consistency-$arch.log"
      done ;;
    rl_megamoe) timeout 330 $PY -m rl.cli train --config configs/h200_rl.yaml "${RL_ARGS[@]}" run.out_dir="$RUNS/rl-megamoe" \
        run.progress=false --overwrite; rc=$?; cp "$RUNS/rl-megamoe/metrics.jsonl" "$LOG/rl-megamoe-metrics.jsonl" ;;
    rl_reference) timeout 330 $PY -m rl.cli train --config configs/h200_rl.yaml "${RL_ARGS[@]}" rollout.moe_impl=reference \
        trainer.moe_impl=reference run.out_dir="$RUNS/rl-reference" run.progress=false --overwrite; rc=$?
      cp "$RUNS/rl-reference/metrics.jsonl" "$LOG/rl-reference-metrics.jsonl" ;;
    # configs/qwen3_30b_a3b_1gpu.yaml (LoRA at Qwen3-30B-A3B's dims): the model drawn on the GPU (Q30B_LAYERS: the
    # largest the card holds by the memory plan, 25 on an H100, 48 on an H200, fewer where /tmp's disk is short,
    # 1.16 GiB a layer), then Q30B_STEPS steps with Triton attention (the bundle has no FlashAttention). An H100
    # made 25 layers in 75 s; the train's start reached vLLM's memory profile in 107 s. No final export: the merged
    # policy is as large as the model (1.16 GiB a layer), which /tmp's disk does not hold a second time.
    q30b) card=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
      free=$(df -BG --output=avail /tmp | tail -1 | tr -dc 0-9); most=25; [ "$card" -gt 100000 ] && most=48
      fit=$(( (free - 6) * 100 / 116 )); L=${Q30B_LAYERS:-$(( fit < most ? fit : most ))}
      if [ "$(cat /tmp/q30b/.layers 2>/dev/null)" != "$L" ]; then
        rm -rf /tmp/q30b && timeout 300 $PY -m rl.cli make-model --out /tmp/q30b --layers "$L" --hidden 2048 --experts 128 \
          --topk 8 --intermediate 768 --vocab 151936 --heads 32 --kv-heads 4 --head-dim 128 --dtype bfloat16 --device cuda \
          > "$LOG/q30b-make.log" 2>&1 && echo "$L" > /tmp/q30b/.layers
        echo "made $L layers: rc=$? in $(( $(date +%s) - t0 )) s"
      fi
      timeout "${Q30B_LIMIT:-540}" $PY -m rl.cli train --config configs/qwen3_30b_a3b_1gpu.yaml model.make=null model.path=/tmp/q30b \
        run.steps="${Q30B_STEPS:-3}" "rollout.engine_kwargs.attention_config={backend: TRITON_ATTN}" run.export_final=false "${RL_ARGS[@]}" \
        run.out_dir="$RUNS/q30b" run.progress=false --overwrite > "$LOG/q30b.log" 2>&1; rc=$?
      cp "$RUNS/q30b/metrics.jsonl" "$LOG/q30b-metrics.jsonl" 2>/dev/null
      grep -E "ERROR|Error|OutOfMemory" "$LOG/q30b.log" | head -5; tail -3 "$LOG/q30b.log" ;;
    # the op's GPU tests outlast one call together: two stages, one per call (docs/CONTRIBUTING.md)
    kernel_tests) timeout 540 $PY -m pytest -p no:cacheprovider -q -rA -m gpu tests/megamoe/test_fused.py tests/trainer/test_trainer_gpu.py \
        -k "bf16 or opcheck or graph or repeated or nan or dw_tma or trainer" > "$LOG/kernel_tests.log" 2>&1; rc=$?
      grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$LOG/kernel_tests.log" ;;
    kernel_tests_fp32) timeout 540 $PY -m pytest -p no:cacheprovider -q -rA -m gpu tests/megamoe/test_fused.py \
        -k "not (bf16 or opcheck or graph or repeated or nan or dw_tma)" > "$LOG/kernel_tests_fp32.log" 2>&1; rc=$?
      grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$LOG/kernel_tests_fp32.log" ;;
    gpu_tests) # every -m gpu test of the op and the trainer (bf16 + fp32), up to 8 concurrent pytest processes, as many as the GPU's free memory holds
      # (shard_tests.py: compiling is most of their time and CPU work); shard logs stay on the machine
      # (8-file limit on $OUT), concatenated into one file
      timeout 590 $PY benchmarks/device/shard_tests.py --shards 8 --timeout 560 --out "$RUNS/gpu_tests" -- \
        -m gpu tests/megamoe/test_fused.py tests/megamoe/test_expert_options.py tests/trainer/test_trainer_gpu.py > "$LOG/gpu_tests.log" 2>&1; rc=$?
      for f in "$RUNS"/gpu_tests/shard*.log; do echo "=== $f"; cat "$f"; done > "$LOG/gpu_tests_shards.log"
      cat "$LOG/gpu_tests.log" ;;
    bench) # Liger Kernel (the Triton peer) from a carried wheel folder: pip download liger-kernel==0.8.5 -d .whl
      $PY -m pip install -q --no-index --no-deps --target /tmp/ligersite .whl/liger_kernel-*.whl >/dev/null
      read -r -a BENCH <<< "${BENCH_ARGS:---shapes qwen3 olmoe --tokens 4096 16384 64}"
      # Liger's ~200 autotune compiles per shape, in parallel first (else DSV3 alone outlasts a call)
      WARM=(); on=0; for a in "${BENCH[@]}"; do case "$a" in --shapes) on=1 ;; --*) on=0 ;; *) [ $on = 1 ] && WARM+=("$a") ;; esac; done
      [ ${#WARM[@]} -gt 0 ] || WARM=(qwen3 olmoe mixtral dsv3)
      PYTHONPATH="${PYTHONPATH:-}:/tmp/ligersite" timeout 200 $PY benchmarks/device/liger_warm.py --shapes "${WARM[@]}" \
        > "$LOG/liger_warm.log" 2>&1; echo "liger_warm rc=$? ($(tail -1 "$LOG/liger_warm.log"))"
      PYTHONPATH="${PYTHONPATH:-}:/tmp/ligersite" timeout 540 $PY benchmarks/bench_moe.py "${BENCH[@]}" \
        --reps 50 --out "$LOG/bench_moe.md"; rc=$? ;;
    router) # megamoe.router's Triton kernels: their GPU tests, then against the cuBLAS row blocks (no vLLM needed)
      timeout 200 $PY -m pytest -p no:cacheprovider -q -rA -m gpu tests/megamoe/test_router.py tests/rl/test_consistency_invariance.py \
        > "$LOG/router_tests.log" 2>&1; rc=$?; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$LOG/router_tests.log"
      for shape in "1024 64" "2048 128" "7168 256"; do read -r hd ne <<< "$shape"
        timeout 100 $PY benchmarks/device/router_probe.py --hidden $hd --experts $ne || rc=1; done ;;
    profile) timeout 240 $PY benchmarks/device/profile_step.py --shape qwen3 --tokens 4096 16384; rc=$? ;;
    host) timeout 200 $PY benchmarks/device/host_path.py --shape qwen3 --tokens 64 512 4096; rc=$? ;;
    tune) timeout 300 $PY benchmarks/tune_moe.py --shape qwen3 --tokens 64 4096 16384 --reps 15; rc=$? ;;
    probe) # the Gluon warp-specialised GEMM1 prototype (a wrong barrier count would hang: hence the
      # short timeout) and the backward's timeline; first run 2026-12-01 (seventh session, 117 s)
      timeout 90 $PY benchmarks/device/gluon_gemm1.py > "$LOG/gluon_gemm1.log" 2>&1; echo "gluon_gemm1 rc=$?"
      tail -8 "$LOG/gluon_gemm1.log"
      timeout 200 $PY benchmarks/device/trace_items.py --backward --cases qwen3:4096 qwen3:16384 mixtral:4096 \
        > "$LOG/trace_backward.log" 2>&1; rc=$?; grep -vE "^\s*$" "$LOG/trace_backward.log" | tail -40
      # the E=256 ground-truth cases (bf16, fp32)
      timeout 200 $PY -m pytest -p no:cacheprovider -q -rA -m gpu tests/megamoe/test_fused.py -k E256 \
        > "$LOG/test_fused_e256.log" 2>&1 || rc=$?; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$LOG/test_fused_e256.log" ;;
    ep) # two or more GPUs (kind nvidia-h200-x2); whole outputs into files (the ranks' stderr says why a spawn failed)
      timeout 150 $PY benchmarks/device/ep_diag.py > "$LOG/ep_diag.log" 2>&1; echo "ep_diag rc=$?"; grep "^\[rank" "$LOG/ep_diag.log"
      timeout 300 $PY -m pytest -p no:cacheprovider -q -rA -m multigpu tests/megamoe/test_ep.py tests/megamoe/test_ep_fused_multiproc.py \
        > "$LOG/ep_tests.log" 2>&1; rc=$?; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$LOG/ep_tests.log"
      timeout 300 $PY benchmarks/bench_ep.py --reps 20 --out "$LOG/bench_ep.md" || rc=$? ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
  echo "=== $stage rc=$rc in $(( $(date +%s) - t0 )) s"
done
