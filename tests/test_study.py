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
            n for n, v in V.items() if not v.cpt and v.softmax == "level"}
    assert {n: (v.init, v.gti) for n, v in V.items() if v.softmax == "full"} == {
        "mean-full": ("mean", False), "mean+gti-full": ("mean", True)}          # the papers' loss, not by default
    assert {n: v.cpt for n, v in V.items() if v.cpt} == {"random+cpt2": 2, "random+cpt8": 8, "centroid+cpt1": 1,
                                                         "centroid+cpt2": 2}
    assert all(v.cpt in study.CPT_EPOCHS[v.init] and v.tokenizer == "rqvae" for v in V.values() if v.cpt)
    for name, v in V.items():                    # every plain centroid row has a shuffled twin at the same scale
        if v.init == "centroid" and not v.gti and not v.cpt:
            twins = [w for w in V.values() if w.init == "shuffled" and w.tokenizer == v.tokenizer]
            assert twins and all(w.scale == v.scale and not w.gti and not w.aux for w in twins), name
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
    assert [study.threshold_verdict(e, 0.2) for e in (0.3, 0.1, -0.1, None)] == \
        ["reproduced", "inconclusive", "not reproduced", "inconclusive"]
    run = lambda s, best: {"seed": s, "sft": {"best_val_loss": best, "val_curve": [[0, 5.0, 0.0], [44, best, 0.1]]}}
    res = {"centroid": [run(0, 1.0), run(1, 3.0)], "random": [run(0, 3.0), run(1, 1.0)]}   # each seed: one reaches 2.0
    ours, v = study.claim_row(res, {}, "steps", "centroid", "random", None)
    assert v == "inconclusive" and "no seed pair" in ours and "1/2 seeds of centroid, 1/2 seeds of random" in ours
    assert study.claim_row({"centroid": [], "random": []}, {}, "steps", "centroid", "random", None)[1] == "not run yet"


# ---------------------------------------------------------------------------------------------------
# Constructed run folders
# ---------------------------------------------------------------------------------------------------
def topk_hitting(hit_users, rank=0):
    """(U, 20) lists: user u's target (item u) at `rank` for u in hit_users, absent otherwise."""
    top = np.tile(np.arange(10_000, 10_020), (U, 1))
    top[list(hit_users), rank] = np.array(list(hit_users))
    return top


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
        json.dump({"models": {v: {"levels": {"all": lv}, "purity": g.get("purity", 0.2)}}},
                  open(os.path.join(run_dir, f"diag_{st}.json"), "w"))


def fake_chain(a, init, seed, per_epoch):
    """A CPT chain's 07 files: per epoch (purity, popularity |rho|)."""
    root = study.cpt_dir(a, init, seed)
    os.makedirs(root, exist_ok=True)
    for e, (purity, pop) in per_epoch.items():
        lv = {**{k: 0.5 for k, _ in study.GEOMETRY}, "pop_spearman_abs": pop}
        json.dump({"models": {init: {"levels": {"all": lv}, "purity": purity}}},
                  open(os.path.join(root, f"diag_cpt{e}.json"), "w"))


RANDOM = [[0, 5.0], [44, 4.0], [88, 3.0], [132, 2.5], [176, 2.2], [220, 2.0]]
FAST = [[0, 5.0], [44, 3.0], [88, 2.0], [132, 1.9], [176, 1.85], [220, 1.8]]


@pytest.fixture
def constructed(tmp_path):
    a = study.parse_args(["--work-dir", str(tmp_path / "runs"), "--results-dir", str(tmp_path / "res"),
                          "--dataset", "toy"])
    for s in range(3):
        fake_run(a, "random", s, range(80 + 20 * s), RANDOM,                       # R@5 .20/.25/.30 over seeds
                 {"init": {"pop": 0.05, "purity": 0.3}, "sft": {"pop": 0.6, "purity": 0.3}})
        fake_run(a, "centroid", s, range(200), FAST, {"sft": {"purity": 0.2}})    # +0.25: reproduced
        fake_run(a, "shuffled", s, range(300), FAST, {})                          # centroid - shuffled < 0
        fake_run(a, "mean+gti", s, range(100, 200), RANDOM, {"sft": {"erank": 10.0, "rsa": 0.3}})
    fake_run(a, "mean", 0, range(100), RANDOM, {"sft": {"erank": 2.0, "rsa": 0.25}})   # one seed only
    for s in range(3):                            # CPT: centroid + 1 epoch = random + 8 > random + 2
        fake_run(a, "centroid+cpt1", s, range(200), RANDOM, {})
        fake_run(a, "random+cpt2", s, range(100), RANDOM, {})
        fake_run(a, "random+cpt8", s, range(200), RANDOM, {})
        fake_chain(a, "random", s, {0: (0.3, 0.05), 1: (0.3, 0.1), 8: (0.32 + 0.01 * s, 0.4)})
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
    assert len(claims) == 17                                                      # every claim of docs/papers.md
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
    assert verdict["GTI: mean init collapses the SID rows, low-rank after SFT"] == "reproduced"   # 1 - 2/10 >= .5
    assert verdict["random init drifts to a popularity axis (Thm 3.1)"] == "reproduced"            # .55 >= .2
    assert verdict["GTI keeps the codebook geometry after SFT (RSA, block structure)"] == "inconclusive"  # .05
    assert verdict["centroid init keeps item semantics after SFT (purity)"] == "not reproduced"  # -.1
    assert claims["GTI vs LC-Rec aux tasks: Recall@10"][2:4] == ["not run", "not run yet"]
    cpt = claims["centroid + 1-4 CPT epochs ~ random + 6-10 CPT epochs: Recall@5"]
    assert cpt[2].startswith("centroid+cpt1 - random+cpt2: +0.2500 [")
    assert "centroid+cpt1 - random+cpt8: +0.0000" in cpt[2]
    assert cpt[3] == "reproduced" and "--variants centroid+cpt1,random+cpt2,random+cpt8`" in cpt[4]
    sem = claims["CPT does not recover semantics from random init (purity)"]   # .5 - mean(.32, .33, .34) >= .05
    assert sem[3] == "reproduced" and "--cpt-only" in sem[4]
    assert "random after 8 CPT epochs 0.330 (mean over seeds 0,1,2)" in sem[2]
    assert "effect a - b = +0.350" in claims["random rows organize by popularity during CPT"][2]  # .4 - .05
    assert verdict["random rows organize by popularity during CPT"] == "reproduced"
    after = {(r[0], r[1]): r for r in table(md, "Geometry after CPT")}
    assert after[("random", "8")][2] == "3 (0,1,2)" and after[("random", "8")][-1] == "0.330 +- 0.010"
    assert ("centroid", "0") in after and ("centroid", "8") not in after
    assert "--variants centroid,random" in claims["centroid vs random: Recall@5"][4]
    assert "--variants random`" in claims["random init drifts to a popularity axis (Thm 3.1)"][4]
    assert os.path.exists(os.path.join(a.results_dir, "toy_val_loss.png"))


def test_cpt_only_report(tmp_path):
    """A --cpt-only piece (chains, no SFT run) reports the CPT geometry claims and leaves the others out."""
    a = study.parse_args(["--work-dir", str(tmp_path / "runs"), "--results-dir", str(tmp_path / "res"),
                          "--dataset", "toy", "--variants", "random+cpt8,centroid+cpt1", "--cpt-only"])
    fake_chain(a, "random", 0, {0: (0.3, 0.05), 1: (0.3, 0.1), 8: (0.31, 0.12)})
    fake_chain(a, "centroid", 0, {0: (0.5, 0.1)})
    # seed 1's chains stopped before epoch 8: the claims compare over seed 0 only, not 8 epochs of seed 0
    # against the mean of two seeds' epoch 0 (that would read 0.12 - 0.55 here)
    fake_chain(a, "random", 1, {0: (0.2, 1.05), 1: (0.2, 1.0)})
    fake_chain(a, "centroid", 1, {0: (0.9, 0.1)})
    res = study.collect(a, list(study.VARIANTS))
    assert not any(res.values())
    md = open(study.report(a, res, np.arange(U), np.full(U, 100), "python scripts/study.py --dataset toy")).read()
    claims = {r[0]: r for r in table(md, "The papers' claims")}
    assert set(claims) == {c[0] for c in study.CLAIMS if c[2] in ("cpt", "cpt_geometry")}
    assert claims["CPT does not recover semantics from random init (purity)"][3] == "reproduced"   # .5 - .31
    assert claims["random rows organize by popularity during CPT"][3] == "inconclusive"           # .12 - .05 < .2
    assert "effect a - b = +0.070" in claims["random rows organize by popularity during CPT"][2]
    assert "(mean over seed 0)" in claims["CPT does not recover semantics from random init (purity)"][2]
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
            "--out-root", str(tmp_path / "o"), "--results-dir", str(tmp_path / "r")]
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
            "--results-dir", str(tmp_path / "r")]
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
