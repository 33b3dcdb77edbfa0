#!/usr/bin/env bash
# One GPU-host session: build (JIT), test and benchmark in one call, logs and JSON under $OUT,
# a short table last. Usage (on the GPU host, from the repo root):
#   source .gpu-kit/setup.sh && bash benchmarks/gpu_run.sh env cpu-suite gpu-suite bench-ffn ...
# Steps: env cpu-suite cpu-core gpu-suite (gpu-suite-gemm + gpu-suite-rest: the same in two
#        calls) gpu-k (tests/gpu -k "$PYTEST_K") intrinsics pytest / pytest2 (one process:
#        files $PYTEST_ARGS / $PYTEST_ARGS2, -k $PYTEST_KX / $PYTEST_KX2)
#        launch-suite layer-suite demo bench-schedule bench-schedule-kernels bench-ffn bench-ffn-sweep bench-ffn-quick
#        bench-layer-4096 bench-layer-symm bench-layer bench-layer-t (LAYER_TOKENS) bench-comm
#        bench-layer-dispatch (LAYER_PRESETS, LAYER_TOKENS, LAYER_DISPATCH: the layer with the
#        pull and split dispatch) bench-layer-tiles (LAYER_TOKENS, GEMM_FROM: per-GEMM tiles of a bench_ffn sweep)
#        gpu-single (the GPU tests one GPU runs, emulated ranks included)
#        gpu-backward (tests/gpu/test_backward_gpu.py: EP 1 per process, EP = all GPUs; and the
#        emulated backward) bench-layer-bwd (LAYER_PRESETS, LAYER_TOKENS, LAYER_ITERS: forward
#        and backward columns)
#        gpu-backward-fp8 (test_backward_gpu.py's FP8 cases alone)
#        probe-host (PROBE_PRESETS, PROBE_TOKENS, PROBE_FLAGS e.g. --fwd-bwd: eager vs compiled
#        step host time, or the eager forward + backward's in bf16 and FP8)
#        gpu-fp8-bwd (the FP8 layer's backward, emulated ranks on one GPU)
#        gpu-dgrad / gpu-wgrad / gpu-quant (the dgrad, wgrad and FP8 quantizer tests on the GPU;
#        gpu-wgrad prints the wgmma wgrad's TFLOP/s at qwen's shape) gpu-fp8 (the FP8 GEMM,
#        quantizer and e4m3 wgmma tests, the FP8 GEMM's TFLOP/s at kimi's gate|up; then the
#        sm_90a PTX checks with this host's ptxas: C7518 and spills; PTX_TESTS: which files) probe-fp8 (the FP8 GEMM's
#        tiles 128x256 / 128x128 vs our bf16 GEMM in turns, bits compared: probe_fp8_ncu
#        --time; NCU_SHAPES, FP8_TILES) probe-fp8-wgrad (the routed weight gradients in FP8
#        vs bf16 in turns: probe_fp8_wgrad; PROBE_PRESETS, PROBE_TOKENS, PROBE_FP8_VARIANTS
#        e.g. 256s3,128s4,256s3f32,256s3acc (acc: FP32 added to, and the bf16 kernel's the same
#        at PROBE_ACC_TILES, e.g. 256s3,128s4),
#        PROBE_PARTS e.g. prod,hoisted,no-store,no-epi,no-mma,no-load; PROBE_FP8_FLAGS e.g.
#        --quant-split)
#        probe-quant (the row quantizer direct / gathering, the transposing one, in turns:
#        probe_quantize_gather) probe-gather (the FP8 rows' gather with 1, 2, 8 chunks a
#        lane in flight against the shipped kernel: probe_gather_rows)
#        ncu (Nsight Compute over a probe's --profile launches: NCU_RUN the probe and its
#        arguments, NCU_KERNEL a kernel-name regex, NCU_COUNT launches, NCU_SECTIONS; e.g.
#        NCU_RUN="benchmarks/probes/probe_fp8_wgrad.py --presets qwen3.5-397b --tokens 7168
#        --quant-split --profile" NCU_KERNEL=quantize_cols, or the default "^kernel" for the
#        weight gradients' L2 throughput: anchored, as "kernel" alone also names the
#        quantiser and torch's elementwise kernels)
#        bench-ffn-fp8 (FFN_PRESETS, FFN_TOKENS: the FP8 routed FFN vs ours in bf16, in turns)
#        bench-layer-fp8 (LAYER_PRESETS, LAYER_TOKENS, LAYER_FP8=fp8w / fp8b: its weight
#        gradients in FP8 / bf16 always, not where FP8 pays: the FP8 layer vs ours in bf16, forward
#        and forward+backward in turns, with the torch-native baseline's columns)
#        gpu-jax (the JAX tests, one process) probe-bwd (probe_backward: PROBE_PRESET,
#        PROBE_TOKENS, PROBE_WGRAD_TILES: --wgrad-tiles, PROBE_PRECISION, PROBE_MAIN_GRAD=1: FP32
#        weight gradients added to) probe-wgrad (probe_wgrad_parts:
#        PROBE_PRESETS, PROBE_VARIANTS, PROBE_TILES, e.g. 128x128s4,128x256s3)
#        gpu-train (MoEBlock, autograd, variable tokens: tests/gpu/test_module_gpu.py and the
#        module / op tests on the GPU) train-example (examples/train_moe.py, TRAIN_STEPS, TRAIN_PRECISION)
#        -- the probes live in benchmarks/probes/
#        ab-probe (another tree against this one, in alternating processes: AB_RUNS, one or
#        more "script args" separated by ';' -- a script's path in both trees and its
#        arguments --, each run AB_ROUNDS times in each tree -- default 2 --, the other tree
#        first each round; the other tree at ab_base/, made here by
#        `rm -rf ab_base && mkdir ab_base && git archive REV | tar -x -C ab_base` and passed
#        as carry: [".gpu-kit", "ab_base"] -- for kernels one process cannot hold both of;
#        AB_TREES: the trees in their order each round, default "ab_base ." -- "." this one;
#        AB_LAUNCH: what runs a script, default python3 -- e.g. "torchrun --standalone
#        --nproc-per-node=1" for bench_layer)
#        Compiled kernels persist across calls when .kernel-cache/ travels (carry) and is
#        replaced here afterwards by the call's $OUT/kernel-cache.tar (`rm -rf .kernel-cache &&
#        mkdir .kernel-cache && tar -xf FILES_AT/kernel-cache.tar -C .kernel-cache`): the
#        entries used last, 15 MiB at most (mok_core.kernel_cache; KCACHE=0: compile afresh).
#        The tar is one of the 8 files a call brings back.
#        (STEP_TIMEOUT seconds each, default 240; gpu-suite: SUITE_TIMEOUT, default 560 --
#        76 tests took 533 s on 2 GPUs in session 8, and 15 GEMM tests came after: run
#        gpu-suite-gemm and gpu-suite-rest in calls of their own; gpu-train: SUITE_TIMEOUT,
#        default 300 -- a fresh machine compiles its kernels: over 170 s in session 31)
set -u
OUT=${OUT:-/tmp/mok-gpu-out}
mkdir -p "$OUT"
LOG="$OUT/run.log"
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
export NUMBA_ENABLE_CUDASIM=0 PYTHONUNBUFFERED=1 OUT
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
rm -f /tmp/nvshmem-socket-* 2>/dev/null
summary=()
# compiled kernels kept across calls (mok_core.kernel_cache): .kernel-cache/ (ignored) comes
# in through carry and goes back as $OUT/kernel-cache.tar (header); KCACHE=0: compile afresh
if [ "${KCACHE:-1}" != 0 ]; then
  export MOK_KERNEL_CACHE="$PWD/.kernel-cache"
  mkdir -p "$MOK_KERNEL_CACHE"
fi
kcache_count() { ls "${MOK_KERNEL_CACHE:-/nonexistent}"/*.xz 2>/dev/null | wc -l; }
KCACHE_START=$(kcache_count)

step() {
  local name=$1; shift
  local t0=$(date +%s)
  echo "===== $name: $* =====" >> "$LOG"
  timeout "${STEP_TIMEOUT:-240}" "$@" >> "$LOG" 2>&1
  local rc=$?
  local t1=$(date +%s)
  local last=$(grep -E "passed|failed|error|Error|ms|rc=" "$LOG" | tail -n 1 | cut -c1-110)
  summary+=("$(printf '%-16s rc=%-3s %4ss  %s' "$name" "$rc" "$((t1 - t0))" "$last")")
}

rank_logs() {   # fold per-rank logs into run.log (only 8 files come back from $OUT)
  for f in "$OUT/$1"-rank*.log; do
    [ -f "$f" ] || continue
    echo "----- $(basename "$f") -----" >> "$LOG"; cat "$f" >> "$LOG"; rm -f "$f"
    summary+=("$(printf '   %-13s %s' "$(basename "$f" .log)" "$(tail -n 1 "$LOG" | cut -c1-100)")")
  done
}

PYT="python3 -m pytest -q -p no:cacheprovider -o addopts="
for s in "$@"; do
  case $s in
    env) step env bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; \
         nvidia-smi topo -m; python3 -c 'import numba_cuda, numpy, torch; \
         print(numba_cuda.__version__, numpy.__version__, torch.__version__)'" ;;
    cpu-suite) step cpu-suite $PYT tests --ignore=tests/gpu --ignore=tests/ptx \
         --ignore=tests/test_reference.py --ignore=tests/test_bootstrap_launch.py ;;
    cpu-core) step cpu-core $PYT tests/test_intrinsics.py tests/test_grouped_gemm.py \
         tests/test_comm_emulated.py tests/test_schedule.py ;;
    gpu-suite) export SUITE=gpu; STEP_TIMEOUT=${SUITE_TIMEOUT:-560} step gpu-suite torchrun --standalone --nproc-per-node="$NGPU" \
         --no-python bash tests/gpu/pytest_rank.sh tests/gpu; rank_logs gpu ;;
    gpu-suite-gemm) export SUITE=gpugemm; STEP_TIMEOUT=${SUITE_TIMEOUT:-500} step gpu-suite-gemm \
         torchrun --standalone --nproc-per-node="$NGPU" --no-python bash tests/gpu/pytest_rank.sh \
         tests/gpu/test_gemm_gpu.py; rank_logs gpugemm ;;   # the suite in two calls (it
    gpu-suite-rest) export SUITE=gpurest; STEP_TIMEOUT=${SUITE_TIMEOUT:-500} step gpu-suite-rest \
         torchrun --standalone --nproc-per-node="$NGPU" --no-python bash tests/gpu/pytest_rank.sh \
         tests/gpu --ignore=tests/gpu/test_gemm_gpu.py; rank_logs gpurest ;;   # outgrew one)
    gpu-k) export SUITE=gpuk; step gpu-k torchrun --standalone --nproc-per-node="$NGPU" \
         --no-python bash tests/gpu/pytest_rank.sh tests/gpu -k "${PYTEST_K:-tma}"; rank_logs gpuk ;;
    intrinsics) step intrinsics $PYT tests/test_intrinsics.py ;;
    pytest) step pytest $PYT -s $PYTEST_ARGS ${PYTEST_KX:+-k "$PYTEST_KX"} ;;   # one process
    pytest2) step pytest2 $PYT -s $PYTEST_ARGS2 ${PYTEST_KX2:+-k "$PYTEST_KX2"} ;;
    probe-host) for p in $(echo "${PROBE_PRESETS:-kimi-k2.7}" | tr , " "); do step probe-host-$p torchrun --standalone \
         --nproc-per-node="$NGPU" benchmarks/probes/probe_host.py --preset "$p" \
         --tokens "${PROBE_TOKENS:-4096}" ${PROBE_FLAGS:-}; done ;;   # eager vs compiled; launcher vs numba's dispatcher
    gpu-single) export SUITE=gpusingle; step gpu-single torchrun --standalone --nproc-per-node=1 \
         --no-python bash tests/gpu/pytest_rank.sh tests/gpu/test_split_capture_gpu.py \
         tests/gpu/test_schedule_gpu.py tests/gpu/test_jax_gpu.py \
         tests/test_comm_emulated.py tests/test_jax_adapter.py tests/test_torch_adapter.py \
         tests/test_torch_op.py; rank_logs gpusingle ;;   # what one GPU can run (the tests/gpu
         # files first and together: the host's pytest lost tests/gpu's fixtures for a file
         # named after files of tests/, run 71)
    launch-suite) export SUITE=launch; step launch-suite python3 -m mok_comm.launch --nproc "$NGPU" \
         -- bash tests/gpu/pytest_rank.sh tests/gpu/test_comm_gpu.py tests/gpu/test_jax_gpu.py; \
         rank_logs launch ;;
    bench-schedule) step bench-schedule python3 benchmarks/bench_schedule.py \
         --out "$OUT/bench_schedule.json" ;;
    bench-schedule-kernels) step bench-schedule-kernels python3 benchmarks/bench_schedule.py \
         --per-kernel --out "$OUT/bench_schedule_kernels.json" ;;   # what each launch adds
    bench-ffn) step bench-ffn python3 benchmarks/bench_ffn.py --sweep --sweep-all \
         --out "$OUT/bench_ffn.json" ;;
    bench-ffn-sweep) step bench-ffn-sweep python3 benchmarks/bench_ffn.py --sweep \
         --presets kimi-k2.7 --tokens 4096 --routing uniform,skewed --out "$OUT/bench_ffn.json" ;;
    bench-ffn-quick) step bench-ffn-quick python3 benchmarks/bench_ffn.py \
         --presets kimi-k2.7 --tokens 4096 --routing uniform --out "$OUT/bench_ffn_quick.json" ;;
    layer-suite) export SUITE=layer; step layer-suite torchrun --standalone \
         --nproc-per-node="$NGPU" --no-python bash tests/gpu/pytest_rank.sh \
         tests/gpu/test_layer_gpu.py; rank_logs layer ;;
    bench-layer-4096) step bench-layer-4096 torchrun --standalone --nproc-per-node="$NGPU" \
         benchmarks/bench_layer.py --tokens 4096 --gemm-from "$OUT/bench_ffn_sweep.json" \
         --breakdown --graph --out "$OUT/bench_layer.json" ;;
    bench-layer-symm) step bench-layer-symm torchrun --standalone --nproc-per-node="$NGPU" \
         benchmarks/bench_layer.py --presets kimi-k2.7 --tokens 4096 --iters 10 --symm-mem \
         --out "$OUT/bench_layer_symm.json" ;;
    demo) step demo python3 -m examples.demo ;;
    bench-layer) step bench-layer torchrun --standalone --nproc-per-node="$NGPU" \
         benchmarks/bench_layer.py --out "$OUT/bench_layer.json" ;;   # library tiles per shape
    bench-layer-tiles) step bench-layer-tiles torchrun --standalone --nproc-per-node="$NGPU" \
         benchmarks/bench_layer.py --tokens "${LAYER_TOKENS:-4096,8192}" \
         --gemm-from "${GEMM_FROM:-benchmarks/results/bench_ffn_sweep.json}" --gemm-per-gemm \
         --out "$OUT/bench_layer_tiles.json" ;;   # tiles per GEMM from a bench_ffn sweep
    bench-layer-t) step bench-layer-t torchrun --standalone --nproc-per-node="$NGPU" \
         benchmarks/bench_layer.py --tokens "${LAYER_TOKENS:-4096}" \
         --out "$OUT/bench_layer_t.json" ;;
    bench-layer-dispatch) step bench-layer-dispatch torchrun --standalone --nproc-per-node="$NGPU" \
         benchmarks/bench_layer.py --presets "${LAYER_PRESETS:-kimi-k2.7}" \
         --tokens "${LAYER_TOKENS:-4096,8192}" --dispatch "${LAYER_DISPATCH:-pull,split,split:1.0}" --breakdown \
         --iters 20 --out "$OUT/bench_layer_dispatch.json" ;;   # MoKConfig.dispatch modes
    gpu-backward) export SUITE=gpubwd; STEP_TIMEOUT=${SUITE_TIMEOUT:-500} step gpu-backward \
         torchrun --standalone --nproc-per-node="$NGPU" --no-python bash tests/gpu/pytest_rank.sh \
         tests/gpu/test_backward_gpu.py tests/test_backward_emulated.py; rank_logs gpubwd ;;
    gpu-backward-fp8) export SUITE=gpubwd8; STEP_TIMEOUT=${SUITE_TIMEOUT:-500} step gpu-backward-fp8 \
         torchrun --standalone --nproc-per-node="$NGPU" --no-python bash tests/gpu/pytest_rank.sh \
         tests/gpu/test_backward_gpu.py -s -k fp8; rank_logs gpubwd8 ;;
    bench-layer-fp8) step bench-layer-fp8 torchrun --standalone --nproc-per-node="$NGPU" \
         benchmarks/bench_layer.py --presets "${LAYER_PRESETS:-kimi-k2.7,glm-5.2,qwen3.5-397b,deepseek-v4-pro}" \
         --tokens "${LAYER_TOKENS:-4096}" --iters "${LAYER_ITERS:-10}" --dispatch pull \
         --precision "bf16,${LAYER_FP8:-fp8}" --out "$OUT/bench_layer_fp8.json" ;;
    bench-layer-bwd) step bench-layer-bwd torchrun --standalone --nproc-per-node="$NGPU" \
         benchmarks/bench_layer.py --presets "${LAYER_PRESETS:-kimi-k2.7,glm-5.2,qwen3.5-397b,deepseek-v4-pro}" \
         --tokens "${LAYER_TOKENS:-4096}" --iters "${LAYER_ITERS:-10}" --out "$OUT/bench_layer_bwd.json" ;;
    gpu-dgrad) step gpu-dgrad $PYT tests/test_gemm_dgrad.py ;;
    gpu-wgrad) step gpu-wgrad $PYT -s tests/test_gemm_wgrad.py ;;
    gpu-quant) step gpu-quant $PYT tests/test_quantize.py ;;
    gpu-fp8-bwd) step gpu-fp8-bwd $PYT -s tests/test_backward_emulated.py -k fp8 ;;
    gpu-fp8) step gpu-fp8 $PYT -s tests/test_gemm_fp8.py tests/test_quantize.py \
         tests/test_intrinsics.py -k "fp8 or e4m3 or quantiz" ;
         step ptx-sm90a $PYT ${PTX_TESTS:-tests/ptx/test_ptx_fp8.py tests/ptx/test_ptx_intrinsics.py \
         tests/ptx/test_ptx_wgrad.py tests/ptx/test_ptx_gemm.py tests/ptx/test_ptx_backward.py} ;;
    bench-ffn-fp8) step bench-ffn-fp8 python3 benchmarks/bench_ffn.py \
         --presets "${FFN_PRESETS:-kimi-k2.7,glm-5.2,qwen3.5-397b,deepseek-v4-pro}" \
         --tokens "${FFN_TOKENS:-8192}" --routing uniform --precision bf16,fp8 \
         --out "$OUT/bench_ffn_fp8.json" ;;
    probe-fp8) step probe-fp8 python3 benchmarks/probes/probe_fp8_ncu.py --time ;;
    probe-fp8-wgrad) step probe-fp8-wgrad python3 benchmarks/probes/probe_fp8_wgrad.py \
         --presets "${PROBE_PRESETS:-kimi-k2.7,qwen3.5-397b}" --tokens "${PROBE_TOKENS:-8192}" \
         --variants "${PROBE_FP8_VARIANTS:-256s3}" --parts "${PROBE_PARTS:-}" \
         --acc-tiles "${PROBE_ACC_TILES:-}" ${PROBE_FP8_FLAGS:-} ;;
    probe-quant) step probe-quant python3 benchmarks/probes/probe_quantize_gather.py ;;
    probe-gather) step probe-gather python3 benchmarks/probes/probe_gather_rows.py ;;
    ncu) step ncu ncu --clock-control none --profile-from-start off -k "regex:${NCU_KERNEL:-^kernel}" \
         --launch-count "${NCU_COUNT:-4}" ${NCU_SECTIONS:---section SpeedOfLight --section \
         MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats} \
         python3 ${NCU_RUN:?NCU_RUN: a probe and its arguments, with --profile} ;;
    ab-probe) IFS=';' read -ra runs <<< "${AB_RUNS:-}"
         [ ${#runs[@]} -eq 0 ] && echo "ab-probe: AB_RUNS is empty" >> "$LOG"
         read -ra trees <<< "${AB_TREES:-ab_base .}"
         for i in "${!runs[@]}"; do
           read -ra run <<< "${runs[$i]}"             # the script, then its arguments
           for r in $(seq "${AB_ROUNDS:-2}"); do
             for tree in "${trees[@]}"; do
               if [ "$tree" = . ]; then step "ab-this-$i.$r" ${AB_LAUNCH:-python3} "${run[@]}"
               else step "ab-$tree-$i.$r" env PYTHONPATH="$PWD/$tree:${PYTHONPATH:-}" \
                    ${AB_LAUNCH:-python3} "$tree/${run[0]}" "${run[@]:1}"; fi
             done; done; done ;;
    gpu-jax) step gpu-jax $PYT tests/gpu/test_jax_gpu.py tests/test_jax_adapter.py ;;
    probe-bwd) step probe-bwd python3 benchmarks/probes/probe_backward.py \
         --preset "${PROBE_PRESET:-qwen3.5-397b}" --tokens "${PROBE_TOKENS:-4096}" \
         --wgrad-tiles "${PROBE_WGRAD_TILES:-}" --precision "${PROBE_PRECISION:-bf16}" \
         ${PROBE_MAIN_GRAD:+--main-grad} ;;
    probe-wgrad) step probe-wgrad python3 benchmarks/probes/probe_wgrad_parts.py \
         --presets "${PROBE_PRESETS:-glm-5.2,qwen3.5-397b}" --tokens "${PROBE_TOKENS:-4096}" \
         --variants "${PROBE_VARIANTS:-prod}" --tiles "${PROBE_TILES:-}" --iters 8 ;;
    gpu-train) export SUITE=gputrain; STEP_TIMEOUT=${SUITE_TIMEOUT:-300} step gpu-train torchrun --standalone --nproc-per-node="$NGPU" \
         --no-python bash tests/gpu/pytest_rank.sh tests/gpu/test_module_gpu.py \
         tests/test_torch_module.py tests/test_torch_op.py; rank_logs gputrain ;;
    train-example) step train-example torchrun --standalone --nproc-per-node="$NGPU" \
         examples/train_moe.py --steps "${TRAIN_STEPS:-300}" --precision "${TRAIN_PRECISION:-bf16}" \
         --plot "$OUT/train_moe_loss_${TRAIN_PRECISION:-bf16}.png" ;;
    bench-comm) step bench-comm torchrun --standalone --nproc-per-node="$NGPU" \
         benchmarks/bench_comm.py --iters "${COMM_ITERS:-20}" --out "$OUT/bench_comm.json" ;;
    *) echo "unknown step $s" >> "$LOG" ;;
  esac
done
echo; echo "==== tables ===="
for f in "$OUT"/*.json; do [ -f "$f" ] && echo "$f" && python3 -c "
import json,sys; rows=json.load(open('$f'))
keys=[k for k in rows[0] if k not in ('gpu','gemm')][:11]
print(' '.join(f'{k[:14]:>14}' for k in keys))
for r in rows: print(' '.join(f'{r[k]:>14.3f}' if isinstance(r.get(k), float) else f'{str(r.get(k, \"-\"))[:14]:>14}' for k in keys))
"; done
if [ -n "${MOK_KERNEL_CACHE:-}" ]; then  # the newest entries up to 15 MiB go back
  total=0; : > "$OUT/.kcache-list"
  for f in $(cd "$MOK_KERNEL_CACHE" && ls -t -- *.xz 2>/dev/null); do   # (hex names)
    total=$((total + $(stat -c %s "$MOK_KERNEL_CACHE/$f")))
    [ "$total" -le $((15 * 1024 * 1024)) ] && echo "$f" >> "$OUT/.kcache-list"
  done
  tar -cf "$OUT/kernel-cache.tar" -C "$MOK_KERNEL_CACHE" -T "$OUT/.kcache-list" 2>/dev/null
  rm -f "$OUT/.kcache-list"
  summary+=("kernel cache: $KCACHE_START entries carried in, $(kcache_count) after the run")
fi
echo; echo "==== summary ===="
printf '%s\n' "${summary[@]}"
