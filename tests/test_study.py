"""scripts/study.py: the aggregation (mean +- std, steps to threshold, most-popular row) on constructed run
folders, and the driver's command plan (--dry-run) against the numbered scripts' current flags."""
import json
import os

import numpy as np
import pytest

from conftest import load_script, REPO, assert_one_line_error, run

study = load_script("scripts/study.py")


def test_mean_std_and_steps_to_threshold():
    assert study.ms([1.0, 3.0]) == "2.000 +- 1.414"
    assert study.ms([2.0, None]) == "2.000"
    assert study.ms([]) == "-"
    curve = [[0, 3.0, 0.1], [10, 2.5, 0.2], [20, 2.0, 0.3]]
    assert study.steps_to(curve, 2.5) == 10 and study.steps_to(curve, 1.0) is None


def fake_run(work, v, seed, best, recall):
    """A finished run folder as run_one leaves it (JSONs only)."""
    run_dir = os.path.join(work, "toy", v, f"seed{seed}")
    final = os.path.join(run_dir, "models", study.VARIANTS[v]["init"] + "+sft")
    os.makedirs(final)
    lv = {k: 1.0 for k, _ in study.GEOMETRY}
    diag = {"reference": {"k": 10, "purity_item_emb": 0.5, "purity_random_sid_rows": 0.3, "purity_chance": 0.1},
            "models": {v: {"levels": {"all": lv}, "purity": 0.4, "spread_ratio_vocab_over_sid": 2.0}}}
    for st in ("init", "sft"):
        json.dump(diag, open(os.path.join(run_dir, f"diag_{st}.json"), "w"))
    json.dump({"val_curve": [[0, 4.0, 0.0], [10, best + 0.5, 0.1], [20, best, 0.2]], "best_val_loss": best,
               "best_step": 20} | ({"val_level_acc": [[20, [0.1 * seed, 0.2, 0.0, 1.0]]],     # older 05: no
                                    "val_level_names": ["a", "b", "c", "eos"]} if seed else {}),  # per position
              open(os.path.join(final, "05_sft.json"), "w"))
    m = {"recall@5": recall, "recall@10": recall, "recall@20": recall, "ndcg@10": recall / 2}
    json.dump({"model": m, "most_popular": {k: 0.05 for k in m}, "cold_users": 3, "cold_model": {"recall@10": 0.0},
               "cold_most_popular": {"recall@10": 0.0}}, open(os.path.join(final, "eval_test_keep.json"), "w"))


def test_report_table(tmp_path):
    a = study.Args(seeds=2, work_dir=str(tmp_path / "runs"), results_dir=str(tmp_path / "res"))
    os.makedirs(a.results_dir)
    for s, (b_r, b_m) in enumerate([(2.0, 3.0), (2.2, 3.2)]):
        fake_run(a.work_dir, "random", s, b_r, 0.02 + 0.01 * s)
        fake_run(a.work_dir, "mean", s, b_m, 0.01)
    res = study.collect(a, "toy", ["random", "mean"])
    study.report(a, "toy", res, [], "python scripts/study.py --test")
    md = open(os.path.join(a.results_dir, "toy.md")).read()
    rows = {}
    for line in md.splitlines():                                        # first table: test metrics
        if line.startswith("| "):
            rows.setdefault(line.split("|")[1].strip(), line)
    assert "0.025 +- 0.007" in rows["random"]                           # Recall@5 over the two seeds
    assert "steps to val loss 3.100" in md                              # auto threshold: worst mean best loss
    assert "(2/2 reached)" in rows["random"] and "(1/2 reached)" in rows["mean"]
    assert rows["most popular"].count("0.050") == 4
    assert "| 0.200 +- 0.000 |" in rows["random"]
    assert "| a 0.10 b 0.20 c 0.00 eos 1.00 |" in rows["random"]             # per position: the seed that has it                           # last validation token accuracy
    assert os.path.exists(os.path.join(a.results_dir, "toy_val_loss.png"))


def test_dry_run_matches_script_flags(tmp_path):
    """Every flag the driver passes exists in the committed scripts (it checks their --help)."""
    for s in ("03_expand_vocab.py", "04_ground.py", "05_sft.py", "06_eval.py"):
        if not os.path.exists(os.path.join(REPO, s)):
            pytest.skip(f"{s} not written yet")
    r = run("scripts/study.py", "--dry-run", "--seeds", "1", "--work-dir", tmp_path / "w",
            "--results-dir", tmp_path / "r", "--out-root", tmp_path / "o")
    assert r.stdout.count("python 05_sft.py") == len(study.Args.variants.split(","))
    assert r.stdout.count("python 04_ground.py") == 2 and "--aux-tasks" in r.stdout
    r = run("scripts/study.py", "--dry-run", "--seeds", "1", "--variants", "why", "--until", "sft", "--work-dir",
            tmp_path / "w", "--results-dir", tmp_path / "r", "--out-root", tmp_path / "o")
    assert r.stdout.count("python 05_sft.py") == len(study.WHY.split(",")) and "06_eval.py" not in r.stdout
    assert r.stdout.count("--head-init") == 4 and r.stdout.count("--centroid-map pad") == 1


def test_unknown_variant_one_line():
    assert_one_line_error(run("scripts/study.py", "--variants", "random,bogus", "--dry-run", check=False))
