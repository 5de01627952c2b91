#!/usr/bin/env bash
# GPU verification, run on the GPU machine from the repo root (see docs/gpu-verification.md):
#   export PYTHONPATH=$PWD/.gpu-site:$PWD; bash scripts/gpu/verify.sh "$OUT" STAGE...
# Stages: machine, unsloth-line (issue 9: a few methods of the Unsloth GPU test on the stack of the site on
# PYTHONPATH; see docs/compatibility.md), unsloth-lines (issue 21: tests/gpu's dynamic-vs-fixed beta graph count on every
# Unsloth line of the carried .gpu-lines, built by scripts/gpu/build-line-sites.sh, the lines at once; writes
# gpu-report-STACK.json, gpu-tests-STACK.log and the table unsloth-lines.md), tests (Unsloth backend, every method as 16-bit LoRA and 4-bit QLoRA; dynamic
# beta over 32 steps), liger (bench), liger-conformance (Liger's upstream GRPO tests against the
# drop-in, and GRPOTrainer(loss_class=) against TRL's loss), unsloth-bench (bench_unsloth.py, LoRA, 16 completions,
# budget 520 s), demo-check (a short run of the study harness, research/study_cli.py), demo-3seeds,
# user-demo (the user's demo, blackwell/test_adaptive_kl_grpo.py: the tiny model with TRL, then SmolLM2 through
# Unsloth's FastLanguageModel where unsloth is installed; first run 2026-11-29: docs/gpu-verification.md, Demo),
# user-demo-tiny (the user's default demo alone, tiny model, <= 560 s, each log line stamped with the time),
# evidence:NAME (the demo invocations listed in research/runlists/NAME.txt, all at once; see
# docs/evidence/). An evidence stage writes to $OUT: NAME-stream.jsonl (every run's steps, as they
# come), NAME-analysis.md (the slope table), NAME.log and NAME-runs.tar.gz (logs, summaries, plots); a list with
# --betas (the beta grid, betagrid*.txt) also NAME-grid.md and NAME-grid.png (--analyze --grid).
# evidence-pair:A,B (a 2-GPU machine): evidence:A on GPU 0 and evidence:B on GPU 1 at once; writes A-stream.jsonl,
# B-stream.jsonl, A-grid.md, B-grid.md and evidence-pair.tar.gz (everything else) to $OUT.
# bench-1b (one GPU, <= ~530 s): bench_liger.py with the GEMM-floor column, the log-prob-kernel path and the fused
# head (fused_head=True, chunks auto and 1024) for none and target (<= 130 s), then on the ~1 B Llama, interleaved
# (docs/benchmarks.md): bench_trl.py, LoRA and full FT, 16 completions per step (budget 165 s, model building
# included), and bench_unsloth.py, LoRA, 8 completions per step (budget 165 s, import and compilation included);
# writes bench-liger-fused.log, bench-trl.md, bench-unsloth.md (tables rewritten after
# every round) and bench-1b-raw.tar.gz (bench-trl.md.json, bench-unsloth.md.json: every timing; both logs).
# perf2 (issue 22, one GPU, <= 540 s): tests/gpu/test_liger_gpu.py, bench_liger.py --recompile-loop, the fused head's
# chunk schedules (auto: one chunk, no fp32 accumulator; 4096: the former default), bench_loss_class.py (budget 90 s).
# perf3 (issue 22, one GPU, <= 560 s): bench_fused_head_parts.py (the fused head's GEMMs and passes alone, interleaved
# with the whole; a kernel profile), bench_unsloth.py with stock, none and length_normalized only (budget 240 s), and
# the bf16 fused-vs-kernel GPU cases of the combined method.
# kl-diagnostics (issue 36, one GPU, <= 580 s): bench_trl.py (LoRA and full FT, 16 completions) and bench_unsloth.py
# (LoRA, 16 completions) with the rows stock, none (tail metrics on), stock beta=0, kl_monitor (both backends) and
# kl_exclude_token_ids; writes bench-trl-kl-diagnostics.md and bench-unsloth-kl-diagnostics.md (+ .json, .log).
# monitor-sampled (issue 53, one GPU, <= 580 s): the same benches with the rows stock beta=0, kl_monitor (every step)
# and kl_monitor sampled (default kl_monitor_every); writes bench-trl-monitor-sampled.md, bench-unsloth-monitor-sampled.md.
# MONITOR_BUDGET (default 270) is bench_trl's budget in seconds, bench_unsloth's is 10 s less.
# study33:NAME (issue 33's study, one GPU, <= ~575 s): evidence:NAME with UNSLOTH_GRPO_SEQ_PACKING=0 exported (Amendment 5)
# and EVIDENCE_TIMEOUT=560, then --analyze --study of its stream; writes NAME-stream.jsonl, NAME.log, NAME-analysis.md,
# NAME-runs.tar.gz and NAME-study.md. study33-pair:A,B (a 2-GPU machine): study33:A on GPU 0 and study33:B on GPU 1 at
# once; writes A-stream.jsonl, B-stream.jsonl, A-study.md, B-study.md and study33-pair.tar.gz (everything else).
# study51:NAME (issue 51's study on SmolLM2, one GPU, <= ~575 s; after smollm2-head and smollm2-join on the same
# machine): evidence:NAME with UNSLOTH_GRPO_SEQ_PACKING=0 and EVIDENCE_TIMEOUT=560; writes NAME-stream.jsonl, NAME.log,
# NAME-analysis.md and NAME-runs.tar.gz. study51-pair:A,B (a 2-GPU machine): study51:A on GPU 0 and study51:B on GPU 1
# at once; writes A-stream.jsonl, B-stream.jsonl, A-analysis.md, B-analysis.md and study51-pair.tar.gz (the rest).
# study33-probe (issue 33, one GPU, <= 560 s): the long task's warm start and GRPO step time before its study
# (research/gpu/study33_probe.py: one run alone, then eight at once, 8 steps each, each invocation warm-starting
# seed 0); writes study33-probe.md, study33-probe.json, study33-probe-k1-stream.jsonl, study33-probe-k8-stream.jsonl
# and study33-probe-runs.tar.gz to $OUT. study33-probe:LR: the same at the warm-start learning rate LR (Amendment 2).
# study33-genspeed (issue 33, one GPU, <= 585 s): where a step of the long task spends its time: one warm start,
# then the demo's runs alone, 8 and 16 at once, and alone without Unsloth's graph decode, generation timed per step
# (research/gpu/study33_genspeed.py; not study data); writes genspeed.md, genspeed.json, genspeed-stream.jsonl.
# study33-profile (issue 33, one GPU, ~5 min): a lone long-task run's step, profiled (timers, cProfile,
# torch.profiler; research/gpu/study33_profile.py; not study data); writes profile.md and profile.json.
# study33-warmscan:LR,LR (issue 33, one GPU, <= ~450 s): the long task's warm start of seed 0 at each learning rate,
# all at once, each with its step-0 record and held-out loss by token role (research/gpu/study33_warmscan.py; not
# study data); writes warmscan.md, warmscan.json, warmscan-lrX.json, warmscan-lrX.log, warmscan-progress.jsonl.
# multi-gpu (2 GPUs): examples/multi_gpu/check_ranks.py for each of MULTI_GPU_RUNS (below): DDP, FSDP2, FSDP2 with a
# LoRA adapter, DeepSpeed ZeRO-2 and ZeRO-3 (full fine-tuning), and the Unsloth backend (LoRA) under DDP;
# multi-gpu:NAME,NAME runs those only (6 runs do not fit one 10-minute call: see docs/gpu-verification.md).
# Writes multi-gpu-NAME.log and multi-gpu-NAME/report.md.
# DeepSpeed: deepspeed importable from PYTHONPATH, or .gpu-site-ds.tgz (scripts/gpu/build-deepspeed-site.sh)
# carried and unpacked here to /tmp/ds-site for the DeepSpeed runs. The whole stage at one commit: two calls
# (docs/gpu-verification.md, "The whole 2-GPU stage at one commit").
EVIDENCE_TIMEOUT=${EVIDENCE_TIMEOUT:-550}
MULTI_GPU_RUNS="ddp:ddp fsdp2:fsdp2 fsdp2-lora:fsdp2:--lora deepspeed_zero2:deepspeed_zero2 deepspeed_zero3:deepspeed_zero3 unsloth-ddp:ddp:--backend=unsloth"
MULTI_GPU_TIMEOUT=${MULTI_GPU_TIMEOUT:-280}
multi_gpu() {  # $1: comma-separated names of MULTI_GPU_RUNS, or "" for all
  local run name config flags pythonpath
  for run in $MULTI_GPU_RUNS; do
    IFS=: read -r name config flags <<< "$run"
    case ",${1:-$name}," in *",$name,"*) ;; *) continue ;; esac
    pythonpath=$PYTHONPATH
    if [[ $config == deepspeed* ]] && ! python -c "import deepspeed" 2> /dev/null && [ -f .gpu-site-ds.tgz ]; then
      mkdir -p /tmp/ds-site && tar xzf .gpu-site-ds.tgz -C /tmp/ds-site
      pythonpath=$PYTHONPATH:/tmp/ds-site
    fi
    # shellcheck disable=SC2086
    PYTHONPATH=$pythonpath timeout "$MULTI_GPU_TIMEOUT" python examples/multi_gpu/check_ranks.py --config "examples/multi_gpu/$config.yaml" \
      $flags --out "$OUT/multi-gpu-$name" --steps 4 --timeout $((MULTI_GPU_TIMEOUT - 40)) > "$OUT/multi-gpu-$name.log" 2>&1
    echo "== $name: exit status $?"; cat "$OUT/multi-gpu-$name/report.md" 2>/dev/null || tail -20 "$OUT/multi-gpu-$name.log"
  done
}
evidence() {  # $1: NAME; the stream goes to $EVIDENCE_STREAM_DIR (default $OUT), everything else to $OUT
  local name=$1 work=/tmp/evidence-$1 i=0 pids=() stream=${EVIDENCE_STREAM_DIR:-$OUT}/$1-stream.jsonl
  mkdir -p "$work"
  while read -r line; do
    case $line in ''|'#'*) continue ;; esac
    i=$((i + 1))
    echo "[$name.$i] $line"
    # shellcheck disable=SC2086
    timeout "$EVIDENCE_TIMEOUT" python research/study_cli.py $line --keep-going \
      --stream "$stream" --output-dir "$work/$i" > "$work/$i.log" 2>&1 &
    pids+=($!)
  done < "research/runlists/$name.txt"
  for pid in "${pids[@]}"; do wait "$pid"; done
  for f in "$work"/*.log; do echo "== $f"; grep -v "^\[\|  started \|^step" "$f" | tail -25; done > "$OUT/$name.log"
  python research/study_cli.py --analyze "$stream" | tee "$OUT/$name-analysis.md"
  if grep -q -- "--betas" "research/runlists/$name.txt"; then  # a beta grid: its own analysis and figure
    python research/study_cli.py --analyze "$stream" --grid --plot "$OUT/$name-grid.png" \
      | tee "$OUT/$name-grid.md"
  fi
  (cd "$work" && tar czf "$OUT/$name-runs.tar.gz" --exclude=checkpoints --exclude=unsloth_compiled_cache --exclude='*.safetensors' .)
}
pair() {  # pair KIND REPORT A,B SHOW: the stages KIND:A on GPU 0 and KIND:B on GPU 1 at once (a 2-GPU machine), their
  # streams to $OUT as they grow, A-REPORT.md and B-REPORT.md to $OUT (each shown with SHOW, e.g. "tail -25"), every
  # other file packed into $OUT/KIND-pair.tar.gz
  local kind=$1 report=$2 first=${3%%,*} second=${3#*,} show=$4 work=/tmp/$1-pair name
  CUDA_VISIBLE_DEVICES=0 EVIDENCE_STREAM_DIR=$OUT bash "$0" "$work" "$kind:$first" > "/tmp/$kind-pair-$first.txt" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 EVIDENCE_STREAM_DIR=$OUT bash "$0" "$work" "$kind:$second" > "/tmp/$kind-pair-$second.txt" 2>&1
  wait
  for name in "$first" "$second"; do
    cp "$work/$name-$report.md" "$OUT/" 2>/dev/null; mv "/tmp/$kind-pair-$name.txt" "$work/"
    $show "$OUT/$name-$report.md" 2>/dev/null
  done
  tar czf "$OUT/$kind-pair.tar.gz" -C "$work" .
}
set -uo pipefail
OUT=$1; shift
mkdir -p "$OUT"
# .gpu-site carried packed (.gpu-site.tgz, ~20 MB for its ~54 MB): with the tree and .gpu-site-ds.tgz it keeps well
# inside the 64 MiB a call carries. Unpacked here, where PYTHONPATH=$PWD/.gpu-site expects it.
if [ ! -d .gpu-site ] && [ -f .gpu-site.tgz ]; then tar xzf .gpu-site.tgz; fi
# The same, packed with xz (~17 MB): what the smollm2 stages carry beside the model's second part.
if [ ! -d .gpu-site ] && [ -f .gpu-carry/site.txz ]; then tar xJf .gpu-carry/site.txz; fi
# SmolLM2-135M-Instruct (issue 50): its GGUF (98 MB) travels in two parts over two calls (smollm2-head, then
# smollm2-join on the still-warm machine); once joined, every later stage and call finds it here.
SMOLLM2=/tmp/smollm2
if [ -f $SMOLLM2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then export UAKL_SMOLLM2_GGUF=$SMOLLM2/SmolLM2-135M-Instruct.Q4_1.gguf; fi
export UAKL_CACHE=$SMOLLM2/cache
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false UNSLOTH_COMPILE_LOCATION=/tmp/unsloth_cache
for stage in "$@"; do
  echo "== $stage"
  case $stage in
    smollm2-head)  # call 1 of 2: keep the GGUF's first part (scripts/gpu/smollm2_parts.sh) on the machine
      mkdir -p $SMOLLM2 && cp .gpu-carry/smollm2.part1 $SMOLLM2/part1 && ls -l $SMOLLM2 && sha256sum $SMOLLM2/part1 ;;
    smollm2-join)  # call 2 of 2: join it with the second part and check the whole file's size and sha256
      cat $SMOLLM2/part1 .gpu-carry/smollm2.part2 > $SMOLLM2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
      export UAKL_SMOLLM2_GGUF=$SMOLLM2/SmolLM2-135M-Instruct.Q4_1.gguf
      python -c "from pathlib import Path; from unsloth_adaptive_kl import smollm2; smollm2.check_gguf(Path('$UAKL_SMOLLM2_GGUF')); print('sha256 ok:', smollm2.GGUF_SHA256); print(smollm2.smollm2_dir())" || exit 1 ;;
    smollm2-probe)  # the task's step-0 record (scripts/gpu/smollm2_gpu.py probe; docs/real-model.md's rule picks the task)
      timeout 300 python scripts/gpu/smollm2_gpu.py probe "$OUT" 2>&1 | grep -v Warning | tail -30; cp "$OUT/smollm2-probe.json" $SMOLLM2/ ;;
    smollm2-tests)  # every built-in method, 3 GRPO steps of SmolLM2 on the Unsloth backend
      UAKL_GPU_REPORT="$OUT/gpu-report-smollm2.json" UNSLOTH_GRPO_SEQ_PACKING=0 timeout 380 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_smollm2_gpu.py 2>&1 | tee "$OUT/gpu-tests-smollm2.log" | grep -E "passed|failed|Error|FAIL" | tail -30 ;;
    smollm2-runs)  # step times of one run alone and of eight at once; the two KL numbers; the template tokens' KL
      timeout 560 python scripts/gpu/smollm2_gpu.py runs "$OUT" 2>&1 | grep -v Warning | tail -60 ;;
    machine)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/machine.txt"
      python -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability())" | tee -a "$OUT/machine.txt" ;;
    tests)  # the Unsloth GPU tests (tests/gpu/test_liger_gpu.py runs in stage perf2)
      UAKL_GPU_REPORT="$OUT/gpu-report.json" timeout 540 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_unsloth_gpu.py tests/gpu/test_estimators_gpu.py 2>&1 | tee "$OUT/gpu-tests.log" | grep -E "passed|failed|Error|FAIL" | tail -30 ;;
    unsloth-line)  # issue 9, point 6: a few methods as 16-bit LoRA and 4-bit QLoRA on the Unsloth stack whose site is on PYTHONPATH
      line=$(python -c "import importlib.metadata as m; print('-'.join(m.version(d) for d in ('unsloth', 'unsloth_zoo', 'trl', 'transformers')))")
      echo "unsloth-unsloth_zoo-trl-transformers: $line" | tee -a "$OUT/unsloth-line.txt"
      UAKL_GPU_REPORT="$OUT/gpu-report-$line.json" timeout 330 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_unsloth_gpu.py \
        -k "run_on_gpu and (none or clip or target)" 2>&1 | tee "$OUT/gpu-tests-$line.log" | grep -E "passed|failed|Error|FAIL" | tail -30 ;;
    unsloth-lines)  # issue 21: tests/gpu's fixed-vs-dynamic beta graph count on each line of .gpu-lines, all at once
      source .gpu-lines/paths.sh
      declare -A site=()
      for stack in $LINES; do site[$stack]=$(line_path "$stack"); done  # unpacks the layers, one at a time
      pids=()
      for stack in $LINES; do
        (
          # One CPU share per line: the test's warm start runs on the CPU, and three processes of nproc
          # OpenMP threads each sat 9 minutes without printing a line (two calls, 2026-11-24). A hang
          # still shows its stacks: the time-out sends SIGABRT, which faulthandler answers with a traceback.
          export PYTHONPATH="${site[$stack]}:$PWD" UNSLOTH_COMPILE_LOCATION=/tmp/unsloth_cache-$stack PYTHONFAULTHANDLER=1 \
            OMP_NUM_THREADS=$(( $(nproc) / $(wc -w <<< "$LINES") )) TORCHINDUCTOR_COMPILE_THREADS=4
          echo "$stack: $(python -c "import importlib.metadata as m; print(', '.join(d + ' ' + m.version(d) for d in ('unsloth', 'unsloth_zoo', 'trl', 'transformers', 'torch')))")"
          UAKL_GPU_REPORT="$OUT/gpu-report-$stack.json" timeout -s ABRT "${LINE_TIMEOUT:-520}" python -m pytest -q -s -p no:cacheprovider \
            tests/gpu/test_unsloth_gpu.py -k "never_recompiles${UAKL_LINES_K:+ or ($UAKL_LINES_K)}" > "$OUT/gpu-tests-$stack.log" 2>&1
          echo "$stack: pytest exit status $?; $(grep -E "passed|failed|error" "$OUT/gpu-tests-$stack.log" | tail -1)"
        ) &
        pids+=($!)
      done
      for pid in "${pids[@]}"; do wait "$pid"; done
      python scripts/gpu/lines_table.py "$OUT" $LINES | tee "$OUT/unsloth-lines.md" ;;
    liger)
      timeout 150 python bench/bench_liger.py 2>&1 | tee "$OUT/bench-liger.log" | tail -25 ;;
    unsloth-bench)  # issue 22 item 4: every Unsloth method, a GPU-bound batch, the whole call's time. The run of
      # 2026-11-25 (40 rounds, all rows) stopped at its 40-round cap in 360 s with +-1.2-2.6 % intervals (stock's
      # step varied 6 % over rounds, the per-round ratio 8-10 %). Now up to 200 rounds, and no beta -> 0 row (not a
      # method; bench-1b has it): 82 rounds fit in the second run (docs/benchmarks.md perf4).
      timeout 560 python bench/bench_unsloth.py --modes lora --batch 16 --budget 520 --rounds 200 \
        --rows stock,none,clip,soft_clip,sigmoid,length_normalized,dynamic,target,dynamic+length_normalized \
        --out "$OUT/bench-unsloth.md" > "$OUT/bench-unsloth.log" 2>&1
      echo "bench_unsloth exit status $?"; cat "$OUT/bench-unsloth.md" 2>/dev/null || tail -30 "$OUT/bench-unsloth.log" ;;
    kl-diagnostics)  # issue 36 (one GPU, <= 580 s): what the tail metrics, kl_monitor and kl_exclude_token_ids cost.
      # The tail metrics are on in every patched row, so none vs stock is the package's whole cost with them (aim
      # <= 1.005x); kl_monitor (beta=0) vs stock, beta=0 is the monitor's cost (the report's note pairs them).
      timeout $((${MONITOR_BUDGET:-270} + 20)) python bench/bench_trl.py --modes lora,full --batch 16 --rounds 200 --budget ${MONITOR_BUDGET:-270} \
        --rows stock,none,stock_beta0,monitor,exclude --out "$OUT/bench-trl-kl-diagnostics.md" > "$OUT/bench-trl-kl-diagnostics.log" 2>&1
      echo "bench_trl exit status $?"; cat "$OUT/bench-trl-kl-diagnostics.md" 2>/dev/null || tail -30 "$OUT/bench-trl-kl-diagnostics.log"
      timeout $((${MONITOR_BUDGET:-270} + 10)) python bench/bench_unsloth.py --modes lora --batch 16 --rounds 200 --budget $((${MONITOR_BUDGET:-270} - 10)) \
        --rows stock,none,stock_beta0,monitor,exclude --out "$OUT/bench-unsloth-kl-diagnostics.md" > "$OUT/bench-unsloth-kl-diagnostics.log" 2>&1
      echo "bench_unsloth exit status $?"; cat "$OUT/bench-unsloth-kl-diagnostics.md" 2>/dev/null || tail -30 "$OUT/bench-unsloth-kl-diagnostics.log" ;;
    monitor-sampled)  # issue 53 item 2 (one GPU, <= 580 s): the sampled kl_monitor (default kl_monitor_every) against stock
      # at beta = 0, beside the full monitor; a timed call of the sampled row is a cycle of kl_monitor_every steps (timed per
      # step), so few rows: aim <= 1.05x paired, the 95 % interval's upper end <= 1.08 (the report's note pairs them).
      timeout $((${MONITOR_BUDGET:-270} + 20)) python bench/bench_trl.py --modes lora,full --batch 16 --rounds 200 --budget ${MONITOR_BUDGET:-270} \
        --rows stock_beta0,monitor,monitor_sampled --out "$OUT/bench-trl-monitor-sampled.md" > "$OUT/bench-trl-monitor-sampled.log" 2>&1
      echo "bench_trl exit status $?"; cat "$OUT/bench-trl-monitor-sampled.md" 2>/dev/null || tail -30 "$OUT/bench-trl-monitor-sampled.log"
      timeout $((${MONITOR_BUDGET:-270} + 10)) python bench/bench_unsloth.py --modes lora --batch 16 --rounds 200 --budget $((${MONITOR_BUDGET:-270} - 10)) \
        --rows stock_beta0,monitor,monitor_sampled --out "$OUT/bench-unsloth-monitor-sampled.md" > "$OUT/bench-unsloth-monitor-sampled.log" 2>&1
      echo "bench_unsloth exit status $?"; cat "$OUT/bench-unsloth-monitor-sampled.md" 2>/dev/null || tail -30 "$OUT/bench-unsloth-monitor-sampled.log" ;;
    liger-conformance)  # Liger's own GRPO test file, stock vs the drop-in, 8 shards each; then loss_class= vs TRL
      timeout 200 python scripts/gpu/liger_loss_class_check.py --steps 4 > "$OUT/liger-loss-class.log" 2>&1 &
      bash scripts/liger_conformance.sh --shards 8 --timeout 500 --out /tmp/liger-conformance 2>&1 | tee "$OUT/liger-conformance.log"
      tar czf "$OUT/liger-conformance.tgz" -C /tmp liger-conformance
      wait; grep -vE "Loading|it/s|^\{|Warning|warn" "$OUT/liger-loss-class.log" | tail -14 ;;
    demo-check)
      timeout 170 python research/study_cli.py --steps 4 --methods none,dynamic --output-dir "$OUT/demo-check" 2>&1 | tee "$OUT/demo-check.log" | tail -30 ;;
    user-demo-tiny)
      # the user's default demo alone (tiny model, none,dynamic,target x 12 steps), each line stamped with the time:
      # under Unsloth its first GPU run after the loader mend trained 9 steps of 'none' in 200 s (2026-11-30); this
      # stage's first run finished in 214 s (docs/gpu-verification.md, Demo)
      timeout 560 python blackwell/test_adaptive_kl_grpo.py --output-dir "$OUT/user-demo-tiny" 2>&1 \
        | while IFS= read -r line; do printf '%(%s)T %s\n' -1 "$line"; done | tee "$OUT/user-demo-tiny.log" | grep -v max_new_tokens | tail -40 ;;
    user-demo)
      # 250 s: the tiny part took 214 s under Unsloth (stage user-demo-tiny, 2026-11-30); the SmolLM2 part's first
      # run fit, with the failed tiny part and the site's unpacking, in a 335 s call (2026-11-29)
      timeout 250 python blackwell/test_adaptive_kl_grpo.py --steps 12 --output-dir "$OUT/user-demo-tiny" 2>&1 | tee "$OUT/user-demo-tiny.log" | tail -20
      timeout 320 python blackwell/test_adaptive_kl_grpo.py --model smollm2 --methods none,target --steps 12 \
        --output-dir "$OUT/user-demo-smollm2" 2>&1 | tee "$OUT/user-demo-smollm2.log" | tail -20 ;;
    demo-beta03)
      timeout 420 python research/study_cli.py --seeds 3 --beta 0.3 --steps 150 --methods none,length_normalized,dynamic,clip --jobs 12 --output-dir "$OUT/demo-beta03" 2>&1 | tee "$OUT/demo-beta03.log" | grep -v "^\[" | tail -25 ;;
    perf2)  # issue 22 (one GPU, <= 540 s): Liger GPU tests (realistic loop subset, fused head vs kernel in bf16), the
      # realistic loop for every loss type x method x head, the fused head's chunk schedules, loss_class= vs TRL end to end
      timeout 200 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_liger_gpu.py 2>&1 | tee "$OUT/gpu-liger-tests.log" \
        | grep -E "passed|failed|Error|FAIL|relative error|^\|" | tail -50
      timeout 160 python bench/bench_liger.py --recompile-loop --loop-calls 6 --loop-workers 12 > "$OUT/recompile-loop.log" 2> /tmp/recompile-loop.err
      echo "recompile loop exit status $?"; grep -v ": graphs per call" "$OUT/recompile-loop.log" | tail -30
      timeout 130 python bench/bench_liger.py --methods none,target --fused-chunks auto,4096 --fused-blocks 4096 2>&1 | tee "$OUT/bench-liger-fused.log" | grep -v "^measured" | tail -22
      timeout 110 python bench/bench_loss_class.py --budget 90 --out "$OUT/bench-loss-class.md" > /tmp/bench-loss-class.log 2>&1
      echo "bench_loss_class exit status $?"; cat "$OUT/bench-loss-class.md" 2>/dev/null || tail -30 /tmp/bench-loss-class.log ;;
    perf3)  # issue 22's rest (one GPU, <= 560 s): what bounds the fused head (its parts alone, interleaved with the
      # whole; a kernel profile), Unsloth length_normalized against stock with only the rows it needs (more rounds),
      # then the bf16 fused-vs-kernel cases that perf2's time limit cut (the combined method, every loss type)
      timeout 120 python bench/bench_fused_head_parts.py 2>&1 | tee "$OUT/bench-fused-head-parts.log" | grep -v Warning | tail -45
      timeout 270 python bench/bench_unsloth.py --modes lora --batch 16 --rows stock,none,length_normalized --rounds 200 \
        --budget 240 --out "$OUT/bench-unsloth-ln.md" > "$OUT/bench-unsloth-ln.log" 2>&1
      echo "bench_unsloth exit status $?"; cat "$OUT/bench-unsloth-ln.md" 2>/dev/null || tail -30 "$OUT/bench-unsloth-ln.log"
      timeout 150 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_liger_gpu.py -k "fused_head_matches and target" 2>&1 \
        | tee "$OUT/gpu-liger-fused-cases.log" | grep -E "passed|failed|Error|FAIL|relative error" | tail -30 ;;
    bench-1b)
      timeout 130 python bench/bench_liger.py --methods none,target --fused-chunks auto,1024 2>&1 | tee "$OUT/bench-liger-fused.log" | grep -v "^measured" | tail -22
      timeout 200 python bench/bench_trl.py --modes lora,full --budget 165 --out "$OUT/bench-trl.md" > /tmp/bench-trl.log 2>&1
      echo "bench_trl exit status $?"; cat "$OUT/bench-trl.md" 2>/dev/null || tail -30 /tmp/bench-trl.log
      timeout 200 python bench/bench_unsloth.py --modes lora --budget 165 --out "$OUT/bench-unsloth.md" > /tmp/bench-unsloth.log 2>&1
      echo "bench_unsloth exit status $?"; cat "$OUT/bench-unsloth.md" 2>/dev/null || tail -30 /tmp/bench-unsloth.log
      cp "$OUT"/bench-*.md.json /tmp/ 2>/dev/null; rm -f "$OUT"/bench-*.md.json
      tar czf "$OUT/bench-1b-raw.tar.gz" -C /tmp bench-trl.log bench-unsloth.log $(cd /tmp && ls bench-*.md.json 2>/dev/null) ;;
    bench-focused)  # issue 54: bench-1b's TRL and Unsloth LoRA benches with 4 rows only (stock, none, clip, target), so that
      # the budget buys rounds (bench-1b's 17 rows got 3-6 rounds each on 2026-11-29); <= ~360 s
      timeout 190 python bench/bench_trl.py --modes lora --rows stock,none,clip,target --budget 150 --out "$OUT/bench-trl-focused.md" > "$OUT/bench-trl-focused.log" 2>&1
      echo "bench_trl exit status $?"; cat "$OUT/bench-trl-focused.md" 2>/dev/null || tail -30 "$OUT/bench-trl-focused.log"
      timeout 160 python bench/bench_unsloth.py --modes lora --rows stock,none,clip,target --budget 110 --out "$OUT/bench-unsloth-focused.md" > "$OUT/bench-unsloth-focused.log" 2>&1
      echo "bench_unsloth exit status $?"; cat "$OUT/bench-unsloth-focused.md" 2>/dev/null || tail -30 "$OUT/bench-unsloth-focused.log" ;;
    multi-gpu|multi-gpu:*)
      names=${stage#multi-gpu}; multi_gpu "${names#:}" ;;
    evidence:*)
      evidence "${stage#evidence:}" ;;
    evidence-pair:*)  # evidence-pair:A,B: two evidence lists at once, A on GPU 0 and B on GPU 1 (a 2-GPU machine).
      # A call returns at most 8 files, and two evidence stages write 12: the streams go to $OUT as they grow (all a
      # timeout leaves), A-grid.md and B-grid.md follow, the rest is packed into evidence-pair.tar.gz.
      pair evidence grid "${stage#evidence-pair:}" "tail -25" ;;
    study33:*)  # issue 33's study (docs/evidence/study33-long-task.md, Amendments 5-6): evidence:NAME with Unsloth's GRPO sequence
      # packing off and a 560 s limit (one invocation a list line: one warm start, its runs at once), then the study's
      # own analysis of the stream (--analyze --study) into NAME-study.md
      name=${stage#study33:}
      UNSLOTH_GRPO_SEQ_PACKING=0 EVIDENCE_TIMEOUT=560 evidence "$name"
      python research/study_cli.py --analyze "${EVIDENCE_STREAM_DIR:-$OUT}/$name-stream.jsonl" --study \
        > "$OUT/$name-study.md" 2>&1
      echo "study analysis exit status $?"; head -40 "$OUT/$name-study.md" ;;
    study33-pair:*)  # study33-pair:A,B (a 2-GPU machine): study33:A on GPU 0 and study33:B on GPU 1 at once; writes
      # A-stream.jsonl and B-stream.jsonl (as they grow), A-study.md, B-study.md and study33-pair.tar.gz (the rest)
      pair study33 study "${stage#study33-pair:}" "head -20" ;;
    study51:*)  # issue 51's study on SmolLM2 (docs/evidence/study51-real-model.md): its model joined on this machine first
      [ -n "${UAKL_SMOLLM2_GGUF:-}" ] || { echo "study51: no SmolLM2 on this machine: run smollm2-head, then smollm2-join, first"; exit 1; }
      UNSLOTH_GRPO_SEQ_PACKING=0 EVIDENCE_TIMEOUT=560 evidence "${stage#study51:}" ;;
    study51-pair:*)  # study51-pair:A,B (a 2-GPU machine): study51:A on GPU 0 and study51:B on GPU 1 at once
      pair study51 analysis "${stage#study51-pair:}" "tail -20" ;;
    study33-probe)
      timeout 570 python research/gpu/study33_probe.py --out "$OUT" 2>&1 | tail -60 ;;
    study33-probe:*)
      timeout 570 python research/gpu/study33_probe.py --out "$OUT" --warm-start-lr "${stage#study33-probe:}" 2>&1 | tail -60 ;;
    study33-genspeed)
      timeout 585 python research/gpu/study33_genspeed.py --out "$OUT" 2>&1 | tail -40 ;;
    study33-genspeed-nopack)  # Amendment 5: the same, Unsloth's GRPO sequence packing (and its re-verification) off
      timeout 585 python research/gpu/study33_genspeed.py --out "$OUT" --phases g1,g8,g16 --env UNSLOTH_GRPO_SEQ_PACKING=0 2>&1 | tail -40 ;;
    study33-profile)
      timeout 585 python research/gpu/study33_profile.py --out "$OUT" 2>&1 | tail -20 ;;
    study33-warmscan:*)
      timeout 470 python research/gpu/study33_warmscan.py --out "$OUT" --lrs "${stage#study33-warmscan:}" 2>&1 | tail -40 ;;
    demo-3seeds)
      timeout 570 python research/study_cli.py --seeds 3 --jobs 21 --output-dir "$OUT/demo-3seeds" 2>&1 | tee "$OUT/demo-3seeds.log" | tail -40 ;;
  esac
done
