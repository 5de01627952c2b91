"""Exact expected gradients of every KL estimator and placement, against the gradient of the KL.

A tiny autoregressive policy over a vocabulary of three tokens and EOS, completions of at most
three tokens, so the 40 completions can be enumerated: every expectation below is an exact sum
over them, weighted by their sampling probability, in float64. No Monte Carlo.

- The policy and the reference are logits tables, one row per prefix ("state"): the policy's 13 x 4
  table is the parameter vector. A completion ends at EOS (which counts as a token, as in TRL's
  completion mask) or at the maximum length.
- The truth is ``grad KL(pi || pi_ref)`` of the sequence-level KL, by autograd on the exact sum
  ``sum_y pi(y) log(pi(y) / pi_ref(y))``.
- ``loss`` placement: the package's estimator per token (``estimate_kl``), times TRL's importance
  ratio when ``use_bias_correction_kl`` (not detached; token-level or TRL's sequence-level
  ``exp(mean_t log ratio)`` broadcast over the tokens), aggregated as each TRL ``loss_type`` does, on
  completions sampled from the old policy (the current one when on-policy).
- ``reward`` placement (``kl_placement="reward"``): each completion's reward is lowered by
  ``beta * sum_t kl_t``, detached, computed at scoring time from the sampling policy's log-probs.
  The advantage is that penalty alone, without group normalisation (plain REINFORCE, unbiased),
  and enters TRL's policy term ``-ratio * advantage`` (ratio token- or sequence-level), aggregated
  as each ``loss_type`` does. :func:`group_normalisation_rows` adds GRPO's group normalisation,
  exactly, by enumerating every group.

Each expected gradient is compared with the truth scaled by the aggregation's constant (the number
that multiplies a completion's token sum on average: 1 for luspo, ``1/max_completion_length`` for
dr_grpo, ``1/E|y|`` for grpo, dapo and bnpo): relative error ``|g - c g*| / |c g*|`` and cosine.

Run ``python research/kl_gradient_study.py`` to print the tables; ``--write`` puts them into
docs/kl-gradients.md between its generated markers (research/tests/test_kl_gradients.py checks the page
holds what the script prints).
"""

from __future__ import annotations

import argparse
import itertools
import math
import pathlib
import sys
from dataclasses import dataclass

import torch

from unsloth_adaptive_kl.estimators import ESTIMATORS, estimate_kl

VOCAB_SIZE = 4  # three content tokens and EOS (the last id)
MAX_LENGTH = 3  # max_completion_length, EOS included
BATCH = 8  # completions under one dapo/bnpo token-count normaliser (TRL's num_generations default)
GROUP = 4  # group size of the group-normalisation study (every group of 4 of the 40 completions)
BETA = 0.04
SEED = 0
POLICY_SHIFT = 1.0  # std of the policy's logits around the reference's
OLD_SHIFT = 0.1  # std of the old policy's logits around the current policy's (off-policy: a few optimiser steps)
#: (policy shift, old-policy shift) of the robustness table, each over ROBUSTNESS_SEEDS.
ROBUSTNESS_SETTINGS = ((0.3, 0.03), (POLICY_SHIFT, OLD_SHIFT), (POLICY_SHIFT, 0.3))
ROBUSTNESS_SEEDS = range(10)
#: TRL's loss types, grouped by how they aggregate a per-token term (sapo as grpo; cispo, vespo as dapo).
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "luspo")
LOSS_TYPE_LABELS = {"grpo": "grpo, sapo", "dapo": "dapo, bnpo, cispo", "dr_grpo": "dr_grpo", "luspo": "luspo"}
DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "kl-gradients.md"
BEGIN, END = "<!-- kl-gradient-study:begin -->", "<!-- kl-gradient-study:end -->"


def study_estimators() -> list[str]:
    """The package's built-in estimators whose value depends on one token only (``bottom_q`` needs a
    batch quantile of the reference log-probs, so its gradient is a property of the batch, not of a
    completion)."""
    return [name for name, spec in ESTIMATORS.items() if spec.builtin and spec.batch_statistic is None]


@dataclass(frozen=True)
class Completions:
    """Every completion, padded to ``max_length``: token ids, mask, and the state (prefix) each token is drawn in."""

    tokens: torch.Tensor  # (N, L) long
    mask: torch.Tensor  # (N, L) float64
    states: torch.Tensor  # (N, L) long, index of the prefix the token is drawn after
    prefixes: tuple[tuple[int, ...], ...]  # the state of each index
    max_length: int
    vocab_size: int

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(-1)


def enumerate_completions(vocab_size: int = VOCAB_SIZE, max_length: int = MAX_LENGTH) -> Completions:
    eos, content = vocab_size - 1, range(vocab_size - 1)
    prefixes = [p for n in range(max_length) for p in itertools.product(content, repeat=n)]
    state_of = {p: i for i, p in enumerate(prefixes)}
    sequences = [(*p, eos) for p in prefixes] + list(itertools.product(content, repeat=max_length))
    tokens = torch.zeros(len(sequences), max_length, dtype=torch.long)
    mask = torch.zeros(len(sequences), max_length, dtype=torch.float64)
    states = torch.zeros(len(sequences), max_length, dtype=torch.long)
    for i, seq in enumerate(sequences):
        for t, token in enumerate(seq):
            tokens[i, t], mask[i, t], states[i, t] = token, 1.0, state_of[seq[:t]]
    return Completions(tokens, mask, states, tuple(prefixes), max_length, vocab_size)


@dataclass(frozen=True)
class Study:
    completions: Completions
    ref_logits: torch.Tensor  # (states, vocab)
    logits: torch.Tensor  # the current policy: the parameters
    old_logits: torch.Tensor  # the policy that sampled, when off-policy


def make_study(seed: int = SEED, vocab_size: int = VOCAB_SIZE, max_length: int = MAX_LENGTH, policy_shift: float = POLICY_SHIFT, old_shift: float = OLD_SHIFT) -> Study:
    """Reference logits N(0, 1); the policy's: the reference's plus N(0, policy_shift²); the old policy's:
    the policy's plus N(0, old_shift²)."""
    completions = enumerate_completions(vocab_size, max_length)
    g = torch.Generator().manual_seed(seed)
    shape = (len(completions.prefixes), vocab_size)
    ref = torch.randn(shape, generator=g, dtype=torch.float64)
    logits = ref + policy_shift * torch.randn(shape, generator=g, dtype=torch.float64)
    old = logits + old_shift * torch.randn(shape, generator=g, dtype=torch.float64)
    return Study(completions, ref, logits, old)


def token_logps(logits: torch.Tensor, completions: Completions) -> torch.Tensor:
    """log pi(y_t | y_<t) of every token of every completion, 0 on padding."""
    table = torch.log_softmax(logits, dim=-1)
    return table[completions.states, completions.tokens] * completions.mask


def sequence_probs(logits: torch.Tensor, completions: Completions) -> torch.Tensor:
    return token_logps(logits, completions).sum(-1).exp()


def true_gradient(study: Study) -> torch.Tensor:
    """grad_theta of sum_y pi(y) log(pi(y) / pi_ref(y)), by autograd on the exact sum."""
    theta = study.logits.clone().requires_grad_(True)
    logp = token_logps(theta, study.completions).sum(-1)
    ref = token_logps(study.ref_logits, study.completions).sum(-1)
    kl = (logp.exp() * (logp - ref)).sum()
    (grad,) = torch.autograd.grad(kl, theta)
    return grad.flatten()


def completion_weights(loss_type: str, lengths: torch.Tensor, probs: torch.Tensor, max_length: int, batch: int = BATCH):
    """``w(y)`` such that TRL's expected aggregated loss is ``sum_y probs(y) w(y) sum_t term_t(y)``, and the
    constant ``c`` the truth is scaled by.

    grpo: the mean over completions of each one's token mean, ``w = 1/|y|``. dapo (and bnpo): the token
    sum over ``batch`` completions divided by their token count (detached), so exactly
    ``w(y) = batch * E[1 / (|y| + N)]`` with ``N`` the token count of the other ``batch - 1`` completions
    (-> ``1/E|y|`` for a large batch). dr_grpo: ``1/max_length``. luspo: the mean of the token sums, 1."""
    mean_length = (probs * lengths).sum()
    if loss_type == "grpo":
        return 1.0 / lengths, 1.0 / mean_length
    if loss_type == "dapo":
        one = torch.zeros(max_length + 1, dtype=torch.float64).index_add_(0, lengths.long(), probs)
        others = torch.ones(1, dtype=torch.float64)  # distribution of N: one's (batch - 1)-fold convolution
        for _ in range(batch - 1):
            convolved = torch.zeros(others.numel() + max_length, dtype=torch.float64)
            for k, p in enumerate(one):
                convolved[k : k + others.numel()] += p * others
            others = convolved
        totals = torch.arange(others.numel(), dtype=torch.float64)
        w = batch * (others[None, :] / (lengths[:, None] + totals[None, :])).sum(-1)
        return w, 1.0 / mean_length
    if loss_type == "dr_grpo":
        return torch.full_like(lengths, 1.0 / max_length), torch.tensor(1.0 / max_length, dtype=torch.float64)
    if loss_type == "luspo":
        return torch.ones_like(lengths), torch.tensor(1.0, dtype=torch.float64)
    raise ValueError(f"loss_type={loss_type!r}; allowed: {LOSS_TYPES}")


def importance_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """TRL's ``coef_1``: ``exp(logp - old)`` per token, or ``exp(mean_t (logp - old))`` per completion, (N, 1)."""
    log_ratio = logp - old_logp
    if level == "token":
        return torch.exp(log_ratio)
    if level == "sequence":
        return torch.exp((log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0))
    raise ValueError(f"importance_sampling_level={level!r}; allowed: 'token', 'sequence'")


def _setup(study: Study, on_policy: bool):
    theta = study.logits.clone().requires_grad_(True)
    c = study.completions
    logp = token_logps(theta, c)
    old_logp = logp.detach() if on_policy else token_logps(study.old_logits, c)
    probs = old_logp.sum(-1).exp()  # the sampling distribution
    ref_logp = token_logps(study.ref_logits, c)
    return theta, logp, old_logp, ref_logp, probs


def _expected_gradient(theta, probs, weights, per_token, mask) -> torch.Tensor:
    objective = (probs * weights * (per_token * mask).sum(-1)).sum()
    (grad,) = torch.autograd.grad(objective, theta)
    return grad.flatten()


def loss_placement_gradient(study: Study, estimator: str, loss_type: str, *, bias_correction: bool, level: str = "token", on_policy: bool = True):
    """Expected gradient of TRL's KL loss term (beta = 1) and the truth's scale ``c``."""
    theta, logp, old_logp, ref_logp, probs = _setup(study, on_policy)
    mask = study.completions.mask
    kl = estimate_kl(estimator, logp, ref_logp, mask=mask)
    if bias_correction:
        kl = kl * importance_ratio(logp, old_logp, mask, level)
    weights, scale = completion_weights(loss_type, study.completions.lengths, probs, study.completions.max_length)
    return _expected_gradient(theta, probs, weights, kl, mask), scale


def reward_placement_gradient(study: Study, estimator: str, loss_type: str, *, level: str = "token", on_policy: bool = True):
    """Expected gradient of TRL's policy term with the advantage ``-sum_t kl_t`` (beta = 1, no group
    normalisation); the penalty is computed from the sampling policy's log-probs, detached."""
    theta, logp, old_logp, ref_logp, probs = _setup(study, on_policy)
    mask = study.completions.mask
    penalty = estimate_kl(estimator, old_logp, ref_logp, mask=mask).sum(-1, keepdim=True).detach()
    advantage = -penalty
    per_token = -importance_ratio(logp, old_logp, mask, level) * advantage
    weights, scale = completion_weights(loss_type, study.completions.lengths, probs, study.completions.max_length)
    return _expected_gradient(theta, probs, weights, per_token, mask), scale


def sequence_k2_loss_gradient(study: Study, loss_type: str = "luspo"):
    """Not an option of TRL: the package's k2 of the *sequence* log-ratio, one term per completion (on-policy)."""
    theta, logp, _, ref_logp, probs = _setup(study, True)
    mask = study.completions.mask
    kl = estimate_kl("k2", logp.sum(-1, keepdim=True), ref_logp.sum(-1, keepdim=True))
    weights, scale = completion_weights(loss_type, study.completions.lengths, probs, study.completions.max_length)
    one_token = torch.zeros_like(mask)
    one_token[:, 0] = 1.0  # the term counted once per completion
    return _expected_gradient(theta, probs, weights, kl, one_token), scale


def compare(grad: torch.Tensor, truth: torch.Tensor) -> tuple[float, float]:
    """Relative error |g - g*| / |g*| and cosine (nan for a zero gradient)."""
    rel = float((grad - truth).norm() / truth.norm())
    if grad.norm() <= 1e-12 * truth.norm():
        return rel, float("nan")
    return rel, float(grad @ truth / (grad.norm() * truth.norm()))


def _cell(rel: float, cos: float) -> str:
    return f"{rel:.3f} / {'—' if cos != cos else f'{cos:.3f}'}"


def _row(label: list[str], gradient_of, truth) -> str:
    cells = []
    for loss_type in LOSS_TYPES:
        grad, scale = gradient_of(loss_type)
        cells.append(_cell(*compare(grad, scale * truth)))
    return "| " + " | ".join(label + cells) + " |"


def _header(columns: list[str]) -> list[str]:
    names = columns + [LOSS_TYPE_LABELS[t] for t in LOSS_TYPES]
    return ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]


def placement_table(study: Study, *, on_policy: bool) -> list[str]:
    truth = true_gradient(study)
    lines = _header(["placement", "estimator", "bias correction", "importance ratio"])
    for estimator in study_estimators():
        lines.append(_row(["loss", f"`{estimator}`", "off", "—"], lambda t: loss_placement_gradient(study, estimator, t, bias_correction=False, on_policy=on_policy), truth))
        for level in ("token", "sequence"):
            lines.append(_row(["loss", f"`{estimator}`", "on", level], lambda t: loss_placement_gradient(study, estimator, t, bias_correction=True, level=level, on_policy=on_policy), truth))
    # On-policy the two levels give the same reward-placement gradient: sum_t of the broadcast mean score is the score sum.
    levels = {"token or sequence": "token"} if on_policy else {"token": "token", "sequence": "sequence"}
    for estimator in study_estimators():
        for label, level in levels.items():
            lines.append(_row(["reward", f"`{estimator}`", "—", label], lambda t: reward_placement_gradient(study, estimator, t, level=level, on_policy=on_policy), truth))
    if on_policy:
        lines.append(_row(["loss (not in TRL)", "`k2` of the sequence log-ratio", "off", "—"], lambda t: sequence_k2_loss_gradient(study, t), truth))
    return lines


def bandit_table(estimators=None) -> list[str]:
    """On-policy, luspo: the same rows with completions of one token (a bandit) and of up to three."""
    studies = {1: make_study(max_length=1), MAX_LENGTH: make_study()}
    truths = {n: true_gradient(s) for n, s in studies.items()}
    lines = ["| placement | estimator | bias correction | max length 1 | max length 3 |", "|---|---|---|---|---|"]
    cases = [("loss", e, b) for e in (estimators or study_estimators()) for b in (False, True)]
    cases += [("reward", e, None) for e in (estimators or study_estimators())]
    for placement, estimator, correction in cases:
        cells = []
        for n, study in studies.items():
            if placement == "loss":
                grad, _ = loss_placement_gradient(study, estimator, "luspo", bias_correction=correction)
            else:
                grad, _ = reward_placement_gradient(study, estimator, "luspo")
            cells.append(_cell(*compare(grad, truths[n])))
        flag = "—" if correction is None else ("on" if correction else "off")
        lines.append(f"| {placement} | `{estimator}` | {flag} | " + " | ".join(cells) + " |")
    return lines


def _other_members(probs: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every multiset of ``group - 1`` completions (the other members of a group) and its probability
    (multinomial count times the product of the members' probabilities)."""
    others = torch.combinations(torch.arange(probs.numel()), r=group - 1, with_replacement=True).view(-1, group - 1)
    counts = torch.stack([(others == i).sum(-1) for i in range(probs.numel())], dim=-1)
    orderings = math.factorial(group - 1) / torch.lgamma(counts.double() + 1).sum(-1).exp()
    return others, orderings * probs[others].prod(-1)


def group_advantage_weights(penalty: torch.Tensor, probs: torch.Tensor, *, group: int, scale_rewards: str, beta: float, task_reward: torch.Tensor) -> torch.Tensor:
    """``W(y) = E[A_1 | y_1 = y]`` over the other ``group - 1`` completions of the group, exactly: TRL's
    advantage ``(R_1 - mean R) / (std R + 1e-4)`` (std with Bessel's correction; no division when
    ``scale_rewards="none"``) with ``R = task_reward - beta * penalty``."""
    reward = task_reward - beta * penalty
    others, others_prob = _other_members(probs, group)
    sum1, sum2 = reward[others].sum(-1), (reward[others] ** 2).sum(-1)  # the others' sum and sum of squares
    total = reward[:, None] + sum1[None, :]
    advantage = reward[:, None] - total / group
    if scale_rewards == "group":
        variance = (reward[:, None] ** 2 + sum2[None, :] - total**2 / group) / (group - 1)
        advantage = advantage / (variance.clamp(min=0.0).sqrt() + 1e-4)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards={scale_rewards!r}; allowed: 'group', 'none'")
    return (advantage * others_prob[None, :]).sum(-1)


def group_gradient(study: Study, estimator: str, *, scale_rewards: str, beta: float = BETA, task_reward=None, group: int = GROUP) -> torch.Tensor:
    """On-policy expected gradient of ``-(1/G) sum_i A_i log pi(y_i)`` (luspo aggregation, ratio 1), exactly."""
    theta, logp, _, ref_logp, probs = _setup(study, True)
    mask = study.completions.mask
    penalty = estimate_kl(estimator, logp.detach(), ref_logp, mask=mask).sum(-1)
    task = torch.zeros_like(penalty) if task_reward is None else task_reward
    weights = group_advantage_weights(penalty, probs, group=group, scale_rewards=scale_rewards, beta=beta, task_reward=task)
    objective = -(probs * weights * logp.sum(-1)).sum()
    (grad,) = torch.autograd.grad(objective, theta)
    return grad.flatten()


def task_reward_of(study: Study, seed: int = SEED) -> torch.Tensor:
    """A fixed task reward per completion, uniform in [0, 1]."""
    return torch.rand(study.completions.tokens.shape[0], generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)


def group_normalisation_rows(study: Study, estimators=("k1", "k3")) -> list[str]:
    """The KL's contribution to the gradient under GRPO's group normalisation, against ``beta * grad KL``:
    without a task reward, and with one (the derivative in beta, by central difference). ``scale``: the
    least-squares factor ``<g, t> / <t, t>`` on the target ``t``."""
    truth = true_gradient(study)
    task = task_reward_of(study)
    lines = ["| estimator | scale_rewards | task reward | g | scale on the target | cosine |", "|---|---|---|---|---|---|"]
    h = 1e-4
    for estimator in estimators:
        for scale_rewards in ("none", "group"):
            for with_task in (False, True):
                if with_task:
                    up = group_gradient(study, estimator, scale_rewards=scale_rewards, beta=BETA + h, task_reward=task)
                    down = group_gradient(study, estimator, scale_rewards=scale_rewards, beta=BETA - h, task_reward=task)
                    grad, target, what = (up - down) / (2 * h), truth, "d/dβ of the gradient, against ∇KL"
                else:
                    grad, target, what = group_gradient(study, estimator, scale_rewards=scale_rewards), BETA * truth, "the gradient, against β·∇KL"
                fit = float(grad @ target / (target @ target))
                cos = float(grad @ target / (grad.norm() * target.norm()))
                lines.append(f"| `{estimator}` | {scale_rewards} | {'yes' if with_task else 'no'} | {what} | {fit:.3g} | {cos:.3f} |")
    return lines


ROBUSTNESS_ROWS = {
    "on-policy, loss, `k2` (= TRL's `k3` with bias correction)": lambda s: loss_placement_gradient(s, "k2", "luspo", bias_correction=False),
    "on-policy, loss, `k3`, no bias correction": lambda s: loss_placement_gradient(s, "k3", "luspo", bias_correction=False),
    "on-policy, loss, `k3+` with bias correction": lambda s: loss_placement_gradient(s, "k3+", "luspo", bias_correction=True),
    "on-policy, reward, `k1`": lambda s: reward_placement_gradient(s, "k1", "luspo"),
    "on-policy, reward, `k3`": lambda s: reward_placement_gradient(s, "k3", "luspo"),
    "off-policy, loss, `k3`, bias correction, token ratio": lambda s: loss_placement_gradient(s, "k3", "luspo", bias_correction=True, level="token", on_policy=False),
    "off-policy, loss, `k3`, bias correction, sequence ratio": lambda s: loss_placement_gradient(s, "k3", "luspo", bias_correction=True, level="sequence", on_policy=False),
    "off-policy, reward, `k1`, token ratio": lambda s: reward_placement_gradient(s, "k1", "luspo", level="token", on_policy=False),
}


def robustness_rows() -> list[str]:
    """Relative error (luspo) of the headline rows, min–max over ROBUSTNESS_SEEDS, per (policy shift, old shift)."""
    studies = {setting: [make_study(seed, policy_shift=setting[0], old_shift=setting[1]) for seed in ROBUSTNESS_SEEDS] for setting in ROBUSTNESS_SETTINGS}
    truths = {setting: [true_gradient(s) for s in group] for setting, group in studies.items()}
    kls = {}
    for setting, group in studies.items():
        values = []
        for s in group:
            c = s.completions
            logp = token_logps(s.logits, c)
            values.append(float((logp.sum(-1).exp() * (logp - token_logps(s.ref_logits, c)).sum(-1)).sum()))
        kls[setting] = f"{min(values):.3g}–{max(values):.3g}"
    header = ["row"] + [f"shift {p}, old {o} (KL {kls[(p, o)]})" for p, o in ROBUSTNESS_SETTINGS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, gradient_of in ROBUSTNESS_ROWS.items():
        cells = []
        for setting in ROBUSTNESS_SETTINGS:
            errors = [compare(gradient_of(s)[0], t)[0] for s, t in zip(studies[setting], truths[setting])]
            cells.append(f"{min(errors):.3f}–{max(errors):.3f}")
        lines.append("| " + " | ".join([label, *cells]) + " |")
    return lines


def report(study: Study | None = None) -> str:
    study = study or make_study()
    c = study.completions
    probs = sequence_probs(study.logits, c)
    old_probs = sequence_probs(study.old_logits, c)
    kl = float((probs * (token_logps(study.logits, c) - token_logps(study.ref_logits, c)).sum(-1)).sum())
    setting = (
        f"Vocabulary {c.vocab_size} (EOS included), max length {c.max_length}: {c.tokens.shape[0]} completions, "
        f"{len(c.prefixes)} states, {study.logits.numel()} parameters; seed {SEED}. KL(π‖π_ref) = {kl:.4f}, "
        f"E|y| = {float((probs * c.lengths).sum()):.4f} (old policy: {float((old_probs * c.lengths).sum()):.4f}); "
        f"dapo/bnpo normaliser over {BATCH} completions; group size {GROUP}, β = {BETA}."
    )
    parts = [
        setting,
        "",
        "Each cell: relative error ‖g − c·∇KL‖ / ‖c·∇KL‖ / cosine(g, ∇KL) (— : the expected gradient is 0).",
        "",
        "### On-policy",
        "",
        *placement_table(study, on_policy=True),
        "",
        "### Off-policy (sampled from π_old ≠ π_θ)",
        "",
        *placement_table(study, on_policy=False),
        "",
        "### Bandit against sequence (on-policy, luspo: the truth unscaled)",
        "",
        *bandit_table(),
        "",
        "### GRPO's group normalisation (reward placement, on-policy, luspo, every group of "
        f"{GROUP} enumerated)",
        "",
        *group_normalisation_rows(study),
        "",
        f"### Robustness: relative error (luspo), min–max over seeds {ROBUSTNESS_SEEDS.start}–{ROBUSTNESS_SEEDS.stop - 1}",
        "",
        *robustness_rows(),
    ]
    return "\n".join(parts) + "\n"


def replace_generated(text: str, generated: str) -> str:
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"{DOC} has no {BEGIN} ... {END} markers")
    return f"{head}{BEGIN}\n{generated}{END}{tail}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write the tables into {DOC.name} between its markers")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # tensors of a few thousand elements: threads only add overhead
    generated = report()
    if args.write:
        DOC.write_text(replace_generated(DOC.read_text(), generated))
    else:
        sys.stdout.write(generated)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
