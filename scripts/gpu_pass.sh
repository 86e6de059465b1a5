#!/usr/bin/env bash
# One device call does the whole GPU pass: correctness tests, then the benchmarks, then a
# short table. Usage (on the device machine, repo root): scripts/gpu_pass.sh [STAGES]
# STAGES is a comma list of: tests, throughput, throughput8b, latency, long, startup, structured, lora,
# moetune, moe, quant, quanttune, pooling, embed, embedprof, moedebug, fp8kv, fp8kvbench, structuredab,
# prefill, prefillab, longprof, structuredub, structuredoverlap, structuredchain, w4tune, fp8tune, fp8norm, spec, loratests, lorakernel, loraprof, tpar, tpartput, gemvtune, gemvab, moequanttune, moeblocktune,
# moequantprefill, startupprof, pieces, lorapieces, tp2tests, pdlrows, gluonprefill (default: startup,tests,throughput,throughput8b,latency).
# Needs the SmolLM2 tokenizer saved under .gpu/tokenizer (carried with the call), and wheels carried in .whl
# for what the device lacks: xgrammar with apache-tvm-ffi, llguidance, pydantic (+ pydantic-core,
# annotated-types, typing-inspection), jsonschema (+ jsonschema-specifications, referencing, rpds-py),
# compressed-tensors with loguru (sentence-transformers, peft and accelerate are there).
set -uo pipefail
export PYTHONPATH=src:.${PYTHONPATH:+:$PYTHONPATH} PAGEDLLM_TEST_TOKENIZER_DIR=.gpu/tokenizer HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The lent hosts set PYTHONDONTWRITEBYTECODE=1 and their packages have no .pyc files, so every process
# would compile its Python sources first (~3 s of each start-up there). Time a machine as pip leaves
# it: bytecode written by the first process, read by the rest.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pagedllm-pyc}
# The device copy has no git history: the caller writes the commit to .gpu/commit.
[ -f .gpu/commit ] && export PAGEDLLM_COMMIT=$(cat .gpu/commit)
OUT=${OUT:-/tmp/pagedllm-out}
mkdir -p "$OUT"
STAGES=",${1:-startup,tests,throughput,throughput8b,latency},"
RES="$OUT/results.jsonl"
: > "$RES"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
stage() { [[ "$STAGES" == *",$1,"* ]]; }
bench() {  # name, then the command; JSON lines go to $RES, the rest to $OUT/NAME.log
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep '^{' "$OUT/$name.log" >> "$RES"
  grep -E '^\{|Error|error|Captured|KV cache' "$OUT/$name.log" | tail -6 | cut -c1-400
  echo "   ($name: rc=$rc, $((SECONDS - t0)) s)"
}
# First, while Triton's cache is as cold as on a fresh machine: run 0 compiles, run 1 does not.
stage startup && bench startup python -m pagedllm.benchmarks.startup --shape llama3-8b --num-runs 2
# Where start-up goes (issue 19): imports, CUDA initialization, then LLM()'s phases and the server's log lines.
if stage startupprof; then
  bench startup3 python -m pagedllm.benchmarks.startup --shape llama3-8b --num-runs 3
  timeout 120 python scripts/startup_profile.py --shape llama3-8b --top 40 > "$OUT/startup_profile.log" 2>&1
  echo "== cProfile of a warm LLM() (full list: startup_profile.log)"; grep -v "^INFO" "$OUT/startup_profile.log" | head -30 | cut -c1-170
  python -X importtime -c "import pagedllm.engine.core, pagedllm.worker.worker" 2> "$OUT/importtime.log" >/dev/null
  echo "== slowest imports (cumulative us)"; sort -t'|' -k2 -n -r "$OUT/importtime.log" | head -25 | cut -c1-120
  python -c "import time; t=time.time(); import torch; t1=time.time(); torch.cuda.init(); torch.zeros(1, device='cuda'); \
print(f'import torch {t1-t:.2f} s, CUDA init + first tensor {time.time()-t1:.2f} s')"
  DIR=$(python -c "from pagedllm.benchmarks.common import write_shape; print(write_shape('llama3-8b', tokenizer_dir='.gpu/tokenizer'))" | tail -1)
  timeout 240 python scripts/serve_launch_time.py --timeline --runs 2 -- "$DIR" --load-format dummy > "$OUT/serve_timeline.log" 2>&1
  grep -v -E "^\s+[0-9.]+\s+(Processed|Loading|Capturing)" "$OUT/serve_timeline.log" | tail -40 | cut -c1-170
fi
if stage tests; then
  echo "== tests"
  python -m pytest -q -rfE -p no:cacheprovider tests/attention tests/ops tests/sample tests/gpu tests/worker tests/engine/test_correctness.py tests/engine/test_correctness_archs.py tests/structured_output tests/engine/test_structured_outputs.py \
    tests/engine/test_async_scheduling.py tests/engine/test_gc_freeze.py tests/engine/test_engine_defaults.py \
    tests/engine/test_spec_decode.py tests/engine/test_sliding_window.py tests/engine/test_structured_reasoning.py \
    tests/lora --ignore=tests/lora/test_lora_server.py tests/model/test_moe_models.py tests/engine/test_routed_experts.py \
    ${EXTRA_TESTS:-} > "$OUT/tests.log" 2>&1
  echo "   tests rc=$?"; tail -15 "$OUT/tests.log" | cut -c1-300
fi
if stage quicktests; then  # the GPU paths new since the last full pass
  echo "== quicktests"
  python -m pytest -q -rfE -p no:cacheprovider tests/gpu tests/ops tests/lora/test_lora.py tests/lora/test_triton_lora.py \
    tests/engine/test_spec_draft.py tests/model/test_moe_models.py tests/engine/test_routed_experts.py \
    tests/engine/test_structured_reasoning.py > "$OUT/quicktests.log" 2>&1
  echo "   quicktests rc=$?"; tail -12 "$OUT/quicktests.log" | cut -c1-300
fi
stage throughput && bench throughput python -m pagedllm.benchmarks.throughput --shape qwen3-0.6b
stage throughput && bench throughput_run2 python -m pagedllm.benchmarks.throughput --shape qwen3-0.6b
stage throughput8b && bench throughput8b python -m pagedllm.benchmarks.throughput --shape llama3-8b
stage latency && bench latency python -m pagedllm.benchmarks.latency --shape llama3-8b --batch-sizes 1,32
stage long && bench long_prompt_06b python -m pagedllm.benchmarks.long_prompt --shape qwen3-0.6b
stage long && bench long_prompt_8b python -m pagedllm.benchmarks.long_prompt --shape llama3-8b
stage long && bench shared_prefix_06b python -m pagedllm.benchmarks.shared_prefix --shape qwen3-0.6b
stage long && bench shared_prefix_8b python -m pagedllm.benchmarks.shared_prefix --shape llama3-8b
stage structured && bench structured python -m pagedllm.benchmarks.structured --shape qwen3-0.6b --tokenizer .gpu/tokenizer
# Issue 15: both grammar backends (each row's masks filled on 8 threads while the forward runs).
stage structuredab && bench structured_xgr python -m pagedllm.benchmarks.structured --shape qwen3-0.6b --tokenizer .gpu/tokenizer --backend xgrammar
stage structuredab && bench structured_llg python -m pagedllm.benchmarks.structured --shape qwen3-0.6b --tokenizer .gpu/tokenizer --backend guidance
# Issue 19: long-prompt prefill attention, the Triton kernel (and its tilings) against torch's SDPA backends.
stage prefill && bench prefill python -m pagedllm.attention.prefill_bench --sweep
stage structuredub && bench structured_unbounded python -m pagedllm.benchmarks.structured --shape qwen3-0.6b --tokenizer .gpu/tokenizer --backend xgrammar --schema unbounded
# Issue 15: async scheduling's overlap kept under constraints (deferred sampling) against the old pause, same run.
for schema in bounded unbounded; do
  stage structuredoverlap && bench structured_defer_$schema python -m pagedllm.benchmarks.structured --shape qwen3-0.6b --tokenizer .gpu/tokenizer --backend xgrammar --schema $schema
  stage structuredoverlap && bench structured_pause_$schema env PAGEDLLM_DEFER_GRAMMAR=0 python -m pagedllm.benchmarks.structured --shape qwen3-0.6b --tokenizer .gpu/tokenizer --backend xgrammar --schema $schema
done
# Issue 15: bounded strings chained (the default) against xgrammar's own form, then the unbounded schema, same run.
stage structuredchain && bench structured_chain python -m pagedllm.benchmarks.structured --shape qwen3-0.6b --tokenizer .gpu/tokenizer --backend xgrammar
stage structuredchain && bench structured_nochain env PAGEDLLM_CHAIN_STRINGS=0 python -m pagedllm.benchmarks.structured --shape qwen3-0.6b --tokenizer .gpu/tokenizer --backend xgrammar
stage structuredchain && bench structured_chain_ub python -m pagedllm.benchmarks.structured --shape qwen3-0.6b --tokenizer .gpu/tokenizer --backend xgrammar --schema unbounded
if stage structuredchain; then
  python -m pytest -q -p no:cacheprovider tests/structured_output tests/engine/test_structured_outputs.py > "$OUT/structuredtests.log" 2>&1
  echo "   structured tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/structuredtests.log" | tail -6 | cut -c1-250
fi
if stage loratests; then  # issue 20: the multi-LoRA kernels and engine paths on the GPU
  echo "== loratests"
  python -m pytest -q -rfE -p no:cacheprovider tests/lora tests/ops/test_triton_gemv.py --ignore=tests/lora/test_lora_server.py > "$OUT/loratests.log" 2>&1
  echo "   loratests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/loratests.log" | tail -12 | cut -c1-250
fi
stage lorakernel && bench lora_kernel python -m pagedllm.benchmarks.lora_kernel --tokens ${LORA_TOKENS:-1,8,32,128,256,2048}
stage lora && bench lora python -m pagedllm.benchmarks.lora --shape llama3-8b
stage loraprof && bench lora_profile python scripts/lora_profile.py
stage loraprof && tail -22 "$OUT/lora_profile.log" | cut -c1-160
stage specdraft && bench spec_draft env PAGEDLLM_SPEC_FORCE_ACCEPT=1 python -m pagedllm.benchmarks.spec_draft
if stage spec; then  # issue 21: speculative steps on CUDA graphs (tests, then the draft model's ceiling)
  echo "== spec tests"
  timeout 240 python -m pytest -q -rfE -p no:cacheprovider tests/engine/test_spec_draft.py tests/engine/test_spec_eagle.py \
    tests/engine/test_spec_decode.py > "$OUT/spec_tests.log" 2>&1
  echo "   spec tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/spec_tests.log" | tail -8 | cut -c1-250
  bench spec_draft env PAGEDLLM_SPEC_FORCE_ACCEPT=1 timeout 300 python -m pagedllm.benchmarks.spec_draft
fi
# MoE (issue 16): --tune writes the tile table to $OUT (copy it to src/pagedllm/ops/fused_moe_configs.json),
# and the later moe stages run with it when it is copied in first.
stage moetune && bench moe_tune python -m pagedllm.benchmarks.moe_kernel --shape qwen3-30b-a3b --tune \
  --tokens 1,2,4,8,16,32,64,128,256,512,1024,2048,4096 --config-out "$OUT/fused_moe_configs.json"
# Quantized experts (issue 17): their own tiles, under ",W=<format>" keys of the same table (merged in place).
if stage moequanttune; then
  for fmt in fp8 int4; do
    bench moe_tune_$fmt python -m pagedllm.benchmarks.moe_kernel --shape qwen3-30b-a3b --tune --weight-format $fmt \
      --tokens 1,2,4,8,16,32,64,128,256
    cp src/pagedllm/ops/fused_moe_configs.json "$OUT/"
  done
fi
# Block-scaled fp8 experts (Qwen3-FP8's [128, 128] blocks): decode steps before and after their own tiles.
if stage moeblocktune; then
  L="python -m pagedllm.benchmarks.latency --shape qwen3-30b-a3b --batch-sizes 1,32 --quantization fp8-block"
  bench moe_block_latency_before $L
  bench moe_tune_fp8-block python -m pagedllm.benchmarks.moe_kernel --shape qwen3-30b-a3b --tune \
    --weight-format fp8-block --tokens 1,2,4,8,16,32,64,128,256
  cp src/pagedllm/ops/fused_moe_configs.json "$OUT/"
  bench moe_block_latency_after $L
fi
# Prefill sizes of the quantized experts (512..4096 tokens took the 16-bit tiles), then workload 1.
if stage moequantprefill; then
  for fmt in ${MOE_FORMATS:-fp8 int4 fp8-block}; do
    bench moe_tune_prefill_$fmt python -m pagedllm.benchmarks.moe_kernel --shape qwen3-30b-a3b --tune \
      --weight-format $fmt --tokens 512,1024,2048,4096
    cp src/pagedllm/ops/fused_moe_configs.json "$OUT/"
  done
fi
stage moe && bench moe_kernel python -m pagedllm.benchmarks.moe_kernel --shape qwen3-30b-a3b
stage moe && bench moe_throughput python -m pagedllm.benchmarks.throughput --shape qwen3-30b-a3b
stage moe && bench moe_latency python -m pagedllm.benchmarks.latency --shape qwen3-30b-a3b --batch-sizes 1,32
# 16-bit small-row GEMMs (issue 19): --tune merges each shape's projections (TP=2 shards too) into
# the table the engine reads (src/pagedllm/ops/gemv_configs.json here; copied to $OUT after each),
# then the dispatch against cuBLAS, then the decode steps it serves with and without the table.
if stage gemvtune; then
  for spec in "qwen3-30b-a3b 1 qkv,o,lm_head" "llama3-8b 2 qkv,o,gate_up,down,lm_head" \
              "llama3-8b 1 qkv,o,gate_up,down,lm_head" "qwen3-0.6b 1 qkv,o,gate_up,down,lm_head"; do
    set -- $spec
    bench gemv_tune_$1_tp$2 python -m pagedllm.benchmarks.gemv_kernel --tune --shape $1 --tp $2 --projections $3
    cp src/pagedllm/ops/gemv_configs.json "$OUT/" 2>/dev/null
  done
  bench gemv_dispatch python -m pagedllm.benchmarks.gemv_kernel --shape llama3-8b --tp 2
fi
stage gemvab && bench gemv_latency_moe python -m pagedllm.benchmarks.latency --shape qwen3-30b-a3b --batch-sizes 1,32
stage gemvab && bench gemv_latency_8b python -m pagedllm.benchmarks.latency --shape llama3-8b --batch-sizes 1,32
# Pooling (issue 22): the encoders' non-causal Triton path and the pooling engine on the GPU against
# sentence-transformers / transformers (the server tests need fastapi, not on the device), then
# embedding throughput against sentence-transformers in the same run.
if stage pooling; then
  echo "== pooling tests"
  python -m pytest -q -rfE -p no:cacheprovider tests/attention/test_bidirectional.py tests/pooling \
    --ignore=tests/pooling/test_pooling_server.py > "$OUT/pooling_tests.log" 2>&1
  echo "   pooling tests rc=$?"; tail -8 "$OUT/pooling_tests.log" | cut -c1-300
fi
stage embed && bench embed python -m pagedllm.benchmarks.embed
if stage embedprof; then
  echo "== embedprof"; python scripts/embed_profile.py > "$OUT/embedprof.log" 2>&1
  echo "   embedprof rc=$?"; grep -E "embed 256|tottime|function calls" -A0 "$OUT/embedprof.log" | head -5
fi
# One test with synchronous launches: where a kernel faults, the traceback names it.
if stage moedebug; then
  echo "== moedebug"
  CUDA_LAUNCH_BLOCKING=1 python -m pytest -q -x -rfE -p no:cacheprovider tests/gpu/test_gpu_moe.py -k qwen2_moe \
    > "$OUT/moedebug.log" 2>&1
  echo "   moedebug rc=$?"; grep -E "Error|error|\.py:[0-9]+" "$OUT/moedebug.log" | tail -25 | cut -c1-300
  python -m pytest -q -x -rfE -p no:cacheprovider tests/gpu/test_gpu_moe.py -k qwen2_moe > "$OUT/moedebug_async.log" 2>&1
  echo "   moedebug without blocking launches rc=$?"; tail -3 "$OUT/moedebug_async.log" | cut -c1-300
  if command -v compute-sanitizer > /dev/null; then
    timeout 300 compute-sanitizer --tool memcheck --print-limit 5 python -m pytest -q -x -p no:cacheprovider \
      tests/gpu/test_gpu_moe.py -k qwen2_moe > "$OUT/moedebug_memcheck.log" 2>&1
    echo "   memcheck rc=$?"; grep -E "Invalid|at 0x|by thread|Address|kernel" "$OUT/moedebug_memcheck.log" | head -12 | cut -c1-300
  fi
fi
# FP8 KV cache (issue 17): kernels and engine on the GPU, then fp8 against bf16 on both shapes.
if stage fp8kv; then
  echo "== fp8kv tests"
  python -m pytest -q -rfE -p no:cacheprovider tests/attention/test_fp8_kv_cache.py tests/gpu/test_gpu_fp8_kv_cache.py \
    tests/engine/test_fp8_kv_cache.py tests/attention/test_triton_attention.py tests/gpu/test_gpu_engine.py \
    --deselect tests/gpu/test_gpu_fp8_kv_cache.py::test_bf16_logprobs_with_an_fp8_cache_stay_near_the_bf16_cache \
    --deselect tests/engine/test_fp8_kv_cache.py::test_fp8_cache_logprobs_stay_within_a_bound_of_the_float32_cache \
    > "$OUT/fp8kv_tests.log" 2>&1  # (the deselected two read the SmolLM2 GGUF, too large to carry)
  echo "   fp8kv tests rc=$?"; tail -6 "$OUT/fp8kv_tests.log" | cut -c1-300
fi
stage kernelbench && bench kernel_bf16 python -m pagedllm.attention.kernel_bench
stage kernelbench && bench kernel_fp8 python -m pagedllm.attention.kernel_bench --kv-cache-dtype fp8
stage fp8kvbench && bench tput_06b_bf16kv python -m pagedllm.benchmarks.throughput --shape qwen3-0.6b
stage fp8kvbench && bench tput_06b_fp8kv python -m pagedllm.benchmarks.throughput --shape qwen3-0.6b --kv-cache-dtype fp8
stage fp8kvbench && bench tput_8b_fp8kv python -m pagedllm.benchmarks.throughput --shape llama3-8b --kv-cache-dtype fp8
stage fp8kvbench && bench lat_8b_fp8kv python -m pagedllm.benchmarks.latency --shape llama3-8b --batch-sizes 1,32 --kv-cache-dtype fp8
# Quantized weights (issue 17): the kernels alone, then llama3-8b decode (batch 1, 32) and workload 1 for
# FP8 W8A8 (online) and W4A16 (GPTQ layout, groups of 128); quanttune times the W4A16 tilings.
stage quant && bench quant_kernel python -m pagedllm.benchmarks.quant_kernel --shape llama3-8b
# Early launch by batch size (stop 58: a W4A16 model's chain launches early only in forwards of <= 16 tokens,
# CHAIN_PDL_MAX_ROWS; early launch cost GPTQ 16% a step at 32 rows on an H200): decode latency for bf16, FP8 and
# GPTQ as shipped and with no early launch at all, then GPTQ workload 1 both ways. For GPTQ at <= 16 rows the
# first is early launch, above it both are stream order; for bf16 and FP8 the first is early launch throughout.
if stage pdlrows; then
  for pdl in 1 0; do
    for q in none fp8 gptq; do
      qarg=$([ $q = none ] || echo "--quantization $q")
      bench pdlrows_latency_${q}_$pdl env PAGEDLLM_DECODE_PDL=$pdl python -m pagedllm.benchmarks.latency \
        --shape llama3-8b --batch-sizes 1,8,16,32,64,128 --num-iters 3 $qarg
    done
    bench pdlrows_throughput_gptq_$pdl env PAGEDLLM_DECODE_PDL=$pdl python -m pagedllm.benchmarks.throughput \
      --shape llama3-8b --quantization gptq
  done
fi
# Issue 19: the Gluon prefill kernel (attention/gluon_prefill.py, Hopper) against the Triton one: its tests, the
# kernels alone, then end to end with PAGEDLLM_GLUON_PREFILL on and off, alternated.
if stage gluonprefill; then
  timeout 300 python -m pytest -q -rfE -p no:cacheprovider tests/attention/test_triton_prefill.py > "$OUT/gluontests.log" 2>&1
  echo "   prefill tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gluontests.log" | tail -8 | cut -c1-250
  bench gluon_prefill_kernels timeout 300 python -m pagedllm.attention.prefill_bench
  for on in 1 0 1 0; do
    bench long_06b_gluon$on env PAGEDLLM_GLUON_PREFILL=$on python -m pagedllm.benchmarks.long_prompt --shape qwen3-0.6b
  done
  for on in 1 0; do
    bench long_8b_gluon$on env PAGEDLLM_GLUON_PREFILL=$on python -m pagedllm.benchmarks.long_prompt --shape llama3-8b
  done
fi
stage quant && bench quant_latency_fp8 python -m pagedllm.benchmarks.latency --shape llama3-8b --batch-sizes 1,32 --quantization fp8
stage quant && bench quant_latency_w4a16 python -m pagedllm.benchmarks.latency --shape llama3-8b --batch-sizes 1,32 --quantization gptq
stage quant && bench quant_throughput_fp8 python -m pagedllm.benchmarks.throughput --shape llama3-8b --quantization fp8
stage quant && bench quant_throughput_w4a16 python -m pagedllm.benchmarks.throughput --shape llama3-8b --quantization gptq
# Issue 17: the FP8 small-row kernel's tilings against _scaled_mm (writes ops/fp8_configs.json), then a step's
# projections in one graph (the table, the untuned default, _scaled_mm, the quantize launches alone).
stage fp8tune && bench fp8_tune python -m pagedllm.benchmarks.fp8_kernel --tune --rows 1,8,16,32
stage fp8tune && bench fp8_graph_chain python -m pagedllm.benchmarks.fp8_kernel --graph-chain --rows 1,16,32
# Issue 17 (branch fp8-norm-quant): the RMSNorm quantizing for the fp8 projection after it, on and off.
if stage fp8norm; then
  python -m pytest -q -rfE -p no:cacheprovider tests/ops/test_triton_ops.py tests/gpu/test_gpu_quantization.py > "$OUT/fp8norm_tests.log" 2>&1
  echo "   fp8norm tests rc=$?"; tail -3 "$OUT/fp8norm_tests.log" | cut -c1-300
  for run in 1a 0a 1b 0b; do
    bench fp8norm_lat_$run env PAGEDLLM_FP8_NORM_QUANT=${run:0:1} python -m pagedllm.benchmarks.latency --shape llama3-8b --batch-sizes 1,32 --quantization fp8
  done
  for on in 1 0; do
    bench fp8norm_tput_$on env PAGEDLLM_FP8_NORM_QUANT=$on python -m pagedllm.benchmarks.throughput --shape llama3-8b --quantization fp8
  done
fi
stage quanttune && bench quant_tune python -m pagedllm.benchmarks.quant_kernel --shape llama3-8b --tune-tiled --rows 1,16,32,256 --iters 20
# W4A16 decode (issue 17): the int4 kernel tests, the split-K kernel's sweep (writes the table the
# dispatcher reads into src/pagedllm/ops/w4a16_configs.json, a copy to $OUT: commit it), llama3-8b's
# projections x 32 layers in one CUDA graph at 1/8/32 rows (bf16, tiled int4, split-K default and
# tuned), then end-to-end decode with GPTQ. Each step goes on whatever the one before did.
if stage w4tune; then
  echo "== w4tune tests"
  timeout 300 python -m pytest -q -rfE -p no:cacheprovider tests/ops/test_triton_int4.py tests/ops/test_quant_kernels_compile.py \
    tests/gpu/test_gpu_quantization.py -k "triton_int4 or compile or w4a16 or gptq or awq or ct-int4" > "$OUT/w4tune_tests.log" 2>&1
  echo "   w4tune tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/w4tune_tests.log" | tail -10 | cut -c1-250
  bench w4a16_tune timeout 300 python -m pagedllm.benchmarks.quant_kernel --shape llama3-8b --tune --rows 1,8,16,32 --replays 10
  cp src/pagedllm/ops/w4a16_configs.json "$OUT/w4a16_configs.json" 2>/dev/null
  bench w4a16_graph_chain timeout 180 python -m pagedllm.benchmarks.quant_kernel --shape llama3-8b --graph-chain --rows 1,8,32 --replays 20
  bench w4a16_latency timeout 240 python -m pagedllm.benchmarks.latency --shape llama3-8b --batch-sizes 1,32 --quantization gptq
  echo "== w4tune summary"
  python - "$RES" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
print("tune: projection rows best_us default_us tiled_us best_roofline best")
for r in rows:
    if r.get("benchmark") == "w4a16_tune":
        best = r.get("best") or {}
        short = {k: best[k] for k in ("USE_DOT", "BLOCK_M", "BLOCK_N", "SPLIT_K", "num_warps", "num_stages") if k in best}
        print(f"  {r['projection']:8} {r['rows']:3} {r['best_us']:9} {r['default_us']!s:>9} {r['tiled_us']!s:>9} "
              f"{r['best_roofline']:6} {r['best_kernel']} {short}")
print("graph chain (32 layers x qkv/o/gate_up/down): path rows ms/step roofline(3.35TB/s) copy_roofline")
for r in rows:
    if r.get("benchmark") == "w4a16_graph_chain":
        print(f"  {r['path']:22} {r['rows']:3} {r['ms_per_step']:9} {r['roofline']:6} {r['copy_roofline']:6}")
print("end to end (latency, gptq):")
for r in rows:
    if r.get("benchmark") == "latency" or "batch_size" in r:
        keep = ("quantization", "batch_size", "ms_per_step", "decode_tok_s", "step_roofline_fraction", "roofline_ms",
                "roofline_fraction")
        print("  " + json.dumps({k: r[k] for k in keep if k in r}))
PY
fi
# This session's GPU paths in one pytest run: quantized linears and kernels, FP8 KV cache, pooling.
if stage newtests; then
  echo "== newtests"
  python -m pytest -q -rfE -p no:cacheprovider tests/gpu tests/ops tests/attention/test_fp8_kv_cache.py \
    tests/attention/test_bidirectional.py tests/engine/test_fp8_kv_cache.py tests/pooling \
    --ignore=tests/pooling/test_pooling_server.py \
    --deselect tests/gpu/test_gpu_fp8_kv_cache.py::test_bf16_logprobs_with_an_fp8_cache_stay_near_the_bf16_cache \
    --deselect tests/engine/test_fp8_kv_cache.py::test_fp8_cache_logprobs_stay_within_a_bound_of_the_float32_cache \
    > "$OUT/newtests.log" 2>&1
  echo "   newtests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/newtests.log" | tail -15 | cut -c1-250
fi
if stage recheck; then  # the tests that failed on the device last time, after their fixes
  echo "== recheck"
  python -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_gpu_quantization.py tests/ops/test_triton_fp8.py \
    tests/gpu/test_gpu_moe.py tests/engine/test_fp8_kv_cache.py -k "not float32_cache" > "$OUT/recheck.log" 2>&1
  echo "   recheck rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/recheck.log" | tail -12 | cut -c1-250
fi
# Issue 19: the prefill kernel (attention/triton_prefill.py) on and off, end to end, same machine.
if stage prefillab; then
  echo "== prefillab tests"
  python -m pytest -q -rfE -p no:cacheprovider tests/attention > "$OUT/prefilltests.log" 2>&1
  echo "   attention tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/prefilltests.log" | tail -8 | cut -c1-250
  for on in 1 0 1 0; do
    bench long_06b_pk$on env PAGEDLLM_PREFILL_KERNEL=$on python -m pagedllm.benchmarks.long_prompt --shape qwen3-0.6b
  done
  for on in 1 0; do
    bench long_8b_pk$on env PAGEDLLM_PREFILL_KERNEL=$on python -m pagedllm.benchmarks.long_prompt --shape llama3-8b
    bench prefix_06b_pk$on env PAGEDLLM_PREFILL_KERNEL=$on python -m pagedllm.benchmarks.shared_prefix --shape qwen3-0.6b
  done
fi
stage longprof && bench long_profile python scripts/profile_throughput.py --long --num-prompts 16 --shape ${PROF_SHAPE:-qwen3-0.6b}
stage longprof && tail -40 "$OUT/long_profile.log" | cut -c1-170
# Issue 19, tensor parallelism (2 GPUs): the peer-memory all-reduce against NCCL, kernels alone then
# end to end with it on and off (disable_custom_all_reduce), same machine.
if stage tpar; then
  bench allreduce python -m pagedllm.benchmarks.all_reduce
  echo "== tpar tests"
  python -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_custom_all_reduce.py tests/gpu/test_device_ids.py > "$OUT/tpartests.log" 2>&1
  echo "   tpar tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tpartests.log" | tail -8 | cut -c1-250
  for off in false true; do
    bench tp2_latency_car_off_$off timeout 300 python -m pagedllm.benchmarks.latency --shape llama3-8b --batch-sizes 1,32 \
      --num-iters 3 --engine-args tensor_parallel_size=2,disable_custom_all_reduce=$off
  done
fi
if stage tpartput; then
  for off in false true; do
    bench tp2_tput_car_off_$off timeout 280 python -m pagedllm.benchmarks.throughput --shape llama3-8b \
      --engine-args tensor_parallel_size=2,disable_custom_all_reduce=$off
  done
fi
stage base8b && bench base_latency_8b python -m pagedllm.benchmarks.latency --shape llama3-8b --batch-sizes 1,32
# Piecewise CUDA graphs (issue 19): what a step with a prefill chunk costs eager, in one graph and in
# pieces, then serving workload 3 and the 2-GPU tests with them on and off (PIECES_PROMPTS requests per rate).
if stage pieces; then
  for s in qwen3-0.6b llama3-8b; do
    bench mixed_probe_$s timeout 200 python scripts/mixed_step_probe.py --shape $s
    grep -A 6 '^#' "$OUT/mixed_probe_$s.log"
  done
  for rate in 16 4; do for tokens in 2048 0; do
    PAGEDLLM_PIECEWISE_GRAPH_TOKENS=$tokens bench serve_${rate}_pieces_$tokens timeout 300 python -m pagedllm.benchmarks.serve \
      --launch --tokenizer .gpu/tokenizer --request-rate $rate --num-prompts ${PIECES_PROMPTS:-500}
  done; done
fi
if stage lorapieces; then  # steps with LoRA adapters in the piecewise graphs, on and off (scripts/lora_prefill_probe.py)
  for tokens in 2048 0 2048 0; do
    PAGEDLLM_PIECEWISE_GRAPH_TOKENS=$tokens timeout 150 python scripts/lora_prefill_probe.py llama3-8b 2> "$OUT/lora_prefill_$tokens.err" \
      | tee -a "$RES"
  done
fi
if stage tp2tests; then  # two GPUs: tensor parallelism with the custom all-reduce, the chain's PDL and the pieces
  python -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_custom_all_reduce.py tests/gpu/test_device_ids.py \
    tests/distributed/test_tensor_parallel.py tests/distributed/test_tensor_parallel_archs.py > "$OUT/tp2tests.log" 2>&1
  echo "   tp2 tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tp2tests.log" | tail -8 | cut -c1-250
fi
echo "== results"
python - "$RES" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    keep = {k: v for k, v in r.items() if k not in ("commit", "device", "time", "engine")}
    print(json.dumps(keep)[:300])
PY
