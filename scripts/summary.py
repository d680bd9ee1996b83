"""What `make run` measured, in one page: <out-dir>/summary.md from the JSON files the steps wrote.

    python scripts/summary.py --out-dir out/ml-100k --model out/ml-100k/models/centroid+gti+sft

Reads 01-07's JSON summaries (and baselines/sasrec.py's); writes <out-dir>/summary.md: 06's test tables
under both protocols (model, most popular, SASRec; cold targets), model - most popular with its paired
bootstrap interval, 05's validation curve, and the time of each step. Nothing is typed by hand: the
README's quick-start numbers and results/<dataset>_make_run.md are copies of this file.
"""
import argparse
import json
import os
import platform
import sys
import time

METRICS = ["recall@1", "recall@5", "recall@10", "recall@20", "ndcg@5", "ndcg@10", "ndcg@20"]


def load(path, hint):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"error: {path}: {'not found' if not os.path.exists(path) else type(e).__name__}; {hint}")


def table(ev, name):
    cols = [m for m in METRICS if m in ev["model"]]
    rows = [(f"{name} (all, n={ev['users']})", ev["model"]), ("most popular", ev["most_popular"])]
    rows += [("SASRec", ev["sasrec"])] if "sasrec" in ev else []
    if ev.get("cold_users"):
        cold = f"cold: test item seen <= {ev['cold_max']} times, n={ev['cold_users']}"
        rows += [(f"{name} ({cold})", ev["cold_model"]), ("most popular (cold)", ev["cold_most_popular"])]
        rows += [("SASRec (cold)", ev["cold_sasrec"])] if "cold_sasrec" in ev else []
    out = ["| | " + " | ".join(c.replace("recall", "Recall").replace("ndcg", "NDCG") for c in cols) + " |",
           "|---" * (len(cols) + 1) + "|"]
    out += [f"| {label} | " + " | ".join(f"{m[c]:.4f}" for c in cols) + " |" for label, m in rows]
    diff = ev.get("model_minus_most_popular", {})
    ci = [f"{k.replace('recall', 'Recall').replace('ndcg', 'NDCG')} {v[0]:+.4f} [{v[1]:+.4f}, {v[2]:+.4f}]"
          for k, v in diff.items() if k in ("recall@10", "ndcg@10")]
    if ci:
        out += ["", f"{name} - most popular (paired bootstrap over users, 95%): " + ", ".join(ci) + "."]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default="out/ml-100k", help="the folder `make run` wrote")
    p.add_argument("--model", default="", help="the fine-tuned folder (default: <out-dir>/models/centroid+gti+sft)")
    p.add_argument("--command", default="make run", help="the command that produced the run (printed)")
    a = p.parse_args()
    o, model = a.out_dir, a.model or os.path.join(a.out_dir, "models", "centroid+gti+sft")
    grounded = model[:-len("+sft")] if model.endswith("+sft") else model
    name = os.path.basename(model.rstrip("/"))
    hint = f"run `{a.command}` first"
    s05 = load(f"{model}/05_sft.json", hint)
    per_epoch = max(1, s05["examples"] + s05["aux_examples"])            # 05's epoch: every example once
    epochs = lambda step: step * s05["batch_size"] * s05["grad_accum"] / per_epoch  # noqa: E731
    s01, s02 = load(f"{o}/01_embed_items.json", hint), load(f"{o}/02_rqvae.json", hint)
    s03, s07 = load(f"{o}/03_expand_vocab.json", hint), load(f"{o}/diagnostics.json", hint)
    s04 = load(f"{grounded}/04_ground.json", hint)
    ev, keep = load(f"{model}/eval_test.json", hint), load(f"{model}/eval_test_keep.json", hint)
    sas = load(f"{o}/sasrec/eval_test.json", hint) if os.path.exists(f"{o}/sasrec/eval_test.json") else None
    L = [f"# `{a.command}`: what it measured ({s01['dataset']})", "",
         f"Written by `python scripts/summary.py --out-dir {o}` at the end of `{a.command}` "
         f"({time.strftime('%Y-%m-%d', time.gmtime())}, {platform.machine()}, {os.cpu_count()} CPU cores, "
         f"{ev.get('autocast', '')}).", "",
         f"{s01['num_users']} users, {s01['num_items']} items, {s01['num_interactions']} interactions; "
         f"SIDs: {s02['quantizer']}, codebooks {s02['codebook_sizes']}, {s02['unique_sids']} unique; "
         f"05: {s05['steps']} steps x {s05['batch_size']} examples ({epochs(s05['steps']):.2f} epochs).", "",
         "## At a glance", "",
         f"Test split, history excluded (`{model}/eval_test.json`): the leave-one-out test item of "
         f"every user, ranked among all items by {ev['search']} search (beam {ev['beam']}), the items "
         "the user has seen removed.", ""]
    L += table(ev, name)
    glance_end = len(L)
    L += ["", f"## Test, history kept (`{model}/eval_test_keep.json`)", ""] + table(keep, name)
    L += ["", f"## 05's validation curve ({s05['val_examples']} users)", "",
          "| step | epochs | val loss | val SID-token accuracy |", "|---|---|---|---|"]
    ranked = {step: (r, n) for step, r, n in s05.get("rank_curve", [])}
    if ranked:          # 05 --rank-users: 06's Recall/NDCG@10 on the validation item
        L[-2:] = [L[-2][:-1] + f"| val Recall@10, NDCG@10 ({s05['rank_users']} users) |",
                  "|---|---|---|---|---|"]
    for step, loss, acc in s05["val_curve"]:
        rn = " %.4f, %.4f |" % ranked[step] if step in ranked else ""
        L.append(f"| {step} | {epochs(step):.2f} | {loss:.3f} | {acc:.3f} |" + rn)
    by = "highest validation NDCG@10" if s05.get("select") == "ndcg" else "lowest validation loss"
    L += ["", f"best step {s05['best_step']} ({by}) is the saved model.", ""]
    t03 = sum(v["seconds"] for v in s03.values() if isinstance(v, dict) and "seconds" in v)
    steps = [("01_embed_items.py", s01["seconds"]), ("02_rqvae.py", s02["seconds"]),
             ("03_expand_vocab.py (all inits)", t03), ("04_ground.py", s04["seconds"]),
             ("05_sft.py", s05["seconds"])]
    steps += [("baselines/sasrec.py", sas["seconds"])] if sas else []
    steps += [("06_eval.py (both protocols)", ev["seconds"]), ("07_diagnose.py", s07["seconds"])]
    L += ["## Time per step", "", "| step | seconds |", "|---|---|"]
    L += [f"| {name} | {sec:.0f} |" for name, sec in steps]
    total = sum(s for _, s in steps)
    L += [f"| total | {total:.0f} ({total / 60:.1f} min) |", ""]
    L[glance_end:glance_end] = ["", f"Time of the steps, by their own clocks: {total / 60:.1f} min."]
    path = os.path.join(o, "summary.md")
    with open(path + ".tmp", "w") as f:
        f.write("\n".join(L))
    os.replace(path + ".tmp", path)
    print("\n".join(L[L.index("## At a glance"):glance_end + 2]))    # what the README shows
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
