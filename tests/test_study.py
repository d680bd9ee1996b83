"""scripts/study.py: the variants table, the report on constructed run folders with known per-user top-k lists
(means, seed spread, paired intervals, verdicts, steps to a validation loss), the dry-run plan against the
numbered scripts' --help, and a killed piece that resumes (finished steps skipped, 05 with --resume)."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import load_script, REPO, assert_one_line_error, run

study = load_script("scripts/study.py")
U = 400                                          # users; user u's test target is item u


def test_variants_table():
    V = study.VARIANTS
    assert len(study.DEFAULT_VARIANTS) == 11 and {
        "random", "mean", "centroid", "shuffled", "mean+gti", "centroid+gti", "random+gti", "mean+aux", "rqk-random",
        "rqk-centroid", "rqk-shuffled"} == set(study.DEFAULT_VARIANTS) == {
            n for n, v in V.items() if not v.cpt and v.softmax == "level" and v.scale != "plain"}
    assert {n: (v.init, v.scale) for n, v in V.items() if v.scale == "plain"} == {
        "centroid-plain": ("centroid", "plain"), "shuffled-plain": ("shuffled", "plain"),
        "centroid-plain-full": ("centroid", "plain")}                                     # Algorithm 1, not default
    assert {n: (v.init, v.gti) for n, v in V.items() if v.softmax == "full"} == {
        "mean-full": ("mean", False), "mean+gti-full": ("mean", True), "random-full": ("random", False),
        "centroid-plain-full": ("centroid", False)}                           # the papers' loss, not by default
    assert {n: v.cpt for n, v in V.items() if v.cpt} == {"random+cpt2": 2, "random+cpt8": 8, "centroid+cpt1": 1,
                                                         "centroid+cpt2": 2}
    assert all(v.cpt in study.CPT_EPOCHS[v.init] and v.tokenizer == "rqvae" for v in V.values() if v.cpt)
    for name, v in V.items():                    # every plain centroid row has a shuffled twin at the same scale
        if v.init == "centroid" and not v.gti and not v.cpt:
            twins = [w for w in V.values() if w.init == "shuffled" and w.tokenizer == v.tokenizer and w.scale == v.scale]
            assert twins and all(not w.gti and not w.aux for w in twins), name
    assert all(bool(v.scale) == (v.init in ("centroid", "shuffled")) for v in V.values())


def test_steps_to_intervals_verdicts():
    curve = [[0, 5.0, 0.0], [44, 3.0, 0.1], [88, 1.0, 0.2]]
    assert study.steps_to(curve, 2.0) == 66.0                           # linear between validations
    assert study.steps_to(curve, 5.0) == 0.0 and study.steps_to(curve, 0.5) is None
    m, lo, hi = study.t_interval([1.0, 2.0, 3.0])
    assert m == 2.0 and np.isclose(hi - m, 4.303 / np.sqrt(3))          # t_{0.975, 2} * sd / sqrt(n)
    assert study.t_interval([1.0])[1:] == [None, None]
    assert study.verdict(0.1, 0.3) == "reproduced" and study.verdict(-0.3, -0.1) == "not reproduced"
    assert study.verdict(-0.1, 0.2) == "inconclusive" and study.verdict(None, None) == "inconclusive"
    # geometry thresholds on the seeds' interval, not on the mean: mean 0.3 but the interval reaches below 0.2
    assert study.seed_verdict([0.3, 0.3, 0.3], 0.2) == ("+0.300 [+0.300, +0.300]", "reproduced")
    assert study.seed_verdict([0.1, 0.3, 0.5], 0.2)[1] == "inconclusive"
    assert study.seed_verdict([-0.1, -0.12, -0.11], 0.2)[1] == "not reproduced"
    assert study.seed_verdict([0.3], 0.2) == ("+0.300", "reproduced (provisional, 1 seed)")
    assert study.seed_verdict([0.10, 0.11, 0.12], 0.2, zero=0.15)[1] == "not reproduced"  # below the null's q95
    assert study.seed_low([0.6, 0.7, 0.8]) == pytest.approx(0.7 - 4.303 * 0.1 / np.sqrt(3))
    assert study.seed_low([0.6]) == 0.6 and study.seed_low([np.inf, 0.6]) == 0.6


def test_steps_count_a_run_that_never_gets_there_at_its_cap():
    """Steps to the same loss: a seed pair where one run never reaches it is kept with that run at its last step
    (dropping it would favour the slower variant); the bound is read only in the direction it holds."""
    run = lambda s, best: {"seed": s, "sft": {"best_val_loss": best, "val_curve": [[0, 5.0, 0.0], [44, best, 0.1]]}}
    res = {"centroid": [run(0, 1.0), run(1, 3.0)], "random": [run(0, 3.0), run(1, 1.0)]}   # each seed: one reaches 2.0
    assert study.convergence(res, "centroid", "random")[2] == [(44 - 33.0, "b", 44.0), (33.0 - 44, "a", 33.0)]
    ours, v = study.claim_row(res, {}, "steps", "centroid", "random", None)
    assert v == "inconclusive" and "over 2 seed pairs (a run that never got there counted at its last step: " \
        "1 of centroid, 1 of random)" in ours
    fast = [[0, 5.0, 0], [44, 3.0, 0], [88, 2.0, 0], [132, 1.0, 0], [176, 1.0, 0], [220, 1.0, 0]]
    slow = lambda end: [[0, 5.0, 0], [44, 4.0, 0], [88, 3.5, 0], [132, 3.3, 0], [176, 3.25, 0], [220, end, 0]]
    res = {"centroid": [{"seed": s, "sft": {"best_val_loss": 1.0, "val_curve": fast}} for s in range(3)],
           "random": [{"seed": s, "sft": {"best_val_loss": end, "val_curve": slow(end)}}
                      for s, end in enumerate((2.8, 3.0, 3.2))]}                    # the loss: their mean best 3.0
    d = study.convergence(res, "centroid", "random")[2]
    assert [p[1:] for p in d] == [("", pytest.approx(176 + 0.25 / 0.45 * 44)), ("", 220.0), ("b", 220.0)]
    assert d[2][0] == 220 - 44.0                                                  # seed 2: random >= its 220 steps
    ours, v = study.claim_row(res, {}, "steps", "centroid", "random", None)
    assert v == "reproduced" and "0 of centroid, 1 of random" in ours             # a saving of at least 176 kept
    assert study.claim_row(res, {}, "steps", "random", "centroid", None)[1] == "not reproduced"  # at most -176: holds
    # centroid never got there in one pair: its saving is at most -2 (could be anything lower): never reproduced
    assert study.censored_verdict([(100, ""), (102, ""), (104, ""), (98, ""), (-2, "a")])[3].startswith("inconclusive")
    assert study.censored_verdict([(100, ""), (102, ""), (104, ""), (98, "")])[3] == "reproduced"
    # random never got there in one pair: its saving is at least +3: never "not reproduced"
    neg = [(-100, ""), (-102, ""), (-98, ""), (-101, ""), (-99, "")]
    assert study.censored_verdict(neg)[3] == "not reproduced"
    assert study.censored_verdict(neg + [(3, "b")])[3].startswith("inconclusive")
    never = {v: [{"seed": 0, "sft": {"best_val_loss": 1.0, "val_curve": slow(3.0)}}] for v in ("centroid", "random")}
    ours, v = study.claim_row(never, {}, "steps", "centroid", "random", None)   # neither gets to 1.0: no information
    assert v == "inconclusive" and "no seed pair in which either reaches" in ours and "0/1 seeds of centroid" in ours
    assert study.claim_row({"centroid": [], "random": []}, {}, "steps", "centroid", "random", None)[1] == "not run yet"


# ---------------------------------------------------------------------------------------------------
# Constructed run folders
# ---------------------------------------------------------------------------------------------------
def topk_hitting(hit_users, rank=0):
    """(U, 20) lists: user u's target (item u) at `rank` for u in hit_users, absent otherwise."""
    top = np.tile(np.arange(10_000, 10_020), (U, 1))
    top[list(hit_users), rank] = np.array(list(hit_users))
    return top


def disp(g):
    """07's displacement entry for g["moved"] (rms / spread; inf: the init rows had no spread), g["pc1"] (|rho| of
    token frequency with PC1 of dE) and g["q95"] (its permutation null); {} without "moved" (an old record)."""
    if "moved" not in g:
        return {}
    r = g["moved"]
    lv = {"rms": 1.0, "spread": 1.0 / r if r else 1.0, "ratio": None if r == np.inf else r, "moved": r > 0,
          "pc1_freq_abs_spearman": g.get("pc1", 0.1), "pc1_freq_spearman": g.get("pc1", 0.1),
          "perm_q95": g.get("q95", 0.15), "perm_p": 0.01}
    return {"displacement": {"levels": {"all": lv}}}


def fake_run(a, v, seed, hits, curve, geometry):
    run_dir, final = study.run_dir(a, v, seed), study.final_model(a, v, seed)
    os.makedirs(final)
    np.save(os.path.join(final, "eval_test_topk.npy"), topk_hitting(hits))
    m = {k: 0.0 for k, _ in study.METRICS}
    json.dump({"model": m, "most_popular": {k: 0.01 for k in m}, "cold_most_popular": {"recall@10": 0.0}},
              open(os.path.join(final, "eval_test.json"), "w"))
    json.dump({"val_curve": [[s, l, 0.1] for s, l in curve], "best_val_loss": min(l for _, l in curve)},
              open(os.path.join(final, "05_sft.json"), "w"))
    for st, g in geometry.items():
        lv = {"effective_rank": g.get("erank", 5.0), "pop_spearman_abs": g.get("pop", 0.1),
              "rsa_codebook": g.get("rsa", 0.2), "pop_probe_r2": 0.1, "mean_cos": 0.0, "rsa_centroids": 0.1}
        json.dump({"models": {v: {"levels": {"all": lv}, "purity": g.get("purity", 0.2), **disp(g)}}},
                  open(os.path.join(run_dir, f"diag_{st}.json"), "w"))


def fake_chain(a, init, seed, per_epoch):
    """A CPT chain's 07 files: per epoch (purity, popularity |rho|[, displacement as in disp()])."""
    root = study.cpt_dir(a, init, seed)
    os.makedirs(root, exist_ok=True)
    for e, (purity, pop, *g) in per_epoch.items():
        lv = {**{k: 0.5 for k, _ in study.GEOMETRY}, "pop_spearman_abs": pop}
        json.dump({"models": {init: {"levels": {"all": lv}, "purity": purity, **disp(g[0] if g else {})}}},
                  open(os.path.join(root, f"diag_cpt{e}.json"), "w"))


RANDOM = [[0, 5.0], [44, 4.0], [88, 3.0], [132, 2.5], [176, 2.2], [220, 2.0]]
FAST = [[0, 5.0], [44, 3.0], [88, 2.0], [132, 1.9], [176, 1.85], [220, 1.8]]


@pytest.fixture
def constructed(tmp_path):
    a = study.parse_args(["--work-dir", str(tmp_path / "runs"), "--results-dir", str(tmp_path / "res"),
                          "--dataset", "toy"])
    for s in range(3):                            # random's SFT moved its rows (0.8 of their spread), along PC1 of
        fake_run(a, "random", s, range(80 + 20 * s), RANDOM,   # dE |rho| .5/.6/.7 (null .15); R@5 .20/.25/.30
                 {"init": {"pop": 0.05, "purity": 0.3}, "sft": {"pop": 0.6, "purity": 0.3, "moved": 0.8,
                                                                "pc1": 0.5 + 0.1 * s}})
        fake_run(a, "centroid", s, range(200), FAST, {"sft": {"purity": 0.2, "moved": 0.2}})   # R@5 +0.25; barely moved
        fake_run(a, "shuffled", s, range(300), FAST, {})                          # centroid - shuffled < 0
        fake_run(a, "mean+gti", s, range(100, 200), RANDOM, {"sft": {"erank": 10.0, "rsa": 0.3, "moved": 0.6}})
    fake_run(a, "mean", 0, range(100), RANDOM, {"sft": {"erank": 2.0, "rsa": 0.25, "moved": np.inf}})  # one seed
    for s in range(3):                            # CPT: centroid + 1 epoch = random + 8 > random + 2
        fake_run(a, "centroid+cpt1", s, range(200), RANDOM, {})
        fake_run(a, "random+cpt2", s, range(100), RANDOM, {})
        fake_run(a, "random+cpt8", s, range(200), RANDOM, {})
        fake_chain(a, "random", s, {0: (0.3, 0.05), 1: (0.3, 0.1),
                                    8: (0.32 + 0.01 * s, 0.4, {"moved": 0.7 + 0.1 * s, "pc1": 0.4})})
        fake_chain(a, "centroid", s, {0: (0.5, 0.1), 1: (0.5, 0.1)})
    for s, hits in enumerate((300, 40, 160)):     # rqk-centroid - rqk-random: +.55, -.15, +.10 over the seeds
        fake_run(a, "rqk-random", s, range(80 + 20 * s), RANDOM, {})
        fake_run(a, "rqk-centroid", s, range(hits), RANDOM, {})
    targets = np.arange(U)
    popularity = np.where(np.arange(U) % 4 == 0, 3, 100)                          # every 4th target is cold
    return a, study.collect(a, list(study.VARIANTS)), targets, popularity


def table(md, title):
    """Rows of the markdown table under `## title...`, keyed by their first cell(s)."""
    part = md.split("## " + title)[1].split("\n## ")[0]
    return [[c.strip() for c in line.split("|")[1:-1]] for line in part.splitlines() if line.startswith("| ")][1:]


def test_report_on_constructed_runs(constructed):
    a, res, targets, pop = constructed
    assert [r["seed"] for r in res["random"]] == [0, 1, 2] and len(res["mean"]) == 1 and res["mean+aux"] == []
    pu = study.per_user(res["random"], targets, pop[targets] <= study.COLD_MAX)
    assert pu["seeds"] == 3 and pu["all"]["recall@5"][90] == pytest.approx(2 / 3)   # seeds pooled per user
    assert pu["all"]["recall@5"].mean() == pytest.approx(0.25) and len(pu["cold"]["recall@10"]) == 100

    md = open(study.report(a, res, targets, pop, "python scripts/study.py --dataset toy --seeds 0,1,2")).read()
    per_variant = {r[0]: r for r in table(md, "Test metrics per variant")}
    assert per_variant["random"][5] == "3 (0,1,2)" and per_variant["mean"][5] == "1 (0)"
    assert per_variant["random"][6] == "0.2500 +- 0.0500"                         # R@5: seed spread
    assert per_variant["centroid"][6:10] == ["0.5000 +- 0.0000"] * 4                # rank 1: R@5=R@10=R@20=N@10
    assert per_variant["centroid"][10] == "0.5000 +- 0.0000"                       # cold R@10: 50 of 100
    assert "steps to val loss 2.000" in md                                        # the worse best of the pair
    assert per_variant["random"][12].startswith("220 +- 0 (3/3") and per_variant["centroid"][12].startswith("88 +- 0")
    assert per_variant["most popular"][6] == "0.0100"

    diffs = {(r[0], r[1]): r for r in table(md, "Paired differences")}
    assert diffs[("centroid", "random")][2] == "3/3" and diffs[("mean", "random")][2] == "1/3"
    d, lo, hi = map(float, re.findall(r"[+-]\d\.\d+", diffs[("centroid", "random")][3]))
    assert d == 0.25 and 0 < lo < d < hi                                          # R@5 +0.25 [lo, hi]

    claims = {r[0]: r for r in table(md, "The papers' claims")}
    assert len(claims) == 18                                                      # every claim of docs/papers.md
    verdict = {k: r[3] for k, r in claims.items()}
    assert verdict["centroid vs random: Recall@5"] == "reproduced"
    assert "per seed pair +0.2500 [" in claims["centroid vs random: Recall@5"][2]       # .30/.25/.20 agree
    # pooled over seeds the users say +0.1667 with an interval above 0, but the seeds disagree (+.55, -.15, +.10)
    rqk = claims["centroid vs random: Recall@5, RQ-KMeans SIDs (the paper's tokenizer)"]
    d, lo, hi = map(float, re.findall(r"[+-]\d\.\d+", rqk[2])[:3])
    assert d == pytest.approx(1 / 6, abs=1e-4) and lo > 0
    assert "3 pairs: +0.5500, -0.1500, +0.1000" in rqk[2] and rqk[3] == "inconclusive (inside the seed spread)"
    seed_col = diffs[("rqk-centroid", "rqk-random")][-1]                          # R@10 per seed pair
    assert seed_col.startswith("+0.1667 [-") and seed_col.endswith("(3 pairs)")
    assert diffs[("mean", "random")][-1] == "-"                                   # one seed pair: no t interval
    # mean ran seed 0 only (R@5 .25): paired with random's seed 0 (.20), not with random's 3-seed average (.25)
    assert diffs[("mean", "random")][3].startswith("+0.0500 [")
    assert "3 vs 1 seeds (1 common)" in claims["GTI vs mean: Recall@20"][2]
    assert "(+100.0%)" in claims["centroid vs random: Recall@5"][2]
    assert verdict["shuffled centroids < centroid: Recall@5"] == "not reproduced"
    assert verdict["GTI vs mean: Recall@20"] == "inconclusive"                   # same mean, other users
    assert verdict["centroid vs random: cold targets (seen <= 25 times), Recall@10"] == "reproduced"
    assert verdict["centroid vs random: SFT steps to the same validation loss"] == "reproduced"
    assert claims["centroid vs random: SFT steps to the same validation loss"][2].startswith("+132.0 [+132.0, +132.0]")
    collapse = claims["GTI: mean init collapses the SID rows, low-rank after SFT"]          # 1 - 2/10 >= .5 on the
    assert collapse[3] == "reproduced (provisional, 1 seed)"                                 # one common seed
    assert ("moved (rms/spread of the init's rows): mean (sft) all (its init rows are one point), "
            "mean+gti (sft) 0.60") in collapse[2]
    axis = claims["random init drifts to a popularity axis (Thm 3.1)"]            # |rho| .6 [.35, .85] >= .2, > .15
    assert axis[3] == "reproduced" and axis[2].startswith("abs(Spearman) of token frequency with PC1 of dE (random")
    assert "+0.600 [+0.352, +0.848] over seeds 0,1,2 (threshold 0.2" in axis[2]
    assert verdict["GTI keeps the codebook geometry after SFT (RSA, block structure)"] == \
        "inconclusive (provisional, 1 seed)"                                                 # .05 < .1
    # centroid's rows moved 0.2 of their spread: purity after SFT is still its init's, whatever it reads
    assert verdict["centroid init keeps item semantics after SFT (purity)"] == \
        "not testable at this budget (rms/spread 0.20 < 0.5)"
    assert "effect a - b = -0.100 [-0.100, -0.100]" in claims["centroid init keeps item semantics after SFT (purity)"][2]
    assert claims["GTI vs LC-Rec aux tasks: Recall@10"][2:4] == ["not run", "not run yet"]
    cpt = claims["centroid + 1-4 CPT epochs ~ random + 6-10 CPT epochs: Recall@5"]
    assert cpt[2].startswith("centroid+cpt1 - random+cpt2: +0.2500 [")
    assert "centroid+cpt1 - random+cpt8: +0.0000" in cpt[2]
    assert cpt[3] == "reproduced" and "--variants centroid+cpt1,random+cpt2,random+cpt8`" in cpt[4]
    sem = claims["CPT does not recover semantics from random init (purity)"]   # .5 - (.32, .33, .34) >= .05
    assert sem[3] == "reproduced" and "--cpt-only" in sem[4]
    assert "random after 8 CPT epochs 0.330 (mean over seeds 0,1,2)" in sem[2]
    assert "random after 8 CPT epochs 0.80 (low end 0.55)" in sem[2]                 # moved .7/.8/.9: >= .5
    assert "+0.400 [+0.400, +0.400] over seeds 0,1,2" in claims["random rows organize by popularity during CPT"][2]
    assert verdict["random rows organize by popularity during CPT"] == "reproduced"
    after = {(r[0], r[1]): r for r in table(md, "Geometry after CPT")}
    assert after[("random", "8")][2] == "3 (0,1,2)" and after[("random", "8")][-2:] == ["0.330 +- 0.010", "0.80 +- 0.10"]
    geometry = {(r[0], r[1]): r for r in table(md, "Geometry of the SID rows")}
    assert geometry[("mean", "sft")][-1] == "inf" and geometry[("random", "init")][-1] == "-"   # the movement column
    assert geometry[("random", "sft")][-1] == "0.80 +- 0.00"
    assert ("centroid", "0") in after and ("centroid", "8") not in after
    assert "--variants centroid,random" in claims["centroid vs random: Recall@5"][4]
    assert "--variants random`" in claims["random init drifts to a popularity axis (Thm 3.1)"][4]
    assert os.path.exists(os.path.join(a.results_dir, "toy_val_loss.png"))


def test_geometry_needs_rows_that_moved_and_the_axis_its_null():
    """A geometry claim about training gets a verdict only where the trained rows moved >= MOVED of their spread
    (judged on the seeds' interval); Theorem 3.1's axis (PC1 of dE against token frequency) must beat its permutation
    null in every seed; records without the displacement are not testable."""
    def res(*gs):
        return {"random": [{"seed": s, "diag": {"sft": {"levels": {"all": {}}, "purity": 0.2, **disp(g)}}}
                           for s, g in enumerate(gs)]}
    axis = lambda *gs: study.claim_row(res(*gs), {}, "axis", "random", "random", ("sft", 0.2))  # noqa: E731
    assert axis({"moved": 0.8, "pc1": 0.5})[1] == "reproduced (provisional, 1 seed)"
    ours, v = axis(*({"moved": 0.8, "pc1": r, "q95": q} for r, q in ((0.30, 0.2), (0.35, 0.5), (0.40, 0.2))))
    assert v == "inconclusive (a seed within its permutation null)" and "+0.350 [+0.226, +0.474]" in ours
    assert axis(*({"moved": 0.8, "pc1": r} for r in (0.10, 0.11, 0.12)))[1] == "not reproduced"   # <= q95 .15
    # moved .9/.6/.3 of the spread: the seeds' interval reaches below MOVED, though the mean .6 is above it
    assert axis(*({"moved": m, "pc1": 0.9} for m in (0.9, 0.6, 0.3)))[1] == \
        "not testable at this budget (rms/spread -0.15 < 0.5)"
    assert axis({"moved": 0.0})[1].startswith("not testable at this budget (rms/spread 0.00")      # dE ~0
    assert axis({}, {"moved": 0.8})[1] == "not testable: movement not measured"                    # an old record
    assert study.moved(disp({"moved": np.inf})) == np.inf and study.moved({}) is None


def test_cpt_equivalence_needs_a_margin(tmp_path):
    """centroid + 1 CPT epoch ~ random + 8: both intervals inside +-EQUIV_MARGIN of random + 8's Recall@5; a wide
    interval that merely covers 0 (the same mean on other users) is inconclusive, not equivalence."""
    a = study.parse_args(["--work-dir", str(tmp_path / "runs"), "--results-dir", str(tmp_path / "res"),
                          "--dataset", "toy"])
    for s in range(3):
        fake_run(a, "centroid+cpt1", s, range(200), RANDOM, {})
        fake_run(a, "random+cpt2", s, range(100), RANDOM, {})
        fake_run(a, "random+cpt8", s, range(100, 300), RANDOM, {})          # R@5 0.5 as centroid + 1, other users
    res = study.collect(a, ["centroid+cpt1", "random+cpt2", "random+cpt8"])
    pu = {v: study.per_user(r, np.arange(U), np.zeros(U, bool)) for v, r in res.items()}
    ours, v = study.claim_row(res, pu, "cpt", "centroid+cpt1", "random+cpt2", "random+cpt8")
    assert "centroid+cpt1 - random+cpt8: +0.0000 [-0.0" in ours and "margin +-0.0325 (6.5% of" in ours
    assert v == "inconclusive (centroid+cpt1 vs random+cpt2: reproduced; vs random+cpt8: inconclusive)"
    assert study.equivalence([[0.0, -0.01, 0.01], [0.0, -0.02, 0.02]], 0.03) == "equivalent"
    assert study.equivalence([[0.0, -0.01, 0.01], [0.0, -0.04, 0.04]], 0.03) == "inconclusive"   # seeds too wide
    assert study.equivalence([[-0.1, -0.15, -0.05], [-0.1, -0.2, -0.04]], 0.03) == "different"
    assert study.equivalence([[0.0, -0.01, 0.01], [None, None, None]], 0.03) == "equivalent"   # one seed pair


def test_07_reads_the_displacement_from_where_training_started(tmp_path):
    """07 after SFT gets --inits the folder 05 started from (03's, 04's +gti, the chain's +cpt); a CPT chain's 07
    after epoch e > 0 gets its 03 folder; 07 at init and after grounding none."""
    a = study.parse_args(["--work-dir", str(tmp_path)])
    inits = lambda steps: {s.name: s.args[s.args.index("--inits") + 1] if "--inits" in s.args else None  # noqa: E731
                           for s in steps if s.name.startswith("07")}
    for v, start in (("random", study.run_dir(a, "random", 0) + "/models/random"),
                     ("mean+gti", study.run_dir(a, "mean+gti", 0) + "/models/mean+gti"),
                     ("random+cpt2", study.cpt_dir(a, "random", 0) + "/models/random+cpt2")):
        steps = study.plan(a, v, 0)
        sft = next(s for s in steps if s.name == "05")
        assert inits(steps) == {**{k: None for k in ("07_init", "07_ground") if k in inits(steps)}, "07_sft": start}
        assert sft.args[sft.args.index("--model") + 1] == os.path.normpath(start)
    chain = study.cpt_dir(a, "random", 0) + "/models/random"
    assert inits(study.plan_cpt(a, "random", 0)) == {"07_cpt0": None, **{f"07_cpt{e}": os.path.normpath(chain)
                                                                          for e in study.CPT_EPOCHS["random"]}}


def test_cpt_only_report(tmp_path):
    """A --cpt-only piece (chains, no SFT run) reports the CPT geometry claims and leaves the others out."""
    a = study.parse_args(["--work-dir", str(tmp_path / "runs"), "--results-dir", str(tmp_path / "res"),
                          "--dataset", "toy", "--variants", "random+cpt8,centroid+cpt1", "--cpt-only"])
    fake_chain(a, "random", 0, {0: (0.3, 0.05), 1: (0.3, 0.1), 8: (0.31, 0.12, {"moved": 0.3, "pc1": 0.9})})
    fake_chain(a, "centroid", 0, {0: (0.5, 0.1)})
    # seed 1's chains stopped before epoch 8: the claims compare over seed 0 only, not 8 epochs of seed 0
    # against the mean of two seeds' epoch 0 (that would read 0.12 - 0.55 here)
    fake_chain(a, "random", 1, {0: (0.2, 1.05), 1: (0.2, 1.0)})
    fake_chain(a, "centroid", 1, {0: (0.9, 0.1)})
    res = study.collect(a, list(study.VARIANTS))
    assert not any(res.values())
    md = open(study.report(a, res, np.arange(U), np.full(U, 100), "python scripts/study.py --dataset toy")).read()
    claims = {r[0]: r for r in table(md, "The papers' claims")}
    assert set(claims) == {c[0] for c in study.CLAIMS if c[2] in ("cpt", "cpt_geometry", "cpt_axis")}
    # 8 CPT epochs moved random's rows 0.3 of their spread: neither claim could have failed (nor held)
    for c in ("CPT does not recover semantics from random init (purity)", "random rows organize by popularity during CPT"):
        assert claims[c][3] == "not testable at this budget (rms/spread 0.30 < 0.5)", c
    assert "effect a - b = +0.190 (threshold 0.05)" in claims["CPT does not recover semantics from random init (purity)"][2]
    assert "(mean over seed 0)" in claims["CPT does not recover semantics from random init (purity)"][2]
    assert "+0.900 over seed 0 (threshold 0.2" in claims["random rows organize by popularity during CPT"][2]
    assert claims["centroid + 1-4 CPT epochs ~ random + 6-10 CPT epochs: Recall@5"][3] == "not run yet"
    assert f"Left out: {len(study.CLAIMS) - 3} claims" in md and "Provisional: 1 seed(s)" in md
    assert "Test metrics per variant" not in md and "Paired differences" not in md
    after = {(r[0], r[1]): r for r in table(md, "Geometry after CPT")}
    assert sorted(after) == [("centroid", "0"), ("random", "0"), ("random", "1"), ("random", "8")]
    assert after[("random", "0")][2] == "2 (0,1)" and after[("random", "8")][2] == "1 (0)"


# ---------------------------------------------------------------------------------------------------
# The plan against the scripts, and resuming
# ---------------------------------------------------------------------------------------------------
def test_dry_run_passes_only_listed_flags(tmp_path):
    r = run("scripts/study.py", "--dry-run", "--seeds", "0,1", "--exact", "--work-dir", tmp_path / "w",
            "--results-dir", tmp_path / "r", "--out-root", tmp_path / "o")
    lines = [l.split("python ", 1)[1].split() for l in r.stdout.splitlines() if "python " in l and ".py " in l]
    helps = {}
    for script, *args in lines:                  # every flag the plan passes is one the script's --help lists
        if script not in helps:
            helps[script] = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True,
                                           text=True).stdout
        for x in args:
            if x.startswith("--"):
                assert re.search(re.escape(x) + r"\b", helps[script]), f"{script} {x}"
    count = lambda s: sum(1 for l in lines if l[0] == s)
    assert count("05_sft.py") == 22 and count("04_ground.py") == 6 and count("03_expand_vocab.py") == 22
    assert count("06_eval.py") == 22 and count("bench/exact_search.py") == 11              # --exact: seed 0 only
    assert sum("--aux-tasks" in l for l in lines) == 2 and sum("rqkmeans" in l for l in lines) == 1
    for l in lines:
        if l[0] == "03_expand_vocab.py" and l[l.index("--init") + 1] in ("centroid", "shuffled"):
            assert l[l.index("--centroid-scale") + 1] == "level"
        if l[0] == "05_sft.py":
            assert l[l.index("--eval-every") + 1] == "44"
        if l[0] in ("06_eval.py", "bench/exact_search.py"):
            assert l[l.index("--cold-max") + 1] == "25" and l[l.index("--protocol") + 1] == "excluded"
    est = float(re.search(r"estimated CPU time of this piece: ([\d.]+) h", r.stdout).group(1))
    assert 4.5 < est < 9                                   # two seeds of 11 variants + 11 exact searches

    r = run("scripts/study.py", "--dry-run", "--seeds", "0", "--variants", "random+cpt2,centroid+cpt1",
            "--work-dir", tmp_path / "w", "--results-dir", tmp_path / "r", "--out-root", tmp_path / "o")
    lines = [l.split("python ", 1)[1].split() for l in r.stdout.splitlines() if "python " in l and ".py " in l]
    for script, *args in lines:                  # the CPT chains' flags too
        assert all(re.search(re.escape(x) + r"\b", helps[script]) for x in args if x.startswith("--")), args
    assert count("04_ground.py") == 2 and count("05_sft.py") == 2
    assert count("07_diagnose.py") == 5 + 4 + 2            # the chains' 1 + 4 and 1 + 3, then after SFT
    cpt_s = [float(l.split("s ", 1)[0].strip(" ~")) for l in r.stdout.splitlines() if "--train all" in l]
    assert cpt_s == [8 * 613, 4 * 613]                     # one CPT epoch ~613 s, random 8 epochs, centroid 4


def fake_step(calls, kill):
    """Stands in for run_script: records the call and writes what the script would (tiny weights included)."""
    from safetensors.torch import save_file

    def model_folder(path):
        os.makedirs(path, exist_ok=True)
        json.dump({"token_ids": [[0, 1], [2, -1]]}, open(os.path.join(path, "sid_vocab.json"), "w"))
        save_file({"model.embed_tokens.weight": torch.zeros(4, 2)}, os.path.join(path, "model.safetensors"))

    def fake(script, args, log):
        calls.append((script, args))
        val = lambda flag: args[args.index(flag) + 1]
        if script == "01_embed_items.py":
            os.makedirs(val("--out-dir"), exist_ok=True)
            torch.save({"test": torch.arange(U), "popularity": torch.arange(U) % 50,
                        "sequences": [[0, u] for u in range(U)]},
                       os.path.join(val("--out-dir"), "dataset.pt"))
        elif script == "02_rqvae.py":
            np.save(os.path.join(val("--out-dir"), "sids.npy"), np.zeros((U, 3), np.int64))
            json.dump({}, open(os.path.join(val("--out-dir"), "02_rqvae.json"), "w"))
        elif script == "03_expand_vocab.py":
            model_folder(os.path.join(val("--out-dir"), "models", val("--init")))
        elif script == "04_ground.py":
            model_folder(val("--save"))
            if kill and kill in val("--save") and "--train" in args and "--resume" not in args:   # a CPT chain
                open(val("--save") + ".resume.pt", "w").write("state")
                raise SystemExit("killed")
            json.dump({"train_seconds": 600.0} if "--resume" in args else {},       # summed over the parts
                      open(os.path.join(val("--save"), "04_ground.json"), "w"))
        elif script == "05_sft.py":
            model_folder(val("--save"))
            if kill and kill in val("--save") and "--resume" not in args:
                open(val("--save") + ".resume.pt", "w").write("state")
                raise SystemExit("killed")
            json.dump({"val_curve": RANDOM, "best_val_loss": 2.0,                  # a resumed 05 sums its parts
                       **({"seconds": 500.0, "rank_seconds": 100.0} if "--resume" in args else {})},
                      open(os.path.join(val("--save"), "05_sft.json"), "w"))
        elif script == "07_diagnose.py":
            lv = {k: 0.5 for k, _ in study.GEOMETRY}
            json.dump({"models": {n: {"levels": {"all": lv}, "purity": 0.2} for n in val("--names").split(",")}},
                      open(val("--save"), "w"))
        elif script == "06_eval.py":
            np.save(os.path.join(val("--model"), "eval_test_topk.npy"), topk_hitting(range(50)))
            m = {k: 0.1 for k, _ in study.METRICS}
            json.dump({"model": m, "most_popular": m, "cold_most_popular": m},
                      open(os.path.join(val("--model"), "eval_test.json"), "w"))
        return 0.0
    return fake


def test_killed_piece_resumes(tmp_path, monkeypatch):
    backbone = tmp_path / "backbone"
    backbone.mkdir()
    (backbone / "config.json").write_text("{}")
    monkeypatch.setattr(study, "BACKBONE", str(backbone))
    argv = ["--variants", "random,mean+gti,rqk-random", "--seeds", "0", "--work-dir", str(tmp_path / "w"),
            "--out-root", str(tmp_path / "o"), "--results-dir", str(tmp_path / "r"), "--sids", ""]
    calls = []
    monkeypatch.setattr(study, "run_script", fake_step(calls, kill="mean+gti"))
    with pytest.raises(SystemExit, match="killed"):                   # killed inside mean+gti's 05
        study.main(argv)
    assert [c[0] for c in calls] == ["01_embed_items.py", "02_rqvae.py", "02_rqvae.py"] + \
        ["03_expand_vocab.py", "07_diagnose.py", "05_sft.py", "07_diagnose.py", "06_eval.py"] + \
        ["03_expand_vocab.py", "07_diagnose.py", "04_ground.py", "07_diagnose.py", "05_sft.py"]
    assert calls[2][1][2:6] == ["--quantizer", "rqkmeans", "--collisions", "reassign"]  # the tokenizer axis:
    tok = study.tokenizer_dir(study.parse_args(argv), "rqkmeans")                 # 01's files linked in
    assert os.path.islink(os.path.join(tok, "dataset.pt")) and calls[2][1][1] == tok
    run0 = study.run_dir(study.parse_args(argv), "random", 0)
    assert os.path.exists(os.path.join(run0, "finished.json"))
    assert not any(f.endswith(".safetensors") for _, _, fs in os.walk(os.path.join(run0, "models")) for f in fs)
    assert os.path.exists(os.path.join(run0, "slim", "sft", "model.safetensors"))   # seed 0 keeps its rows

    calls.clear()
    monkeypatch.setattr(study, "run_script", fake_step(calls, kill=""))
    study.main(argv)                                                  # the same command again
    steps = [c[0] for c in calls if c[0] != "scripts/figures.py" and
             ("--names" not in c[1] or "," not in c[1][c[1].index("--names") + 1])]
    assert steps[:3] == ["05_sft.py", "07_diagnose.py", "06_eval.py"]  # only what mean+gti had left
    assert "--resume" in calls[0][1]
    assert [c[0] for c in calls[3:8]] == ["03_expand_vocab.py", "07_diagnose.py", "05_sft.py", "07_diagnose.py",
                                          "06_eval.py"]                             # then rqk-random, in full
    sids = os.path.join(study.run_dir(study.parse_args(argv), "rqk-random", 0), "sids.npy")
    assert os.path.realpath(sids) == os.path.realpath(os.path.join(tok, "sids.npy"))   # its tokenizer's SIDs
    assert os.path.exists(os.path.join(tmp_path / "r", "ml-100k.md"))
    runs = study.collect(study.parse_args(argv), ["random", "mean+gti"])
    assert runs["random"][0]["seconds"] == 0.0                        # (the fake steps take 0 s)
    assert runs["mean+gti"][0]["seconds"] == 600.0                    # the resumed 05: its loop over both parts

    calls.clear()
    study.main(argv)                                                  # everything done: nothing runs
    assert calls == []


def test_runs_train_on_the_pinned_sids(tmp_path, monkeypatch):
    """--sids: the RQ-VAE runs link their 02 files from the pin (02 does not run for them), 01's from --out-root;
    the RQ-KMeans axis still learns its own; a --sids folder without sids.npy is a one-line error."""
    backbone, pin = tmp_path / "backbone", tmp_path / "pin"
    backbone.mkdir(), pin.mkdir()
    (backbone / "config.json").write_text("{}")
    np.save(pin / "sids.npy", np.ones((U, 3), np.int64))
    monkeypatch.setattr(study, "BACKBONE", str(backbone))
    argv = ["--variants", "random,rqk-random", "--seeds", "0", "--work-dir", str(tmp_path / "w"), "--out-root",
            str(tmp_path / "o"), "--results-dir", str(tmp_path / "r"), "--sids", str(pin)]
    calls = []
    monkeypatch.setattr(study, "run_script", fake_step(calls, kill=""))
    study.main(argv)
    assert [c[0] for c in calls][:2] == ["01_embed_items.py", "02_rqvae.py"]
    assert "rqkmeans" in calls[1][1] and sum(c[0] == "02_rqvae.py" for c in calls) == 1   # only the RQ-KMeans axis
    a = study.parse_args(argv)
    rd = study.run_dir(a, "random", 0)
    assert os.path.realpath(os.path.join(rd, "sids.npy")) == os.path.realpath(pin / "sids.npy")
    assert os.path.realpath(os.path.join(rd, "dataset.pt")) == os.path.realpath(tmp_path / "o" / "ml-100k" / "dataset.pt")
    rec = json.load(open(os.path.join(study.records_dir(a), "random-s0.json")))
    assert rec["sids_sha256"] == study.sha(str(pin / "sids.npy"))
    r = run("scripts/study.py", "--dry-run", "--sids", tmp_path, check=False)
    assert_one_line_error(r)
    assert "sids.npy not found" in r.stderr


def test_unknown_variant_one_line():
    assert_one_line_error(run("scripts/study.py", "--variants", "random,bogus", "--dry-run", check=False))


def test_cpt_chain_runs_once_per_init_and_seed(tmp_path, monkeypatch):
    """Two +cpt variants of one init share one chain (03, one 04 --train all, 07 per saved epoch), their 05
    starts from the chain's folder, and --cpt-only runs the chains without SFT."""
    backbone = tmp_path / "backbone"
    backbone.mkdir()
    (backbone / "config.json").write_text("{}")
    monkeypatch.setattr(study, "BACKBONE", str(backbone))
    base = ["--seeds", "0", "--work-dir", str(tmp_path / "w"), "--out-root", str(tmp_path / "o"),
            "--results-dir", str(tmp_path / "r"), "--sids", ""]
    calls = []
    monkeypatch.setattr(study, "run_script", fake_step(calls, kill=""))
    study.main(["--variants", "random+cpt2,random+cpt8"] + base)
    calls[:] = [c for c in calls if c[0] != "scripts/figures.py" and
                ("--names" not in c[1] or "," not in c[1][c[1].index("--names") + 1])]
    names = [c[0] for c in calls]                                     # (without the seed-0 figures' 07)
    assert names == ["01_embed_items.py", "02_rqvae.py", "03_expand_vocab.py"] + ["07_diagnose.py"] + \
        ["04_ground.py"] + ["07_diagnose.py"] * 4 + ["05_sft.py", "07_diagnose.py", "06_eval.py"] * 2
    a = study.parse_args(["--variants", "random+cpt2"] + base)
    chain = os.path.join(study.cpt_dir(a, "random", 0), "models", "random")
    g = calls[4][1]
    assert g[g.index("--train") + 1] == "all" and g[g.index("--epochs") + 1] == "8"
    assert "--save-epochs" not in g                                   # 04 saves every epoch
    assert [c[1][c[1].index("--model") + 1] for c in calls if c[0] == "05_sft.py"] == [chain + "+cpt2", chain + "+cpt8"]
    assert os.path.exists(os.path.join(study.final_model(a, "random+cpt2", 0), "eval_test.json"))
    md = open(os.path.join(tmp_path / "r", "ml-100k.md")).read()
    assert "## Geometry after CPT" in md and "| random | 8 | 1 (0) |" in md

    calls.clear()
    monkeypatch.setattr(study, "run_script", fake_step(calls, kill="centroid+cpt4"))
    with pytest.raises(SystemExit, match="killed"):                   # killed inside the centroid chain's 04
        study.main(["--variants", "random+cpt8,centroid+cpt1", "--cpt-only"] + base)
    assert "04c" not in study.collect_cpt(a)[1][os.path.join("ml-100k", "_cpt", "centroid", "seed0")]  # no time yet
    assert [c[0] for c in calls] == ["03_expand_vocab.py", "07_diagnose.py", "04_ground.py"]
    g = calls[2][1]
    assert g[g.index("--epochs") + 1] == "4" and "centroid" in g[g.index("--model") + 1]
    assert calls[0][1][calls[0][1].index("--centroid-scale") + 1] == "level"
    calls.clear()
    monkeypatch.setattr(study, "run_script", fake_step(calls, kill=""))
    study.main(["--variants", "random+cpt8,centroid+cpt1", "--cpt-only"] + base)
    assert [c[0] for c in calls] == ["04_ground.py"] + ["07_diagnose.py"] * 3   # 04 continues: --resume
    assert calls[0][1] == g + ["--resume"]
    chains = study.collect_cpt(a)[1]              # the resumed chain's time: 04's loop over both parts, not the last
    assert chains[os.path.join("ml-100k", "_cpt", "centroid", "seed0")]["04c"] == 600.0
    assert "04 of ml-100k/_cpt/centroid/seed0: 10 min" in open(os.path.join(tmp_path / "r", "ml-100k.md")).read()


def test_report_rebuilt_from_records_alone(constructed):
    """collect() writes a record for every finished run folder; with the run folders gone the records give the
    same report (the per-run records are what is committed)."""
    import shutil
    a, res, targets, pop = constructed
    first = open(study.report(a, res, targets, pop, "python scripts/study.py --dataset toy --seeds 0,1,2")).read()
    rd = study.records_dir(a)
    assert sorted(f for f in os.listdir(rd) if f.startswith("random-s")) == [
        f"random-s{s}{x}" for s in range(3) for x in (".json", "_test_topk.npy")]
    shutil.rmtree(a.work_dir)
    again = study.collect(a, list(study.VARIANTS))
    seeds = lambda r: {v: [x["seed"] for x in rs] for v, rs in r.items()}  # noqa: E731
    assert seeds(again) == seeds(res)
    second = open(study.report(a, again, targets, pop, "python scripts/study.py --dataset toy --seeds 0,1,2")).read()
    drop = lambda md: [l for l in md.splitlines() if not l.startswith("Machine:")]   # the date  # noqa: E731
    assert drop(first) == drop(second)


def test_a_baseline_below_most_popular_is_not_testable(constructed):
    """A paired claim gets a verdict only where its baseline beats most-popular; records made on other SIDs are
    flagged in the claim."""
    a, res, targets, pop = constructed
    hist = [[] for _ in targets]                    # most-popular with popularity = -target: hits every user at 1
    md = open(study.report(a, res, targets, pop, "python scripts/study.py --dataset toy", (), hist)).read()
    claims = {r[0]: r for r in table(md, "The papers' claims")}
    assert not any("did not train" in r[3] for r in claims.values())          # most-popular 0.025
    high = np.zeros(U) - np.arange(U)              # popularity ranks item 0 first, ... : user u's target u
    md = open(study.report(a, res, targets, high, "python scripts/study.py --dataset toy", (),
                           [[i for i in range(u)] for u in range(U)])).read()   # u's history: the items above u
    claims = {r[0]: r for r in table(md, "The papers' claims")}
    v = claims["centroid vs random: Recall@5"][3]
    assert v.startswith("not testable: the baseline did not train (random's Recall@10 0.2500 vs most-popular 1.0000")
    res["centroid"][0]["sids"] = "0123456789ab"
    md = open(study.report(a, res, targets, pop, "python scripts/study.py --dataset toy")).read()
    claims = {r[0]: r for r in table(md, "The papers' claims")}
    assert "trained on 2 different SIDs: confounded" in claims["centroid vs random: Recall@5"][3]
    assert "SIDs (sha256 of the sids.npy each run trained on): -, 012345;" in md


def test_one_seed_pair_verdict_says_provisional(tmp_path):
    """With one seed pair only the users' bootstrap exists: the verdict is given, marked provisional; with two pairs
    that agree it is not."""
    a = study.parse_args(["--work-dir", str(tmp_path / "runs"), "--results-dir", str(tmp_path / "res"),
                          "--dataset", "toy"])
    for s in range(2):
        fake_run(a, "centroid", s, range(200), RANDOM, {})                  # hits half the users
        fake_run(a, "random", s, range(100 + s), RANDOM, {})                 # a quarter
    res = study.collect(a, ["centroid", "random"])
    pu = {v: study.per_user(r, np.arange(U), np.zeros(U, bool)) for v, r in res.items()}
    one = {v: {**p, "users_by_seed": {0: p["users_by_seed"][0]}} for v, p in pu.items()}
    _, v = study.claim_row(res, one, "paired", "centroid", "random", "recall@5")
    assert v == "reproduced (provisional: 1 seed pair, the seed spread not measured)", v
    assert study.claim_row(res, pu, "paired", "centroid", "random", "recall@5")[1] == "reproduced"


def test_records_are_not_git_ignored():
    """The records are the study's committed results: a .gitignore pattern that swallows them loses them."""
    a = study.parse_args(["--sids", ""])
    path = os.path.join(study.records_dir(a), "random-s0.json")
    r = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO)
    assert r.returncode == 1, f"{path} is git-ignored"


def test_committed_figures_stay_listed_without_the_run_folders(tmp_path):
    """The report rebuilt on a machine without the study's seed-0 folders lists the committed figures (07's per-stage
    figures in results/) that exist, and no others."""
    a = study.parse_args(["--work-dir", str(tmp_path / "runs"), "--results-dir", str(tmp_path / "res"),
                          "--dataset", "toy"])
    os.makedirs(a.results_dir)
    for k in ("cosine", "spectra"):
        open(os.path.join(a.results_dir, f"toy_sft_{k}.png"), "wb").close()
    figs = study.seed0_figures(a, ["random", "centroid"])
    assert [os.path.basename(f) for f in figs] == ["toy_sft_cosine.png", "toy_sft_spectra.png"]


def test_load_json_names_an_unreadable_record(tmp_path):
    rec = tmp_path / "random-s0.json"
    assert study.load_json(str(rec)) is None                           # not run yet
    rec.write_text('{"eval": {"model"')                                  # a truncated record
    with pytest.raises(SystemExit, match=r"random-s0.json is unreadable \(JSONDecodeError\); delete it and rerun"):
        study.load_json(str(rec))
