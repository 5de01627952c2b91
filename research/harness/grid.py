"""The β-grid analysis (``--analyze FILE... --grid``): runs of settings that differ only in the initial
β (``--betas``), each method's final values against the initial β, their spread across β, the target
controller's KL against its ``kl_target``, and the best fixed β against ``target``, paired by seed."""

from __future__ import annotations

import math
import re

from unsloth_adaptive_kl import metrics

from .analysis import fmt_interval, read_rows, t_interval
from .settings import Settings
from .summary import _mean, cell

FINAL_STEPS = 50  # "final" values: means over the last 50 logged steps of a run
FINAL_KEYS = {"kl": metrics.RAW_KL, "reward": "reward", "length": "completions/mean_length",
              "beta": metrics.CURRENT_BETA}
TRACKING = 0.25  # target's claim: the final KL within ±25 % of kl_target
BETA_IN_TAG = re.compile(r"-b(\d[\d.]*(?:e[+-]?\d+)?)(?=-|$)")
KT_IN_TAG = re.compile(r"-kt(\d[\d.]*(?:e[+-]?\d+)?)(?=-|$)")
STEPS_IN_TAG = re.compile(r"-s(\d+)(?=-|$)")


def final_values(rows: list[dict], last: int = FINAL_STEPS) -> dict:
    """Means over the last ``last`` rows (steps) of one run: KL (adaptive_kl/raw_kl), reward, completion
    length, β; and the run's last step."""
    tail = rows[-last:]
    out = {name: _mean(r.get(key) for r in tail) for name, key in FINAL_KEYS.items()}
    out["steps"] = rows[-1]["step"]
    return out


def split_tag(tag: str) -> tuple[str, float]:
    """(the setting without its β, written ``-b*``; the initial β) from a tag that carries ``-bβ``."""
    match = BETA_IN_TAG.search(tag)
    if not match:
        raise ValueError(f"setting tag {tag!r} has no '-bBETA' part: the grid analysis needs the initial β in the tag "
                         "(the default tag and --betas write it)")
    return tag[:match.start()] + "-b*" + tag[match.end():], float(match.group(1))


def kl_target_of(tag: str, rows: list[dict]) -> float:
    """The run's kl_target: the rows' ``kl_target`` field, else the tag's ``-ktK``, else the default."""
    if rows and rows[0].get("kl_target") is not None:
        return float(rows[0]["kl_target"])
    match = KT_IN_TAG.search(tag)
    return float(match.group(1)) if match else Settings.kl_target


def read_grid(paths: list[str]) -> dict[str, dict]:
    """{setting without β: {"kl_target": K, "runs": {(method, β, seed): final values}, "incomplete": [...]}}.
    A run that stopped before its planned step count (the rows' ``planned_steps``; streams written before
    it existed: the tag's ``-sN``) stays in "runs", its final values over the last steps it reached, and is
    named in "incomplete" (a rerun of the same seed, in the same or another stream, completes it: a run in
    several files counts whole from the copy that went furthest; ``read_rows``)."""
    grids: dict[str, dict] = {}
    for tag, runs in read_rows(paths).items():
        base, beta = split_tag(tag)
        steps = STEPS_IN_TAG.search(tag)
        grid = grids.setdefault(base, {"kl_target": None, "runs": {}, "incomplete": []})
        for (method, seed), rows in runs.items():
            if rows[0].get("beta0") is not None and float(rows[0]["beta0"]) != beta:
                raise ValueError(f"setting {tag!r}: the rows say initial β {rows[0]['beta0']}, the tag {beta:g}")
            planned = rows[0].get("planned_steps") or (int(steps.group(1)) if steps else None)
            if planned and rows[-1]["step"] < planned:
                grid["incomplete"].append(f"{method}/seed{seed}/b{beta:g} (step {rows[-1]['step']} of {planned})")
            grid["runs"][(method, beta, seed)] = final_values(rows)
            kt = kl_target_of(tag, rows)
            if grid["kl_target"] is not None and grid["kl_target"] != kt:
                raise ValueError(f"setting {base!r}: runs with kl_target {grid['kl_target']} and {kt}")
            grid["kl_target"] = kt
    return grids


def _by(runs: dict, method: str) -> dict[float, dict[int, dict]]:
    """{β: {seed: final values}} of one method."""
    out: dict[float, dict[int, dict]] = {}
    for (m, beta, seed), values in runs.items():
        if m == method:
            out.setdefault(beta, {})[seed] = values
    return dict(sorted(out.items()))


def seed_mean(per_seed: dict[int, dict], key: str) -> float:
    return _mean(v[key] for v in per_seed.values())


def spread(by_beta: dict[float, dict[int, dict]]) -> dict:
    """One method's spread across initial β: the max/min ratio of the seed-mean final KL and the range
    (max - min) of the seed-mean final reward; and the same per seed (over the β that seed has at
    every β of the method), for intervals."""
    kl = {b: seed_mean(s, "kl") for b, s in by_beta.items()}
    reward = {b: seed_mean(s, "reward") for b, s in by_beta.items()}
    kl_ok = {b: v for b, v in kl.items() if v > 0}
    seeds = sorted(set.intersection(*(set(s) for s in by_beta.values()))) if by_beta else []
    per_seed_ratio, per_seed_range = [], []
    for seed in seeds:
        kls = [s[seed]["kl"] for s in by_beta.values()]
        rewards = [s[seed]["reward"] for s in by_beta.values()]
        if all(k > 0 for k in kls):
            per_seed_ratio.append(max(kls) / min(kls))
        per_seed_range.append(max(rewards) - min(rewards))
    return {
        "kl_ratio": max(kl_ok.values()) / min(kl_ok.values()) if kl_ok else math.nan,
        "kl_max_at": max(kl_ok, key=kl_ok.get) if kl_ok else math.nan,
        "kl_min_at": min(kl_ok, key=kl_ok.get) if kl_ok else math.nan,
        "reward_range": max(reward.values()) - min(reward.values()) if reward else math.nan,
        "reward_max_at": max(reward, key=reward.get) if reward else math.nan,
        "reward_min_at": min(reward, key=reward.get) if reward else math.nan,
        "per_seed_kl_ratio": per_seed_ratio,
        "per_seed_reward_range": per_seed_range,
    }


def ratio_interval(ratios: list[float]) -> str:
    """Geometric mean of ratios with the 95 % t interval of their logs, back-transformed."""
    if not ratios:
        return "—"
    mean, low, high = t_interval([math.log(r) for r in ratios])
    if math.isnan(low):
        return f"{math.exp(mean):.2f}"
    return f"{math.exp(mean):.2f} [{math.exp(low):.2f}, {math.exp(high):.2f}]"


def best_fixed_beta(runs: dict, baseline: str = "none") -> float | None:
    """The initial β whose fixed-β runs (``baseline``) have the highest seed-mean final reward."""
    rewards = {b: seed_mean(s, "reward") for b, s in _by(runs, baseline).items()}
    return max(rewards, key=rewards.get) if rewards else None


def paired(a: dict[int, dict], b: dict[int, dict], key: str) -> list[float]:
    """``a[seed][key] - b[seed][key]`` for the seeds both have (same starting model), by seed."""
    return [a[s][key] - b[s][key] for s in sorted(set(a) & set(b))]


def analyze_grid(paths: list[str], baseline: str = "none", target: str = "target") -> str:
    """Markdown tables of the β grid, per setting (tag without its β)."""
    out = []
    for base, grid in read_grid(paths).items():
        runs, kt = grid["runs"], grid["kl_target"]
        methods = list(dict.fromkeys(m for m, _, _ in sorted(runs, key=lambda k: (k[0] != baseline, k[0]))))
        out += [f"## β grid: {base}", "",
                f"Final values: means over the last {FINAL_STEPS} steps of each run; mean ± std over seeds. KL: "
                f"adaptive_kl/raw_kl; β: adaptive_kl/current_beta. kl_target {kt:g}."
                + (f" Stopped early (final values over the last {FINAL_STEPS} steps they reached; the 'last step' column "
                   f"is a row's shortest run): {', '.join(grid['incomplete'])}." if grid["incomplete"] else ""), "",
                "| method | initial β | seeds | last step | final KL | final reward | final length | final β |",
                "|---|---|---|---|---|---|---|---|"]
        for method in methods:
            for beta, per_seed in _by(runs, method).items():
                v = list(per_seed.values())
                col = lambda key, fmt: cell([x[key] for x in v], fmt)  # noqa: E731
                out.append(f"| `{method}` | {beta:g} | {len(v)} | {min(x['steps'] for x in v)} | {col('kl', '.4f')} | "
                           f"{col('reward', '.3f')} | {col('length', '.1f')} | {col('beta', '.4g')} |")
        out += ["", "**Spread across initial β** (of the seed means; per seed: the same within each seed, geometric "
                    "mean of the KL ratios with the 95 % t interval of their logs, mean of the reward ranges with "
                    "the 95 % t interval, over seeds)", "",
                "| method | initial β | final KL max / min | KL max at β / min at β | per seed: KL ratio | final reward "
                "range | reward max at β / min at β | per seed: reward range |", "|---|---|---|---|---|---|---|---|"]
        for method in methods:
            by_beta = _by(runs, method)
            s = spread(by_beta)
            out.append(f"| `{method}` | {', '.join(f'{b:g}' for b in by_beta)} | {s['kl_ratio']:.2f} | "
                       f"{s['kl_max_at']:g} / {s['kl_min_at']:g} | {ratio_interval(s['per_seed_kl_ratio'])} | "
                       f"{s['reward_range']:.3f} | {s['reward_max_at']:g} / {s['reward_min_at']:g} | "
                       f"{fmt_interval(s['per_seed_reward_range'], '.3f') if s['per_seed_reward_range'] else '—'} |")
        by_target = _by(runs, target)
        if by_target:
            out += ["", f"**`{target}`: final KL / kl_target ({kt:g})** per initial β: mean [95 % t interval over "
                        f"seeds]; within ±{TRACKING:.0%}: seeds whose ratio is in [{1 - TRACKING:g}, {1 + TRACKING:g}]",
                    "", "| initial β | seeds | KL / kl_target | per seed | within ±25 % |", "|---|---|---|---|---|"]
            for beta, per_seed in by_target.items():
                ratios = [per_seed[s]["kl"] / kt for s in sorted(per_seed)]
                inside = sum(abs(r - 1) <= TRACKING for r in ratios)
                out.append(f"| {beta:g} | {len(ratios)} | {fmt_interval(ratios, '.2f').replace(' *', '')} | "
                           f"{', '.join(format(r, '.2f') for r in ratios)} | {inside}/{len(ratios)} |")
        best = best_fixed_beta(runs, baseline)
        if best is not None:
            ref = _by(runs, baseline)[best]
            out += ["", f"**The best fixed β against every start**: `{baseline}` at β {best:g} (the highest seed-mean "
                        f"final reward of `{baseline}`, picked on these same runs, which favours it). Δ: the method "
                        "minus that run, on the same seed (same starting model), mean [95 % t interval over seeds] "
                        "(* excludes 0)", "",
                    "| method | initial β | Δ final reward | Δ final KL |", "|---|---|---|---|"]
            for method in [m for m in methods if m != baseline]:
                for beta, per_seed in _by(runs, method).items():
                    dr, dk = paired(per_seed, ref, "reward"), paired(per_seed, ref, "kl")
                    out.append(f"| `{method}` | {beta:g} | {fmt_interval(dr, '.3f') if dr else '—'} | "
                               f"{fmt_interval(dk, '.4f') if dk else '—'} |")
        out.append("")
    return "\n".join(out)


def plot_grid(paths: list[str], path: str) -> str:
    """Final KL (log y) and final reward against the initial β (log x), a line per method (mean over
    seeds) with a band from the lowest to the highest seed; one row of panels per setting."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "PNG skipped: matplotlib is not installed (pip install matplotlib)."
    grids = read_grid(paths)
    fig, axes = plt.subplots(len(grids), 2, figsize=(12, 4.5 * len(grids)), squeeze=False)
    colors = plt.get_cmap("tab10")
    for (base, grid), (ax_kl, ax_reward) in zip(grids.items(), axes):
        methods = list(dict.fromkeys(m for m, _, _ in sorted(grid["runs"])))
        for i, method in enumerate(methods):
            by_beta = _by(grid["runs"], method)
            betas = list(by_beta)
            for ax, key in ((ax_kl, "kl"), (ax_reward, "reward")):
                values = [[v[key] for v in by_beta[b].values() if not math.isnan(v[key])] for b in betas]
                keep = [j for j, v in enumerate(values) if v]
                xs = [betas[j] for j in keep]
                ax.plot(xs, [sum(values[j]) / len(values[j]) for j in keep], "o-", color=colors(i), label=method)
                ax.fill_between(xs, [min(values[j]) for j in keep], [max(values[j]) for j in keep], color=colors(i),
                                alpha=0.15, linewidth=0)
        ax_kl.axhline(grid["kl_target"], color="gray", linestyle="--", linewidth=1, label="kl_target")
        ax_kl.axhspan(grid["kl_target"] * (1 - TRACKING), grid["kl_target"] * (1 + TRACKING), color="gray", alpha=0.08)
        ax_kl.set_yscale("log")
        ax_kl.set_ylabel(f"final KL (last {FINAL_STEPS} steps)")
        ax_reward.set_ylabel(f"final reward (last {FINAL_STEPS} steps)")
        for ax in (ax_kl, ax_reward):
            ax.set_xscale("log")
            ax.set_xlabel("initial β")
            ax.grid(alpha=0.3, which="both")
            ax.set_title(base, fontsize=9)
        ax_kl.legend(fontsize=8)
    fig.suptitle("β grid: mean over seeds, band: lowest to highest seed", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"
