"""Which rows for a collision-suffix level? The measurement behind 03's --centroid-scale default.

TIGER's SIDs end with a suffix level that numbers the items sharing the first L codes (`<d_0>` for 98% of
ML-100K's items). Its "centroids" are the mean of almost all items, so with one scale for all levels
(03 --centroid-scale matched) its rows sit in the middle of the SID cloud, and the former study found that
the tied output head then does not learn that level (results/ml-100k_why.md). Two fixes, measured here
against the former default, each from 03 through the first --stop-at steps of 05's default schedule
(220 steps, validation every --eval-every steps; the same schedule as `make run` and the study):

  matched          03 --centroid-scale matched   (the former default)
  level            03 --centroid-scale level     (each level centered and scaled alone; 03's default now)
  matched+random   03 --centroid-scale matched, the suffix level's rows drawn like random init's instead
                   (random_suffix_rows below: 03's new_rows on the semantic levels, run in this process;
                   formerly 03 --suffix-rows random, the same rows)

Reported per config and seed: validation loss and per-level accuracy (a / b / c / d) at every
validation up to step --stop-at, read from 05_sft.json (05 runs its whole schedule: the curve up to a step does
not depend on where the run ends). Finished runs are skipped.
Writes results/<dataset>_suffix.md and .json.

CPU:  python scripts/suffix_study.py                 (3 configs x 2 seeds x 220 steps: ~65 min on 2 cores)
"""
import argparse
import json
import os
import shutil
import time

import torch

from grounding_study import REPO, link_artifacts, sh, shared_artifacts   # same folder: the runner and the links
from common import load_step                                              # grounding_study put REPO on sys.path

CONFIGS = {"matched": ["--centroid-scale", "matched"],          # 03's flags per config
           "level": ["--centroid-scale", "level"],
           "matched+random": ["--centroid-scale", "matched"]}
RANDOM_SUFFIX = {"matched+random"}                              # configs whose suffix rows are random_suffix_rows'
SUFFIX_SEED = 2                                                 # --seed offset of the random suffix rows


def random_suffix_rows(new_rows):
    """03's new_rows, except that with init centroid or shuffled the last level's rows are drawn like random init's
    (N(vocab mean, sigma^2), own generator) and the semantic levels get the rows 03 gives them without the suffix
    level (centered and scaled over those levels only)."""
    def rows(init, old, cents, scale="level", seed=0):
        if init not in ("centroid", "shuffled"):
            return new_rows(init, old, cents, scale, seed)
        gen = torch.Generator().manual_seed(seed + SUFFIX_SEED)
        tail = old.mean(0) + old.std(0) * torch.randn(len(cents[-1]), old.shape[1], generator=gen)  # (n_sfx, D)
        return torch.cat([new_rows(init, old, cents[:-1], scale, seed), tail])
    return rows


def expand_vocab(out_dir, backbone, config, seed, init="centroid"):
    """03 for one config, in this process (cwd: the repository). Its random-suffix configs swap 03's new_rows for
    random_suffix_rows' while 03 runs, when the SIDs end with a collision suffix (02's default; 02 --collisions
    reassign leaves no suffix level, and then the config is plain 03)."""
    step03 = load_step("03_expand_vocab")
    rq = torch.load(os.path.join(out_dir, "rqvae.pt"), weights_only=True)
    suffix = rq.get("config", {}).get("collisions", "suffix") == "suffix"
    argv = ["--out-dir", out_dir, "--model", backbone, "--init", init, "--seed", str(seed), *CONFIGS[config]]
    print("+ 03_expand_vocab.py", " ".join(argv), "(random suffix rows)" if config in RANDOM_SUFFIX else "",
          flush=True)
    new_rows = step03.new_rows
    if config in RANDOM_SUFFIX and suffix:
        step03.new_rows = random_suffix_rows(new_rows)
    try:
        step03.main(argv)
    finally:
        step03.new_rows = new_rows


def run_one(a, src, config, seed):
    """03 + the first --stop-at steps of 05 for one config and seed -> {val_curve, val_level_acc, seconds}."""
    work = os.path.join(REPO, a.work_dir, config, f"seed{seed}")
    done = os.path.join(work, "curve.json")
    if os.path.exists(done):
        return json.load(open(done))
    link_artifacts(src, work)
    t0 = time.time()
    base, save = os.path.join(work, "models", "centroid"), os.path.join(work, "models", "centroid+sft")
    expand_vocab(work, a.backbone, config, seed)
    sh("05_sft.py", "--model", base, "--save", save, "--out-dir", work, "--eval-every", a.eval_every, "--seed", seed)
    j = json.load(open(os.path.join(save, "05_sft.json")))       # the whole schedule; read up to --stop-at
    upto = lambda curve: [c for c in curve if c[0] <= a.stop_at]  # noqa: E731
    out = {"config": config, "seed": seed, "args_03": CONFIGS[config], "stop_at": a.stop_at,
           "val_curve": upto(j["val_curve"]), "val_level_acc": upto(j["val_level_acc"]),
           "seconds": round(time.time() - t0, 1)}
    with open(done + ".tmp", "w") as f:
        json.dump(out, f, indent=2)
    os.replace(done + ".tmp", done)
    shutil.rmtree(base)
    shutil.rmtree(save)
    return out


def report(a, runs) -> str:
    steps = [s for s, _, _ in runs[0]["val_curve"]]
    lines = [f"# Suffix-level rows: which 03 default (ML-100K, `python scripts/suffix_study.py`)", "",
             f"03 --init centroid, then 05's default schedule (220 steps x 8 windows, lr 1e-3, level softmax) "
             f"stopped after step {a.stop_at}; validation on 128 users. Accuracy = argmax within each level. "
             "matched+random: the suffix level's rows drawn like random init's (`random_suffix_rows`).", "",
             "| config (03 flags) | seed | val loss at step " + " / ".join(map(str, steps))
             + f" | accuracy a / b / c / d at {steps[-1]} |", "|---|---|---|---|"]
    for r in runs:
        acc = r["val_level_acc"][-1][1]
        lines.append(f"| {r['config']} (`{' '.join(r['args_03'])}`) | {r['seed']} | "
                     + " / ".join(f"{v:.3f}" for _, v, _ in r["val_curve"]) + " | "
                     + " / ".join(f"{x:.2f}" for x in acc) + " |")
    lines += ["", "Mean over seeds (val loss at the last validation; d accuracy):", ""]
    for c in CONFIGS:
        rs = [r for r in runs if r["config"] == c]
        if rs:
            v = [r["val_curve"][-1][1] for r in rs]
            d = [r["val_level_acc"][-1][1][3] for r in rs]
            lines.append(f"- {c}: val loss {sum(v) / len(v):.3f} (seeds: {', '.join(f'{x:.3f}' for x in v)}), "
                         f"d accuracy {sum(d) / len(d):.2f}")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="ml-100k")
    p.add_argument("--backbone", default="models/SmolLM2-135M-Instruct")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--stop-at", type=int, default=66, help="report the curves up to this step of 05's 220-step schedule")
    p.add_argument("--eval-every", type=int, default=22)
    p.add_argument("--work-dir", default="runs/suffix")
    p.add_argument("--results-dir", default="results")
    a = p.parse_args()
    os.chdir(REPO)                                                    # 03 runs in this process, 05 in a subprocess
    src = shared_artifacts(a.dataset)
    t0 = time.time()
    runs = [run_one(a, src, c, s) for s in a.seeds.split(",") for c in a.configs.split(",")]
    text = report(a, runs) + (f"\n{sum(r['seconds'] for r in runs):.0f} s of runs (03 + 05, 2 CPU cores); "
                              f"{time.time() - t0:.0f} s for this call.\n")
    os.makedirs(os.path.join(REPO, a.results_dir), exist_ok=True)
    base = os.path.join(REPO, a.results_dir, f"{a.dataset}_suffix")
    json.dump(runs, open(base + ".json", "w"), indent=2)
    open(base + ".md", "w").write(text)
    print(text)


if __name__ == "__main__":
    main()
