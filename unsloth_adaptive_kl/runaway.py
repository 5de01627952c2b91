"""The runaway alarm: one cheap check of the KL against its own recent level, while the reward falls, at each
optimizer step that computed a KL (docs/runaway.md).

A run "runs away" when its KL leaves the level it had held and the reward drops with it: the policy found
tokens the reference finds unlikely and is losing what it learnt. :class:`RunawayAlarm` is fed once per
optimizer step with the step's KL (None on a step that computed none: the sampled ``kl_monitor``'s other
steps) and the reward of the generation batches scored in it. At each step with a KL, the rule holds when

* the mean KL observed in the recent window (the last :attr:`RunawayRule.recent_steps` steps) is at least
  :attr:`RunawayRule.kl_ratio` times the median KL observed in the :attr:`RunawayRule.base_steps` steps before that
  window (at least :attr:`RunawayRule.min_base_observations` of them), and
* the mean reward of the recent window is below the mean reward of those steps before it;

the alarm fires, once, when the rule has held at :attr:`RunawayRule.confirmations` consecutive observed KLs. The
confirmations are counted in observations, not steps: with every step's KL they are consecutive steps, with one
step in N (``kl_monitor_every=N``) they are watched steps N apart, so one noisy watched step cannot fire it. The
alarm needs no knowledge of N: it counts the KLs it receives. The thresholds come from study 33's streams
(``research/runaway/study33.py`` prints the counts and the scan they were chosen by). Pure Python on host floats:
the KL and the reward are already on the host when the controller updates β.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class RunawayRule:
    """The alarm's thresholds (docs/runaway.md: chosen on study 33's streams, with the counts they give)."""

    recent_steps: int = 10
    base_steps: int = 50
    kl_ratio: float = 5.0
    min_base_observations: int = 3
    min_recent_observations: int = 3
    confirmations: int = 2

    @property
    def span(self) -> int:
        return self.recent_steps + self.base_steps

    def windows(self, step: int, kls) -> tuple[int, int]:
        """``(base_from, recent_from)``: the recent window is steps (recent_from, step], the last
        :attr:`recent_steps` steps or, where they hold fewer, back to the :attr:`min_recent_observations`-th last
        observed KL; the base window is the :attr:`base_steps` steps before it, (base_from, recent_from]."""
        recent_from = step - self.recent_steps
        if len(kls) >= self.min_recent_observations:
            recent_from = min(recent_from, kls[-self.min_recent_observations][0] - 1)
        return recent_from - self.base_steps, recent_from


@dataclass(frozen=True)
class RunawaySignal:
    """What the check saw at one step with a KL: the recent KL over the base median, the two reward means, and
    whether the rule holds there."""

    step: int
    recent_kl: float
    base_kl: float
    kl_ratio: float
    recent_reward: float
    base_reward: float
    holds: bool


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan


def check(step: int, kls: list[tuple[int, float]], rewards: list[tuple[int, float]], rule: RunawayRule = RunawayRule()) -> RunawaySignal | None:
    """The rule at ``step`` from ``(step, value)`` observations (finite values only, any older ones ignored).
    None when it cannot be judged yet: no KL at ``step``, the base window not yet elapsed, too few KLs or no
    reward in a window, or a base KL median that is not positive."""
    if not kls or kls[-1][0] != step:
        return None
    base_from, recent_from = rule.windows(step, kls)
    if base_from < 0:
        return None
    recent_kl = [v for s, v in kls if recent_from < s <= step]
    base_kl = [v for s, v in kls if base_from < s <= recent_from]
    recent_reward = _mean(v for s, v in rewards if recent_from < s <= step)
    base_reward = _mean(v for s, v in rewards if base_from < s <= recent_from)
    if len(base_kl) < rule.min_base_observations or math.isnan(recent_reward) or math.isnan(base_reward):
        return None
    base = statistics.median(base_kl)
    if not base > 0:
        return None
    recent = _mean(recent_kl)
    ratio = recent / base
    return RunawaySignal(step, recent, base, ratio, recent_reward, base_reward, holds=ratio >= rule.kl_ratio and recent_reward < base_reward)


class RunawayAlarm:
    """The alarm's state: the last :attr:`RunawayRule.span` steps' KLs and rewards, how many consecutive observed
    KLs the rule has held at, and the step it fired at. :meth:`state_dict` / :meth:`load_state_dict` carry it
    through a checkpoint (plain lists and numbers: it travels in the trainer state's JSON)."""

    def __init__(self, rule: RunawayRule = RunawayRule()):
        self.rule = rule
        self._kls: deque[tuple[int, float]] = deque()
        self._rewards: deque[tuple[int, float]] = deque()
        self._pending_rewards: list[float] = []
        self.streak = 0  # consecutive observed KLs at which the rule held, up to the last one
        self.fired_at: int | None = None
        self.last: RunawaySignal | None = None  # the check at the last observed KL (None: not judged there)

    @property
    def fired(self) -> bool:
        return self.fired_at is not None

    def observe_reward(self, reward: float) -> None:
        """A generation batch's mean reward (the trainer's logged ``reward``); it counts at the next :meth:`end_step`."""
        if reward is not None and math.isfinite(reward):
            self._pending_rewards.append(float(reward))

    def end_step(self, step: int, kl: float | None) -> bool:
        """Close optimizer step ``step`` (1-based: the steps completed) with its KL (None: none computed).
        Returns True at the one step the alarm fires."""
        if self._pending_rewards:
            self._rewards.append((step, _mean(self._pending_rewards)))
            self._pending_rewards = []
        observed = kl is not None and math.isfinite(kl)
        if observed:
            self._kls.append((step, float(kl)))
        horizon = self.rule.windows(step, self._kls)[0]  # steps up to it are in no later window (both bounds only grow)
        for window in (self._kls, self._rewards):
            while window and window[0][0] <= horizon:
                window.popleft()
        if self.fired or not observed:
            return False
        self.last = check(step, list(self._kls), list(self._rewards), self.rule)
        self.streak = self.streak + 1 if self.last is not None and self.last.holds else 0
        if self.streak >= self.rule.confirmations:
            self.fired_at = step
            return True
        return False

    def state_dict(self) -> dict:
        return {
            "kls": [list(pair) for pair in self._kls], "rewards": [list(pair) for pair in self._rewards],
            "pending_rewards": list(self._pending_rewards), "streak": self.streak, "fired_at": self.fired_at,
        }  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self._kls = deque((int(s), float(v)) for s, v in state["kls"])
        self._rewards = deque((int(s), float(v)) for s, v in state["rewards"])
        self._pending_rewards = [float(v) for v in state["pending_rewards"]]
        self.streak, self.fired_at = int(state["streak"]), state["fired_at"]
        self.last = None
