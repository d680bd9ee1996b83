"""Which rows for a collision-suffix level? The measurement behind 03's --centroid-scale / --suffix-rows defaults.

TIGER's SIDs end with a suffix level that numbers the items sharing the first L codes (`<d_0>` for 98% of
ML-100K's items). Its "centroids" are the mean of almost all items, so with one scale for all levels
(03 --centroid-scale matched) its rows sit in the middle of the SID cloud, and the former study found that
the tied output head then does not learn that level (results/ml-100k_why.md). Two fixes, measured here
against the former default, each from 03 through the first --stop-at steps of 05's default schedule
(220 steps, validation every --eval-every steps; the same schedule as `make run` and the study):

  matched          03 --centroid-scale matched --suffix-rows centroid   (the former default)
  level            03 --centroid-scale level   --suffix-rows centroid   (each level centered and scaled alone)
  matched+random   03 --centroid-scale matched --suffix-rows random     (the suffix level gets random rows)

Reported per config and seed: validation loss and per-level accuracy (a / b / c / d) at every
validation, from the resume checkpoint 05 leaves at --stop-at (its `state`). Finished runs are skipped.
Writes results/<dataset>_suffix.md and .json.

CPU:  python scripts/suffix_study.py                 (3 configs x 2 seeds x 66 steps: ~20 min on 2 cores)
"""
import argparse
import json
import os
import shutil
import time

import torch

from grounding_study import REPO, link_artifacts, sh, shared_artifacts   # same folder: the runner and the links

CONFIGS = {"matched": ["--centroid-scale", "matched", "--suffix-rows", "centroid"],
           "level": ["--centroid-scale", "level", "--suffix-rows", "centroid"],
           "matched+random": ["--centroid-scale", "matched", "--suffix-rows", "random"]}


def run_one(a, src, config, seed):
    """03 + the first --stop-at steps of 05 for one config and seed -> {val_curve, val_level_acc, seconds}."""
    work = os.path.join(REPO, a.work_dir, config, f"seed{seed}")
    done = os.path.join(work, "curve.json")
    if os.path.exists(done):
        return json.load(open(done))
    link_artifacts(src, work)
    t0 = time.time()
    base, save = os.path.join(work, "models", "centroid"), os.path.join(work, "models", "centroid+sft")
    sh("03_expand_vocab.py", "--out-dir", work, "--model", a.backbone, "--init", "centroid", "--seed", seed,
       *CONFIGS[config])
    sh("05_sft.py", "--model", base, "--save", save, "--out-dir", work, "--eval-every", a.eval_every,
       "--stop-at", a.stop_at, "--seed", seed, "--no-resume")
    ckpt = save + ".resume.pt"
    state = torch.load(ckpt, weights_only=True, mmap=True)["state"]   # only the loop state is read
    out = {"config": config, "seed": seed, "args_03": CONFIGS[config], "stop_at": a.stop_at,
           "val_curve": state["val_curve"], "val_level_acc": state["val_level_acc"],
           "seconds": round(time.time() - t0, 1)}
    with open(done + ".tmp", "w") as f:
        json.dump(out, f, indent=2)
    os.replace(done + ".tmp", done)
    os.remove(ckpt)                                                   # ~2.7 GB of weights per run
    shutil.rmtree(base)
    shutil.rmtree(save)
    return out


def report(a, runs) -> str:
    steps = [s for s, _, _ in runs[0]["val_curve"]]
    lines = [f"# Suffix-level rows: which 03 default (ML-100K, `python scripts/suffix_study.py`)", "",
             f"03 --init centroid, then 05's default schedule (220 steps x 8 windows, lr 1e-3, level softmax) "
             f"stopped after step {a.stop_at}; validation on 128 users. Accuracy = argmax within each level.", "",
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
    p.add_argument("--stop-at", type=int, default=66, help="05 stops after this step of its 220-step schedule")
    p.add_argument("--eval-every", type=int, default=22)
    p.add_argument("--work-dir", default="runs/suffix")
    p.add_argument("--results-dir", default="results")
    a = p.parse_args()
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
