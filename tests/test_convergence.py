"""scripts/convergence.py: a finished run's record round-trips (the report needs no out/ folder), a run with a
record is not rerun, and the efficiency verdict pairs seeds and refuses a pair whose peak was not reached."""
import json

import numpy as np
import pytest

from conftest import load_script

conv = load_script("scripts/convergence.py")


def fake_run(d, best, stopped, users=5):
    d.mkdir(parents=True)
    (d / "05_sft.json").write_text(json.dumps({
        "examples": 600, "aux_examples": 60, "batch_size": 8, "grad_accum": 1, "best_step": best,
        "stopped_at": stopped, "rank_curve": [[0, 0.0, 0.01], [best, 0.2, 0.1]], "seconds": 90.0,
        "rank_seconds": 30.0}))
    (d / "eval_test.json").write_text(json.dumps({"model": {"recall@10": 0.4}}))
    np.save(d / "eval_test_topk.npy", np.arange(users * 20).reshape(users, 20))


def test_record_round_trip_and_skip(tmp_path, monkeypatch):
    monkeypatch.setattr(conv, "REPO", str(tmp_path))
    fake_run(tmp_path / "run", 44, 88)
    (tmp_path / conv.OUT).mkdir(parents=True)
    np.save(tmp_path / conv.OUT / "sids.npy", np.zeros((5, 4), np.int64))
    conv.write_record("random-s0", "random", 0, str(tmp_path / "run"))
    rec, topk = conv.read_record("random-s0", 5)
    assert rec["init"] == "random" and rec["best_step"] == 44 and rec["steps_per_epoch"] == 82.5
    assert len(rec["sids_sha256"]) == 12 and int(rec["sids_sha256"], 16) >= 0
    assert rec["rank_curve"][1] == [44, 0.2, 0.1] and topk.dtype == np.int64
    assert (topk == np.arange(100).reshape(5, 20)).all()
    assert conv.read_record("centroid-s0", 5) is None
    with pytest.raises(SystemExit, match=r"has 5 users, dataset.pt 6; delete the record and rerun"):
        conv.read_record("random-s0", 6)                               # a record of another dataset
    monkeypatch.setattr(conv, "sh", lambda *a, **k: pytest.fail("a run with a record must not rerun"))
    conv.run_one(None, "random-s0", "random", 0)


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
    recs["centroid-s1"] = rec("centroid", 1, 1980, 1980)            # best at its last validation
    lines, v = conv.efficiency(recs)
    assert "peak not reached" in lines[1] and v.startswith("inconclusive") and "one seed pair, no interval" in v
    capped = {"random-s0": rec("random", 0, 1980, 1980), "centroid-s0": rec("centroid", 0, 900, 1340)}
    lines, v = conv.efficiency(capped)
    assert v == "inconclusive: no seed pair where both runs reached their peak"
    assert conv.efficiency({"ceiling": rec("centroid+gti", 0, 1988, 1988)}) == ([], v)
