"""Shared test material: a hand-made GRPO batch and float64 references written from the
definitions (Schulman's estimators, the shaping formulas, TRL 1.15's per-loss-type aggregation)."""

import math

import torch

from unsloth_adaptive_kl.config import FIELD_NAMES
from unsloth_adaptive_kl.controllers import CONTROLLERS, ControllerConfig, controller_names
from unsloth_adaptive_kl.method import method_names
from unsloth_adaptive_kl.shaping import SHAPING, shaping_names

MAX_COMPLETION = 6

#: Float64 per-token shaping of each built-in method, written from its definition (``c``:
#: kl_clip_threshold, ``t``: kl_target). ``test_shaping`` checks that every built-in has one.
SHAPING64 = {  # not a registry list: references, checked against the registry by test_shaping
    "clip": lambda kl, c, t: torch.minimum(kl, torch.tensor(c, dtype=torch.float64)),
    "soft_clip": lambda kl, c, t: c * torch.tanh(kl / c),
    "sigmoid": lambda kl, c, t: torch.sigmoid(kl - t) * kl,
}
BUILTIN_SHAPING = [name for name in shaping_names() if SHAPING[name].builtin]
PER_TOKEN_SHAPING = [name for name in BUILTIN_SHAPING if SHAPING[name].per_token]
BUILTIN_CONTROLLERS = [name for name in controller_names() if CONTROLLERS[name].builtin]
#: The methods the backend tests train with: every built-in alone, each built-in β controller, one composition.
METHODS = ["none", *BUILTIN_SHAPING, *BUILTIN_CONTROLLERS, f"{BUILTIN_CONTROLLERS[0]}+length_normalized"]
#: Every name ``kl_adaptation_method`` takes alone, and each β controller joined with ``length_normalized``
#: (the one term a backend adds itself, so the one whose gradient-accumulation divisor is the backend's to apply):
#: the methods the gradient-accumulation tests run on every backend.
ACCUMULATION_METHODS = [*method_names(), *(f"{controller}+length_normalized" for controller in controller_names())]


def shaped64(kl, method, clip_threshold, kl_target):
    """Float64 per-token shaping of ``method`` (a ``+``-joined string), in the package's order."""
    parts = method.split("+")
    for name in shaping_names():
        if name in parts and SHAPING[name].per_token:
            kl = SHAPING64[name](kl.double(), clip_threshold, kl_target)
    return kl


def loss_inputs(vocab_size, seed=0, batch=4, prompt=3, completion=MAX_COMPLETION, ref_spread=6.0, ref_offset=0.0, pad_token_id=0):
    """A hand-made batch: variable completion lengths (one all-masked row) padded with
    ``pad_token_id`` (Unsloth rebuilds the mask from it), policy away from the reference and from
    the old policy, so every KL term and ratio is non-trivial."""
    g = torch.Generator().manual_seed(seed)
    completion_mask = torch.ones(batch, completion, dtype=torch.long)
    for i, length in enumerate([completion, 3, 1, 0][:batch]):
        completion_mask[i, length:] = 0
    completion_ids = torch.randint(5, vocab_size, (batch, completion), generator=g)
    return {
        "prompt_ids": torch.randint(5, vocab_size, (batch, prompt), generator=g),
        "prompt_mask": torch.ones(batch, prompt, dtype=torch.long),
        "completion_ids": completion_ids.masked_fill(completion_mask == 0, pad_token_id),
        "completion_mask": completion_mask,
        "advantages": torch.randn(batch, generator=g),
        "old_per_token_logps": -torch.rand(batch, completion, generator=g) * 3 - 2,
        "ref_per_token_logps": -torch.rand(batch, completion, generator=g) * ref_spread - ref_offset,
        "num_items_in_batch": completion_mask.sum().float(),
    }


def aggregate(x, mask, loss_type, *, num_items, max_completion=MAX_COMPLETION, spg=1, ga=1, nproc=1):
    """TRL 1.15's aggregation of a per-token term, written out per loss type (float64)."""
    m = mask.double()
    lengths = m.sum(-1).clamp(min=1)
    if loss_type in ("grpo", "sapo"):
        return ((x * m).sum(-1) / lengths).mean() / ga
    if loss_type == "bnpo":
        return (x * m).sum() / m.sum().clamp(min=1) / ga
    if loss_type == "dr_grpo":
        return (x * m).sum() / (x.shape[0] * max_completion) / ga
    if loss_type in ("dapo", "cispo", "vespo"):
        return (x * m).sum() / (num_items / nproc * ga / spg)
    if loss_type == "luspo":
        return (x * m).sum(-1).mean() / ga
    raise AssertionError(loss_type)


#: The estimators' values (Schulman 2020; abs: |r|) as functions of r = log pi_ref - log pi, in float64. The
#: straight-through k1+ / k3+ and bottom_q (a batch statistic) have references of their own in their tests.
# not a registry list: read by estimator name (the others have references in their tests)
RAW64 = {"k3": lambda r: torch.exp(r) - r - 1, "k1": lambda r: -r, "k2": lambda r: 0.5 * r**2, "abs": lambda r: r.abs()}


def raw_and_shaped_kl(method, logp, ref, old, mask, *, estimator, clip_threshold, kl_target, bias_correction=True, unsloth_clamps=False):
    """Float64 per-token raw KL (estimator x importance ratio) and its shaped value (masked to 0).

    ``unsloth_clamps``: Unsloth's fused loss clamps the log-ratio to [-20, 20] and the corrected
    KL to [-10, 10]; its backend keeps those clamps for every estimator."""
    logp, ref, old = logp.double(), ref.double(), old.double()
    r = ref - logp
    if unsloth_clamps:
        r = r.clamp(-20, 20)
    raw = RAW64[estimator](r)
    if bias_correction:
        raw = raw * torch.exp(logp - old)
    if unsloth_clamps:
        raw = raw.clamp(-10, 10)
    shaped = shaped64(raw, method, clip_threshold, kl_target)
    mask = mask.bool()
    return torch.where(mask, raw, torch.zeros_like(raw)), torch.where(mask, shaped, torch.zeros_like(shaped))


def kl_part(method, logp, inputs, loss_type, *, beta, estimator, clip_threshold, kl_target, bias_correction=True, unsloth_clamps=False, ga=1,
            excluded=None, **normaliser):  # fmt: skip
    """Float64 KL part of the loss, ``beta * agg(shaped)``, or ``beta * mean_i(mean_t shaped)`` when length-normalised.
    ``excluded`` (bool, like the mask): positions with no KL term (0, in the normaliser of every aggregation but
    length normalisation's, whose mean is over the tokens that have a KL)."""
    mask = inputs["completion_mask"].bool()
    kl_mask = mask if excluded is None else mask & ~excluded
    raw, shaped = raw_and_shaped_kl(
        method, logp, inputs["ref_per_token_logps"], inputs["old_per_token_logps"], kl_mask,
        estimator=estimator, clip_threshold=clip_threshold, kl_target=kl_target, bias_correction=bias_correction,
        unsloth_clamps=unsloth_clamps,
    )
    if "length_normalized" in method.split("+"):
        return beta * (shaped.sum(-1) / kl_mask.sum(-1).clamp(min=1)).mean() / ga, raw, shaped
    num_items = float(inputs["num_items_in_batch"])
    return beta * aggregate(shaped, mask, loss_type, num_items=num_items, ga=ga, **normaliser), raw, shaped


def metric_reference(method, raw, shaped, mask):
    """Float64 adaptive_kl/raw_kl and adaptive_kl/adapted_kl for one micro-batch."""
    mask = mask.bool()
    raw_mean = raw.sum() / mask.sum()
    if "length_normalized" in method.split("+"):
        adapted = (shaped.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    else:
        adapted = shaped.sum() / mask.sum()
    return raw_mean.item(), adapted.item()


#: The controller settings of the backends' end-to-end runs (3 optimizer steps of 4 completions): each controller
#: moves β at every step and β stays > 0 (the KL is logged at every step). Settings of controllers not registered
#: are left out (:func:`training_settings`).
TRAINING_SETTINGS = dict(
    beta_min=0.01, reward_threshold=-1.0, kl_target=0.02, kl_horizon=40.0,  # dynamic decays at every step
    beta_schedule="cosine", beta_schedule_steps=2,  # schedule: cosine to the floor at step 2 (dynamic: the floor there)
    reward_beta_midpoint=0.5, reward_beta_width=0.25,  # reward_conditioned
    target_warmup_steps=0,  # target: β falls from the first update (its KL is 0, below kl_target) or rises
)


#: The controller settings of the resume tests (5 optimizer steps, checkpoint at 2): every controller moves β.
RESUME_SETTINGS = dict(beta_min=0.001, reward_threshold=0.1, reward_window=3, kl_target=0.01, kl_horizon=20.0, target_warmup_steps=0)


def stop_after_checkpoint(step):
    """A trainer callback that ends training once checkpoint-``step`` is written (a run kept only for that checkpoint).
    Set after the save, the flag is not in the checkpoint, whose files are those of a run that goes on: max_steps, and
    with it the learning-rate schedule, is the configured one; training stops at the end of that step. (transformers is
    imported here, not with this module, which workers import before their import order is set.)"""
    from transformers import TrainerCallback

    class StopAfterCheckpoint(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == step:
                control.should_training_stop = True

    return StopAfterCheckpoint()


def training_settings() -> dict:
    """:data:`TRAINING_SETTINGS` for the registered controllers' fields."""
    return {name: value for name, value in TRAINING_SETTINGS.items() if name in FIELD_NAMES}


def controller_config(beta, **settings) -> ControllerConfig:
    """A ``ControllerConfig`` of ``beta`` and those of ``settings`` a registered controller declares."""
    return ControllerConfig(beta, **{name: value for name, value in settings.items() if name in vars(ControllerConfig(beta))})


def expected_betas(method, logs, *, beta=0.04, completions=4):
    """The β each logged step should have used, from :data:`NEXT_BETA` with :func:`training_settings`, for the
    end-to-end runs of the backend tests (one micro-batch and one generation batch per step, so the logged raw_kl
    is the step's mean KL and the logged reward its reward)."""
    controller = next((p for p in method.split("+") if p in CONTROLLERS), "fixed")
    settings = controller_config(beta, **TRAINING_SETTINGS)
    betas, rewards, next_beta = [beta], [], stepper(controller)
    for step, h in enumerate(logs[:-1], start=1):
        rewards.append(h.get("reward"))
        trailing = sum(rewards) / len(rewards) if None not in rewards else None
        betas.append(next_beta(betas[-1], settings, h["adaptive_kl/raw_kl"], trailing, completions, step=step, latest=rewards[-1]))
    return betas


#: β after one optimizer step, per controller, written from each controller's definition (``c``: the
#: ControllerConfig's fields; ``kl``: the step's token-weighted mean *raw* KL, None when nothing was observed;
#: ``reward``: the trailing mean reward (``reward_window`` covering every reward so far), None without one;
#: ``latest``: the step's own reward; ``n``: completions in the step; ``step``: the index of the optimizer step
#: about to start; None: no step-indexed schedule applies). ``test_controllers``
#: checks every registered controller has one.
def _dynamic_step(beta, c, kl, reward, n, *, step=None, latest=None):
    if step is not None and step >= c.beta_schedule_steps:
        return c.beta_min
    return max(c.beta_min, beta * c.dynamic_beta_decay) if reward is not None and reward > c.reward_threshold else beta


def _target_step(beta, c, kl, reward, n, *, step=None, latest=None):
    if kl is None:
        return beta
    error = min(max(kl / c.kl_target - 1.0, -0.2), 0.2)
    return max(c.beta_min, beta * (1.0 + error * n / c.kl_horizon))


def _schedule_step(beta, c, kl, reward, n, *, step, latest=None):
    """β at ``step`` of the linear or cosine schedule from the configured β (``c.beta``) to ``beta_min`` over
    ``beta_schedule_steps`` optimizer steps, then ``beta_min``."""
    done = min(step / c.beta_schedule_steps, 1.0) if c.beta_schedule_steps else 1.0
    left = 1.0 - done if c.beta_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
    return c.beta_min + (c.beta - c.beta_min) * left


def _reward_conditioned_step(beta, c, kl, reward, n, *, step=None, latest):
    """FG-ExPO's accuracy-conditioned β (arXiv 2605.11403), as the package documents its smooth function: the
    logistic of the step's mean reward, ``beta_min + (beta - beta_min) / (1 + exp(-(r - midpoint) / width))``."""
    if latest is None or not math.isfinite(latest):
        return beta
    z = (latest - c.reward_beta_midpoint) / c.reward_beta_width
    logistic = 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))  # no overflow either side
    return c.beta_min + (c.beta - c.beta_min) * logistic


class HeldTargetReference:
    """``target`` (issue 49) in float64, written from its definition (docs/methods.md, the module docstring of
    unsloth_adaptive_kl/target_controller.py), with :data:`NEXT_BETA`'s call signature. It keeps state (the smoothed
    KL, the episode, the cap), so one instance follows one run: get a fresh one from :func:`stepper`.

    m = KL (first update) or m + 0.2 (KL - m); e = clip(ln(m / kl_target), ±1) (-1 when m = 0);
    s = clip(gain * e, ln max_fall, ln max_rise), and s >= 0 in the first warmup_steps updates; outside the band
    |e| <= ln 1.25 an episode (direction sign(e), anchor β) runs: once ln(β / anchor) + s would reach ln 2 in its
    direction, or β already sits at its bound that way (design 2: the range's top or the cap above, its floor below),
    s may not go that way (frozen); above the target, at `patience` frozen updates, if the mean of their raw
    KL × 1.25 <= m when the freeze began the KL responded (a new episode from this β, s unfrozen), else the target is
    unreachable: cap = the β at which m (above the target) was least, β cut to it, reachable = False.
    ln β <- ln β + s, clipped to [max(beta_min, beta / range), min(beta * range, cap)]."""

    def __init__(self):
        self.m = None
        self.updates = 0
        self.episode = None  # (direction, anchor beta, anchor m, frozen)
        self.cap = math.inf
        self.least = (math.inf, None)
        self.reachable = True

    def __call__(self, beta, c, kl, reward, n, *, step=None, latest=None):
        if kl is None or beta == 0.0:
            return beta
        kl = max(kl, 0.0)
        self.updates += 1
        self.m = kl if self.m is None else (1 - 0.2) * self.m + 0.2 * kl
        e = -1.0 if self.m == 0 else min(1.0, max(-1.0, math.log(self.m / c.kl_target)))
        s = min(math.log(c.target_max_rise), max(math.log(c.target_max_fall), c.target_gain * e))
        if self.updates <= c.target_warmup_steps:
            s = max(0.0, s)
        if abs(e) > math.log(1.25):
            d = 1 if e > 0 else -1
            if d == 1 and self.m < self.least[0]:
                self.least = (self.m, beta)
            lower, upper = max(c.beta_min, c.beta / c.target_beta_range), min(c.beta * c.target_beta_range, self.cap)
            at_bound = beta >= upper if d == 1 else beta <= lower
            if self.episode is None or self.episode["d"] != d:
                self.episode = {"d": d, "anchor": beta, "ref": None, "kls": []}
            elif at_bound or d * (math.log(beta / self.episode["anchor"]) + s) >= math.log(2.0):
                if self.episode["ref"] is None:
                    self.episode["ref"] = self.m
                self.episode["kls"].append(kl)
                frozen = self.episode["kls"]
                s = min(s, 0.0) if d == 1 else max(s, 0.0)
                if d == 1 and len(frozen) >= c.target_patience:
                    if sum(frozen) / len(frozen) * 1.25 <= self.episode["ref"]:  # responded: a new episode, β moves
                        self.episode = {"d": d, "anchor": beta, "ref": None, "kls": []}
                        s = min(math.log(c.target_max_rise), max(math.log(c.target_max_fall), c.target_gain * e))
                    elif self.reachable:
                        self.reachable = False
                        self.cap = max(self.least[1], max(c.beta_min, c.beta / c.target_beta_range))
                        beta = min(beta, self.cap)
        else:
            self.episode = None
        lower, upper = max(c.beta_min, c.beta / c.target_beta_range), min(c.beta * c.target_beta_range, self.cap)
        return min(upper, max(lower, beta * math.exp(s)))


NEXT_BETA = {  # not a registry list: references, checked against the registry by test_controllers
    "fixed": lambda beta, c, kl, reward, n, *, step=None, latest=None: beta,
    "dynamic": _dynamic_step,
    "ziegler": _target_step,
    "schedule": _schedule_step,
    "reward_conditioned": _reward_conditioned_step,
}
#: Controllers whose float64 reference keeps state: a fresh reference per run (:func:`stepper`).
STATEFUL = {"target": HeldTargetReference}


def stepper(name):
    """The float64 β step of controller ``name`` for one run (a fresh state for a stateful one), called as
    :data:`NEXT_BETA`'s entries are."""
    return STATEFUL[name]() if name in STATEFUL else NEXT_BETA[name]


#: docs/kl-placement.md: each token's KL enters the reward placement's penalty clamped to [-10, 10] (verl's k3 clamp).
REWARD_KL_BOUND64 = 10.0


def reward_penalty64(method, logp, ref, mask, *, estimator, beta, clip_threshold, kl_target):
    """Float64 kl_placement='reward' penalty per completion: ``beta * sum_t clamp(shaped, -10, 10)`` (``mean_t`` under
    length_normalized) of the estimator on the sampled tokens, no importance ratio; and the raw per-token KL."""
    raw, shaped = raw_and_shaped_kl(
        method, logp, ref, logp, mask, estimator=estimator, clip_threshold=clip_threshold, kl_target=kl_target, bias_correction=False
    )
    per_completion = shaped.double().clamp(-REWARD_KL_BOUND64, REWARD_KL_BOUND64).sum(-1)
    if "length_normalized" in method.split("+"):
        per_completion = per_completion / mask.sum(-1).clamp(min=1)
    return beta * per_completion, raw


def group_advantages64(rewards, num_generations):
    """TRL's advantages under scale_rewards='group': (r - group mean) / (group std (Bessel) + 1e-4), float64."""
    grouped = rewards.double().view(-1, num_generations)
    return ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)


def group_spreads64(rewards, penalty, num_generations):
    """Python loops, float64: per group of ``num_generations``, (penalty spread, reward spread) (max - min) over the
    completions with a reward (NaN: unscored) and a finite penalty; 0 for fewer than two such."""
    out = []
    for start in range(0, len(rewards), num_generations):
        kept = [i for i in range(start, start + num_generations) if rewards[i] == rewards[i] and math.isfinite(penalty[i])]
        r, p = [float(rewards[i]) for i in kept], [float(penalty[i]) for i in kept]
        out.append(((max(p) - min(p)) if len(p) > 1 else 0.0, (max(r) - min(r)) if len(r) > 1 else 0.0))
    return out


def group_counts64(rewards, penalty, num_generations):
    """(groups whose penalty spread exceeds a reward spread > 0, groups of equal rewards whose penalties differ):
    the reward placement's kl_dominated_groups and kl_only_groups, from :func:`group_spreads64`."""
    spreads = group_spreads64(rewards, penalty, num_generations)
    return sum(p > r > 0 for p, r in spreads), sum(r == 0 and p > 0 for p, r in spreads)


def course_line(method, betas, *, adapts=None):
    """The line a run of ``method`` should log when ``train()`` ends, from the β its steps logged (``betas``, in order):
    None with a fixed β; the first and last β, the steps where β changed and its extremes, written out here from the
    logged series; or the start of the warning when it never changed (whose reason is the controller's)."""
    controller = next((p for p in method.split("+") if p in CONTROLLERS), None)
    if not (controller is not None if adapts is None else adapts):  # adapts: for a controller registered elsewhere
        return None
    changes = sum(a != b for a, b in zip(betas, betas[1:]))
    steps = f"{len(betas)} optimizer step{'s' if len(betas) != 1 else ''} of this run"
    if changes == 0:
        return f"unsloth_adaptive_kl: kl_adaptation_method={method!r} never moved beta in the {steps}"
    return (f"unsloth_adaptive_kl: kl_adaptation_method={method!r}: beta {betas[0]:g} -> {betas[-1]:g} over the {steps} "
            f"(the beta each step trained with; it changed at {changes} of them, lowest {min(betas):g}, highest {max(betas):g})")


def assert_course_logged(lines, method, betas, *, adapts=None):
    """``lines`` (the messages logged with " of this run" in them) are the one :func:`course_line` expects."""
    expected = course_line(method, betas, adapts=adapts)
    if expected is None:
        assert lines == [], lines
        return
    (line,) = lines
    assert (line.startswith(expected) if "never moved" in expected else line == expected), (line, expected)
