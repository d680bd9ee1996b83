"""The geometry claims read at each run's peak, from the convergence records' SID rows.

    python scripts/peak_geometry.py          # -> results/ml-100k_peak_geometry.md (seconds; needs make run's 01)

scripts/convergence.py keeps, for every run to the peak, the SID rows (fp16) of every ranked checkpoint in
results/convergence/<run>_rows.npz: step 0 is the init 05 started from, and the best step (by validation NDCG@10)
is the model the run's test metrics come from. This script hands the rows at init and at the best step to
07_diagnose.py's own `diagnose` (spectrum, RSA, popularity, purity and the displacement dE = peak - init) and judges
the papers' geometry claims with scripts/study.py's rules: a claim about what training does to the rows gets a
verdict only when the rows moved (rms(dE) >= study.MOVED x the init's spread, on the seeds' interval), thresholds
on the seeds' t interval, the popularity axis against a permutation null. One seed: provisional.
Frequencies, centroids and categories: make run's dataset.pt with the pinned tokenizer (results/convergence/tokenizer).
07's spread_ratio_vocab_over_sid is not measured here (the records keep only the SID rows).
"""
import os
import sys

import numpy as np

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from common import atomic_write, die, load_json, load_step  # noqa: E402
from convergence import BASE, OUT, RECORDS, TOKENIZER, sha, stage_base  # noqa: E402
from study import MOVED, REPO, axis_verdict, gate, geometry_row, moved, seed_list  # noqa: E402

diag = load_step("07_diagnose")
STAGE = "peak"
# claim, paper, kind, a, b, what: study.CLAIMS' geometry claims, read at the peak (study.geometry_row's forms)
CLAIMS = [
    ("GTI: mean init collapses the SID rows (effective rank, 1 - mean / mean+gti)", "qualitative (SVD spectrum)",
     "geometry", "mean-full", "mean+gti-full", ("effective_rank", STAGE, STAGE, "ratio", 0.5)),
    ("GTI keeps the codebook geometry (RSA with the RQ-VAE codebook, mean+gti - mean)", "qualitative (RSA)",
     "geometry", "mean+gti-full", "mean-full", ("rsa_codebook", STAGE, STAGE, "difference", 0.1)),
    ("random init drifts to a popularity axis (Thm 3.1)", "qualitative (rows organize by popularity)",
     "axis", "random", "random", (STAGE, 0.2)),
    ("mean init's rows (all of them training's) organize by popularity (Thm 3.1)", "Thm 3.1 (any init)",
     "axis", "mean-full", "mean-full", (STAGE, 0.2)),
    ("random init drifts to a popularity axis, within each code level", "qualitative (rows organize by popularity)",
     "level_axis", "random", "random", (STAGE, 0.2)),
    ("mean init's rows organize by popularity, within each code level (rule set after seeing seed 0)",
     "Thm 3.1 (any init)",
     "level_axis", "mean-full", "mean-full", (STAGE, 0.2)),
    ("centroid init keeps item semantics (purity@10, centroid - random)", "qualitative (CPT does not recover them)",
     "geometry", "centroid", "random", ("purity", STAGE, STAGE, "difference", 0.05)),
]


def level_axis_row(res, a_, what):
    """Theorem 3.1 within each code level (set on 2026-12-04 after mean-full-s0's rows showed that PC1 over all rows is
    the levels' separation, before any random/centroid run kept its rows): per seed, the mean over the code levels of
    |Spearman(freq, PC1 of that level's dE)| and of its permutation null's q95; judged as study.geometry_row's axis
    claims (threshold on the seeds' interval, every seed beyond its null, only where the rows moved)."""
    stage, t = what
    ds = {r["seed"]: r["diag"][stage] for r in res.get(a_, [])}
    if not ds:
        return "not run", "not run yet"
    move, why = gate({f"{a_} ({stage})": ds})
    per = [[v for k, v in d["displacement"]["levels"].items() if k != "all" and v["pc1_freq_abs_spearman"] is not None]
           for d in ds.values()]
    if not all(per):                                       # not moved, or every level shifted alike: no PC1
        return move, why or "not testable: no level's dE has a PC1"
    rho, q95 = [np.mean([v["pc1_freq_abs_spearman"] for v in p]) for p in per], [np.mean([v["perm_q95"] for v in p])
                                                                                for p in per]
    iv, v = axis_verdict(rho, q95, t)
    return (f"mean over the code levels of abs(Spearman) of token frequency with PC1 of the level's dE: {iv} over "
            f"{seed_list(ds)} (threshold {t}; null q95 <= {max(q95):.3f}); {move}", why or v)


def load_data():
    """07's inputs on the pinned SIDs: make run's dataset.pt and item_emb.npy, the tokenizer's sids/centroids/rqvae,
    staged in convergence.py's base folder as its runs stage them."""
    if not os.path.exists(f"{REPO}/{OUT}/dataset.pt"):
        die(f"{OUT}/dataset.pt not found: run `make run` (01) first")
    if not os.path.exists(f"{REPO}/{TOKENIZER}/sids.npy"):
        die(f"{TOKENIZER}/sids.npy not found: the records need the SIDs they were trained on (git checkout it)")
    stage_base(sha(f"{REPO}/{TOKENIZER}/sids.npy"))
    _, _, data = diag.load_step_artifacts(f"{REPO}/{BASE}")
    data["names"], data["device"] = [chr(97 + l) for l in range(data["sids"].shape[1])], "cpu"
    return data


def row_index(sids, centroids):
    """tok: per level (codes,) -> the row of that token in a record (level by level, used codes in order; -1 unused),
    as 03 numbers its tokens; item_tok (N, L+1) rows of each item's tokens."""
    tok, start = [], 0
    for l, c in enumerate(centroids):
        used = np.unique(sids[:, l])
        t = np.full(len(c), -1, np.int64)
        t[used] = start + np.arange(len(used))
        tok.append(t)
        start += len(used)
    return tok, np.stack([t[sids[:, l]] for l, t in enumerate(tok)], 1), start


def measure(name, rec, data, tok, item_tok, n):
    """07's entries of one record's rows: {"init": at step 0, STAGE: at the best step (with its displacement from
    step 0)}, and rms(dE) / init spread at every ranked step."""
    z = np.load(f"{REPO}/{RECORDS}/{rec['rows']}", allow_pickle=False)
    E, steps = z["input"].astype(np.float64), list(z["steps"])
    if E.shape[1] != n or steps[0] != 0 or rec["best_step"] not in steps:
        die(f"{RECORDS}/{rec['rows']}: {E.shape[1]} rows, steps {steps[:3]}...; expected {n} rows from step 0 to the "
            f"best step {rec['best_step']} on the pinned SIDs: rerun `python scripts/convergence.py --runs {name}`")
    vocab = {"vocab_row_norm": float("nan"), "vocab_spread": float("nan")}      # not in the record
    init, _ = diag.diagnose(E[0], tok, item_tok, vocab, data, seed=0)
    peak, _ = diag.diagnose(E[steps.index(rec["best_step"])], tok, item_tok, vocab, data, seed=0,
                            init=("step 0", E[0]))
    rms = lambda X: float(np.sqrt((X ** 2).sum(1).mean()))                    # noqa: E731
    spread = rms(E[0] - E[0].mean(0)) or 1.0                                    # mean init: rms itself
    return {"init": init, STAGE: peak}, [(s, rms(E[i] - E[0]) / spread) for i, s in enumerate(steps) if s]


def fmt(x, f="{:.3f}"):
    return "-" if x is None else f.format(x)


def per_level(entry):
    """PC1 of dE ~ freq within each level of codes (one level's rows share a position, so a level's own frequencies
    do not stand in for the level itself, as they can over all rows): 'a 0.17 (p 0.20), ...'."""
    lv = entry["displacement"]["levels"]
    return ", ".join(f"{k} {fmt(v['pc1_freq_abs_spearman'], '{:.2f}')} (p {fmt(v['perm_p'], '{:.3f}')})"
                     for k, v in lv.items() if k != "all" and v["pc1_freq_abs_spearman"] is not None)


def main():
    recs = {}
    for fn in sorted(os.listdir(f"{REPO}/{RECORDS}")):
        if fn.endswith(".json") and fn != "ceiling.json":
            rec = load_json(f"{REPO}/{RECORDS}/{fn}", f"delete it and rerun `scripts/convergence.py --runs {fn[:-5]}`")
            recs[rec["run"]] = rec
    with_rows = {k: r for k, r in recs.items() if r.get("rows")}
    data = load_data()
    tok, item_tok, n = row_index(data["sids"], data["centroids"])
    res, table, width = {}, [], 1
    for name, rec in with_rows.items():
        d, path = measure(name, rec, data, tok, item_tok, n)
        res.setdefault(rec["kind"], []).append({"seed": rec["seed"], "diag": d})
        width = d[STAGE]["d_model"]
        i, p, dis = d["init"]["levels"]["all"], d[STAGE]["levels"]["all"], d[STAGE]["displacement"]["levels"]["all"]
        mv, walk = moved(d[STAGE]), ", ".join(f"{s}: {x:.2f}" for s, x in path)
        mv = "inf (init rows identical)" if mv == np.inf else fmt(mv, "{:.2f}")
        table.append(f"| {name} | {rec['best_step']} | {mv} | {walk} | {i['effective_rank']:.1f} -> "
                     f"{p['effective_rank']:.1f} | {fmt(i['rsa_centroids'])} -> "
                     f"{fmt(p['rsa_centroids'])} | {fmt(i['rsa_codebook'])} -> {fmt(p['rsa_codebook'])} | "
                     f"{fmt(p['pop_spearman_abs'])} | {fmt(dis['pc1_freq_abs_spearman'])} (p {fmt(dis['perm_p'])}) | "
                     f"{per_level(d[STAGE])} | "
                     f"{fmt(d['init']['purity'])} -> {fmt(d[STAGE]['purity'])} |")
        print(table[-1], flush=True)
    claims = []
    for claim, paper, kind, a_, b_, what in CLAIMS:
        ours, v = level_axis_row(res, a_, what) if kind == "level_axis" else geometry_row(res, None, kind, a_, b_, what)
        claims.append(f"| {claim} | {paper} | {ours} | {v} |")
    lacking = sorted(set(recs) - set(with_rows))
    emb = np.load(f"{REPO}/{BASE}/item_emb.npy", allow_pickle=False)         # purity's references, as 07 prints them
    gauss = np.random.default_rng(0).standard_normal((n, width))                 # as 07's reference (its seed 0)
    ref = (f"purity@10 references: item_emb.npy {diag.knn_purity(emb, data['category']):.3f}, random Gaussian SID "
           f"rows {diag.knn_purity(gauss[item_tok].mean(1), data['category']):.3f}")
    md = "\n".join([
        "# The geometry claims at the peak (ml-100k)", "",
        "Written by `python scripts/peak_geometry.py` from the SID rows in results/convergence/<run>_rows.npz: each "
        "run's rows at step 0 (the init 05 started from) and at its best step by validation NDCG@10 (the checkpoint "
        "its test metrics come from), measured by 07_diagnose.py's `diagnose` on the pinned SIDs.", "",
        f"A claim about what training does to the rows gets a verdict only where the rows moved: rms(peak - init) >= "
        f"{MOVED} x the init rows' spread, on the seeds' interval (scripts/study.py's rule; mean init has no spread, "
        "so all its rows' geometry is training's: inf). Thresholds are judged on the 95% t interval over seeds "
        "(one seed: provisional); the popularity axis is |Spearman| of token frequency with PC1 of the displacement, "
        "against 1,000 shuffles of the frequencies. Every run of a kind starts from the same 03 (and 04) folder, built "
        "once with seed 0: the seeds' interval is over 05's example order and validation users, not over inits.", "",
        "| run | best step | moved at the peak (rms/spread) | moved at each validation (rms/spread; mean init: rms) "
        "| effective rank init -> peak | RSA centroids | RSA codebook | pop abs(rho) PC1 of rows | PC1 of dE ~ freq "
        "abs(rho), all rows | the same within each level | purity@10 |",
        "|---|---|---|---|---|---|---|---|---|---|---|", *table, "",
        "study.py's popularity-axis rule reads all rows together (fixed before these runs). Over all rows, PC1 can be "
        "the levels' own separation, which token frequency does not follow (mean-full-s0 showed it), so the claims "
        "are also read within each code level, a rule set after mean-full-s0 and before any random or centroid run "
        "kept its rows. " + ref + ".", "",
        "| claim | paper | ours (at the peak) | verdict |", "|---|---|---|---|", *claims, "",
        "Records without rows (made before convergence.py kept them; rerun to read their geometry): "
        + (", ".join(lacking) or "none") + "."]) + "\n"
    path = f"{REPO}/results/ml-100k_peak_geometry.md"
    atomic_write(path, lambda t: open(t, "w").write(md))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
