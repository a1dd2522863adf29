#!/usr/bin/env bash
# The device-machine checks behind benchmarks/RESULTS.md, one part per argument, each bounded in time. From the repo
# root on the device machine (inputs: `.venv/bin/python benchmarks/make_gpu_inputs.py` here, carry .gpu and .whl):
#   bash benchmarks/gpu_checks.sh tests fsdp1 nf4 e2e-offload max-context-offload
# QLoRA (each about one 10-minute call or less): qlora qlora-fp8 qlora-70b qlora-mixtral, then qlora-cap, cap-262k; TRL: trl; the peak: peak
# GRPO and the log-prob head (#27): grpo (one call), then grpo-long logprob-mem (one call together)
# Host-bound steps (#25), one call each: host, host-off, host-1b
# Every part writes under $OUT and prints a short table last.
set -uo pipefail
source benchmarks/gpu_env.sh

part_tests() {  # the GPU cases of the ops that moved or changed, offload's CUDA path, NF4 against bitsandbytes' CUDA
  timeout $(bound 330) python3 -m pytest -q -p no:cacheprovider -rs tests/test_lora.py tests/test_lora_glu.py \
    tests/test_linear_cross_entropy.py tests/test_cross_entropy.py tests/test_autograd_contract.py \
    tests/test_offload.py tests/test_nf4.py tests/test_tiled_mlp.py > "$OUT/pytest.log" 2>&1
  echo "pytest exit $?"; grep -E "passed|failed" "$OUT/pytest.log" | tail -3; grep -E "^FAILED|^ERROR" "$OUT/pytest.log" | head
}

part_tests_changed() {  # the GPU cases this session added or whose kernels changed, most important first
  timeout $(bound 240) python3 -m pytest -q -p no:cacheprovider -rs tests/test_nf4.py tests/test_offload.py -k cuda \
    > "$OUT/pytest-new.log" 2>&1; echo "pytest (nf4, offload) exit $?"; tail -2 "$OUT/pytest-new.log"
  timeout $(bound 200) python3 -m pytest -q -p no:cacheprovider -rs tests/test_linear_cross_entropy.py tests/test_cross_entropy.py \
    tests/test_autograd_contract.py -k "vocabulary or chunk_count or softcap or contract" > "$OUT/pytest-loss.log" 2>&1
  echo "pytest (loss, contract) exit $?"; tail -2 "$OUT/pytest-loss.log"; grep -E "^FAILED|^ERROR" "$OUT"/pytest-*.log | head
}

part_tests_new() {  # this stop's kernels and paths on the card: loss statistics, NF4 table lookup, document attention
  timeout $(bound 240) python3 -m pytest -q -p no:cacheprovider -rs tests/test_loss_statistics.py tests/test_document_attention.py \
    tests/test_nf4.py -k "not bit_exact_with_bitsandbytes or cuda" > "$OUT/pytest-new.log" 2>&1
  echo "pytest (statistics, document attention, nf4) exit $?"; tail -2 "$OUT/pytest-new.log"
  grep -E "^FAILED|^ERROR" "$OUT/pytest-new.log" | head
}

part_nf4_sweep() {
  timeout $(bound 150) python3 benchmarks/nf4_sweep.py > "$OUT/nf4_sweep.md" 2>&1; echo "sweep exit $?"; cat "$OUT/nf4_sweep.md"
}

part_fsdp1() {  # FSDP2 at world size 1 vs the plain run: same losses, tokens/s and peak (Llama-3.2-1B shape)
  local args="--model .gpu/llama32-1b/config.json --data .gpu/chitchat.json --max-steps 24 --seq-len 4096
    --batch-size 1 --eval-every 0 --eval-size 4 --save-every 0 --max-examples 1500 --gradient-checkpointing on"
  timeout $(bound 150) python3 -m leantune train $args --output /tmp/plain > "$OUT/plain.log" 2>&1; echo "plain exit $?"
  timeout $(bound 150) torchrun --standalone --nproc_per_node 1 -m leantune train $args --distributed fsdp --output /tmp/fsdp1 \
    > "$OUT/fsdp1.log" 2>&1; echo "fsdp1 exit $?"
  cp /tmp/plain/metrics.jsonl "$OUT/plain-metrics.jsonl"; cp /tmp/fsdp1/metrics.jsonl "$OUT/fsdp1-metrics.jsonl"
  python3 - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
rows = {k: [json.loads(l) for l in open(f"{out}/{k}-metrics.jsonl")] for k in ("plain", "fsdp1")}
summ = {k: json.load(open(f"/tmp/{k}/summary.json")) for k in ("plain", "fsdp1")}
p, f = ([r for r in rows[k] if r["type"] == "train"] for k in ("plain", "fsdp1"))
worst = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(f, p))
print("| run | first loss | last loss | worst rel loss diff | tokens/s (steps 3-24) | median / p90 step ms | peak GiB |")
for k, r in (("plain", p), ("fsdp1", f)):
    tps = sum(x["tokens"] for x in r[2:]) / sum(x["tokens"] / x["tokens_per_s"] for x in r[2:])
    ms = sorted(x["tokens"] / x["tokens_per_s"] * 1e3 for x in r[2:])  # a stall moves the sum, not the median
    print(f"| {k} | {r[0]['loss']:.5f} | {r[-1]['loss']:.5f} | {worst if k == 'fsdp1' else 0:.2e} | {tps:,.0f} | "
          f"{ms[len(ms) // 2]:.1f} / {ms[int(0.9 * len(ms))]:.1f} | {summ[k]['peak_memory_gib']:.2f} |")
EOF
}

part_nf4() {  # dequantisation against its floor and bitsandbytes' CUDA kernel
  timeout $(bound 120) python3 -m leantune bench ops --ops nf4_dequant --out "$OUT/nf4" > "$OUT/nf4.log" 2>&1
  echo "nf4 exit $?"; tail -8 "$OUT/nf4.log"
}

part_e2e_offload() {  # 8B, 4096 x 1, checkpointing on: leantune with and without offload (and 2048-token tiles)
  timeout $(bound 330) python3 -m leantune bench e2e --configs .gpu/llama3-8b --seq 4096 --batch 1 --gc on --steps 6 \
    --impls leantune,leantune+offload,leantune+offload+tiled2048 --budget-s 320 --out "$OUT/e2e" > "$OUT/e2e.log" 2>&1
  echo "e2e exit $?"; tail -12 "$OUT/e2e.log"
}

part_max_context_offload() {  # one probe: does 393,216 tokens train with offload + tiling?
  timeout $(bound 560) python3 -m leantune bench e2e --configs .gpu/llama3-8b --seq 393216 --batch 1 --gc on --steps 1 \
    --warmup 0 --impls leantune+offload+tiled --matmul-tflops 700 --budget-s 550 --out "$OUT/ctx" > "$OUT/ctx.log" 2>&1
  echo "ctx exit $?"; tail -8 "$OUT/ctx.log"
}

part_qlora() {  # 8B, 4096 x 1, checkpointing on: leantune QLoRA vs HF+PEFT+bitsandbytes vs leantune bf16, one run
  timeout $(bound 430) python3 -m leantune bench e2e --configs .gpu/llama3-8b --seq 4096 --batch 1 --gc on --steps 20 \
    --impls hf+peft+bnb,leantune+nf4,leantune --matmul-tflops 700 --budget-s 420 --compare --out "$OUT/qlora" \
    > "$OUT/qlora.log" 2>&1
  echo "qlora exit $?"; tail -14 "$OUT/qlora.log"
}

part_qlora_fp8() {  # #26: NF4 storage with FP8 compute (leantune+nf4fp8) beside NF4 -> bf16 and bitsandbytes, CUDA graphs
  timeout $(bound 60) python3 -m pytest -q -p no:cacheprovider tests/test_nf4_fp8.py > "$OUT/pytest-nf4fp8.log" 2>&1
  echo "pytest (nf4-fp8) exit $?"; tail -2 "$OUT/pytest-nf4fp8.log"
  timeout $(bound 470) python3 -m leantune bench e2e --configs .gpu/llama3-8b --seq 4096 --batch 1 --gc on --steps 20 \
    --impls hf+peft+bnb,leantune+nf4+graph,leantune+nf4fp8+graph --matmul-tflops 700 --budget-s 460 --compare \
    --out "$OUT/qlora-fp8" > "$OUT/qlora-fp8.log" 2>&1
  echo "qlora-fp8 exit $?"; tail -14 "$OUT/qlora-fp8.log"
}

part_fp8_groups() {  # #26/#25: the grouped FP8 dX kernel on the card, its probe, then the 8B GC-on step: bf16, NF4 and FP8
  # graphs (FP8 grouped dX on and off), 20 steps each, one run
  timeout $(bound 90) python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_fp8_kernels.py > "$OUT/pytest-fp8k.log" 2>&1
  echo "pytest (fp8 kernels) exit $?"; tail -2 "$OUT/pytest-fp8k.log"; grep -E "^FAILED|^ERROR" "$OUT/pytest-fp8k.log" | head
  timeout $(bound 100) python3 benchmarks/fp8_probe.py > "$OUT/fp8_probe.md" 2>&1; echo "fp8_probe exit $?"
  grep -v -i warn "$OUT/fp8_probe.md" | tail -24
  local e2e="--configs .gpu/llama3-8b --seq 4096 --batch 1 --gc on --steps 20 --matmul-tflops 700"
  timeout $(bound 300) python3 -m leantune bench e2e $e2e --impls leantune+graph,leantune+nf4+graph,leantune+fp8+graph \
    --budget-s $(( $(bound 300) - 10 )) --out "$OUT/grouped" > "$OUT/grouped.log" 2>&1; echo "grouped exit $?"
  LEANTUNE_FP8_GROUPED_DX=0 timeout $(bound 120) python3 -m leantune bench e2e $e2e --impls leantune+fp8+graph \
    --budget-s $(( $(bound 120) - 10 )) --out "$OUT/ungrouped" > "$OUT/ungrouped.log" 2>&1; echo "ungrouped exit $?"
  sed -n '/^Step times/,$p' "$OUT/grouped/results.md" 2>/dev/null; sed -n '/^| model/,$p' "$OUT/ungrouped/results.md" 2>/dev/null | tail -3
  timeout $(bound 150) python3 benchmarks/lora_probe.py > "$OUT/lora_probe.md" 2>&1; echo "lora_probe exit $?"
  grep -v -i warn "$OUT/lora_probe.md" | tail -30
}

part_fp8_dy() {  # #26: gate/up's dY codes from the GLU backward (ops/glu_fp8.py) on the card: its tests, the probe's
  # "gate/up dY codes" line (with launch variants), then the 8B FP8 graph step GC on, fused (default) against
  # LEANTUNE_FP8_FUSED_DY=0, 20 steps each, one run; then GC off against HF+PEFT
  timeout $(bound 90) python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_glu_fp8.py > "$OUT/pytest-glu-fp8.log" 2>&1
  echo "pytest (glu_fp8) exit $?"; tail -2 "$OUT/pytest-glu-fp8.log"; grep -E "^FAILED|^ERROR" "$OUT/pytest-glu-fp8.log" | head
  timeout $(bound 120) python3 benchmarks/fp8_probe.py --sweep > "$OUT/fp8_probe.md" 2>&1; echo "fp8_probe exit $?"
  grep -A1 "gate/up dY codes" "$OUT/fp8_probe.md"
  local e2e="--configs .gpu/llama3-8b --seq 4096 --batch 1 --steps 20 --matmul-tflops 700"
  timeout $(bound 120) python3 -m leantune bench e2e $e2e --gc on --impls leantune+fp8+graph \
    --budget-s $(( $(bound 120) - 10 )) --out "$OUT/fused" > "$OUT/fused.log" 2>&1; echo "fused exit $?"
  LEANTUNE_FP8_FUSED_DY=0 timeout $(bound 120) python3 -m leantune bench e2e $e2e --gc on --impls leantune+fp8+graph \
    --budget-s $(( $(bound 120) - 10 )) --out "$OUT/separate" > "$OUT/separate.log" 2>&1; echo "separate exit $?"
  grep -h "tok/s" "$OUT/fused.log" "$OUT/separate.log"
  timeout $(bound 200) python3 -m leantune bench e2e $e2e --gc off --impls hf+peft,leantune+fp8+graph --compare \
    --budget-s $(( $(bound 200) - 10 )) --out "$OUT/gcoff" > "$OUT/gcoff.log" 2>&1; echo "gcoff exit $?"
  grep -E "tok/s|tokens/s x" "$OUT/gcoff.log"
}

part_fp8_h() {  # #26: down's input codes from the LoRA GLU's tile absmaxes (one read of h), never run on the card:
  # its tests, the probe's line (kernel + row quantiser against the tile absmaxes), then the 8B GC-on rows, three runs
  timeout $(bound 90) python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_fp8_fused.py > "$OUT/pytest-fp8-fused.log" 2>&1
  echo "pytest (fp8_fused) exit $?"; tail -2 "$OUT/pytest-fp8-fused.log"; grep -E "^FAILED|^ERROR" "$OUT/pytest-fp8-fused.log" | head
  timeout $(bound 60) python3 -c "import sys, torch; sys.path.insert(0, 'benchmarks'); import fp8_probe as p
p.glu_h_codes(4096, torch.device('cuda'))" 2>&1 | grep -v -i warn | tail -2
  REPEAT=${REPEAT:-3} IMPLS=${IMPLS:-hf+peft,leantune+graph,leantune+fp8+graph} part_host
}

part_fp8_numerics() {  # #26's numerics row on the card: the same 8B-shaped LoRA fine-tune (random init, chitchat, 4096 x 1,
  # checkpointing on, 60 steps, eval on 16 held-out rows at start and end) in bf16 and with --quantize fp8 (~5 min)
  local args="--model .gpu/llama3-8b/config.json --data .gpu/chitchat.json --max-steps ${STEPS:-60} --seq-len 4096
    --batch-size 1 --eval-every 0 --eval-size 16 --save-every 0 --max-examples 3000 --gradient-checkpointing on"
  timeout $(bound 200) python3 -m leantune train $args --output /tmp/num-bf16 > "$OUT/num-bf16.log" 2>&1; echo "bf16 exit $?"
  timeout $(bound 200) python3 -m leantune train $args --quantize fp8 --output /tmp/num-fp8 > "$OUT/num-fp8.log" 2>&1
  echo "fp8 exit $?"
  for k in bf16 fp8; do cp /tmp/num-$k/metrics.jsonl "$OUT/num-$k-metrics.jsonl"; cp /tmp/num-$k/summary.json "$OUT/num-$k-summary.json"; done
  python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
evals = {k: [json.loads(l) for l in open(f"{out}/num-{k}-metrics.jsonl") if '"eval"' in l] for k in ("bf16", "fp8")}
print("| run | eval loss at start | eval loss at end | end vs bf16 |")
for k, rows in evals.items():
    first, last = rows[0]["eval_loss"], rows[-1]["eval_loss"]
    print(f"| {k} | {first:.4f} | {last:.4f} | {last / evals['bf16'][-1]['eval_loss'] - 1:+.2%} |")
PY
}

part_fp8_torchao() {  # #26's peer baseline in the same call: torchao 0.17's float8 rowwise training on the frozen base
  # layers (eager and each Float8Linear compiled) beside HF+PEFT and leantune's FP8 step, 8B 4096 x 1 GC on, 10 steps
  # (~6 min). Carry .whl-tao (torchao-0.17.0, built for torch 2.11), installed here apart from .whl's packages.
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-tao .whl-tao/*.whl
  PYTHONPATH=$PYTHONPATH:/tmp/site-tao timeout $(bound 560) python3 -m leantune bench e2e --configs .gpu/llama3-8b \
    --seq 4096 --batch 1 --gc on --steps ${STEPS:-10} --impls ${IMPLS:-hf+peft,hf+peft+torchao,hf+peft+torchao+compile,leantune+fp8+graph} \
    --matmul-tflops 700 --budget-s $(( $(bound 560) - 10 )) --compare --out "$OUT/torchao" > "$OUT/torchao.log" 2>&1
  echo "torchao exit $?"; grep -E "tok/s|x[0-9.]+, peak|not run|skipped" "$OUT/torchao.log" | grep -v -i warn | tail -8
}

part_fp8_70b() {  # #26: Llama-3-70B shape with FP8 frozen weights on one H200 (~67.6 GiB of e4m3 codes), 4096 x 1,
  # GC on, 3 timed steps (~3-4 min; built layer by layer); needs the H200's memory
  timeout $(bound 330) python3 -m leantune bench e2e --configs .gpu/llama3-70b --seq 4096 --batch 1 --gc on --steps 3 \
    --warmup 1 --profile-steps 0 --impls leantune+fp8 --matmul-tflops 700 --budget-s $(( $(bound 330) - 10 )) \
    --out "$OUT/fp8-70b" > "$OUT/fp8-70b.log" 2>&1
  echo "fp8-70b exit $?"; grep -v -i warn "$OUT/fp8-70b.log" | tail -5
}

part_qlora_same() {  # #25's QLoRA row in one call: bitsandbytes, bf16, NF4 and NF4-FP8 graphs, 8B GC on, 20 steps; then
  # #26's GC-off row (HF+PEFT vs FP8 graphs, one run) and the LoRA probe
  timeout $(bound 300) python3 -m leantune bench e2e --configs .gpu/llama3-8b --seq 4096 --batch 1 --gc on --steps 20 \
    --impls hf+peft+bnb,leantune+graph,leantune+nf4+graph,leantune+nf4fp8+graph --matmul-tflops 700 \
    --budget-s $(( $(bound 300) - 10 )) --compare --out "$OUT/qlora" > "$OUT/qlora.log" 2>&1; echo "qlora exit $?"
  sed -n '/^| model | seq x batch | GC | impl | steps/,$p' "$OUT/qlora/results.md" 2>/dev/null
  timeout $(bound 150) python3 -m leantune bench e2e --configs .gpu/llama3-8b --seq 4096 --batch 1 --gc off --steps 20 \
    --impls hf+peft,leantune+fp8+graph --matmul-tflops 700 --budget-s $(( $(bound 150) - 10 )) --compare \
    --out "$OUT/gcoff" > "$OUT/gcoff.log" 2>&1; echo "gcoff exit $?"
  sed -n '/^| model | seq x batch | GC | impl | steps/,$p' "$OUT/gcoff/results.md" 2>/dev/null
  timeout $(bound 130) python3 benchmarks/lora_probe.py > "$OUT/lora_probe.md" 2>&1; echo "lora_probe exit $?"
  grep -v -i warn "$OUT/lora_probe.md" | tail -30
}

part_qlora_70b() {  # Llama-3-70B shape, QLoRA on one card, 4096 x 1 (built layer by layer: the bf16 model never whole)
  timeout $(bound 400) python3 -m leantune bench e2e --configs .gpu/llama3-70b --seq 4096 --batch 1 --gc on --steps 3 \
    --warmup 1 --impls leantune+nf4 --matmul-tflops 700 --budget-s 390 --out "$OUT/qlora70b" > "$OUT/qlora70b.log" 2>&1
  echo "qlora-70b exit $?"; tail -8 "$OUT/qlora70b.log"
}

part_qlora_mixtral() {  # Mixtral-8x7B shape, NF4 linears and expert stacks, LoRA r16 on attention and experts, 4096 x 1
  timeout $(bound 560) python3 -m leantune bench e2e --configs .gpu/mixtral-8x7b --seq 4096 --batch 1 --gc on --steps 3 \
    --warmup 1 --impls leantune+nf4 --budget-s 540 --out "$OUT/qlora-mixtral" > "$OUT/qlora-mixtral.log" 2>&1
  echo "qlora-mixtral exit $?"; tail -8 "$OUT/qlora-mixtral.log"
}

part_qlora_cap() {  # one probe: 8B QLoRA with offload + tiling at 344,064 tokens (>= Unsloth's 342,733) in 80 GiB
  timeout $(bound 560) python3 -m leantune bench e2e --configs .gpu/llama3-8b --seq 344064 --batch 1 --gc on --steps 1 \
    --warmup 0 --impls leantune+nf4+offload+tiled --memory-cap-gib 80 --matmul-tflops 700 --budget-s 550 \
    --out "$OUT/qlora-cap" > "$OUT/qlora-cap.log" 2>&1
  echo "qlora-cap exit $?"; tail -8 "$OUT/qlora-cap.log"
}

part_cap_262k() {  # one probe: 8B bf16 with offload + tiling at 262,144 tokens in 80 GiB
  timeout $(bound 480) python3 -m leantune bench e2e --configs .gpu/llama3-8b --seq 262144 --batch 1 --gc on --steps 1 \
    --warmup 0 --impls leantune+offload+tiled --memory-cap-gib 80 --matmul-tflops 700 --budget-s 470 \
    --out "$OUT/cap262k" > "$OUT/cap262k.log" 2>&1
  echo "cap-262k exit $?"; tail -8 "$OUT/cap262k.log"
}

part_peak() {  # 8B, 4096 x 1, offload: what is alive at the peak, by allocation site, for MLP tiles and loss chunks
  timeout $(bound 300) python3 benchmarks/peak_breakdown.py --config .gpu/llama3-8b --seq 4096 --out "$OUT/peak" \
    --variants leantune+offload+tiled:4096:128 leantune+offload+tiled:2048:128 leantune+offload+tiled:1024:128 \
    > "$OUT/peak.log" 2>&1; echo "peak exit $?"; cat "$OUT/peak.log" | tail -60
}

part_tests_peak() {  # the CUDA cases of what the peak work changed: the LoRA MLP backward's order, the embedding leaf
  timeout $(bound 200) python3 -m pytest -q -p no:cacheprovider -rs tests/test_lora.py tests/test_offload.py \
    -k "mlp or offload or embedding or reentrant" > "$OUT/pytest-peak.log" 2>&1
  echo "pytest (lora mlp, offload) exit $?"; tail -2 "$OUT/pytest-peak.log"; grep -E "^FAILED|^ERROR" "$OUT/pytest-peak.log" | head
}

part_trl() {  # TRL, 8B, 4096 x 1, checkpointing on: leantune's head vs TRL's own vs TRL use_liger_kernel, SFT then DPO
  timeout $(bound 330) python3 benchmarks/trl_bench.py --config .gpu/llama3-8b --trainer sft --seq 4096 --out "$OUT/trl" \
    > "$OUT/trl-sft.log" 2>&1; echo "trl sft exit $?"; tail -6 "$OUT/trl-sft.log"
  timeout $(bound 600) python3 benchmarks/trl_bench.py --config .gpu/llama3-8b --trainer dpo --seq 4096 \
    --steps 3 --out "$OUT/trl" > "$OUT/trl-dpo.log" 2>&1; echo "trl dpo exit $?"; tail -6 "$OUT/trl-dpo.log"
}

part_dpo_profile() {  # #27's DPO row with a trace: TRL's default head vs leantune, 8B 4096, 5 timed steps, then one
  # profiled step each (GPU busy, kernels, top kernels in the JSONs); ~5 min; carry .whl (trl, datasets, dill, multiprocess)
  timeout $(bound 540) python3 benchmarks/trl_bench.py --config .gpu/llama3-8b --trainer dpo --seq 4096 --impls trl,leantune \
    --warmup 2 --steps 5 --profile --out "$OUT/dpo" > "$OUT/dpo.log" 2>&1; echo "dpo exit $?"; tail -6 "$OUT/dpo.log"
  python3 - "$OUT/dpo" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("dpo-*.json")):
    r = json.loads(path.read_text())
    print(f"{path.stem}: profiled step {r.get('profiled_step_ms', 0):.1f} ms, GPU busy {r.get('busy_fraction') or 0:.1%}, "
          f"{r.get('kernels_per_step')} kernels")
    for k in (r.get("top_kernels") or [])[:14]:
        print(f"  {k['ms_per_step']:8.2f} ms x{k['calls_per_step']:<5.0f} {k['name'][:90]}")
PY
}

part_trl_sft() {  # TRL SFT only, 8B 4096 x 1: leantune with and without the heap freeze, TRL, TRL + Liger
  timeout $(bound 330) python3 benchmarks/trl_bench.py --config .gpu/llama3-8b --trainer sft --seq 4096 --steps 10 --out "$OUT/trl" \
    > "$OUT/trl-sft.log" 2>&1; echo "trl sft exit $?"; tail -8 "$OUT/trl-sft.log"
}

part_grpo() {  # #27: TRL GRPOTrainer, 8B, one prompt's 8 completions of 2,048 tokens (+128 prompt) per step, LoRA
  # ~5 min: per implementation ~60-80 s of start, 8B build and trainer set-up, then 5 steps of ~3-5 s (17,408 tokens)
  timeout $(bound 480) python3 benchmarks/trl_bench.py --config .gpu/llama3-8b --trainer grpo --impls ${IMPLS:-trl,trl+liger,leantune} \
    --num-generations 8 --completion-len 2048 --prompt-len 128 --warmup 2 --steps 3 --out "$OUT/grpo" > "$OUT/grpo.log" 2>&1
  echo "grpo exit $?"; tail -8 "$OUT/grpo.log"
}

part_grpo_long() {  # #27: one probe, 8 x (128 + 14,208) = 114,688 tokens in one micro-batch under an 80 GiB cap
  # ~3-4 min: start and build ~60-80 s, a warm-up and a timed step of ~30-60 s each (offloaded checkpoints: 30 GB pinned)
  timeout $(bound 420) python3 benchmarks/trl_bench.py --config .gpu/llama3-8b --trainer grpo --impls ${IMPLS:-leantune+offload} \
    --num-generations 8 --completion-len 14208 --prompt-len 128 --warmup 1 --steps 1 --memory-cap-gib 80 \
    --out "$OUT/grpo-long" > "$OUT/grpo-long.log" 2>&1
  echo "grpo-long exit $?"; tail -6 "$OUT/grpo-long.log"
}

part_logprob_mem() {  # #27: ops.linear_log_probs fwd+bwd at N 65,536, H 4,096, V 151,936 bf16 vs the torch path (~1-2 min)
  timeout $(bound 180) python3 benchmarks/log_probs_probe.py --out "$OUT/logprob-mem.json" > "$OUT/logprob-mem.md" 2>&1
  echo "logprob-mem exit $?"; tail -10 "$OUT/logprob-mem.md"
}

part_tests_round3() {  # round 3's kernels and paths on the card: launch path, graphs, no-sync, MoE, FP8, compile, RL heads
  timeout $(bound 270) python3 -m pytest -q -n 8 -p no:cacheprovider -rs tests/test_launch.py tests/test_graphs.py \
    tests/test_no_sync.py tests/test_moe_kernels.py tests/test_moe.py tests/test_patch_moe.py tests/test_sink_attention.py \
    tests/test_fp8.py tests/test_fp8_kernels.py tests/test_fp8_train.py tests/test_compile.py tests/test_log_probs.py tests/test_preference.py \
    tests/test_distillation.py tests/test_patch_families.py tests/test_patch_structures.py tests/test_patch_qlora.py \
    tests/test_lora_nf4.py tests/test_loss_options.py tests/test_tiled_mlp.py tests/test_dora.py tests/test_nf4.py \
    tests/test_patch_api.py > "$OUT/pytest-r3.log" 2>&1
  echo "pytest (round 3) exit $?"; tail -2 "$OUT/pytest-r3.log"; grep -E "^_{3,} test.* _{3,}$" "$OUT/pytest-r3.log" | head -30
}

part_probes() {  # the bound launch path, the grouped expert GEMMs, the FP8 GEMM pieces, gpt-oss sinks (each < 2 min)
  local p; for p in launch_probe moe_probe fp8_probe sink_attention_probe; do
    timeout $(bound 110) python3 benchmarks/$p.py > "$OUT/$p.md" 2>&1; echo "$p exit $?"; tail -25 "$OUT/$p.md"
  done
}

part_compile_xfail() {  # the softcap CE kernel under inductor (a strict xfail on CPU): what the card says
  timeout $(bound 120) python3 -m pytest -q -p no:cacheprovider -m gpu --runxfail tests/test_compile.py -k "fast-inductor" \
    > "$OUT/compile-xfail.log" 2>&1; echo "compile xfail exit $?"; tail -15 "$OUT/compile-xfail.log"
}

part_fp8_sweep() {  # the single-pass quantisation and transpose kernels beside the torch chains and their floors
  timeout $(bound 150) python3 benchmarks/fp8_probe.py --sweep > "$OUT/fp8_sweep.md" 2>&1; echo "fp8 sweep exit $?"
  tail -40 "$OUT/fp8_sweep.md"
}

part_dora() {  # #28: PEFT's DoRA step vs leantune's fused DoRA, 8B 4096 x 1, checkpointing on, 20 timed steps
  timeout $(bound 330) python3 -m leantune bench e2e --configs .gpu/llama3-8b --seq 4096 --batch 1 --gc on --dora \
    --steps 20 --repeat ${REPEAT:-1} --impls ${DORA_IMPLS:-hf+peft,leantune,leantune+graph} --matmul-tflops 700 --budget-s $(( $(bound 330) - 10 )) \
    --compare --out "$OUT/dora" > "$OUT/dora.log" 2>&1
  echo "dora exit $?"; grep -E "tokens/s of|x[0-9.]+, peak|not run" "$OUT/dora.log"; sed -n '/^Step times/,$p' "$OUT/dora/results.md" 2>/dev/null
}

part_dora_scale() {  # DoRA's column-scale kernels on the card: tests/test_dora.py (bit for bit against torch), then ms per call
  timeout $(bound 240) python3 -m pytest -q -p no:cacheprovider -rs tests/test_dora.py > "$OUT/pytest-dora.log" 2>&1
  echo "pytest (dora) exit $?"; tail -2 "$OUT/pytest-dora.log"; grep -E "^FAILED|^ERROR" "$OUT/pytest-dora.log" | head
  timeout $(bound 120) python3 benchmarks/dora_scale_probe.py > "$OUT/dora_scale.md" 2>&1; echo "dora_scale_probe exit $?"
  cat "$OUT/dora_scale.md"
}

part_fp8() {  # #26 stage 2 on the card: the FP8 tests, then the 8B step with fused activation quantisation and its trace
  timeout $(bound 150) python3 -m pytest -q -n 8 -p no:cacheprovider -rs tests/test_fp8.py tests/test_fp8_kernels.py \
    tests/test_fp8_fused.py tests/test_fp8_train.py tests/test_lora_glu.py > "$OUT/pytest-fp8.log" 2>&1
  echo "pytest (fp8) exit $?"; tail -2 "$OUT/pytest-fp8.log"; grep -E "^_{3,} test.* _{3,}$" "$OUT/pytest-fp8.log" | head
  REPEAT=${REPEAT:-1} IMPLS=${IMPLS:-hf+peft,leantune+graph,leantune+fp8+graph} \
    host_e2e fp8-8b --configs .gpu/llama3-8b --gc on --seq 4096 --batch 1
  python3 benchmarks/top_kernels.py "$OUT/fp8-8b" --n 48 | grep -iE "^top|quant|transpose|_fp8|scaled|rms|glu|gemm|cutlass" \
    > "$OUT/fp8-trace.txt"; cat "$OUT/fp8-trace.txt"  # a separate quantisation pass shows as _quantize_rows_kernel
  [ -z "${GC_OFF-1}" ] || REPEAT=${REPEAT:-1} IMPLS=${GC_OFF_IMPLS:-hf+peft,leantune+fp8+graph} \
    host_e2e fp8-8b-gcoff --configs .gpu/llama3-8b --gc off --seq 4096 --batch 1
}

part_lora_probe() {  # the low-rank kernels' fp32 x fp32 products as tf32x3: the CUDA tests of their kernels, then ms per call
  timeout $(bound 240) python3 -m pytest -q -n 8 -p no:cacheprovider -rs tests/test_lora.py tests/test_lora_glu.py \
    tests/test_dora.py tests/test_glu.py tests/test_moe_kernels.py tests/test_moe.py > "$OUT/pytest-lowrank.log" 2>&1
  echo "pytest (lowrank) exit $?"; tail -2 "$OUT/pytest-lowrank.log"; grep -E "^_{3,} test.* _{3,}$" "$OUT/pytest-lowrank.log" | head
  timeout $(bound 120) python3 benchmarks/lora_probe.py > "$OUT/lora_probe.md" 2>&1; echo "lora_probe exit $?"
  cat "$OUT/lora_probe.md"
}

part_moe_e2e() {  # #29: Qwen3-30B-A3B shape (48 layers, 128 experts, top-8), LoRA on attention and experts, 4096 x 1
  # (~2 min; warm-up 2: with 1, leantune+graph's capture step fell into the timed steps)
  timeout $(bound 540) python3 -m leantune bench e2e --configs .gpu/qwen3-30b-a3b --seq 4096 --batch 1 --gc on \
    --steps ${STEPS:-10} --warmup 2 --impls ${IMPLS:-hf+peft,leantune+graph} --matmul-tflops 700 \
    --budget-s $(( $(bound 540) - 10 )) --compare --out "$OUT/moe-e2e" > "$OUT/moe-e2e.log" 2>&1
  echo "moe-e2e exit $?"; grep -E "tokens/s|x[0-9.]+, peak|not run" "$OUT/moe-e2e.log" | tail -6
  sed -n '/^Step times/,$p' "$OUT/moe-e2e/results.md" 2>/dev/null
}

part_gpt_oss() {  # #29: gpt-oss-20b shape (sinks, alternating 128-token windows, 32 experts top-4), LoRA, 4096 x 1
  timeout $(bound 480) python3 -m leantune bench e2e --configs .gpu/gpt-oss-20b --seq 4096 --batch 1 --gc on \
    --steps ${STEPS:-10} --warmup 1 --impls ${IMPLS:-hf+peft,leantune} --matmul-tflops 700 \
    --budget-s $(( $(bound 480) - 10 )) --compare --out "$OUT/gpt-oss" > "$OUT/gpt-oss.log" 2>&1
  echo "gpt-oss exit $?"; grep -E "tokens/s|x[0-9.]+, peak|not run" "$OUT/gpt-oss.log" | tail -6
  sed -n '/^Step times/,$p' "$OUT/gpt-oss/results.md" 2>/dev/null
}

part_tests_fixed() {  # the cases that failed on the card in the first call of 2026-12-03, after their fixes
  timeout $(bound 150) python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_fp8_kernels.py tests/test_dora.py \
    tests/test_no_sync.py > "$OUT/pytest-fixed.log" 2>&1
  echo "pytest (fixed) exit $?"; tail -2 "$OUT/pytest-fixed.log"; grep -E "^_{3,} test.* _{3,}$" "$OUT/pytest-fixed.log" | head
}

part_profile_1b() {  # the patched 1B step's kernels at 8192 x 2 (4 layers): where the GPU time goes
  timeout $(bound 120) python3 benchmarks/profile_step.py --config .gpu/llama32-1b --layers 4 --seq 8192 --batch 2 --gc \
    > "$OUT/profile-1b.md" 2>&1; echo "profile-1b exit $?"; cat "$OUT/profile-1b.md" | grep -v Warning | tail -48
}

part_moe_block() {  # the MoE training step, HF+PEFT (grouped_mm experts) vs leantune, Qwen3-30B-A3B layer shape
  timeout $(bound 200) python3 benchmarks/moe_block_bench.py --profile > "$OUT/moe_block.md" 2>&1; echo "moe_block exit $?"
  grep -v -i warn "$OUT/moe_block.md" | tail -44
}

# Issue #25's step figures: 20 timed steps per run, three runs (REPEAT) per implementation (IMPLS, default
# hf+peft,leantune+graph) interleaved in one call (the worst quoted), step ms median / min / p90, host issue ms, GPU-busy fraction from a separate profiled pass of 3 steps.
# One part per device call (each about 6-7 minutes for 8B: 6 children of ~10 s start + 20-40 s build + 25 steps + the
# profiled pass; about 4 minutes for 1B): host (8B GC on), host-off (8B GC off), host-1b (1B, 8192 x 2, GC on).
host_e2e() {  # $1: subfolder of $OUT, then the e2e options
  local name=$1; shift
  timeout $(bound 560) python3 -m leantune bench e2e "$@" --steps 20 --repeat ${REPEAT:-3} --impls ${IMPLS:-hf+peft,leantune+graph} \
    --matmul-tflops 700 --budget-s $(( $(bound 560) - 10 )) --compare --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  echo "$name exit $?"; grep -E "tokens/s of 3 runs|x[0-9.]+, peak|not run" "$OUT/$name.log"
  sed -n '/^Step times/,$p' "$OUT/$name/results.md" 2>/dev/null  # the step table (no max-context or ops here)
  python3 benchmarks/top_kernels.py "$OUT/$name"  # each implementation's profiled pass: where its GPU time goes
}

part_host() { host_e2e host-8b-gcon --configs .gpu/llama3-8b --gc on --seq 4096 --batch 1; }
part_host_off() { host_e2e host-8b-gcoff --configs .gpu/llama3-8b --gc off --seq 4096 --batch 1; }
part_host_1b() { host_e2e host-1b --configs .gpu/llama32-1b --gc on; }

bound() {  # the part's own limit, or what is left of the call if less (at least 1: `timeout 0` means no limit)
  local l=$(( $(left) - 10 )); l=$(( l < $1 ? l : $1 )); echo $(( l < 1 ? 1 : l ))
}

for part in "$@"; do
  echo "== $part ($(left) s left)"
  "part_${part//-/_}"
done
