"""Does GTI grounding erode centroid geometry, or does a too-large learning rate? (04's study)

At lr 1e-2, Adam moves each coordinate of a new row by up to ~lr per step: for plain-scale centroid rows
(spread ~0.1-1 per coordinate after the mean shift) that is the whole spread within a few steps, so
"grounding erodes centroid geometry" and "the step is too large" cannot be told apart. This script grounds
the centroid rows at several learning rates, at both centroid scales (plain = the paper's mean shift only,
matched = scaled to the vocabulary's spread), with the loss averaged over tokens (04's loss) or per
direction (directions_loss below, run through 04 in this process; formerly 04 --loss-average
directions), then measures after grounding:
  held-out text->SID accuracy per level (04_ground.json, argmax within each level's tokens),
  RSA of the rows to the item-space centroids and purity@10 of the items' mean SID rows (07).

Each (scale) gets a work folder runs/grounding/<scale>/ holding links to 01/02's artifacts, its own
03 centroid folder and the grounded folders; finished folders are skipped (resumable).
Writes results/<dataset>_grounding.md and .json.

CPU:  python scripts/grounding_study.py                       (2 scales x 3 lr x 2 averages, 120 steps each)
      python scripts/grounding_study.py --averages directions  (then --lrs 1e-2 --averages tokens: reports all)
"""
import argparse
import json
import os
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from common import load_step  # noqa: E402  (after the path: common.py is at the repository root)

ARTIFACTS = ("dataset.pt", "item_emb.npy", "sids.npy", "centroids.pt", "rqvae.pt")


def sh(*cmd):
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([sys.executable, *map(str, cmd)], cwd=REPO, check=True,
                   env={**os.environ, "HF_HUB_OFFLINE": "1"})


def shared_artifacts(dataset: str) -> str:
    """out/<dataset>, checked to hold 01/02's artifacts (one line and exit if not). Also used by suffix_study.py."""
    src = os.path.join(REPO, "out", dataset)
    missing = [f for f in ARTIFACTS if not os.path.exists(os.path.join(src, f))]
    if missing:
        sys.exit(f"error: {src} lacks {', '.join(missing)}; run 01_embed_items.py and 02_rqvae.py first")
    return src


def link_artifacts(src: str, work: str):
    """A work folder with links to the shared 01/02 artifacts (its own 03+ outputs go beside them)."""
    os.makedirs(work, exist_ok=True)
    for f in ARTIFACTS:
        if not os.path.lexists(os.path.join(work, f)):
            os.symlink(os.path.join(src, f), os.path.join(work, f))


def directions_loss(new_ids: torch.Tensor):
    """A loss for 04's loop: the text->SID mean NLL and the SID->text mean NLL, averaged (an absent direction drops
    out), so 4 SID tokens weigh like a ~18-token title. Text->SID targets are the SID tokens (new_ids); SID->text
    targets are text tokens and eos."""
    def loss(logits, y):
        nll = torch.nn.functional.cross_entropy(logits, y, reduction="none")                    # (M,)
        is_t2s = torch.isin(y, new_ids.to(y.device))                                          # (M,)
        parts = [nll[m].mean() for m in (is_t2s, ~is_t2s) if m.any()]
        return sum(parts) / len(parts)
    return loss


def ground_04(argv, average: str, model: str):
    """04 with these flags, in this process (cwd: the repository); average "directions" swaps 04's
    grounding_loss for directions_loss while it runs."""
    print("+ 04_ground.py", " ".join(map(str, argv)), f"(loss averaged over {average})", flush=True)
    step04 = load_step("04_ground")
    tokens_loss = step04.grounding_loss
    if average == "directions":
        vocab = json.load(open(os.path.join(model, "sid_vocab.json")))
        step04.grounding_loss = directions_loss(torch.tensor([t for lvl in vocab["token_ids"] for t in lvl if t >= 0]))
    try:
        step04.main([str(x) for x in argv])
    finally:
        step04.grounding_loss = tokens_loss


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="ml-100k")
    p.add_argument("--backbone", default="models/SmolLM2-135M-Instruct")
    p.add_argument("--scales", default="plain,matched")
    p.add_argument("--lrs", default="1e-3,3e-3,1e-2")
    p.add_argument("--averages", default="tokens,directions")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--work-dir", default="runs/grounding")
    a = p.parse_args()
    os.chdir(REPO)                                                     # 04 runs in this process, 03 and 07 in subprocesses
    src = shared_artifacts(a.dataset)
    t0, rows = time.time(), []
    for scale in a.scales.split(","):
        work = os.path.join(REPO, a.work_dir, scale)
        link_artifacts(src, work)
        base = os.path.join(work, "models", "centroid")
        if not os.path.exists(os.path.join(base, "sid_vocab.json")):
            sh("03_expand_vocab.py", "--out-dir", work, "--model", a.backbone, "--init", "centroid",
               "--centroid-scale", scale)
        names = ["centroid"]
        for lr in a.lrs.split(","):
            for avg in a.averages.split(","):
                name = f"centroid+gti_lr{lr}_{avg}"
                if not os.path.exists(os.path.join(work, "models", name, "04_ground.json")):
                    ground_04(["--out-dir", work, "--model", base, "--save", os.path.join(work, "models", name),
                               "--steps", a.steps, "--lr", lr], avg, base)
        names += sorted(n for n in os.listdir(os.path.join(work, "models"))           # every grounded folder so far
                        if n.startswith("centroid+gti_lr") and os.path.exists(os.path.join(work, "models", n, "04_ground.json")))
        sh("07_diagnose.py", "--out-dir", work, "--models", ",".join(names))
        diag = json.load(open(os.path.join(work, "diagnostics.json")))["models"]
        before = {}                                                    # the base row: accuracy before grounding
        if len(names) > 1:
            before = {"before": json.load(open(os.path.join(work, "models", names[1], "04_ground.json")))["before"]}
        for name in names:
            g = os.path.join(work, "models", name, "04_ground.json")
            ground = json.load(open(g)) if os.path.exists(g) else before
            lv = diag[name]["levels"]
            rows.append({"scale": scale, "model": name,
                         "lr": ground.get("args", {}).get("lr"),
                         "average": name.rsplit("_", 1)[1] if name != "centroid" else None,   # centroid+gti_lr<lr>_<avg>
                         "held_out_acc_in_level": (ground.get("after") or ground.get("before") or {}).get(
                             "held_out", {}).get("acc_in_level"),
                         "rsa_centroids": {k: round(v["rsa_centroids"], 3) for k, v in lv.items()
                                           if v.get("rsa_centroids") is not None},
                         "purity": round(diag[name]["purity"], 4),
                         "row_shift": ground.get("new_row_shift")})
    out = os.path.join(REPO, "results", f"{a.dataset}_grounding")
    json.dump({"rows": rows, "steps": a.steps, "seconds": round(time.time() - t0)}, open(out + ".json", "w"), indent=1)
    lines = ["| scale | lr | loss average | held-out text->SID acc (in level) | RSA a / b / c / all | purity@10 | "
             "mean row shift |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = " / ".join(f"{x:.2f}" for x in r["held_out_acc_in_level"]) if r["held_out_acc_in_level"] else "-"
        rsa = " / ".join(f"{r['rsa_centroids'].get(k, float('nan')):.2f}" for k in ("a", "b", "c", "all"))
        lines.append(f"| {r['scale']} | {r['lr'] or '- (before)'} | {r['average'] or '-'} | {acc} | {rsa} | "
                     f"{r['purity']:.3f} | {r['row_shift'] if r['row_shift'] is not None else '-'} |")
    open(out + ".md", "w").write(f"# Grounding: learning rate x centroid scale x loss average ({a.dataset}, "
                                 f"{a.steps} steps, seed 0)\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}.md / .json in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
