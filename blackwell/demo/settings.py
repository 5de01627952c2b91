"""What a demo run depends on: the settings every method shares, the offline task's variants, the
adaptive-KL fields, the methods, and how the command line fills them in."""

from __future__ import annotations

from dataclasses import dataclass, replace

from unsloth_adaptive_kl.shaping import method_names

#: Every registered method alone (none, the shaping methods, the β controllers), and one composition.
ALL_METHODS = [*method_names(), "dynamic+length_normalized"]


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
    # AdamW's learning rate in the warm start. 3e-3 suits the 128-wide model; at hidden 256 it left the
    # loss at 1.47 after 300 steps of the hard task in a CPU trial, against 0.93 with 1e-3 (docs/evidence.md).
    warm_start_lr: float = 3e-3
    summary_window: float = 0.1  # "start" and "end" values are means over this fraction of the steps
    task: str = "easy"  # the offline task's difficulty: a key of TASKS
    kl_target: float = 0.1  # the target controller's KL target (method `target`; `sigmoid` centres on it too)


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
        kl_target=settings.kl_target,
        reward_threshold=0.8,
        reward_window=5,
        dynamic_beta_decay=0.9,
        beta_min=0.0,
        beta_schedule_steps=1_000_000,
        kl_horizon=10.0 * completions_per_step,
    )


def default_tag(settings: Settings) -> str:
    return (f"{settings.task}-{settings.loss_type}-b{settings.beta:g}-h{settings.hidden_size}x{settings.layers}"
            f"-L{settings.max_completion_length}-s{settings.steps}"
            + (f"-wlr{settings.warm_start_lr:g}" if settings.warm_start_lr != Settings.warm_start_lr else "")
            + (f"-kt{settings.kl_target:g}" if settings.kl_target != Settings.kl_target else ""))


def beta_settings(args, settings: Settings) -> list[tuple[Settings, str]]:
    """(settings, tag) for each initial β of the invocation: ``--betas`` gives several, each its own
    setting tag (the default tag, or ``--tag`` followed by ``-bβ``); otherwise the one of ``--beta``."""
    if not args.betas:
        return [(settings, args.tag or default_tag(settings))]
    out = []
    for beta in args.betas:
        one = replace(settings, beta=beta)
        out.append((one, f"{args.tag}-b{beta:g}" if args.tag else default_tag(one)))
    return out


def parse_betas(text: str) -> list[float]:
    """``--betas``: comma-separated positive floats, no repeats."""
    try:
        betas = [float(b) for b in text.split(",") if b.strip()]
    except ValueError as e:
        raise ValueError(f"--betas={text!r}: {e}; allowed: comma-separated numbers, e.g. 0.01,0.1,1") from e
    if not betas or any(not b > 0 for b in betas) or len(set(betas)) != len(betas):
        raise ValueError(f"--betas={text!r}: allowed: distinct numbers > 0, e.g. 0.01,0.1,1")
    return betas


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
                 "max_completion_length": args.max_completion_length, "warm_start_steps": args.warm_start_steps,
                 "warm_start_lr": args.warm_start_lr, "kl_target": args.kl_target}
    return replace(settings, **{k: v for k, v in overrides.items() if v is not None})


def validate_methods(methods: list[str]) -> None:
    from unsloth_adaptive_kl.shaping import parse_method

    for method in methods:
        try:
            parse_method(method)
        except ValueError as e:
            raise SystemExit(f"--methods: {e}") from e
