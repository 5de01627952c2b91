"""Study 49's pre-registered analysis (docs/evidence/study49-target.md): the new ``target`` and ``ziegler`` (study 33's
``target``) at kl_target 0.04, 0.099 and 0.0062, against study 33's phase-1 fixed-β runs paired by seed.

    python research/study49/report.py research/data/study49-seed*-?      # the page's tables and criteria
    python research/study49/report.py research/data/study49-seed*-? --design2 research/data/study49d2-*   # Amendment 1

Each argument is a directory a ``study33:study49-seedS-X`` call wrote (its ``*-stream.jsonl[.gz]`` and
``*-runs.tar.xz``, whose ``runs/<run>/log.txt`` holds the controller's warnings; research/data keeps the archives
recompressed, a ``.tar.gz`` as a call returns it is read too); the fixed-β comparators are read from
``research/data/study33-p1-*`` (``--phase1`` to change). Every number is computed with study 33's own
functions (``research/harness/analysis.py``: final window, seed values over copies, runaway rule, TOST); nothing here
defines a statistic the page does not.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import math
import os
import re
import sys
import tarfile
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from research.harness import analysis as A  # noqa: E402
from unsloth_adaptive_kl import metrics  # noqa: E402

REACHABLE_TARGET, HIGH_TARGET, UNREACHABLE_TARGET = 0.04, 0.099, 0.0062
# The comparators the page fixes before any run: {kl_target: (runaway comparator β, reward comparator β, also shown)}
COMPARATORS = {REACHABLE_TARGET: (0.01, 0.01, 0.3), HIGH_TARGET: (0.001, 0.1, None)}
H1_RUNS, H1_PER_BETA0 = 14, 4  # of 15 runs, of 5 seeds a β0
U_BETA0, U1_BY_UPDATE, U2_RANGE = 0.1, 60, (0.02, 0.5)  # the unreachable cell's β0 and U1/U2's bounds
NUMBER = r"\d+(?:\.\d+)?(?:e[+-]?\d+)?"
WARNING = re.compile(rf"kl_target=(?P<kt>{NUMBER}) is not reachable in this run.*?Beta is capped at (?P<cap>{NUMBER}) "
                     r"from optimizer step (?P<step>\d+)", re.S)
# A run's log; its spec.json beside it names the run (a list of one run names its directory "<method>-seed<S>" alone,
# several runs add "-b<β0>[-kt<kl_target>]...": the name is read only where an archive has no spec.json)
RUN_LOG = re.compile(r"(?:^|/)runs/(?P<run>[^/]+)/log\.txt$")
RUN_DIR = re.compile(rf"^(?P<method>[a-z_+]+)-seed(?P<seed>\d+)-b(?P<beta>{NUMBER})(?:-kt(?P<kt>{NUMBER}))?")


def streams(directories: list[str]) -> list[str]:
    return sorted(p for d in directories for p in glob.glob(os.path.join(d, "*-stream.jsonl*")))


def warnings(directories: list[str]) -> dict[tuple, list[tuple[float, int]]]:
    """{(method, seed, β0, kl_target): [(the β the warning caps at, its step), ...]} from every run log in the calls'
    runs archives (one entry per copy that warned)."""
    out: dict[tuple, list[tuple[float, int]]] = {}
    for archive in (p for d in directories for p in glob.glob(os.path.join(d, "*-runs.tar.*"))):
        with tarfile.open(archive) as tar:
            members = {m.name: m for m in tar.getmembers() if m.isfile()}
            for path, member in members.items():
                log = RUN_LOG.search(path)
                if not log:
                    continue
                found = list(WARNING.finditer(tar.extractfile(member).read().decode("utf-8", "replace")))
                if not found:
                    continue
                run = _run_of(tar, members.get(path[: -len("log.txt")] + "spec.json"), log["run"], archive)
                for w in found:
                    key = (run[0], run[1], run[2], float(w["kt"]))
                    out.setdefault(key, []).append((float(w["cap"]), int(w["step"])))
    return out


def _run_of(tar: tarfile.TarFile, spec: tarfile.TarInfo | None, name: str, archive: str) -> tuple[str, int, float]:
    """(method, seed, β0) of a run: from its spec.json (the harness's record of what it trained), else its name."""
    if spec is not None:
        record = json.load(tar.extractfile(spec))
        return record["method"], int(record["seed"]), float(record["settings"]["beta"])
    named = RUN_DIR.match(name)
    if not named:
        raise ValueError(f"{archive}: run {name!r} has no spec.json and its name does not give its β0")
    return named["method"], int(named["seed"]), float(named["beta"])


def within_cap(beta: float, cap: float) -> bool:
    """U2's "never above the warning's cap": the warning prints its cap to 4 significant digits (``%.4g``), so β is
    compared at that precision (β 0.191111 is within a cap printed 0.1911; 0.19116 rounds to 0.1912 and is not)."""
    return float(f"{beta:.4g}") <= cap


def declared_step(rows: list[dict]) -> int | None:
    """The page's "declared": the first step whose logged adaptive_kl/target_reachable is 0."""
    return next((r["step"] for r in rows if r.get(metrics.TARGET_REACHABLE) == 0), None)


def betas(rows: list[dict]) -> list[float]:
    return [r[metrics.CURRENT_BETA] for r in rows if r.get(metrics.CURRENT_BETA) is not None]


def runaways(cell: dict[int, list[list[dict]]], steps: int, threshold: float) -> int:
    """How many copies of a cell ({seed: copies}) ran away by section 7's rule (every copy a draw)."""
    return sum(A.copy_numbers(rows, steps, threshold)["runaway_step"] is not None for copies in cell.values() for rows in copies)


def held(kl: float | None, kl_target: float) -> bool:
    return kl is not None and kl > 0 and abs(math.log(kl / kl_target)) <= A.KL_RATIO_MARGIN


def design_two(directories: list[str], design2: list[str], workdir: str) -> tuple[list[str], dict, list[str]]:
    """Amendment 1: design 2's runs. A design-1 ``target`` run whose logged KL, replayed through design 2, gives the
    same β at every step (research/study49/replay.py) is design 2's run: it is kept, its ``adaptive_kl/target_reachable``
    set from the replay (0 from the step design 2 declares at) and the replay's warning (cap, step) added. A run whose
    replay diverges is replaced by its rerun from ``design2`` (the calls that ran design 2; their logs hold the
    warnings). Returns (the stream paths to read, the added warnings, one line per replaced or relabelled run)."""
    from research.study49 import replay

    diverging, declared, notes = set(), {}, []
    for (beta0, kl_target, seed, _copy), rows in replay.target_runs(directories).items():
        same, diverges, step, _one, cap = replay.compare_designs(rows)
        if not same:
            raise ValueError(f"design 1 does not reproduce the logged β of target β0 {beta0:g} kl_target {kl_target:g} seed {seed}")
        if diverges is not None:
            diverging.add((beta0, kl_target, seed))
        elif step is not None:
            declared[(beta0, kl_target, seed)] = (step, cap)
    reruns = {(r[0], r[1], r[2]) for r in replay.target_runs(design2)}
    missing = sorted(diverging - reruns)
    if missing:
        raise ValueError(f"design 2 trains these runs differently and they have no rerun in {design2}: {missing}")
    merged = os.path.join(workdir, "design2-stream.jsonl")
    with open(merged, "w") as out:
        for path in streams(directories):
            with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
                for line in f:
                    row = json.loads(line)
                    key = (row.get("beta0"), row.get("kl_target"), row.get("seed"))
                    if row.get("method") == "target":
                        if key in diverging:
                            continue
                        if key in declared:
                            row[metrics.TARGET_REACHABLE] = 0.0 if row["step"] >= declared[key][0] else 1.0
                    out.write(json.dumps(row) + "\n")
    warned = {("target", seed, beta0, kt): [(float(f"{cap:.4g}"), step)] for (beta0, kt, seed), (step, cap) in declared.items()}
    notes += [f"target β0 {b:g} kl_target {kt:g} seed {s}: design 1's run (identical β under design 2), declared by design 2 "
              f"at step {st} (replayed)" for (b, kt, s), (st, _) in sorted(declared.items())]
    notes += [f"target β0 {b:g} kl_target {kt:g} seed {s}: design 2's rerun (design 1's run diverges under design 2)"
              for (b, kt, s) in sorted(diverging)]
    return [merged] + streams(design2), warned, notes


def report(directories: list[str], phase1: list[str], design2: list[str] | None = None) -> str:
    if design2 is not None:
        with tempfile.TemporaryDirectory() as workdir:
            paths, replayed, notes = design_two(directories, design2, workdir)
            warned = {**warnings(directories + design2), **replayed}
            text = _report(paths, phase1, warned, "design 2 (Amendment 1)")
        return text + "\n## Design 2's runs\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    return _report(streams(directories), phase1, warnings(directories), "design 1")


def _report(paths: list[str], phase1: list[str], warned: dict, design: str) -> str:
    runs, planned = A.study_cells(paths + phase1)
    if len(runs) != 1:
        raise ValueError(f"expected one family of settings (study 33's long task), got {sorted(runs)}")
    (family, cells), = runs.items()
    steps = planned[family]
    _, natural_key, natural = A.natural_kl(cells, steps)
    threshold = A.RUNAWAY_KL_FACTOR * natural
    fixed = {k.beta: v for k, v in A.fixed_cells(cells).items()}
    controlled = {k: v for k, v in cells.items() if k.kl_target is not None and k.default_placement}
    out = [f"# Study 49, {design} ({family}; {steps} planned steps, final window {A.final_window_start(steps) + 1}-{steps})", "",
           f"K_nat (best fixed β > 0 of phase 1, {natural_key.beta:g}): {natural:.4g}; runaway threshold "
           f"{A.RUNAWAY_KL_FACTOR:g} x = {threshold:.4g}.", "",
           "| method | β0 | kl_target | seeds | copies (complete) | held (±25 %) | KL / kl_target: mean | 90 % CI | verdict "
           "| final reward | final length | runaways | declared (step) | β min | β max |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    summary: dict = {}
    for key, by_seed in sorted(controlled.items(), key=lambda kv: (kv[0].kl_target, kv[0].method, kv[0].beta)):
        kls = {s: A.seed_values(c, steps, "kl") for s, c in by_seed.items()}
        logs = [math.log(v / key.kl_target) for v in kls.values() if v and v > 0]
        hold = A.tost(logs, A.KL_RATIO_MARGIN)
        copies = [rows for c in by_seed.values() for rows in c]
        numbers = [A.copy_numbers(rows, steps, threshold) for rows in copies]
        declared = {s: [declared_step(rows) for rows in c] for s, c in by_seed.items()}
        every_beta = [b for rows in copies for b in betas(rows)]
        n_held = sum(held(v, key.kl_target) for v in kls.values())
        summary[key] = dict(held=n_held, seeds=len(by_seed), tost=hold, runaways=runaways(by_seed, steps, threshold), by_seed=by_seed)
        ratio = f"{math.exp(hold.mean):.2f}" if logs else "—"
        ci = f"[{math.exp(hold.low90):.2f}, {math.exp(hold.high90):.2f}]" if hold.n >= 2 else "—"
        dec = ", ".join(f"s{s}: {'/'.join('—' if d is None else str(d) for d in ds)}" for s, ds in sorted(declared.items()))
        out.append(f"| `{key.method}` | {key.beta:g} | {key.kl_target:g} | {len(by_seed)} | {len(numbers)} "
                   f"({sum(n['complete'] for n in numbers)}) | {n_held}/{len(by_seed)} | {ratio} | {ci} | {hold.verdict} | "
                   f"{A.cell_text([A.seed_values(c, steps, 'reward') for c in by_seed.values()], '.3f')} | "
                   f"{A.cell_text([A.seed_values(c, steps, 'length') for c in by_seed.values()], '.1f')} | "
                   f"{summary[key]['runaways']} | {dec} | {min(every_beta):.4g} | {max(every_beta):.4g} |")
    out += ["", "## Comparators (study 33 phase 1, fixed β, paired by seed)", "",
            "| fixed β | seeds | final reward | final KL | runaways |", "|---|---|---|---|---|"]
    for beta in sorted(fixed):
        out.append(f"| {beta:g} | {len(fixed[beta])} | {A.cell_mean(fixed[beta], steps, 'reward'):.3f} | "
                   f"{A.cell_mean(fixed[beta], steps, 'kl'):.4f} | {runaways(fixed[beta], steps, threshold)} |")
    out += ["", "## Criteria", ""] + criteria(summary, fixed, steps, threshold, warned)
    return "\n".join(out) + "\n"


def _cells(summary: dict, method: str, kl_target: float) -> dict:
    return {k: v for k, v in summary.items() if k.method == method and k.kl_target == kl_target}


def per_beta0(cells: dict, key: str, of_seeds: bool = False) -> str:
    return ", ".join(f"{k.beta:g}: {v[key]}" + (f"/{v['seeds']}" if of_seeds else "") for k, v in sorted(cells.items()))


def criteria(summary: dict, fixed: dict, steps: int, threshold: float, warned: dict) -> list[str]:
    out = []
    target, ziegler = _cells(summary, "target", REACHABLE_TARGET), _cells(summary, "ziegler", REACHABLE_TARGET)
    if target:
        runs = sum(v["seeds"] for v in target.values())
        n = sum(v["held"] for v in target.values())
        each = all(v["held"] >= H1_PER_BETA0 for v in target.values())
        tost_all = all(v["tost"].equivalent for v in target.values())
        z_runs, z_held = sum(v["seeds"] for v in ziegler.values()), sum(v["held"] for v in ziegler.values())
        complete = runs == 15 and len(target) == 3 and z_runs == 15
        met = n >= H1_RUNS and each and tost_all and z_held < H1_RUNS
        out.append(f"- **H1, held at {REACHABLE_TARGET:g}**: `target` {n} of {runs} runs within ±25 % (≥ {H1_RUNS} of 15 "
                   f"needed), per β0 {per_beta0(target, 'held', True)} "
                   f"(≥ {H1_PER_BETA0} each: {'yes' if each else 'no'}), TOST equivalent in every β0: "
                   f"{'yes' if tost_all else 'no'}; `ziegler` {z_held} of {z_runs} (fewer than {H1_RUNS} needed). "
                   f"**{'met' if met else 'not met'}**" + ("" if complete else " (incomplete: not all 15 + 15 runs yet)") + ".")
    for kt, (runaway_beta, reward_beta, also) in COMPARATORS.items():
        cells = _cells(summary, "target", kt)
        if not cells:
            continue
        limit = runaways(fixed.get(runaway_beta, {}), steps, threshold)
        worst = max(v["runaways"] for v in cells.values())
        partial = "" if len(cells) == 3 and all(v["seeds"] == 5 for v in cells.values()) else " (incomplete: not all 3 × 5 runs yet)"
        out.append(f"- **H2, runaways at {kt:g}**: `target` per β0 "
                   f"{per_beta0(cells, 'runaways')}; comparator β "
                   f"{runaway_beta:g}: {limit}. **{'met' if worst <= limit else 'not met'}**{partial}.")
        z = _cells(summary, "ziegler", kt)
        if z:
            out.append(f"  `ziegler` per β0: {per_beta0(z, 'runaways')}.")
        lines, equivalent = [], True
        for key, v in sorted(cells.items()):
            e = A.tost(A.paired_by_seed(v["by_seed"], fixed.get(reward_beta, {}), steps, "reward"), A.REWARD_MARGIN)
            equivalent &= e.equivalent
            lines.append(f"  | `target` β0 {key.beta:g} vs fixed β {reward_beta:g} | {A.fmt_equivalence(e)} |")
            if also is not None:
                e2 = A.tost(A.paired_by_seed(v["by_seed"], fixed.get(also, {}), steps, "reward"), A.REWARD_MARGIN)
                lines.append(f"  | `target` β0 {key.beta:g} vs fixed β {also:g} (reported) | {A.fmt_equivalence(e2)} |")
        out += [f"- **H3, reward at {kt:g}** (Δ final reward, paired by seed, margin ±{A.REWARD_MARGIN:g}): "
                f"{'equivalent in every β0: **met**' if equivalent else '**not met**'}{partial}" +
                ("" if kt == REACHABLE_TARGET else " (no fixed β reaches this target: reported against the best fixed β)") + ".",
                "", "  | comparison | Δ mean | 90 % CI | 95 % CI | verdict |", "  |---|---|---|---|---|", *lines, ""]
    unreachable = {k: v for k, v in _cells(summary, "target", UNREACHABLE_TARGET).items() if k.beta == U_BETA0}
    for key, v in sorted(unreachable.items()):
        u1, u2, detail = True, True, []
        for seed, copies in sorted(v["by_seed"].items()):
            named = warned.get(("target", seed, key.beta, key.kl_target), [])
            for i, rows in enumerate(copies):
                step = declared_step(rows)
                ok1 = step is not None and step <= U1_BY_UPDATE and bool(named)
                bs = betas(rows)
                in_range = all(U2_RANGE[0] <= b <= U2_RANGE[1] for b in bs)
                cap = named[0][0] if named else None
                after = [r[metrics.CURRENT_BETA] for r in rows if step is not None and r["step"] > step
                         and r.get(metrics.CURRENT_BETA) is not None]
                capped = cap is None or all(within_cap(b, cap) for b in after)
                u1, u2 = u1 and ok1, u2 and in_range and capped
                detail.append(f"seed {seed}{f' copy {i + 1}' if len(copies) > 1 else ''}: declared at "
                              f"{step if step is not None else 'never'}, warning {'caps β at %.4g' % cap if cap else 'none'}, "
                              f"β in [{min(bs):.4g}, {max(bs):.4g}], after the declaration ≤ cap: {'yes' if capped else 'no'}")
        out += [f"- **U1, {key.kl_target:g} from β0 {key.beta:g} declared by update {U1_BY_UPDATE}** with a warning, every seed: "
                f"**{'met' if u1 and v['seeds'] == 5 else 'not met'}**" + ("" if v["seeds"] == 5 else f" (incomplete: {v['seeds']} of 5 seeds)") + ".",
                f"- **U2, β within [{U2_RANGE[0]:g}, {U2_RANGE[1]:g}] and never above the warning's cap after it**: "
                f"**{'met' if u2 else 'not met'}**.", *[f"  - {d}" for d in detail]]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directories", nargs="+", help="the study49-seedS-X directories a call wrote")
    parser.add_argument("--phase1", nargs="*", default=None,
                        help="study 33's phase-1 streams (default: research/data/study33-p1-*/*-stream.jsonl.gz)")
    parser.add_argument("--design2", nargs="+", default=None, metavar="DIR",
                        help="Amendment 1: report design 2, from these reruns (study49d2-*) and the design-1 runs that "
                        "design 2 trains identically (their declarations replayed)")
    args = parser.parse_args(argv)
    phase1 = args.phase1 if args.phase1 is not None else sorted(glob.glob(os.path.join(ROOT, "research/data/study33-p1-*/*-stream.jsonl*")))
    print(report(args.directories, phase1, args.design2), end="")


if __name__ == "__main__":
    main()
