"""Adaptive-KL GRPO on one starting model, one method after another: does fixed-β GRPO drift to
longer completions once the reward saturates, and what does each adaptive method change?

Offline by default: it builds a character-level tokenizer and a small Llama for a synthetic
task (sums written with a free-length scratchpad, then ">" and the answer; format reward plus
correctness reward, 0.5 each), warm-starts the model with a short supervised phase, and trains a
LoRA adapter on it with GRPO under every method, from the same checkpoint. Runs go to
subprocesses, several at a time (--jobs): a tiny model leaves the GPU mostly idle.

    python blackwell/test_adaptive_kl_grpo.py                   # all methods, one seed
    python blackwell/test_adaptive_kl_grpo.py --seeds 3         # mean ± std across seeds
    python blackwell/test_adaptive_kl_grpo.py --smoke           # CPU, tiny, every method, ~1 min
    python blackwell/test_adaptive_kl_grpo.py --task medium --loss-type grpo --beta 0.04 --steps 300 --seeds 3
    python blackwell/test_adaptive_kl_grpo.py --analyze out/metrics.jsonl   # length slopes, paired intervals

Under --output-dir: metrics.jsonl (one line per run and step), summary.md (the header and the
table), curves.png (reward, completion length, KL, β against step), runs/*/log.txt.

Backend: Unsloth's GRPO trainer when unsloth is installed and CUDA is available, TRL's
otherwise (--backend overrides). On a GPU it first checks that the torch build supports the
card (Blackwell: sm_100 / sm_120 need a build for CUDA >= 12.8) and that bf16 works.
See docs/demo.md.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace

ALL_METHODS = ["none", "clip", "length_normalized", "dynamic", "sigmoid", "target", "dynamic+length_normalized"]
BLACKWELL = {10: "datacenter Blackwell (B200, B300, GB200)", 12: "Blackwell (RTX 50, RTX PRO 6000, DGX Spark)"}
BLACKWELL_FIX = (
    "Install a PyTorch build for CUDA >= 12.8, e.g. `pip install torch --index-url "
    "https://download.pytorch.org/whl/cu128` (or a newer cu12x/cu13x index), or, as Unsloth's Blackwell guide "
    "recommends, `uv pip install unsloth --torch-backend=auto`. Then check: python -c \"import torch; "
    'print(torch.cuda.get_arch_list())"'
)
HUB_HELP = (
    "This machine may have no access to the Hugging Face hub: run without --model/--dataset for the offline "
    "task, or download the model/data set elsewhere and pass its local path."
)


# -- settings ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    """Everything a run depends on, the same for every method."""

    steps: int = 120
    beta: float = 0.1
    learning_rate: float = 2e-3
    prompts_per_step: int = 8
    num_generations: int = 8
    max_completion_length: int = 48  # the longest warm-start completion is 14 tokens
    temperature: float = 1.0
    loss_type: str = "dapo"  # TRL's default: token-sum, where length_normalized changes the loss
    lora_rank: int = 32
    hidden_size: int = 128
    layers: int = 4
    warm_start_steps: int = 800  # batch 64; seconds on a GPU. 400 left the reward at ~0.7 in a CPU trial
    summary_window: float = 0.1  # "start" and "end" values are means over this fraction of the steps
    task: str = "easy"  # the offline task's difficulty: a key of TASKS


# The offline task's variants: how many terms a sum has and how large they are. "easy" is the
# original (the reward saturates near 0.9 within ~20 steps); "medium" and "hard" keep accuracy below 1
# for longer (the longest warm-start completion: ~23 and ~30 tokens). On the GPU, the 800-step warm
# start taught neither "hard" nor "easy" to a 256x4 model (accuracy ~0.03 and ~0.14: docs/evidence.md).
TASKS = {
    "easy": dict(min_terms=2, max_terms=3, max_operand=9),
    "medium": dict(min_terms=3, max_terms=4, max_operand=9),
    "hard": dict(min_terms=3, max_terms=4, max_operand=19),
}

SMOKE = dict(steps=4, prompts_per_step=2, num_generations=4, max_completion_length=24, hidden_size=32, layers=2,
             warm_start_steps=30, lora_rank=8)
HUB = dict(learning_rate=5e-6, prompts_per_step=2, num_generations=8, max_completion_length=256, warm_start_steps=0)


def method_fields(settings: Settings) -> dict:
    """The adaptive-KL fields given to every run; each method reads only the ones it uses.

    Package defaults, except two that are tied to this run's length: the reward window (10 of
    120 steps is most of the run) and the target controller's horizon, set so that it can move β
    by up to 2% a step (with the default 10 000 completions it could barely move in the run)."""
    completions_per_step = settings.prompts_per_step * settings.num_generations
    return dict(
        kl_estimator="k3",
        kl_clip_threshold=1.0,
        kl_target=0.1,
        reward_threshold=0.8,
        reward_window=5,
        dynamic_beta_decay=0.9,
        beta_min=0.0,
        beta_schedule_steps=1_000_000,
        kl_horizon=10.0 * completions_per_step,
    )


# -- the GPU check ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuCheck:
    ok: bool
    blackwell: bool
    report: str  # one line for the run's header
    fix: str | None = None


def check_gpu(name: str | None, capability: tuple[int, int] | None, arch_list: list[str], bf16_error: str | None) -> GpuCheck:
    """Judge whether this torch build can train on this GPU. Pure: the caller measures.

    ``capability`` is ``torch.cuda.get_device_capability()`` (None without a GPU), ``arch_list``
    ``torch.cuda.get_arch_list()``, ``bf16_error`` the error of a small bf16 matmul (None if it
    worked). A kernel built for sm_XY runs on sm_XZ with Z >= Y (same major), so sm_120 in the
    build covers a 12.1 card."""
    if capability is None:
        return GpuCheck(True, False, "no CUDA GPU: running on the CPU, not on Blackwell")
    major, minor = capability
    sm = f"sm_{major}{minor}"
    family = BLACKWELL.get(major)
    where = f"{name} ({sm}, {family or 'not Blackwell'})"
    covered = any(arch == f"sm_{major}{m}" for m in range(minor + 1) for arch in arch_list)
    if not covered:
        return GpuCheck(
            False, family is not None,
            f"{where}: this torch build has no kernels for {sm} (it has {', '.join(arch_list) or 'none'})",
            BLACKWELL_FIX if family else "Install a PyTorch build whose CUDA version supports this GPU.",
        )
    if bf16_error is not None:
        return GpuCheck(False, family is not None, f"{where}: a bf16 matmul failed: {bf16_error}",
                        BLACKWELL_FIX if family else "Install a PyTorch build with CUDA bf16 support for this GPU.")
    verdict = "Blackwell check passed" if family else "runs, but this is not a Blackwell GPU"
    return GpuCheck(True, family is not None, f"{where}: {sm} in torch's arch list, bf16 matmul OK; {verdict}")


def probe_gpu() -> GpuCheck:
    """Measure this machine and judge it with :func:`check_gpu`."""
    import torch

    if not torch.cuda.is_available():
        return check_gpu(None, None, [], None)
    bf16_error = None
    try:
        a = torch.randn(64, 64, device="cuda")
        exact = a @ a
        err = ((a.bfloat16() @ a.bfloat16()).float() - exact).abs().max().item()
        if not err < 1.0:  # bf16 keeps ~3 significant digits; entries of a @ a are ~8
            bf16_error = f"bf16 result off by {err}"
    except Exception as e:  # "no kernel image is available" on a build without this arch
        bf16_error = f"{type(e).__name__}: {e}".splitlines()[0]
    return check_gpu(torch.cuda.get_device_name(), torch.cuda.get_device_capability(), torch.cuda.get_arch_list(), bf16_error)


def choose_backend(requested: str, *, unsloth_installed: bool, cuda: bool) -> str:
    """``auto``: Unsloth when it is installed and CUDA is available, TRL otherwise."""
    if requested == "unsloth" and not unsloth_installed:
        raise SystemExit("--backend unsloth: unsloth is not installed (pip install -e '.[unsloth]').")
    if requested == "auto":
        return "unsloth" if unsloth_installed and cuda else "trl"
    return requested


# -- one training run (in its own process) ----------------------------------------------------------
def import_trainer(backend: str, cuda: bool):
    """GRPOConfig and GRPOTrainer of the backend, with this package's patch applied."""
    if backend == "unsloth":
        import unsloth  # noqa: F401  (first: it rebinds TRL's GRPO classes to its generated trainer)

        if not cuda:  # Unsloth patches no RL trainer without a GPU; this private entry point does
            from unsloth.models.rl import _patch_trl_rl_trainers

            _patch_trl_rl_trainers("grpo_trainer")
    import unsloth_adaptive_kl  # noqa: F401
    from trl import GRPOConfig, GRPOTrainer

    return GRPOConfig, GRPOTrainer


def load_policy(spec: dict, cuda: bool):
    """(model, tokenizer, peft_config) for the trainer: Unsloth's FastLanguageModel with its LoRA on a
    GPU; otherwise the checkpoint's path and a peft LoraConfig, which TRL applies."""
    settings = Settings(**spec["settings"])
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    if spec["backend"] == "unsloth" and cuda:
        from unsloth import FastLanguageModel

        model, tokenizer = FastLanguageModel.from_pretrained(
            model_name=spec["model"], max_seq_length=spec["max_seq_length"], load_in_4bit=False, dtype=None
        )
        model = FastLanguageModel.get_peft_model(
            model, r=settings.lora_rank, lora_alpha=settings.lora_rank, target_modules=modules,
            use_gradient_checkpointing=False, random_state=spec["seed"],
        )
        return model, tokenizer, None
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"])
    if spec["backend"] == "unsloth":  # what FastLanguageModel adds; on CPU only, for tests of the plumbing
        model.for_training = model.for_inference = lambda *a, **k: None
    return model, tokenizer, LoraConfig(r=settings.lora_rank, lora_alpha=settings.lora_rank, target_modules=modules,
                                        task_type="CAUSAL_LM")


def task(spec: dict):
    """(train data set, reward functions) of the run's task."""
    from unsloth_adaptive_kl import toy

    if spec["dataset"] is None:
        from datasets import Dataset

        rows = toy.sum_problems(4096, seed=spec["seed"], **TASKS[spec["settings"]["task"]])
        data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
        return data, [toy.scratchpad_format_reward, toy.scratchpad_correctness_reward]
    return hub_dataset(spec["dataset"]), [hub_format_reward, hub_correctness_reward]


def step_logger(metrics_path: str, spec: dict):
    """A callback writing one JSON line per logged step (with its wall time) and a progress line."""
    from transformers import TrainerCallback

    class StepLogger(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds = time.perf_counter() - self.started

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "reward" not in logs:  # the end-of-training summary
                return
            row = {"tag": spec["tag"], "method": spec["method"], "seed": spec["seed"], "step": state.global_step,
                   "step_time": self.seconds}
            row.update({k: v for k, v in logs.items() if isinstance(v, (int, float)) or v is None})
            line = json.dumps(row) + "\n"
            for path in filter(None, [metrics_path, spec.get("stream")]):
                with open(path, "a") as f:  # one short append per line: concurrent runs may share the stream
                    f.write(line)
            print(f"step {state.global_step}: reward {row['reward']:.3f} length {row['completions/mean_length']:.1f} "
                  f"beta {row['adaptive_kl/current_beta']:.4g} ({self.seconds:.2f} s)", flush=True)

    return StepLogger()


def train_one(spec_path: str) -> None:
    """Train one (method, seed) and append its per-step metrics to the run's metrics file."""
    with open(spec_path) as f:
        spec = json.load(f)
    import torch

    cuda = torch.cuda.is_available()
    GRPOConfig, GRPOTrainer = import_trainer(spec["backend"], cuda)
    settings = Settings(**spec["settings"])
    model, tokenizer, peft_config = load_policy(spec, cuda)
    dataset, rewards = task(spec)
    config = GRPOConfig(
        output_dir=spec["run_dir"], seed=spec["seed"], use_cpu=not cuda, bf16=cuda, report_to="none",
        save_strategy="no", disable_tqdm=True, logging_steps=1, max_steps=settings.steps,
        per_device_train_batch_size=settings.prompts_per_step * settings.num_generations,
        num_generations=settings.num_generations, max_completion_length=settings.max_completion_length,
        temperature=settings.temperature, learning_rate=settings.learning_rate, lr_scheduler_type="constant",
        warmup_steps=0, loss_type=settings.loss_type, beta=settings.beta, kl_adaptation_method=spec["method"],
        **method_fields(settings),
    )
    trainer = GRPOTrainer(model=model, reward_funcs=rewards, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config)
    trainer.add_callback(step_logger(spec["metrics_path"], spec))
    print(f"{spec['method']} seed {spec['seed']}: {type(trainer).__module__}.{type(trainer).__name__}", flush=True)
    trainer.train()


# -- the Hugging Face hub path (not reachable offline; small on purpose) -----------------------------
HUB_PROMPT = "{question}\nThink step by step, then give the final answer on its own line as: #### <number>\n"


def hub_dataset(name: str):
    """A GSM8K-shaped data set (``question``, ``answer`` ending in ``#### N``) as prompts and answers.
    ``name`` may carry a config: ``openai/gsm8k:main``."""
    from datasets import load_dataset

    path, _, config = name.partition(":")
    try:
        data = load_dataset(path, config or None, split="train")
    except Exception as e:
        raise SystemExit(f"Could not load the data set {name!r}: {type(e).__name__}: {e}\n{HUB_HELP}") from e
    if not {"question", "answer"} <= set(data.column_names):
        raise SystemExit(f"{name!r} has columns {data.column_names}; the demo needs GSM8K's 'question' and 'answer'.")
    return data.map(lambda r: {"prompt": HUB_PROMPT.format(question=r["question"]),
                               "answer": r["answer"].split("####")[-1].strip().replace(",", "")},
                    remove_columns=data.column_names)


def _final_number(completion: str) -> str | None:
    tail = completion.rsplit("####", 1)
    if len(tail) != 2:
        return None
    words = tail[1].strip().replace(",", "").split()
    return words[0].rstrip(".") if words else None


def hub_format_reward(completions, **kwargs) -> list[float]:
    """0.5 when the completion ends its reasoning with ``#### <answer>``."""
    return [0.5 if _final_number(c) is not None else 0.0 for c in completions]


def hub_correctness_reward(completions, answer, **kwargs) -> list[float]:
    """0.5 when the number after the last ``####`` equals the reference answer."""
    return [0.5 if _final_number(c) == a else 0.0 for c, a in zip(completions, answer)]


def fetch_hub_model(name: str) -> str:
    """Download (or find in the cache) a hub model before the runs start; fail clearly if offline."""
    if os.path.isdir(name):
        return name
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name)
    except Exception as e:
        raise SystemExit(f"Could not get the model {name!r}: {type(e).__name__}: {e}\n{HUB_HELP}") from e


# -- the starting model ------------------------------------------------------------------------------
def starting_model(args, settings: Settings, seed: int, device: str) -> str:
    """The checkpoint every method of this seed starts from."""
    from unsloth_adaptive_kl import toy

    if args.model:
        return fetch_hub_model(args.model)
    path = os.path.join(args.output_dir, "checkpoints", f"seed{seed}")
    started = time.perf_counter()
    if settings.task == "easy":  # the original task: toy's own builder, unchanged
        built = toy.build_scratchpad_checkpoint(path, seed=seed, hidden_size=settings.hidden_size, layers=settings.layers,
                                                warm_start_steps=settings.warm_start_steps, device=device)
    else:
        built = build_task_checkpoint(path, settings, seed, device)
    print(f"seed {seed}: tiny Llama ({settings.hidden_size}x{settings.layers}) warm-started for "
          f"{settings.warm_start_steps} steps on the {settings.task} task, final loss {built['warm_start_loss']:.3f} "
          f"({time.perf_counter() - started:.0f} s)", flush=True)
    return path


def build_task_checkpoint(path: str, settings: Settings, seed: int, device: str) -> dict:
    """As ``toy.build_scratchpad_checkpoint``, for any task of TASKS: the three solution styles in
    equal parts, batch 64, ``settings.warm_start_steps`` steps."""
    import random

    import torch

    from unsloth_adaptive_kl import toy

    tokenizer = toy.build_scratchpad_tokenizer()
    model = toy.build_model(tokenizer, hidden_size=settings.hidden_size, layers=settings.layers, seed=seed).to(device)
    rng = random.Random(seed + 1)
    rows = toy.sum_problems(settings.warm_start_steps * 64, seed=seed + 1, **TASKS[settings.task])
    texts = [r["prompt"] + toy.worked_solution(r["terms"], rng.randrange(3)) + tokenizer.eos_token for r in rows]
    loss = toy.supervised_warm_start(model, tokenizer, texts, batch_size=64) if settings.warm_start_steps else math.nan
    model.to("cpu").save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    return {"path": path, "warm_start_loss": loss}


# -- running every (method, seed) ------------------------------------------------------------------
@dataclass
class Run:
    method: str
    seed: int
    spec_path: str
    log_path: str
    metrics_path: str
    process: subprocess.Popen | None = None
    started: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.method}/seed{self.seed}"


def make_runs(args, settings: Settings, backend: str, checkpoints: dict[int, str]) -> list[Run]:
    runs = []
    for seed, model in checkpoints.items():
        for method in args.methods:
            run_dir = os.path.join(args.output_dir, "runs", f"{method}-seed{seed}")
            os.makedirs(run_dir, exist_ok=True)
            run = Run(method, seed, os.path.join(run_dir, "spec.json"), os.path.join(run_dir, "log.txt"),
                      os.path.join(run_dir, "metrics.jsonl"))
            spec = dict(method=method, seed=seed, backend=backend, model=model, dataset=args.dataset,
                        settings=asdict(settings), run_dir=run_dir, metrics_path=run.metrics_path,
                        max_seq_length=512 if args.model else 128, tag=args.tag or default_tag(settings),
                        stream=os.path.abspath(args.stream) if args.stream else None)
            with open(run.spec_path, "w") as f:
                json.dump(spec, f, indent=1)
            if os.path.exists(run.metrics_path):
                os.remove(run.metrics_path)
            runs.append(run)
    return runs


def child_env(threads: int, run_dir: str, cuda: bool) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               TORCHINDUCTOR_COMPILE_THREADS="1", UNSLOTH_COMPILE_LOCATION=os.path.join(run_dir, "unsloth_compiled_cache"))
    if not cuda:
        env["TRITON_INTERPRET"] = "1"  # TRL's Triton log-prob kernel, interpreted on the CPU
    return env


def last_step(run: Run) -> dict | None:
    if not os.path.exists(run.metrics_path):
        return None
    with open(run.metrics_path) as f:
        lines = f.read().splitlines()
    return json.loads(lines[-1]) if lines else None


def start(run: Run, threads: int, cuda: bool) -> None:
    log = open(run.log_path, "w")
    run.process = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", run.spec_path],
                                   stdout=log, stderr=subprocess.STDOUT,
                                   env=child_env(threads, os.path.dirname(run.log_path), cuda))
    run.started = time.perf_counter()
    print(f"  started {run.name}", flush=True)


def fail(run: Run) -> None:
    with open(run.log_path) as f:
        tail = f.read().splitlines()[-30:]
    raise SystemExit(f"{run.name} failed (exit {run.process.returncode}); last lines of {run.log_path}:\n  "
                     + "\n  ".join(tail))


def default_jobs(num_runs: int, cuda: bool) -> int:
    """On a GPU, every run at once up to 24 (each keeps one core and a sliver of the GPU busy, so
    3 seeds x 7 methods run in one wave); on the CPU, one run per core."""
    return min(num_runs, 24 if cuda else os.cpu_count() or 1)


def run_all(runs: list[Run], jobs: int, steps: int, cuda: bool, poll_seconds: float, keep_going: bool = False) -> list[Run]:
    """Run at most ``jobs`` runs at a time, printing each run's progress as it advances. A failed run
    stops them all, or with ``keep_going`` is reported and left out; returns the runs that finished."""
    threads = max(1, (os.cpu_count() or 1) // jobs)
    waiting, active, shown, failed = list(runs), [], {}, []
    t0 = time.perf_counter()
    while waiting or active:
        while waiting and len(active) < jobs:
            run = waiting.pop(0)
            start(run, threads, cuda)
            active.append(run)
        time.sleep(poll_seconds)
        for run in list(active):
            row = last_step(run)
            if row and shown.get(run.name) != row["step"]:
                shown[run.name] = row["step"]
                print(f"[{time.perf_counter() - t0:6.0f} s] {run.name:<36} step {row['step']:>4}/{steps} "
                      f"reward {row['reward']:.3f}  length {row['completions/mean_length']:5.1f}  "
                      f"beta {row['adaptive_kl/current_beta']:.4g}", flush=True)
            if run.process.poll() is not None:
                active.remove(run)
                if run.process.returncode != 0:
                    if keep_going:
                        print(f"  FAILED {run.name} (exit {run.process.returncode}): see {run.log_path}", flush=True)
                        failed.append(run)
                        continue
                    for other in active:
                        other.process.terminate()
                    fail(run)
                print(f"  finished {run.name} in {time.perf_counter() - run.started:.0f} s", flush=True)
    return [run for run in runs if run not in failed]


# -- summary ------------------------------------------------------------------------------------------
COLUMNS = [  # (header, key in a run's summary, format)
    ("final reward", "final_reward", ".3f"),
    ("peak reward", "peak_reward", ".3f"),
    ("length start", "length_start", ".1f"),
    ("length end", "length_end", ".1f"),
    ("raw KL end", "raw_kl_end", ".4f"),
    ("adapted KL end", "adapted_kl_end", ".4f"),
    ("final β", "final_beta", ".4g"),
    ("median step (s)", "median_step_s", ".2f"),
]


def _mean(values) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def summarize_run(rows: list[dict], window: float) -> dict:
    """One run's numbers: "start"/"end"/"final" are means over the first/last ``window`` of steps
    (at least one step); "peak" is the highest single step. A KL is NaN where β had reached 0."""
    k = max(1, round(len(rows) * window))
    head, tail = rows[:k], rows[-k:]
    return {
        "final_reward": _mean(r["reward"] for r in tail),
        "peak_reward": max(r["reward"] for r in rows),
        "length_start": _mean(r["completions/mean_length"] for r in head),
        "length_end": _mean(r["completions/mean_length"] for r in tail),
        "raw_kl_end": _mean(r.get("adaptive_kl/raw_kl") for r in tail),
        "adapted_kl_end": _mean(r.get("adaptive_kl/adapted_kl") for r in tail),
        "final_beta": rows[-1]["adaptive_kl/current_beta"],
        "median_step_s": statistics.median(r["step_time"] for r in rows),
    }


def read_metrics(runs: list[Run]) -> dict[tuple[str, int], list[dict]]:
    metrics = {}
    for run in runs:
        with open(run.metrics_path) as f:
            metrics[(run.method, run.seed)] = [json.loads(line) for line in f]
    return metrics


def cell(values: list[float], fmt: str) -> str:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "—"
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} ± {format(statistics.stdev(values), fmt)}"


def markdown_table(metrics: dict, methods: list[str], seeds: list[int], window: float) -> str:
    lines = ["| method | " + " | ".join(h for h, _, _ in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for method in methods:
        per_seed = [summarize_run(metrics[(method, seed)], window) for seed in seeds]
        cells = [cell([s[key] for s in per_seed], fmt) for _, key, fmt in COLUMNS]
        lines.append(f"| `{method}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table_notes(seeds: list[int], steps: int, window: float) -> str:
    k = max(1, round(steps * window))
    spread = f"mean ± std over {len(seeds)} seeds ({', '.join(map(str, seeds))})" if len(seeds) > 1 else f"seed {seeds[0]}"
    return (f"{spread}. start / end / final: mean over the first / last {k} of {steps} steps; peak: the best "
            "step. Length in tokens (TRL's completions/mean_length). KL: adaptive_kl/raw_kl and adapted_kl "
            "(— once β reached 0: no KL is computed). Step time: median wall time of an optimizer step, "
            "generation included.")


# -- drift analysis: length slope per run, intervals over seeds, paired differences --------------------
LENGTH = "completions/mean_length"
CORRECT = "rewards/scratchpad_correctness_reward/mean"  # 0.5 per right answer
# Two-sided 95 % quantiles of Student's t, by degrees of freedom (standard table values).
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def ols_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys on xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def second_half_slope(rows: list[dict], key: str = LENGTH, per: float = 100.0) -> float:
    """Slope of ``key`` against step over the second half of a run (steps > last step / 2), in units
    per ``per`` steps."""
    last = max(r["step"] for r in rows)
    half = [(r["step"], r[key]) for r in rows if r["step"] > last / 2 and r.get(key) is not None]
    return per * ols_slope([x for x, _ in half], [y for _, y in half])


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the two-sided 95 % Student-t interval of the mean; (v, nan, nan) for one value."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan, math.nan
    sd = statistics.stdev(values)
    half = (T975[n - 2] if n - 1 <= len(T975) else 1.96) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def paired_differences(values: dict[tuple[str, int], float], method: str, baseline: str = "none") -> list[float]:
    """``values[(method, seed)] - values[(baseline, seed)]`` for every seed both have, by seed."""
    seeds = sorted(s for m, s in values if m == method and (baseline, s) in values)
    return [values[(method, s)] - values[(baseline, s)] for s in seeds]


def fmt_interval(values: list[float], fmt: str = ".2f") -> str:
    mean, low, high = t_interval(values)
    if math.isnan(low):
        return format(mean, fmt)
    excludes = " *" if low > 0 or high < 0 else ""
    return f"{format(mean, fmt)} [{format(low, fmt)}, {format(high, fmt)}]{excludes}"


def read_rows(paths: list[str]) -> dict[str, dict[tuple[str, int], list[dict]]]:
    """{tag: {(method, seed): rows sorted by step}} from metrics files (.jsonl, or .jsonl.gz); a step seen
    twice counts once."""
    by_run: dict[tuple[str, str, int], dict[int, dict]] = {}
    for path in paths:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    by_run.setdefault((row.get("tag", "default"), row["method"], row["seed"]), {})[row["step"]] = row
    out: dict[str, dict[tuple[str, int], list[dict]]] = {}
    for (tag, method, seed), steps in sorted(by_run.items()):
        out.setdefault(tag, {})[(method, seed)] = [steps[k] for k in sorted(steps)]
    return out


def run_numbers(rows: list[dict], window: float = 0.1) -> dict:
    """One run's numbers for the drift tables (summarize_run's, plus the length slope and accuracy)."""
    k = max(1, round(len(rows) * window))
    numbers = summarize_run(rows, window)
    numbers["steps"] = rows[-1]["step"]
    numbers["length_slope"] = second_half_slope(rows)
    numbers["accuracy_start"] = 2 * _mean(r.get(CORRECT) for r in rows[:k])
    numbers["accuracy_end"] = 2 * _mean(r.get(CORRECT) for r in rows[-k:])
    return numbers


def analyze(paths: list[str], baseline: str = "none") -> str:
    """Markdown: per setting (tag), the baseline's length slope over the second half with its 95 % t
    interval over seeds; per setting with several methods, each method's numbers and its paired
    difference from the baseline by seed. ``*``: the interval excludes 0."""
    data = read_rows(paths)
    out = ["| setting | seeds | steps | accuracy start → end | length start → end | length slope / 100 steps, "
           "2nd half: mean [95% CI] | per seed |", "|---|---|---|---|---|---|---|"]
    for tag, runs in data.items():
        base = {s: run_numbers(rows) for (m, s), rows in runs.items() if m == baseline}
        if not base:
            continue
        v = list(base.values())
        out.append(f"| {tag} | {len(v)} | {min(x['steps'] for x in v)} | "
                   f"{_mean(x['accuracy_start'] for x in v):.2f} → {_mean(x['accuracy_end'] for x in v):.2f} | "
                   f"{_mean(x['length_start'] for x in v):.1f} → {_mean(x['length_end'] for x in v):.1f} | "
                   f"{fmt_interval([x['length_slope'] for x in v])} | "
                   f"{', '.join(format(base[s]['length_slope'], '.2f') for s in sorted(base))} |")
    for tag, runs in data.items():
        methods = list(dict.fromkeys(m for m, _ in runs))
        if len(methods) < 2 or baseline not in methods:
            continue
        methods = [baseline] + [m for m in methods if m != baseline]
        numbers = {key: run_numbers(rows) for key, rows in runs.items()}
        out += ["", f"**{tag}**: mean ± std over seeds; Δ: paired difference from `{baseline}` by seed, mean "
                    "[95% t interval] (* excludes 0)", "",
                "| method | seeds | length end | length slope | accuracy end | reward end | raw KL end | adapted KL end "
                "| final β | Δ length end | Δ length slope | Δ reward end |", "|---" * 12 + "|"]
        for method in methods:
            mine = [numbers[(method, s)] for (m, s) in runs if m == method]
            col = lambda key, fmt: cell([x[key] for x in mine], fmt)  # noqa: E731
            diff = lambda key: (fmt_interval(paired_differences({k: x[key] for k, x in numbers.items()}, method, baseline))  # noqa: E731
                                if method != baseline else "—")
            out.append(f"| `{method}` | {len(mine)} | {col('length_end', '.2f')} | {col('length_slope', '.2f')} | "
                       f"{col('accuracy_end', '.3f')} | {col('final_reward', '.3f')} | {col('raw_kl_end', '.4f')} | "
                       f"{col('adapted_kl_end', '.4f')} | {col('final_beta', '.3g')} | {diff('length_end')} | "
                       f"{diff('length_slope')} | {diff('final_reward')} |")
    return "\n".join(out)


# -- the plot -----------------------------------------------------------------------------------------
PANELS = [("reward", "reward"), ("completions/mean_length", "completion length (tokens)"),
          ("adaptive_kl/raw_kl", "KL: raw (solid), adapted (dashed)"), ("adaptive_kl/current_beta", "β")]


def seed_mean_curve(metrics: dict, method: str, seeds: list[int], key: str, smooth: int, std: bool = False):
    """Per step, the mean over seeds of ``key``, then a trailing moving average over ``smooth`` steps;
    with ``std``, also the smoothed sample standard deviation over seeds (0 with one seed)."""
    by_step: dict[int, list[float]] = {}
    for seed in seeds:
        for row in metrics[(method, seed)]:
            value = row.get(key)
            if value is not None and not math.isnan(value):
                by_step.setdefault(row["step"], []).append(value)
    steps = sorted(by_step)
    means = [sum(by_step[s]) / len(by_step[s]) for s in steps]
    def smoothe(values):
        return [sum(values[max(0, i - smooth + 1): i + 1]) / len(values[max(0, i - smooth + 1): i + 1])
                for i in range(len(values))]

    if not std:
        return steps, smoothe(means)
    stds = [statistics.stdev(by_step[s]) if len(by_step[s]) > 1 else 0.0 for s in steps]
    return steps, smoothe(means), smoothe(stds)


def plot(metrics: dict, methods: list[str], seeds: list[int], steps: int, path: str, title: str) -> str:
    """Write the 2x2 figure; return a line saying where it went (or why it did not)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ("PNG skipped: matplotlib is not installed. `pip install matplotlib` (or the project's dev extra, "
                "pip install -e '.[dev]') and run again; metrics.jsonl and summary.md are complete without it.")
    smooth = max(1, steps // 20)
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), sharex=True)
    colors = plt.get_cmap("tab10")
    for (key, label), ax in zip(PANELS, axes.flat):
        for i, method in enumerate(methods):
            xs, ys, sd = seed_mean_curve(metrics, method, seeds, key, smooth, std=True)
            ax.plot(xs, ys, color=colors(i), label=method)
            if len(seeds) > 1:  # ± one standard deviation over seeds
                ax.fill_between(xs, [y - d for y, d in zip(ys, sd)], [y + d for y, d in zip(ys, sd)],
                                color=colors(i), alpha=0.12, linewidth=0)
            if key == "adaptive_kl/raw_kl":
                xs, ys = seed_mean_curve(metrics, method, seeds, "adaptive_kl/adapted_kl", smooth)
                ax.plot(xs, ys, color=colors(i), linestyle="--")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{title}\n(mean over {len(seeds)} seed(s){', band: ± 1 std over seeds' if len(seeds) > 1 else ''}, "
                 f"moving average over {smooth} step(s))", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


def plot_analysis(paths: list[str], path: str, baseline: str = "none") -> str:
    """The figure for metrics files: every method of the one setting they hold, or, with several
    settings, the baseline of each (a line per setting)."""
    data = read_rows(paths)
    if len(data) == 1:
        (tag, runs), = data.items()
        methods = list(dict.fromkeys(m for m, _ in runs))
        title = f"setting {tag}"
    else:
        runs = {(tag, s): rows for tag, by_run in data.items() for (m, s), rows in by_run.items() if m == baseline}
        methods = list(data)
        title = f"the fixed-β baseline (`{baseline}`) in each setting"
    seeds = sorted({s for _, s in runs})
    for method in methods:  # seeds a setting lacks are left out of its mean
        for seed in seeds:
            runs.setdefault((method, seed), [])
    steps = max(r["step"] for rows in runs.values() for r in rows)
    return plot(runs, methods, seeds, steps, path, title)


# -- main ------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=",".join(ALL_METHODS), help="comma-separated kl_adaptation_method values")
    p.add_argument("--steps", type=int, help=f"GRPO steps per run (default {Settings.steps}; smoke {SMOKE['steps']})")
    p.add_argument("--beta", type=float, help=f"initial β, the same for every method (default {Settings.beta})")
    p.add_argument("--learning-rate", type=float, help=f"default {Settings.learning_rate} (hub model: {HUB['learning_rate']})")
    p.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1 (from --first-seed): each its own starting "
                                                         "model, shared by every method")
    p.add_argument("--first-seed", type=int, default=0, help="the first seed (default 0): --first-seed 3 --seeds 2 "
                                                             "runs seeds 3 and 4")
    p.add_argument("--task", choices=sorted(TASKS), help=f"the offline task's difficulty (default {Settings.task}): "
                   + "; ".join(f"{k}: {v['min_terms']}-{v['max_terms']} terms of 0-{v['max_operand']}" for k, v in TASKS.items()))
    p.add_argument("--loss-type", help=f"TRL's loss_type (default {Settings.loss_type}), e.g. grpo, dapo, dr_grpo, bnpo")
    p.add_argument("--hidden-size", type=int, help=f"tiny Llama's hidden size (default {Settings.hidden_size})")
    p.add_argument("--layers", type=int, help=f"tiny Llama's layers (default {Settings.layers})")
    p.add_argument("--max-completion-length", type=int, help=f"default {Settings.max_completion_length}")
    p.add_argument("--warm-start-steps", type=int, help=f"supervised steps of batch 64 (default {Settings.warm_start_steps})")
    p.add_argument("--tag", help="a name for this setting in the metrics (default: built from task, loss, β, model, "
                                 "length and steps)")
    p.add_argument("--stream", help="also append every run's per-step JSON lines to this file as they come "
                                    "(several invocations may share it)")
    p.add_argument("--keep-going", action="store_true", help="a failed run is reported and left out instead of "
                                                             "stopping the others")
    p.add_argument("--analyze", nargs="+", metavar="JSONL", help="only analyse finished metrics files (metrics.jsonl "
                   "or --stream files): the length-slope table per setting and, where a setting has several methods, "
                   "the paired comparison with `none`; prints markdown")
    p.add_argument("--plot", metavar="PNG", help="with --analyze: also draw the curves (every method of one setting, "
                                                 "or the baseline of each setting) into this file")
    p.add_argument("--backend", choices=["auto", "unsloth", "trl"], default="auto")
    p.add_argument("--jobs", type=int, help="runs at a time (default: all of them, at most 24 on a GPU and one "
                                            "per core on the CPU)")
    p.add_argument("--output-dir", default="adaptive_kl_demo")
    p.add_argument("--model", help="a Hugging Face model name or local path instead of the offline tiny Llama "
                                   "(e.g. unsloth/Qwen3-0.6B-Base); no warm start")
    p.add_argument("--dataset", help="a GSM8K-shaped Hugging Face data set, NAME[:CONFIG] (e.g. openai/gsm8k:main); "
                                     "needs --model")
    p.add_argument("--smoke", action="store_true", help="CPU, a tiny model, a few steps: checks the plumbing, "
                                                        "says nothing about the methods")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: train one run from its spec file
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.dataset and not args.model:
        p.error("--dataset needs --model: the offline tiny Llama only knows the synthetic task's characters")
    if args.smoke and (args.model or args.dataset):
        p.error("--smoke builds its own tiny model; it does not take --model or --dataset")
    return args


def default_tag(settings: Settings) -> str:
    return (f"{settings.task}-{settings.loss_type}-b{settings.beta:g}-h{settings.hidden_size}x{settings.layers}"
            f"-L{settings.max_completion_length}-s{settings.steps}")


def seed_list(args) -> list[int]:
    return list(range(args.first_seed, args.first_seed + args.seeds))


def settings_from(args) -> Settings:
    settings = Settings()
    if args.smoke:
        settings = replace(settings, **SMOKE)
    if args.model:
        settings = replace(settings, **HUB)
    overrides = {"steps": args.steps, "beta": args.beta, "learning_rate": args.learning_rate, "task": args.task,
                 "loss_type": args.loss_type, "hidden_size": args.hidden_size, "layers": args.layers,
                 "max_completion_length": args.max_completion_length, "warm_start_steps": args.warm_start_steps}
    return replace(settings, **{k: v for k, v in overrides.items() if v is not None})


def validate_methods(methods: list[str]) -> None:
    from unsloth_adaptive_kl.shaping import parse_method

    for method in methods:
        try:
            parse_method(method)
        except ValueError as e:
            raise SystemExit(f"--methods: {e}") from e


def header(args, settings: Settings, backend: str, gpu: GpuCheck) -> str:
    import torch
    import transformers
    import trl

    task = (f"model {args.model}, data set {args.dataset or 'synthetic sums (scratchpad)'}" if args.model else
            f"offline: synthetic sums with a free-length scratchpad, tiny Llama {settings.hidden_size}x{settings.layers} "
            f"warm-started {settings.warm_start_steps} steps, LoRA r={settings.lora_rank}")
    return "\n".join([
        f"command: python {' '.join(shlex.quote(a) for a in sys.argv)}",
        f"machine: {platform.node()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, trl {trl.__version__}",
        f"GPU: {gpu.report}",
        f"backend: {backend} ({'Unsloth generated GRPOTrainer' if backend == 'unsloth' else 'TRL GRPOTrainer'})",
        f"task: {task}",
        f"settings: {json.dumps(asdict(settings))}",
        f"method fields (every run): {json.dumps(method_fields(settings))}",
        f"methods: {', '.join(args.methods)}; seeds: {seed_list(args)}; tag: {args.tag or default_tag(settings)}",
    ])


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        return train_one(args.worker)
    if args.analyze:
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
    gpu = probe_gpu()
    if not gpu.ok:
        raise SystemExit(f"GPU check failed: {gpu.report}\nFix: {gpu.fix}")
    backend = choose_backend(args.backend, unsloth_installed=importlib.util.find_spec("unsloth") is not None, cuda=cuda)
    os.makedirs(args.output_dir, exist_ok=True)
    head = header(args, settings, backend, gpu)
    print(head, flush=True)

    t0 = time.perf_counter()
    seeds = seed_list(args)
    checkpoints = {seed: starting_model(args, settings, seed, "cuda" if cuda else "cpu") for seed in seeds}
    runs = make_runs(args, settings, backend, checkpoints)
    jobs = args.jobs or default_jobs(len(runs), cuda)
    print(f"{len(runs)} runs, {jobs} at a time, {settings.steps} steps each", flush=True)
    runs = run_all(runs, jobs, settings.steps, cuda, poll_seconds=2.0 if args.smoke else 10.0, keep_going=args.keep_going)
    finished = {(r.method, r.seed) for r in runs}  # with --keep-going: the table keeps methods done on every seed
    args.methods = [m for m in args.methods if all((m, s) in finished for s in seeds)]
    runs = [r for r in runs if r.method in args.methods]

    metrics = read_metrics(runs)
    with open(os.path.join(args.output_dir, "metrics.jsonl"), "w") as f:
        for rows in metrics.values():
            f.writelines(json.dumps(r) + "\n" for r in rows)
    table = markdown_table(metrics, args.methods, seeds, settings.summary_window)
    notes = table_notes(seeds, settings.steps, settings.summary_window)
    elapsed = f"wall time: {time.perf_counter() - t0:.0f} s"
    with open(os.path.join(args.output_dir, "summary.md"), "w") as f:
        f.write(f"```\n{head}\n{elapsed}\n```\n\n{table}\n\n{notes}\n")
    title = (f"adaptive-KL GRPO, backend {backend}, β0={settings.beta}, loss {settings.loss_type}, task {settings.task}, "
             f"Llama {settings.hidden_size}x{settings.layers}")
    plotted = plot(metrics, args.methods, seeds, settings.steps, os.path.join(args.output_dir, "curves.png"), title)
    print(f"\n{table}\n\n{notes}\n\n{elapsed}\n{plotted}\nwritten: {args.output_dir}/metrics.jsonl, "
          f"{args.output_dir}/summary.md", flush=True)


if __name__ == "__main__":
    main()
