"""scripts/convergence.py: every run trains on the pinned tokenizer (not on whatever 02 learned on this machine),
the patience rule applied to 06's ranking of 05's kept checkpoints (best, stop, the checkpoints after the stop never
ranked, a killed ranking resumed), a finished run's record round-trips (the report needs no out/ folder), a run
with a record on the pinned SIDs is not rerun and one on other SIDs is, and the efficiency verdict pairs seeds and
keeps a pair whose peak was not reached as a bound (censored), against the claim where it is centroid's."""
import argparse
import json

import numpy as np
import pytest

from conftest import load_script

conv = load_script("scripts/convergence.py")


def fake_run(d, best, stopped, users=5):
    """05's folder (05_sft.json) and its chosen checkpoint (06's test files); -> (best_dir, the ranking)."""
    d.mkdir(parents=True)
    (d / "05_sft.json").write_text(json.dumps({
        "examples": 600, "aux_examples": 60, "batch_size": 8, "grad_accum": 1, "seconds": 90.0, "steps": 2 * stopped,
        "device": "cuda:0", "autocast": "bf16 autocast on cuda (fp32 weights)"}))
    best_dir = d.parent / f"{d.name}.checkpoints" / f"step_{best}"
    best_dir.mkdir(parents=True)
    (best_dir / "eval_test.json").write_text(json.dumps({"model": {"recall@10": 0.4}}))
    np.save(best_dir / "eval_test_topk.npy", np.arange(users * 20).reshape(users, 20))
    return str(best_dir), {"rank_curve": [[0, 0.0, 0.01], [best, 0.2, 0.1]], "best_step": best, "stopped_at": stopped,
                           "rank_seconds": 30.0}


def fake_make_run(root, sids):
    """make run's 01 and 02 files (contents that only have to be copied or linked)."""
    out = root / conv.OUT
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "sids.npy", sids)
    for f in ("centroids.pt", "rqvae.pt", "02_rqvae.json", "dataset.pt", "item_emb.npy", "01_embed_items.json"):
        (out / f).write_text(f)


def test_pinned_tokenizer_and_base(tmp_path, monkeypatch):
    monkeypatch.setattr(conv, "REPO", str(tmp_path))
    fake_make_run(tmp_path, np.zeros((5, 4), np.int64))
    calls = []

    def fake_sh(cmd, logs):                        # 03/04 "build" the folder they would write
        calls.append(cmd[0])
        model = {"03_expand_vocab.py": "random", "04_ground.py": "centroid+gti"}[cmd[0]]
        (tmp_path / conv.BASE / "models" / model).mkdir(parents=True)
        (tmp_path / conv.BASE / "models" / model / "sid_vocab.json").write_text("{}")
    monkeypatch.setattr(conv, "sh", fake_sh)
    pinned = conv.pin_tokenizer()
    assert (tmp_path / conv.TOKENIZER / "sids.npy").read_bytes() == (tmp_path / conv.OUT / "sids.npy").read_bytes()
    np.save(tmp_path / conv.OUT / "sids.npy", np.ones((5, 4), np.int64))  # this machine's 02 learned other codes
    assert conv.pin_tokenizer() == pinned                                   # the pin does not follow it
    conv.build_base("random", pinned)
    base = tmp_path / conv.BASE
    assert (base / "sids.npy").read_bytes() == (tmp_path / conv.TOKENIZER / "sids.npy").read_bytes()
    assert (base / "dataset.pt").is_symlink() and calls == ["03_expand_vocab.py"]
    conv.build_base("random", pinned)                                       # built: nothing reruns
    conv.build_base("centroid+gti", pinned)                                 # the ceiling also grounds
    assert calls == ["03_expand_vocab.py", "04_ground.py"]
    np.save(tmp_path / conv.TOKENIZER / "sids.npy", np.full((5, 4), 2, np.int64))   # a new pin: 03 reruns
    conv.build_base("random", conv.pin_tokenizer())
    assert calls[-1] == "03_expand_vocab.py" and (base / "sids.npy").read_bytes() == (
        tmp_path / conv.TOKENIZER / "sids.npy").read_bytes()


def test_record_round_trip_and_skip(tmp_path, monkeypatch):
    monkeypatch.setattr(conv, "REPO", str(tmp_path))
    best_dir, ranked = fake_run(tmp_path / "run", 44, 88)
    fake_make_run(tmp_path, np.zeros((5, 4), np.int64))
    conv.pin_tokenizer()
    conv.write_record("random-s0", "random", 0, str(tmp_path / "run"), best_dir, ranked)
    rec, topk = conv.read_record("random-s0", 5)
    assert rec["init"] == "random" and rec["best_step"] == 44 and rec["steps_per_epoch"] == 82.5
    assert rec["stopped_at"] == 88 and rec["seconds"] == 90.0 and rec["rank_seconds"] == 30.0
    assert list(rec) == ["run", "kind", "init", "flags", "seed", "sids_sha256", "test", "steps_per_epoch",
                         "best_step", "stopped_at", "rank_curve", "seconds", "rank_seconds", "cpu", "device"]   # the fields
    assert rec["device"] == "cuda:0, bf16 autocast on cuda (fp32 weights)"        # a GPU run says so
    assert len(rec["sids_sha256"]) == 12 and int(rec["sids_sha256"], 16) >= 0
    assert rec["rank_curve"][1] == [44, 0.2, 0.1] and topk.dtype == np.int64
    assert (topk == np.arange(100).reshape(5, 20)).all()
    assert conv.read_record("centroid-s0", 5) is None
    with pytest.raises(SystemExit, match=r"5 users, dataset.pt 6; delete results/convergence/random-s0\* and rerun"):
        conv.read_record("random-s0", 6)                               # a record of another dataset
    good = (tmp_path / conv.RECORDS / "random-s0.json").read_text()
    (tmp_path / conv.RECORDS / "random-s0.json").write_text(good[:40])  # a truncated record: one line, no traceback
    with pytest.raises(SystemExit, match=r"random-s0.json is unreadable \(JSONDecodeError\); delete results/conv"):
        conv.read_record("random-s0", 5)
    (tmp_path / conv.RECORDS / "random-s0.json").write_text(good)
    monkeypatch.setattr(conv, "sh", lambda *a, **k: pytest.fail("a run with a record must not rerun"))
    conv.run_one(None, "random-s0", "random", 0)
    rec["sids_sha256"] = "0123456789ab"                                # a record made on other SIDs: rerun
    (tmp_path / conv.RECORDS / "random-s0.json").write_text(json.dumps(rec))
    monkeypatch.setattr(conv, "build_base", lambda init, pinned: None)
    ran = []

    def stop_at_05(cmd, logs):
        ran.append(cmd)
        raise InterruptedError                                         # the test needs only the first call
    monkeypatch.setattr(conv, "sh", stop_at_05)
    with pytest.raises(InterruptedError):
        conv.run_one(argparse.Namespace(epochs=1.0, eval_every=10, rank_users=5), "random-s0", "random", 0)
    assert [c[0] for c in ran] == ["05_sft.py"] and "--keep-checkpoints" in ran[0]     # 05 to the cap, all kept
    assert ran[0][ran[0].index("--steps") + 1] == "660" and "--resume" not in ran[0]


@pytest.mark.parametrize("ndcg, best, stopped", [
    ([0.01, 0.05, 0.04, 0.03, 0.06, 0.07], 1, 3),       # 2 validations after the best without a better one: stop
    ([0.01, 0.05, 0.04, 0.05, 0.06, 0.07], 1, 3),       # a tie is not better: the first of equal values stays best
    ([0.01, 0.05, 0.04, 0.06, 0.05, 0.07], 5, 5),       # each new best restarts the count; runs to the cap
    ([0.01, 0.02, 0.03, 0.04, 0.03, 0.02], 3, 5),       # the rule never stops the run at its last validation
    ([0.09, 0.05, 0.04, 0.06], 0, 2)])                  # step 0 can be the best
def test_patience_rule(ndcg, best, stopped):
    curve = [[220 * i, 0.0, n] for i, n in enumerate(ndcg)]
    assert conv.stop_early(curve, 220 * (len(ndcg) - 1)) == (220 * best, 220 * stopped)


def test_rank_checkpoints_stops_with_the_patience_rule_and_resumes(tmp_path, monkeypatch):
    """06 ranks 05's checkpoints in step order and stops with the rule: the ones after the stop are never ranked;
    a killed ranking goes on at the next checkpoint; the record's curve, best step, stop and seconds."""
    monkeypatch.setattr(conv, "REPO", str(tmp_path))
    save = "out/ml-100k/convergence/random-s0"
    (tmp_path / save).mkdir(parents=True)
    (tmp_path / save / "05_sft.json").write_text(json.dumps({"steps": 1100}))
    ndcg = {0: 0.01, 220: 0.05, 440: 0.07, 660: 0.06, 880: 0.065, 1100: 0.2}     # stop at 880, best 440
    for step in ndcg:
        (tmp_path / f"{save}.checkpoints" / f"step_{step}").mkdir(parents=True)
    ranked = []

    def fake_06(cmd, logs):
        model = cmd[cmd.index("--model") + 1]
        assert cmd[0] == "06_eval.py" and cmd[cmd.index("--split") + 1] == "valid" and "--users" in cmd
        assert cmd[cmd.index("--protocol") + 1] == "excluded" and cmd[cmd.index("--beam") + 1] == "20"
        step = int(model.rsplit("_", 1)[1])
        if len(ranked) == 2 and not killed:
            killed.append(step)
            raise InterruptedError                                     # killed while ranking step 440
        ranked.append(step)
        (tmp_path / model / "eval_valid.json").write_text(json.dumps(
            {"model": {"recall@10": 2 * ndcg[step], "ndcg@10": ndcg[step]}}))
    killed = []
    monkeypatch.setattr(conv, "sh", fake_06)
    a = argparse.Namespace(rank_users=943)
    with pytest.raises(InterruptedError):
        conv.rank_checkpoints(a, save, "logs")
    out = conv.rank_checkpoints(a, save, "logs")
    assert ranked == [0, 220, 440, 660, 880] and killed == [440]           # 1100 never ranked; 0, 220 not twice
    assert out["best_step"] == 440 and out["stopped_at"] == 880
    assert out["rank_curve"] == [[s, round(2 * ndcg[s], 5), ndcg[s]] for s in (0, 220, 440, 660, 880)]
    assert 0 <= out["rank_seconds"] < 60


def rec(init, seed, best, stopped):
    return {"init": init, "seed": seed, "best_step": best, "stopped_at": stopped}, None


def test_efficiency_verdict():
    recs = {"random-s0": rec("random", 0, 1000, 1440), "centroid-s0": rec("centroid", 0, 700, 1140),
            "random-s1": rec("random", 1, 1100, 1540), "centroid-s1": rec("centroid", 1, 800, 1240)}
    lines, v = conv.efficiency(recs)
    assert len(lines) == 2 and "centroid -30% steps" in lines[0] and "-27% steps" in lines[1]
    assert v.startswith("reproduced") and "-29% steps" in v and "[-46%, -11%]" in v   # t_{0.975,1} = 12.7
    recs["centroid-s1"] = rec("centroid", 1, 1200, 1640)            # seed 1: centroid 9% slower
    lines, v = conv.efficiency(recs)
    assert "+9% steps" in lines[1] and v.startswith("inconclusive") and "-10% steps" in v
    recs["centroid-s1"][0]["sids_sha256"] = "abc"                  # trained on other SIDs: flagged
    assert "confounded with the tokenizer" in conv.efficiency(recs)[0][1]
    assert "confounded" not in conv.efficiency(recs)[0][0]
    recs["centroid-s1"] = rec("centroid", 1, 1980, 1980)            # best at its last validation: peak >= 1980
    lines, v = conv.efficiency(recs)                                # kept, at most -80% saved: against the claim
    assert lines[1] == ("seed 1: best step random 1100, centroid 1980 (centroid best at its last validation: peak not "
                        "reached): centroid >= +80% steps, counted against the claim")
    assert v.startswith("inconclusive: centroid +25% steps") and "1 censored at the cap" in v   # (-30% and >= +80%)
    capped = {"random-s0": rec("random", 0, 1980, 1980), "centroid-s0": rec("centroid", 0, 900, 1340)}
    lines, v = conv.efficiency(capped)                              # random still rising: a saving of at least 55%
    assert "centroid <= -55% steps" in lines[0] and v == (
        "inconclusive: centroid -55% steps to its peak vs random (one seed pair, no interval; 1 censored at the cap; "
        "paper: -27%)")
    both = {"random-s0": rec("random", 0, 1980, 1980), "centroid-s0": rec("centroid", 0, 1980, 1980)}
    lines, v = conv.efficiency(both)
    assert "no information" in lines[0] and v == "inconclusive: no seed pair where either run reached its peak"
    assert conv.efficiency({"ceiling": rec("centroid+gti", 0, 1988, 1988)}) == ([], v)


def test_a_censored_pair_is_a_bound_not_dropped():
    """Six seed pairs where centroid peaks ~30% earlier and one where it is still rising at the cap: dropping that
    pair would read 'reproduced'; kept as a bound (its saving at most 0), the claim is inconclusive."""
    recs = {}
    for sd, c in enumerate((700, 690, 710, 720, 680, 705)):
        recs.update({f"random-s{sd}": rec("random", sd, 1000, 1440), f"centroid-s{sd}": rec("centroid", sd, c, 1140)})
    assert conv.efficiency(recs)[1].startswith("reproduced: centroid -30% steps")
    recs.update({"random-s6": rec("random", 6, 1980, 1980 + 440), "centroid-s6": rec("centroid", 6, 1980, 1980)})
    lines, v = conv.efficiency(recs)
    assert "centroid >= +0% steps, counted against the claim" in lines[6]
    assert v.startswith("inconclusive (a censored pair bounds the saving the other way): centroid -26% steps")


def curve(init, seed, ndcg, every=220):
    """A record whose validation NDCG@10 is `ndcg` at steps 0, every, 2 every, ..."""
    best = every * int(np.argmax(ndcg))
    return {"init": init, "seed": seed, "best_step": best, "stopped_at": every * (len(ndcg) - 1),
            "rank_curve": [[every * i, 0.0, n] for i, n in enumerate(ndcg)]}, None


def test_reach_reads_the_first_validation_at_random_peak():
    """Steps until centroid first reaches random's best, defined also when centroid is still rising at the cap."""
    recs = {"random-s0": curve("random", 0, [0.0, 0.05, 0.09, 0.10, 0.09, 0.08]),       # peak 0.10 at 660
            "centroid-s0": curve("centroid", 0, [0.0, 0.06, 0.10, 0.09, 0.11, 0.12])}   # reaches it at 440
    lines, v = conv.reach(recs)
    assert lines == ["seed 0: random's best 0.1000 at step 660; centroid reaches it at step 440: -33% steps"]
    assert v == "inconclusive: centroid -33% steps to random's peak (one seed pair, no interval; paper: -27%)"
    recs["random-s1"] = curve("random", 1, [0.0, 0.05, 0.09, 0.10, 0.09])             # peak at 660 again
    recs["centroid-s1"] = curve("centroid", 1, [0.0, 0.04, 0.07, 0.095, 0.099])        # never reaches it
    lines, v = conv.reach(recs)                                     # kept: at least 880 steps, against the claim
    assert lines[1] == ("seed 1: random's best 0.1000 at step 660; centroid reaches it at no validation up to step "
                        "880: >= +33% steps, counted against the claim")
    assert v.startswith("inconclusive: centroid ") and v.endswith(   # -33% and >= +33%: a mean of 0
        "0% steps to random's peak (95% t interval over seed pairs [-424%, +424%]; 1 censored at the cap; paper: -27%)")
    recs["centroid-s1"] = curve("centroid", 1, [0.0, 0.10, 0.10, 0.09, 0.09])          # 220: -67%
    lines, v = conv.reach(recs)                                     # two pairs: -33% and -67%, t_{0.975,1} = 12.7
    assert lines[1].endswith("at step 220: -67% steps")
    assert v == "inconclusive: centroid -50% steps to random's peak (95% t interval over seed pairs [-262%, +162%]; paper: -27%)"
    recs["centroid-s1"] = curve("centroid", 1, [0.0, 0.07, 0.095, 0.12, 0.09])         # 660: +0%
    assert "[-228%, +195%]" in conv.reach(recs)[1]
    assert conv.reach({"random-s0": recs["random-s0"]}) == ([], "inconclusive: no seed pair with both validation curves")


def test_reach_other_names_a_run_that_never_gets_there():
    """Steps each GTI-claim run needs to reach the other's best; one that never does says so, with its last step."""
    gti, _ = curve("mean+gti", 0, [0.0, 0.05, 0.10, 0.12, 0.11])        # best 0.12 at 660
    mean, _ = curve("mean", 0, [0.0, 0.02, 0.06, 0.09, 0.08, 0.07])     # best 0.09 at 660
    assert conv.reach_other("g", "m", gti, mean) == (
        "g reaches m's best validation NDCG@10 at step 440 (m's best step 660); "
        "m reaches g's at no validation up to step 1100 (g's best step 660)")


def test_report_from_records_alone(tmp_path, monkeypatch):
    """The table and figure come from the records (no run folders): test metrics recomputed from the ranked
    lists, each run paired with SASRec's lists, a pair on different SIDs flagged, the runs not made yet named with their command."""
    import torch
    monkeypatch.setattr(conv, "REPO", str(tmp_path))
    fake_make_run(tmp_path, np.zeros((5, 4), np.int64))
    torch.save({"valid": torch.tensor([1, 2, 3, 4, 0]), "test": torch.arange(5),
                "popularity": torch.tensor([5, 4, 3, 2, 1]), "train": [[9], [9], [9], [9], [9]]},
               tmp_path / conv.OUT / "dataset.pt")
    (tmp_path / conv.OUT / "sasrec").mkdir()
    m = {"recall@10": 0.5, "ndcg@10": 0.25}
    (tmp_path / conv.OUT / "sasrec" / "eval_test.json").write_text(json.dumps(
        {"best_epoch": 3, "best_val_ndcg@10": 0.3, "train_seconds": 60,
         "exclude_history": {"model": m, "most_popular": m}}))
    sas_topk = np.tile(np.arange(20) + 100, (5, 1))
    sas_topk[0, 0] = 0                                       # SASRec hits 1 test item at rank 1
    np.save(tmp_path / conv.OUT / "sasrec" / "eval_test_topk_exclude.npy", sas_topk)
    pinned = conv.pin_tokenizer()
    for name, best, first in (("random-s0", 40, 0), ("centroid-s0", 30, 1)):
        best_dir, ranked = fake_run(tmp_path / name, best, 60)
        conv.write_record(name, name.split("-")[0], 0, str(tmp_path / name), best_dir, ranked)
        topk = np.tile(np.arange(20) + 100, (5, 1))
        topk[:first + 2, 0] = np.arange(first + 2)          # random hits 2 test items at rank 1, centroid 3
        np.save(tmp_path / conv.RECORDS / f"{name}_test_topk.npy", topk.astype(np.int32))
    rec = json.loads((tmp_path / conv.RECORDS / "random-s0.json").read_text())
    (tmp_path / conv.RECORDS / "random-s0.json").write_text(json.dumps({**rec, "sids_sha256": "-"}))
    a = argparse.Namespace(inits="ceiling,random,centroid", seeds="0,1", epochs=3.0, eval_every=220,
                           rank_users=943)
    conv.report(a, conv.runs_of(a))
    md = (tmp_path / "results" / "ml-100k_convergence.md").read_text()
    assert "| random-s0 | 40 (0.48) | 0.1000 | 0.4000 | 0.4000 |" in md and f"| {pinned[:6]} |" in md
    assert "| centroid-s0 | 30 (0.36) | 0.1000 | 0.6000 | 0.6000 |" in md
    paired = next(x for x in md.splitlines() if x.startswith("seed 0, centroid - random at the peak"))
    assert "recall@10 +0.2000" in paired and paired.endswith("SIDs differ: confounded with the tokenizer)")
    assert "random-s0 - SASRec (test, paired bootstrap 95%): recall@10 +0.2000" in md
    assert "centroid-s0 - SASRec (test, paired bootstrap 95%): recall@10 +0.4000" in md
    assert "random 40, centroid 30" in md and "confounded with the tokenizer)" in md.split("Efficiency")[1]
    assert "Not run yet: ceiling, random-s1, centroid-s1 (`python scripts/convergence.py --runs ceiling`" in md
    assert (tmp_path / "results" / "ml-100k_convergence.png").stat().st_size > 1000
    import shutil                                            # SASRec is pinned in results/: out/'s copy can go
    shutil.rmtree(tmp_path / conv.OUT / "sasrec")
    conv.report(a, conv.runs_of(a))
    assert (tmp_path / "results" / "ml-100k_convergence.md").read_text() == md


def test_record_keeps_the_sid_rows_of_every_ranked_checkpoint(tmp_path, monkeypatch):
    """Each ranked checkpoint's SID rows (fp16, sid_vocab.json's order; step 0 = the init) go into <run>_rows.npz;
    a tied head keeps no head rows."""
    import torch
    from safetensors.torch import save_file
    monkeypatch.setattr(conv, "REPO", str(tmp_path))
    fake_make_run(tmp_path, np.zeros((5, 4), np.int64))
    conv.pin_tokenizer()
    best_dir, ranked = fake_run(tmp_path / "run", 44, 88)
    ranked["rank_curve"] = [[0, 0.0, 0.01], [44, 0.2, 0.1], [88, 0.1, 0.05]]
    for step in (0, 44, 88):
        ck = tmp_path / "run.checkpoints" / f"step_{step}"
        ck.mkdir(parents=True, exist_ok=True)
        (ck / "sid_vocab.json").write_text(json.dumps({"token_ids": [[3, 5], [7, -1]]}))
        emb = torch.arange(40, dtype=torch.float32).view(10, 4) + step
        save_file({"model.embed_tokens.weight": emb}, str(ck / "model.safetensors"))
    conv.write_record("mean-full-s0", "mean-full", 0, str(tmp_path / "run"), best_dir, ranked)
    rec, _ = conv.read_record("mean-full-s0", 5)
    assert rec["rows"] == "mean-full-s0_rows.npz" and rec["flags"] == ["--softmax", "full"] and rec["init"] == "mean"
    z = np.load(tmp_path / conv.RECORDS / "mean-full-s0_rows.npz")
    assert sorted(z.files) == ["input", "steps", "token_ids"] and list(z["steps"]) == [0, 44, 88]
    assert list(z["token_ids"]) == [3, 5, 7] and z["input"].dtype == np.float16 and z["input"].shape == (3, 3, 4)
    assert (z["input"][2, 1] == np.arange(20, 24) + 88).all()          # step 88, token 5


def test_gti_claim_needs_a_baseline_that_trains():
    """A GTI row gets a verdict only where its baseline beats most-popular; with two seed pairs both intervals
    must agree; an unjudged row (Recall@5, NDCG@5) is shown beside."""
    n = 400
    pop = (np.arange(n) % 10 == 0).astype(float)                     # most-popular: Recall@10 0.10
    weak = {"recall@10": (np.arange(n) % 20 == 0).astype(float)}       # 0.05: below most-popular
    strong = {"recall@10": (np.arange(n) % 4 == 0).astype(float)}      # 0.25
    better = {"recall@10": (np.arange(n) % 2 == 0).astype(float)}      # 0.50
    per = {"mean-full": {0: weak}, "mean+gti-full": {0: better}}
    assert conv.gti_claim(per, pop, "mean+gti-full", "mean-full", "recall@10", True)[2] == (
        "not testable: the baseline did not train")
    per["mean-full"] = {0: strong}
    ours, b_text, v = conv.gti_claim(per, pop, "mean+gti-full", "mean-full", "recall@10", True)
    assert v == "reproduced (provisional: 1 seed pair, the seed spread not measured)" and ours.startswith("+0.2500 [") and "(+100.0%)" in ours and b_text.startswith("0.2500")
    per["mean+gti-full"] = {0: {"recall@10": strong["recall@10"][::-1].copy()}}   # same mean, other users
    v = conv.gti_claim(per, pop, "mean+gti-full", "mean-full", "recall@10", True)[2]
    assert v == "inconclusive"                                         # plain: more pairs cannot decide it
    a_little = {"recall@10": strong["recall@10"] + (np.arange(n) == 1)}  # seed 1: one more hit than strong
    per = {"mean-full": {0: strong, 1: strong}, "mean+gti-full": {0: better, 1: a_little}}   # +0.25, +0.0025
    assert conv.gti_claim(per, pop, "mean+gti-full", "mean-full", "recall@10", True)[2] == (
        "inconclusive (inside the seed spread)")
    assert conv.gti_claim(per, pop, "mean+gti-full", "mean-full", "recall@10", False)[2] == "shown beside"
    per["mean+gti2-full"] = {0: better}                  # one pair, +0.25: judged on light GTI's spread (sd 0.175)
    ours, _, v = conv.gti_claim(per, pop, "mean+gti2-full", "mean-full", "recall@10", True)
    assert v == "inconclusive (inside the seed spread)" and "mean+gti-full - mean-full's seed spread (sd 0.1750" in ours
    one_less = {"recall@10": better["recall@10"] - (np.arange(n) == 0)}   # light GTI +0.25, +0.2475: sd 0.0018
    per["mean+gti-full"] = {0: better, 1: one_less}
    assert conv.gti_claim(per, pop, "mean+gti2-full", "mean-full", "recall@10", True)[2] == "reproduced"
    assert conv.gti_claim({"mean-full": {0: strong}}, pop, "mean+gti-full", "mean-full", "recall@10", True)[2] == (
        "not run yet")
    per = {"mean-full": {0: strong, 3: weak}, "mean+gti-full": {0: better}}    # b's seed 3 has no partner
    assert conv.gti_claim(per, pop, "mean+gti-full", "mean-full", "recall@10", True)[1].startswith("0.2500")
    assert conv.gti_claim({"mean-full": per["mean-full"]}, pop, "mean+gti-full", "mean-full", "recall@10",
                          True)[1].startswith("0.1500")                       # before a has run: all of b's seeds


def test_gti_power_from_the_peak_seed_spread():
    """The seed pairs the GTI claims need, from centroid - random's spread at the peak: per-seed Recall@10 differences
    0 and 0.01 (sd 0.00707) give 2 pairs an MDE of (12.706 + 1.376) x 0.00707 / sqrt(2) = 0.0704; the paper's 22.03%
    of 0.25 = 0.0551 needs 3 pairs ((4.303 + 1.061) x 0.00707 / sqrt(3) = 0.0219). Nothing before two pairs."""
    n = 400
    hits = lambda k: {"recall@10": (np.arange(n) < k).astype(float)}   # noqa: E731  (k / 400)
    per = {"random": {0: hits(40), 1: hits(40)}, "centroid": {0: hits(40), 1: hits(44)}, "mean-full": {0: hits(100)}}
    line = conv.gti_power(per)
    assert "sd 0.0071" in line and "MDE (80% power) of 0.0704 with 2 pairs" in line, line
    assert "is 0.0551, which needs 3 seed pairs" in line, line
    assert conv.gti_power({**per, "centroid": {0: hits(40)}}) is None
    # 3 GTI pairs: their own spread. Differences 0.01, 0.03, 0.02 (sd 0.01): MDE (4.303 + 1.061) x 0.01 / sqrt(3)
    # = 0.0310; the paper's 22% of 0.25 = 0.0551 needs 2 pairs at that spread ((12.706 + 1.376) x 0.01 / sqrt(2)
    # = 0.0996 > 0.0551, so not 2) -> 3 pairs
    per = {**per, "mean-full": {s: hits(100) for s in range(3)},
           "mean+gti-full": {0: hits(104), 1: hits(112), 2: hits(108)}}
    line = conv.gti_power(per)
    assert "over its 3 seed pairs (+0.0100, +0.0300, +0.0200; sd 0.0100)" in line, line
    assert "MDE (80% power) of 0.0310;" in line and "is 0.0551, which needs 3 seed pairs" in line, line


def test_unknown_kind_is_one_line():
    with pytest.raises(SystemExit, match=r"unknown kind 'mean-fulll' in --inits; choose from ceiling,"):
        conv.runs_of(argparse.Namespace(inits="mean-fulll", seeds="0"))


def test_schedule_scales_the_aux_runs_to_the_same_windows():
    a = argparse.Namespace(epochs=3.0, eval_every=220)
    assert conv.schedule(a) == (1980, 220) == conv.schedule(a, conv.KINDS["mean-full"][1])
    steps, every = conv.schedule(a, conv.KINDS["mean+aux-full"][1])           # 7.53 rows per window
    assert every == round(220 * 39880 / 5299) and steps == 9 * every


def test_two_stage_gti_base(tmp_path, monkeypatch):
    """Two-stage GTI: 04 grounds the rows with the plateau rule (resuming a killed piece), then trains every parameter
    for as many passes as the first stage ran; the first stage's per-epoch CPT folders are removed; nothing reruns
    once built."""
    monkeypatch.setattr(conv, "REPO", str(tmp_path))
    fake_make_run(tmp_path, np.zeros((5, 4), np.int64))
    calls, models = [], tmp_path / conv.BASE / "models"

    def fake_sh(cmd, logs):
        calls.append(cmd)
        save = cmd[cmd.index("--save") + 1] if "--save" in cmd else f"{conv.BASE}/models/random"
        (tmp_path / save).mkdir(parents=True, exist_ok=True)
        (tmp_path / save / "sid_vocab.json").write_text("{}")
        if "--plateau" in cmd:
            (tmp_path / save / "04_ground.json").write_text(json.dumps({"epochs_done": 7}))
        if "--train" in cmd:
            (tmp_path / f"{cmd[cmd.index('--model') + 1]}+cpt3").mkdir()
        if cmd[0] == "03_expand_vocab.py":                          # stage 1 was killed after an epoch
            (models / "mean+gti2-rows.resume.pt").write_bytes(b"")
    monkeypatch.setattr(conv, "sh", fake_sh)
    conv.build_base("mean+gti2", conv.pin_tokenizer())
    stage1, stage2 = calls[1], calls[2]
    assert stage1[stage1.index("--model") + 1].endswith("models/mean") and "--plateau" in stage1
    assert "--resume" in stage1
    assert stage2[stage2.index("--train") + 1] == "all" and stage2[stage2.index("--epochs") + 1] == "7"
    assert stage2[stage2.index("--model") + 1].endswith("mean+gti2-rows") and "--resume" not in stage2
    assert (models / "mean+gti2").is_dir() and not (models / "mean+gti2-rows+cpt3").exists()
    conv.build_base("mean+gti2", conv.pin_tokenizer())
    assert len(calls) == 3


def test_init_notes_name_a_seed_that_starts_from_other_rows(tmp_path, monkeypatch):
    """Seeds of one kind share their init rows; a run whose step-0 rows differ (04 rebuilt on another CPU) is named
    with the gap and both CPUs, and identical rows or another kind's rows say nothing."""
    monkeypatch.setattr(conv, "REPO", str(tmp_path))
    (tmp_path / conv.RECORDS).mkdir(parents=True)
    base = np.arange(12, dtype=np.float16).reshape(1, 3, 4)
    recs = {}
    runs = [("mean+gti-full-s0", "mean+gti-full", 0, 0.0), ("mean+gti-full-s1", "mean+gti-full", 1, 0.0),
            ("mean+gti-full-s3", "mean+gti-full", 3, 0.25), ("mean-full-s3", "mean-full", 3, 1.0)]
    for name, kind, seed, shift in runs:
        rows = (base + shift).astype(np.float16)
        np.savez_compressed(tmp_path / conv.RECORDS / f"{name}_rows.npz", steps=np.array([0]), input=rows)
        recs[name] = ({"run": name, "kind": kind, "seed": seed, "rows": f"{name}_rows.npz", "cpu": f"cpu{seed}"}, None)
    lines = conv.init_notes(recs)
    assert lines == ["- mean+gti-full-s3 starts from other init rows than mean+gti-full-s0 (max |difference| 0.250 over "
                     "the SID rows; cpu0 vs cpu3): its seed pairs differ by the init build too, not only by the seed."]
    assert conv.init_notes({k: v for k, v in recs.items() if not k.endswith("s3")}) == []
