"""What a demo run depends on: the settings every method shares, the offline task's variants, the
adaptive-KL fields, the methods, and how the command line fills them in."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import NamedTuple

import toy  # examples/toy.py: harness/__init__.py puts examples/ on sys.path
from unsloth_adaptive_kl import smollm2
from unsloth_adaptive_kl.method import method_names

#: Every registered method alone (none, the shaping methods, the β controllers), and one composition.
ALL_METHODS = [*method_names(), "dynamic+length_normalized"]


@dataclass(frozen=True)
class Settings:
    """Everything a run depends on, the same for every method."""

    steps: int = 120
    beta: float = 0.1
    learning_rate: float = 2e-3
    prompts_per_step: int = 8  # per optimizer step, all processes together
    num_generations: int = 8
    # Micro-batches per optimizer step. Passed to every backend's config: Unsloth's defaults to 2, TRL's
    # to 1, and the number of completions a step trains (StepBatch) is what kl_horizon is sized from.
    gradient_accumulation_steps: int = 1
    optim: str = "adamw_torch"  # TRL's default, passed to every backend (Unsloth's config defaults to adamw_8bit)
    weight_decay: float = 0.0  # TRL's default, passed to every backend (Unsloth's: 0.001)
    # TRL's defaults, passed to every backend: Unsloth's config sets mask_truncated_completions=True and
    # epsilon_high=0.28 when loss_type="dapo" is passed and these are not.
    mask_truncated_completions: bool = False
    epsilon_high: float = 0.2
    max_completion_length: int = 48  # the longest warm-start completion is 14 tokens
    temperature: float = 1.0
    loss_type: str = "dapo"  # TRL's default: token-sum, where length_normalized changes the loss
    lora_rank: int = 32
    hidden_size: int = 128
    layers: int = 4
    heads: int = 4
    warm_start_steps: int = 800  # batch 64; seconds on a GPU. 400 left the reward at ~0.7 in a CPU trial
    # AdamW's learning rate in the warm start. 3e-3 suits the 128-wide model; at hidden 256 it left the
    # loss at 1.47 after 300 steps of the hard task in a CPU trial, against 0.93 with 1e-3 (docs/evidence/study11-drift.md).
    warm_start_lr: float = 3e-3
    summary_window: float = 0.1  # "start" and "end" values are means over this fraction of the steps
    task: str = "easy"  # the offline task's difficulty: a key of TASKS
    kl_target: float = 0.1  # the target controller's KL target (method `target`; `sigmoid` centres on it too)
    # kl_horizon in optimizer steps: kl_horizon = kl_horizon_steps x the completions a step trains, so that
    # target moves β by at most 0.2 / kl_horizon_steps a step (2 %) whatever the batch.
    kl_horizon_steps: float = 10.0
    # Where β·KL acts (the package's kl_placement: "loss", TRL's place, or "reward") and the per-token estimator
    # (kl_estimator, a name the package's estimator registry knows); per run with --runs METHOD@BETA:placement=...
    kl_placement: str = "loss"
    kl_estimator: str = "k3"
    # The learning rate's schedule (TRL's lr_scheduler_type, no warm-up): "constant", every study's before issue 51, or
    # "linear" / "cosine" from learning_rate down to 0 at the run's last step; per run with --runs ...:sched=NAME
    # (and :lr=FLOAT for the rate).
    lr_schedule: str = "constant"
    # The package's kl_monitor (every step: kl_monitor_every 1): at β = 0 the KL is still computed and logged, the loss
    # left as β = 0's; per run with --runs none@0:monitor=on.
    kl_monitor: bool = False
    # β-controller parameters set per run (--runs ...:NAME=VALUE, NAME a registered controller parameter), over
    # method_fields' values: ((name, value), ...) sorted by name.
    controller_params: tuple = ()
    # The model trained: "tiny-llama" (the offline tiny Llama, warm-started here), "smollm2" (SmolLM2-135M-Instruct,
    # pretrained: --model smollm2, SMOLLM2 below) or a hub name or path (--model NAME).
    model: str = "tiny-llama"
    # SmolLM2's chat addition task (smollm2.addition_problems): operands in [addition_low, addition_high], the
    # prompt's style. None where the run trains another task; the --model smollm2 values are SMOLLM2's.
    addition_low: int | None = None
    addition_high: int | None = None
    addition_style: str | None = None

    def __post_init__(self):
        # a run's spec holds its settings as JSON: its controller parameters come back as lists
        object.__setattr__(self, "controller_params", tuple(tuple(pair) for pair in self.controller_params))

    def check(self) -> None:
        """ValueError naming the field when the batch cannot be split as asked, or the addition task is malformed."""
        if self.num_generations < 2:
            raise ValueError(f"num_generations={self.num_generations}: allowed >= 2 (GRPO's advantage compares the "
                             "completions of a prompt)")
        completions = self.prompts_per_step * self.num_generations
        if self.gradient_accumulation_steps < 1 or completions % self.gradient_accumulation_steps:
            raise ValueError(f"gradient_accumulation_steps={self.gradient_accumulation_steps}: it must be >= 1 and divide "
                             f"prompts_per_step x num_generations = {completions}, the completions of an optimizer step")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule={self.lr_schedule!r}: allowed one of {list(LR_SCHEDULES)}")
        if not self.kl_horizon_steps > 0.2:
            raise ValueError(f"kl_horizon_steps={self.kl_horizon_steps}: allowed > 0.2 (target's factor 1 - 0.2 / "
                             "kl_horizon_steps must stay positive)")
        if self.model == SMOLLM2_MODEL:
            if not 0 <= self.addition_low <= self.addition_high < 10**SMOLLM2_MAX_DIGITS:
                raise ValueError(f"addition_low={self.addition_low}, addition_high={self.addition_high}: allowed "
                                 f"0 <= addition_low <= addition_high < 10**{SMOLLM2_MAX_DIGITS} (the operands' range; "
                                 f"a prompt has {SMOLLM2_PROMPT_TOKENS} positions)")
            if self.addition_style not in smollm2.STYLES:
                raise ValueError(f"addition_style={self.addition_style!r}: allowed one of {list(smollm2.STYLES)}")

    @property
    def per_device_train_batch_size(self) -> int:
        """Completions per micro-batch (one process): an optimizer step's, split over the accumulation steps."""
        return self.prompts_per_step * self.num_generations // self.gradient_accumulation_steps

    @property
    def max_seq_length(self) -> int:
        """Positions a sequence may take: the longest prompt of the task (its digits, '+' and '='), then the
        completion; at least 128, what the tasks before "long" always had. SmolLM2: SMOLLM2_PROMPT_TOKENS, then
        the completion."""
        if self.model == SMOLLM2_MODEL:
            return SMOLLM2_PROMPT_TOKENS + self.max_completion_length
        task = TASKS[self.task]
        longest_prompt = task["max_terms"] * (len(str(task["max_operand"])) + 1)
        return max(128, longest_prompt + self.max_completion_length)


# The offline task's variants: how many terms a sum has and how large they are. "easy" is the
# original (the reward saturates near 0.9 within ~20 steps); "medium" and "hard" keep accuracy below 1
# for longer (the longest warm-start completion: ~23 and ~30 tokens). On the GPU, the 800-step warm
# start taught neither "hard" nor "easy" to a 256x4 model (accuracy ~0.03 and ~0.14: docs/evidence/study11-drift.md).
TASKS = {
    "easy": dict(min_terms=2, max_terms=3, max_operand=9),
    "medium": dict(min_terms=3, max_terms=4, max_operand=9),
    "hard": dict(min_terms=3, max_terms=4, max_operand=19),
    # Issue 33: completions of ~100+ tokens. Column additions of 4-5 terms of up to 8 digits; the warm start
    # writes toy.column_solution's styles (answer only, column sums, every column written out) in parts
    # 0.2, 0.2, 0.6, a median of 116 tokens (the full style 110-132).
    "long": dict(min_terms=4, max_terms=5, max_operand=99_999_999),
}

# How a task's warm-start completions are written: (solution function, weight of each style). The tasks
# not named here mix toy.worked_solution's three styles in equal parts.
SOLUTIONS = {"long": (toy.column_solution, (0.2, 0.2, 0.6))}
DEFAULT_SOLUTION = (toy.worked_solution, (1.0, 1.0, 1.0))

#: The learning-rate schedules a run may take (TRL's lr_scheduler_type names).
LR_SCHEDULES = ("constant", "linear", "cosine")

# The settings a task brings with it where the command line does not say otherwise (--task long): a
# Llama of 35.4 M parameters (768 x 6, 12 heads; a token step of decoding costs per layer, so few wide
# layers), completions up to 192 tokens (room above the longest warm-start completion, 132).
TASK_DEFAULTS = {
    "long": dict(hidden_size=768, layers=6, heads=12, max_completion_length=192, warm_start_steps=2000,
                 warm_start_lr=1e-3, learning_rate=1e-3, steps=200),
}

SMOKE = dict(steps=4, prompts_per_step=2, num_generations=4, max_completion_length=24, hidden_size=32, layers=2, heads=4,
             warm_start_steps=30, lora_rank=8)
HUB = dict(learning_rate=5e-6, prompts_per_step=2, num_generations=8, max_completion_length=256, warm_start_steps=0)

# --model smollm2: SmolLM2-135M-Instruct (unsloth_adaptive_kl.smollm2), pretrained, so no warm start, on the chat
# addition task with its one reward (smollm2.correct_answer_reward). Every default of this model lives here. The
# task: "explain", operands 1-9, the one docs/real-model.md's probe chose (step-0 accuracy 0.162, median length
# 59 tokens, 8 % of completions past 256). The batch and optimiser of that page's timed GPU runs: 8 prompts x 8
# completions of at most 256 tokens, learning rate 2e-5, LoRA r 16 on every projection (alpha = r, as the demo's
# other models); β and the rest are the demo's. The tiny Llama's own fields (size, warm start) are None: nothing
# builds or warm-starts a model.
SMOLLM2_MODEL = "smollm2"
SMOLLM2 = dict(model=SMOLLM2_MODEL, task="addition", addition_low=1, addition_high=9, addition_style="explain",
               learning_rate=2e-5, prompts_per_step=8, num_generations=8, max_completion_length=256, lora_rank=16,
               hidden_size=None, layers=None, heads=None, warm_start_steps=0, warm_start_lr=None)
# Positions a SmolLM2 prompt may take: the chat template's default system turn and the question, 55 tokens in the
# explain style for one-digit operands and 2 more per digit (SmolLM2 writes a digit a token; 63 at 5 digits);
# 128 leaves room for operands of up to SMOLLM2_MAX_DIGITS digits (research/tests/test_harness_smollm2.py measures it).
SMOLLM2_PROMPT_TOKENS = 128
SMOLLM2_MAX_DIGITS = 12


def method_fields(settings: Settings, *, completions_per_step: int) -> dict:
    """The adaptive-KL fields given to every run; each method reads only the ones it uses.

    ``completions_per_step``: what an optimizer step of the run's trainer trains (all processes), read
    from the backend's config (:class:`~harness.batch.StepBatch`), never from the settings alone.
    Package defaults, except two that are tied to this run's length: the reward window (10 of
    120 steps is most of the run) and the target controller's horizon, ``kl_horizon_steps`` steps of
    completions, so that it can move β by up to 0.2 / kl_horizon_steps a step (2 % by default; with the
    package's 10 000 completions it could barely move in the run). A run's own controller parameters
    (``settings.controller_params``, from ``--runs ...:NAME=VALUE``) replace these."""
    return dict(
        kl_estimator=settings.kl_estimator,
        kl_placement=settings.kl_placement,
        kl_clip_threshold=1.0,
        kl_target=settings.kl_target,
        reward_threshold=0.8,
        reward_window=5,
        dynamic_beta_decay=0.9,
        beta_min=0.0,
        beta_schedule_steps=1_000_000,
        kl_horizon=settings.kl_horizon_steps * completions_per_step,
    ) | dict(settings.controller_params)


def default_tag(settings: Settings) -> str:
    if settings.model == SMOLLM2_MODEL:  # e.g. smollm2-explain1-9-dapo-b0.1-L256-s120
        return (f"smollm2-{settings.addition_style}{settings.addition_low}-{settings.addition_high}-{settings.loss_type}"
                f"-b{settings.beta:g}-L{settings.max_completion_length}-s{settings.steps}"
                + (f"-kt{settings.kl_target:g}" if settings.kl_target != Settings.kl_target else "")
                + placement_suffix(settings))
    return (f"{settings.task}-{settings.loss_type}-b{settings.beta:g}-h{settings.hidden_size}x{settings.layers}"
            f"-L{settings.max_completion_length}-s{settings.steps}"
            + (f"-wlr{settings.warm_start_lr:g}" if settings.warm_start_lr != Settings.warm_start_lr else "")
            + (f"-kt{settings.kl_target:g}" if settings.kl_target != Settings.kl_target else "")
            + placement_suffix(settings))


def option_suffix(one: Settings, base: Settings) -> str:
    """The tag's part for a run's other options (``--runs ...:lr=, :sched=, :monitor=, :NAME=``): ``-lrX`` where its
    learning rate is not the invocation's, ``-schedNAME`` for a schedule other than constant, ``-mon`` with kl_monitor,
    ``-NAMEvalue`` for each controller parameter; empty without them, so the tags of every earlier run are unchanged."""
    return (f"-lr{one.learning_rate:g}" if one.learning_rate != base.learning_rate else "") + run_option_suffix(one)


def run_option_suffix(one: Settings) -> str:
    """The options beyond the learning rate: ``-schedNAME``, ``-mon``, ``-NAMEvalue`` (:func:`option_suffix`)."""
    return ((f"-sched{one.lr_schedule}" if one.lr_schedule != Settings.lr_schedule else "")
            + ("-mon" if one.kl_monitor else "")
            + "".join(f"-{name}{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool)
                      else f"-{name}{value}" for name, value in one.controller_params))


def placement_suffix(settings: Settings) -> str:
    """The tag's part for a KL placement or estimator other than the defaults (loss, k3): ``-plPLACEMENT`` and
    ``-estNAME``; empty for the defaults, so the tags of runs made before these options are unchanged."""
    return ((f"-pl{settings.kl_placement}" if settings.kl_placement != Settings.kl_placement else "")
            + (f"-est{settings.kl_estimator}" if settings.kl_estimator != Settings.kl_estimator else ""))


# What placement_suffix writes, for the analyses that group tags into families (analysis._family).
PLACEMENT_IN_TAG = re.compile(r"-pl[a-z]+(?=-|$)")
ESTIMATOR_IN_TAG = re.compile(r"-est[^-]+(?=-|$)")


def beta_settings(args, settings: Settings) -> list[tuple[Settings, str]]:
    """(settings, tag) for each setting of the invocation: ``--betas`` gives one per initial β, and ``--runs`` one per
    distinct (β, kt, placement, estimator) of its runs in the order given (:func:`run_keys`), each its own setting
    tag (the default tag, or ``--tag`` followed by ``-bβ`` and the run's overrides); otherwise the one of ``--beta``.
    Two runs of one method that come to the same settings (``:kt=`` equal to the invocation's ``kl_target``) raise
    ValueError."""
    if getattr(args, "runs", None):
        out, made = [], {}
        first = {}  # each setting's first run, to name it
        for run in args.runs:
            first.setdefault(run._replace(method=""), run)
        for key in run_keys(args.runs):
            one = run_settings(key, settings)
            if one in made:
                raise ValueError(f"--runs: {first[key].text()} and {made[one].text()} are the same setting (kl_target "
                                 f"{settings.kl_target:g} is the invocation's); allowed: give :kt= only where it differs")
            made[one] = first[key]
            tag = ((f"{args.tag}-b{one.beta:g}" + override_suffix(one, settings)) if args.tag else default_tag(one)) \
                + option_suffix(one, settings)
            out.append((one, tag))
        return _distinct_tags(out)
    if not args.betas:
        return [(settings, args.tag or default_tag(settings))]
    out = []
    for beta in args.betas:
        one = replace(settings, beta=beta)
        out.append((one, f"{args.tag}-b{beta:g}" if args.tag else default_tag(one)))
    return out


def override_suffix(one: Settings, base: Settings) -> str:
    """A --tag'ed setting's part beyond ``-bβ``: ``-ktK`` where its kl_target is not the invocation's, and the
    placement and estimator where they are not the defaults."""
    return (f"-kt{one.kl_target:g}" if one.kl_target != base.kl_target else "") + placement_suffix(one)


def _distinct_tags(settings_list: list[tuple[Settings, str]]) -> list[tuple[Settings, str]]:
    tags = [tag for _, tag in settings_list]
    if len(set(tags)) != len(tags):
        raise ValueError(f"--runs: settings {tags} share a tag (a number written with 6 significant digits); allowed: "
                         "values that differ in their first 6 digits")
    return settings_list


def run_settings(run: "RunSpec", base: Settings) -> Settings:
    """The settings of one ``--runs`` entry: the invocation's, with its initial β and its overrides."""
    return replace(base, beta=run.beta, kl_target=base.kl_target if run.kl_target is None else run.kl_target,
                   kl_placement=run.kl_placement, kl_estimator=run.kl_estimator,
                   learning_rate=base.learning_rate if run.learning_rate is None else run.learning_rate,
                   lr_schedule=run.lr_schedule, kl_monitor=run.kl_monitor, controller_params=run.controller_params)


def run_keys(runs: list["RunSpec"]) -> list["RunSpec"]:
    """The distinct settings of ``--runs``'s entries in the order first given, each as its entry without the method:
    one setting per (β, kt, placement, estimator)."""
    return list(dict.fromkeys(run._replace(method="") for run in runs))


def setting_labels(settings_list: list[tuple[Settings, str]]) -> dict[str, str]:
    """{tag: a short name} per setting, for its runs' directories and progress lines: ``bβ``, then ``-ktK`` where
    the invocation's settings differ in kl_target, the placement and estimator where not the defaults, and
    ``-lrX`` where they differ in learning rate, then the other run options (:func:`option_suffix`). Two settings
    with one label raise ValueError (their runs would share a directory)."""
    several_kt = len({one.kl_target for one, _ in settings_list}) > 1
    several_lr = len({one.learning_rate for one, _ in settings_list}) > 1
    labels = {tag: f"b{one.beta:g}" + (f"-kt{one.kl_target:g}" if several_kt else "") + placement_suffix(one)
              + (f"-lr{one.learning_rate:g}" if several_lr else "") + run_option_suffix(one)
              for one, tag in settings_list}
    if len(set(labels.values())) != len(labels):
        raise ValueError(f"settings {sorted(labels)} share a run label ({sorted(labels.values())}); allowed: settings "
                         "that differ in β, kl_target, placement, estimator, learning rate or another run option")
    return labels


def parse_betas(text: str) -> list[float]:
    """``--betas``: comma-separated positive floats, no repeats."""
    try:
        betas = [float(b) for b in text.split(",") if b.strip()]
    except ValueError as e:
        raise ValueError(f"--betas={text!r}: {e}; allowed: comma-separated numbers, e.g. 0.01,0.1,1") from e
    if not betas or any(not b > 0 for b in betas) or len(set(betas)) != len(betas):
        raise ValueError(f"--betas={text!r}: allowed: distinct numbers > 0, e.g. 0.01,0.1,1")
    return betas


RUNS_HELP = ("comma-separated METHOD@BETA[:kt=FLOAT][:placement=loss|reward][:estimator=NAME][:lr=FLOAT]"
             "[:sched=constant|linear|cosine][:monitor=on][:NAME=VALUE for a β-controller parameter], e.g. "
             "none@0,none@0.04,clip@0.04,target@0.1:kt=0.02,none@0.04:placement=reward:estimator=k1,none@0:monitor=on,"
             "none@0.04:lr=5e-5:sched=cosine,schedule@1:beta_min=0.02:beta_schedule=cosine")


class RunSpec(NamedTuple):
    """One ``--runs`` entry: the method, the initial β, and the per-run overrides (kt: None is the invocation's
    ``--kl-target``; placement and estimator: the defaults unless given)."""

    method: str
    beta: float
    kl_target: float | None = None
    kl_placement: str = Settings.kl_placement
    kl_estimator: str = Settings.kl_estimator
    learning_rate: float | None = None  # None: the invocation's
    lr_schedule: str = Settings.lr_schedule
    kl_monitor: bool = False
    controller_params: tuple = ()  # ((name, value), ...) sorted by name

    def text(self) -> str:
        """As written on the command line, the defaults left out."""
        return (f"{self.method}@{self.beta:g}" + (f":kt={self.kl_target:g}" if self.kl_target is not None else "")
                + (f":placement={self.kl_placement}" if self.kl_placement != Settings.kl_placement else "")
                + (f":estimator={self.kl_estimator}" if self.kl_estimator != Settings.kl_estimator else "")
                + (f":lr={self.learning_rate:g}" if self.learning_rate is not None else "")
                + (f":sched={self.lr_schedule}" if self.lr_schedule != Settings.lr_schedule else "")
                + (":monitor=on" if self.kl_monitor else "")
                + "".join(f":{name}={value}" for name, value in self.controller_params))


MONITOR_ON = ("on", "true", "1")


def _positive_number(where: str, key: str, value: str, what: str) -> float:
    """``value`` as a finite number > 0, or ValueError naming the run, the key, the value and what is allowed."""
    try:
        number = float(value)
    except ValueError:
        number = None
    if number is None or not (number > 0 and number != float("inf")):
        raise ValueError(f"{where}: {key}={value!r}; allowed: a finite number > 0 ({what})")
    return number


def _override(where: str, key: str, value: str):
    """One ``:KEY=VALUE`` of a run, checked: kt a finite number > 0; placement one of the package's kl_placement
    values; estimator a name the package's estimator registry knows (its canonical name: an alias counts as it); lr
    a finite number > 0; sched one of LR_SCHEDULES; monitor on; any other KEY a registered β-controller parameter
    (kl_target is kt), its value read as the parameter's type and checked by its declaration. Returns (the RunSpec
    field, the value); a controller parameter as ("controller_params", (name, value))."""
    from unsloth_adaptive_kl.config import PLACEMENTS
    from unsloth_adaptive_kl.controllers import controller_parameters
    from unsloth_adaptive_kl.declarations import check_parameter
    from unsloth_adaptive_kl.estimators import get_estimator

    if key == "kt":
        return "kl_target", _positive_number(where, key, value, "the run's kl_target")
    if key == "placement":
        if value not in PLACEMENTS:
            raise ValueError(f"{where}: placement={value!r}; allowed: one of {list(PLACEMENTS)} (the package's kl_placement)")
        return "kl_placement", value
    if key == "estimator":
        try:
            return "kl_estimator", get_estimator(value).name
        except ValueError as e:
            raise ValueError(f"{where}: estimator={value!r}: {e}") from e
    if key == "lr":
        return "learning_rate", _positive_number(where, key, value, "the run's learning rate")
    if key == "sched":
        if value not in LR_SCHEDULES:
            raise ValueError(f"{where}: sched={value!r}; allowed: one of {list(LR_SCHEDULES)} (the learning rate's schedule)")
        return "lr_schedule", value
    if key == "monitor":
        if value not in MONITOR_ON:
            raise ValueError(f"{where}: monitor={value!r}; allowed: on (the package's kl_monitor; leave it out for off)")
        return "kl_monitor", True
    declared = {p.name: p for p in controller_parameters() if p.name != "kl_target"}
    if key in declared:
        parameter = declared[key]
        if parameter.type in (int, float):
            try:
                number = float(value)
            except ValueError:
                raise ValueError(f"{where}: {key}={value!r} is not a number; allowed: {parameter.allowed}") from None
            typed = int(number) if parameter.type is int and number.is_integer() else number
        else:
            typed = value
        try:
            return "controller_params", (key, check_parameter(parameter, typed))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
    raise ValueError(f"{where}: unknown key {key!r}; allowed: kt, placement, estimator, lr, sched, monitor, or a β-controller "
                     f"parameter ({', '.join(sorted(declared))})")


def parse_runs(text: str) -> list[RunSpec]:
    """``--runs``: an explicit list of runs, in the order given: METHOD@BETA and optional ``:KEY=VALUE`` overrides
    (kt, placement, estimator, lr, sched, monitor, a β-controller parameter; :func:`_override`). β >= 0; β = 0
    (TRL's default: no reference model, no KL computed or logged; with ``:monitor=on`` the KL is logged) only with
    ``none``, as the package refuses an adaptive method at β = 0; the package's own check of the fields
    (``config.validate``) refuses what it would refuse in the run (e.g. placement=reward at β = 0); no run twice."""
    from types import SimpleNamespace

    from unsloth_adaptive_kl.config import DEFAULTS, validate
    from unsloth_adaptive_kl.method import parse_method

    runs = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        head, *options = item.split(":")
        method, at, beta_text = head.rpartition("@")
        if not at or not method.strip():
            raise ValueError(f"--runs={text!r}: {item!r} is not METHOD@BETA; allowed: {RUNS_HELP}")
        method = method.strip()
        try:
            parse_method(method)
        except ValueError as e:
            raise ValueError(f"--runs={text!r}: {item!r}: {e}") from e
        try:
            beta = float(beta_text)
        except ValueError as e:
            raise ValueError(f"--runs={text!r}: {item!r}: initial β {beta_text!r} is not a number; allowed: a number "
                             ">= 0") from e
        if not (beta >= 0 and beta != float("inf")):
            raise ValueError(f"--runs={text!r}: {item!r}: initial β {beta_text}; allowed: a finite number >= 0")
        if beta == 0 and method != "none":
            raise ValueError(f"--runs={text!r}: {item!r}: initial β 0 with method {method!r}; allowed: β = 0 only with "
                             "'none' (β = 0 removes the KL term an adaptive method acts on)")
        fields, where = {}, f"--runs={text!r}: {item!r}"
        for option in options:
            key, eq, value = (part.strip() for part in option.partition("="))
            if not eq or not key or not value:
                raise ValueError(f"{where}: {option!r} is not KEY=VALUE; allowed: {RUNS_HELP}")
            name, checked = _override(where, key, value)
            if name == "controller_params":
                name, checked = checked
            if name in fields:
                raise ValueError(f"{where}: key {key!r} is given twice; allowed: each key once per run")
            fields[name] = checked
        params = {k: fields.pop(k) for k in list(fields) if k not in RunSpec._fields}
        run = RunSpec(method, beta, **fields, controller_params=tuple(sorted(params.items())))
        try:  # what the run's trainer would refuse at its start, refused here, before the warm start
            validate(SimpleNamespace(**{**DEFAULTS, "kl_adaptation_method": method, "kl_estimator": run.kl_estimator,
                                        "kl_placement": run.kl_placement, "kl_monitor": run.kl_monitor,
                                        "kl_target": run.kl_target or DEFAULTS["kl_target"], **params}, beta=beta))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
        if run in runs:
            raise ValueError(f"--runs={text!r}: {item!r} is given twice; allowed: each run once")
        runs.append(run)
    if not runs:
        raise ValueError(f"--runs={text!r}: no run; allowed: {RUNS_HELP}")
    return runs


def run_pairs(args, settings_list: list[tuple[Settings, str]]) -> list[tuple[Settings, str, str]]:
    """(settings, tag, method) of every run of one seed: ``--runs``'s entries in the order given, each with its
    setting's settings and tag (``settings_list`` as :func:`beta_settings` makes it: one per :func:`run_keys`
    entry, in that order); otherwise every method at every β (``--methods`` x ``--betas``)."""
    if getattr(args, "runs", None):
        keys = run_keys(args.runs)
        if len(keys) != len(settings_list):
            raise ValueError(f"run_pairs: {len(settings_list)} settings for the {len(keys)} settings of --runs; "
                             "allowed: beta_settings(args, ...)'s list")
        by_key = dict(zip(keys, settings_list))
        return [(*by_key[run._replace(method="")], run.method) for run in args.runs]
    return [(one, tag, method) for one, tag in settings_list for method in args.methods]


def seed_list(args) -> list[int]:
    return list(range(args.first_seed, args.first_seed + args.seeds))


def settings_from(args) -> Settings:
    settings = Settings()
    if args.task in TASK_DEFAULTS:
        settings = replace(settings, **TASK_DEFAULTS[args.task])
    if args.smoke:
        settings = replace(settings, **SMOKE)
    if args.model == SMOLLM2_MODEL:
        settings = replace(settings, **SMOLLM2)
    elif args.model:
        settings = replace(settings, **HUB, model=args.model)
    overrides = {"steps": args.steps, "beta": args.beta, "learning_rate": args.learning_rate, "task": args.task,
                 "loss_type": args.loss_type, "hidden_size": args.hidden_size, "layers": args.layers,
                 "max_completion_length": args.max_completion_length, "warm_start_steps": args.warm_start_steps,
                 "warm_start_lr": args.warm_start_lr, "kl_target": args.kl_target,
                 "prompts_per_step": args.prompts_per_step, "gradient_accumulation_steps": args.gradient_accumulation_steps,
                 "kl_horizon_steps": args.kl_horizon_steps, "num_generations": args.num_generations,
                 "addition_low": args.addition_low, "addition_high": args.addition_high,
                 "addition_style": args.addition_style}
    settings = replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    settings.check()
    return settings


def validate_methods(methods: list[str]) -> None:
    from unsloth_adaptive_kl.method import parse_method

    for method in methods:
        try:
            parse_method(method)
        except ValueError as e:
            raise SystemExit(f"--methods: {e}") from e
