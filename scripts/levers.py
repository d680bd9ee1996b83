"""Levers for quality per CPU minute: `make run`'s SFT chain with one setting changed at a time, each
scored on the validation item (06 --split valid, all users, history excluded, beam 20) and compared
with today's default by a paired bootstrap over users. No test item is read for any choice.

    python scripts/levers.py                      # every lever not yet run (resumable: one per call is fine)
    python scripts/levers.py --levers lr2e-3      # one of them
    python scripts/levers.py --report-only        # the table from the finished runs

Needs `make run` (out/ml-100k: dataset.pt, item_emb.npy, models/centroid+gti and its +sft). A lever
runs in out/ml-100k/levers/<name> (the 3-token lever also re-runs 02-04 there, ~4 min; logs in
<name>/logs/); each piece keeps its 05_sft.json and eval_valid.json, so a killed run continues
with the next call.
Writes results/ml-100k_levers.md (the table, the 05 seconds of each run, the commands).
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from study import BACKBONE, REPO, ev, link_artifacts, run_script  # noqa: E402  (study.py's runner; ev = 06's metrics)
from common import atomic_write  # noqa: E402
OUT = "out/ml-100k"
GROUNDED = f"{OUT}/models/centroid+gti"      # make run's 04 output: the default chain's input to 05
# name: (what changes, 05 flags, quantizer flags for a separate 02-04 or None)
LEVERS = {
    "default": ("make run's 05 (lr 1e-3, 220 steps x 8 windows, max history 20)", None, None),
    "lr2e-3": ("peak learning rate 2e-3", ["--lr", "2e-3"], None),
    "max-history10": ("windows of 11 items (max history 10)", ["--max-history", "10"], None),
    "batch16": ("16 windows per step, 110 steps (same windows, half the steps)",
                ["--batch-size", "16", "--steps", "110", "--eval-every", "55"], None),
    "3-token": ("collision-free 3-token SIDs (02 --collisions reassign), 02-04 rerun", [],
                ["--collisions", "reassign"]),
}


def sh(cmd, logs):
    """One step through study.py's run_script: its output in <logs>/<script>.log, one line and
    exit on failure."""
    print("+ python", " ".join(cmd), flush=True)
    run_script(cmd[0], cmd[1:], os.path.join(logs, f"{cmd[0]}.log"))


def model_of(name):
    return f"{OUT}/models/centroid+gti+sft" if name == "default" else f"{OUT}/levers/{name}/sft"


def run_lever(name):
    _, sft_flags, quant = LEVERS[name]
    work = f"{OUT}/levers/{name}"
    os.makedirs(os.path.join(REPO, work), exist_ok=True)
    log, model, out_dir, grounded = f"{REPO}/{work}/logs", model_of(name), OUT, GROUNDED
    if quant is not None:                          # own SIDs: 02-04 in <work>, 01's files linked
        out_dir, grounded = work, f"{work}/models/centroid+gti"
        link_artifacts(f"{REPO}/{OUT}", f"{REPO}/{work}", ("dataset.pt", "item_emb.npy", "01_embed_items.json"))
        if not os.path.exists(f"{REPO}/{grounded}/04_ground.json"):
            sh(["02_rqvae.py", "--out-dir", work, *quant], log)
            sh(["03_expand_vocab.py", "--out-dir", work, "--model", BACKBONE, "--init", "centroid"], log)
            sh(["04_ground.py", "--out-dir", work, "--model", f"{work}/models/centroid", "--steps", "120"],
               log)
    if sft_flags is not None and not os.path.exists(f"{REPO}/{model}/05_sft.json"):
        sh(["05_sft.py", "--out-dir", out_dir, "--model", grounded, "--save", model, *sft_flags], log)
    if not os.path.exists(f"{REPO}/{model}/eval_valid.json"):
        sh(["06_eval.py", "--out-dir", out_dir, "--model", model, "--split", "valid",
            "--protocol", "excluded"], log)


def report(names):
    data = torch.load(f"{REPO}/{OUT}/dataset.pt", map_location="cpu", weights_only=True)
    targets = data["valid"].numpy()
    base = None
    rows = ["| lever | what changes | val Recall@10 | val NDCG@10 | Recall@10 - default [95%] | "
            "NDCG@10 - default [95%] | 05 seconds |", "|---|---|---|---|---|---|---|"]
    for name in names:
        m = f"{REPO}/{model_of(name)}"
        if not os.path.exists(f"{m}/eval_valid.json"):
            continue
        per = ev.per_user_metrics(np.load(f"{m}/eval_valid_topk.npy", allow_pickle=False), targets)
        sec = json.load(open(f"{m}/05_sft.json"))["seconds"]
        if base is None:
            base = per
        d = {k: ev.paired_bootstrap(per[k], base[k]) for k in ("recall@10", "ndcg@10")}
        cell = lambda v: "-" if per is base else f"{v[0]:+.4f} [{v[1]:+.4f}, {v[2]:+.4f}]"  # noqa: E731
        rows.append(f"| {name} | {LEVERS[name][0]} | {per['recall@10'].mean():.4f} | "
                    f"{per['ndcg@10'].mean():.4f} | {cell(d['recall@10'])} | {cell(d['ndcg@10'])} | "
                    f"{sec:.0f} |")
    text = ["# Levers for quality per CPU minute (ml-100k, validation split)", "",
            f"Written by `python scripts/levers.py` ({time.strftime('%Y-%m-%d', time.gmtime())}, "
            f"{os.cpu_count()} CPU cores, one lever at a time, seed 0). Every row is `make run`'s chain "
            "(centroid init + GTI, then 05) with one change; 06 ranks every user's validation item "
            f"({len(targets)} users, history excluded, beam 20). Intervals: paired bootstrap over users "
            "(2000 draws), one seed: the seed-to-seed spread is not in them. 05 seconds: training "
            "only, by 05's clock.", "", *rows, ""]
    os.makedirs(f"{REPO}/results", exist_ok=True)
    atomic_write(f"{REPO}/results/ml-100k_levers.md", lambda t: open(t, "w").write("\n".join(text)))
    print("\n".join(rows))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levers", default=",".join(LEVERS), help="comma-separated names of LEVERS")
    p.add_argument("--report-only", action="store_true", help="run nothing; the table from finished runs")
    a = p.parse_args()
    names = a.levers.split(",")
    if bad := [n for n in names if n not in LEVERS]:
        sys.exit(f"error: unknown lever(s) {bad}; choose from {list(LEVERS)}")
    if not os.path.exists(f"{REPO}/{GROUNDED}/04_ground.json"):
        sys.exit(f"error: {GROUNDED} not found; run `make run` first")
    for name in [] if a.report_only else ["default"] + [n for n in names if n != "default"]:
        run_lever(name)
    report(["default"] + [n for n in LEVERS if n != "default"])


if __name__ == "__main__":
    main()
