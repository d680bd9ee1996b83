"""baselines/sasrec.py: end-to-end run and its artifacts, determinism, the history-exclusion protocol, that it
learns a deterministic successor rule, and bad input."""
import json
import os

import numpy as np
import pytest
import torch
from conftest import assert_one_line_error, make_synthetic_out, run

SCRIPT = "baselines/sasrec.py"
TINY = ["--epochs", "4", "--eval-every", "2", "--dim", "16", "--max-len", "8", "--device", "cpu"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """Two runs with the same seed on two copies of the synthetic artifacts (built once per module)."""
    root = tmp_path_factory.mktemp("sasrec")
    outs = [make_synthetic_out(str(root / f"out{i}")) for i in range(2)]
    logs = [run(SCRIPT, "--out-dir", o, *TINY).stdout for o in outs]
    return outs, logs


def load(out):
    d = os.path.join(out, "sasrec")
    res = json.load(open(os.path.join(d, "eval_test.json")))
    topk = {p: np.load(os.path.join(d, f"eval_test_topk_{p}.npy")) for p in ("exclude", "keep")}
    return res, topk


def test_smoke_artifacts_and_determinism(smoke):
    (out, out2), (log, _) = smoke
    res, topk = load(out)
    data = torch.load(os.path.join(out, "dataset.pt"), weights_only=True)
    U = len(data["sequences"])
    assert res["split"] == "test" and res["users"] == U and res["cold_max"] == 10
    for proto in ("exclude_history", "keep_history"):
        assert {"model", "cold_model"} <= set(res[proto])
        assert set(res[proto]["model"]) == {"recall@1", "recall@5", "recall@10", "recall@20",
                                            "ndcg@5", "ndcg@10", "ndcg@20"}
    for k in ("best_epoch", "epochs_run", "val_curve", "train_seconds", "seconds", "params", "args", "cold_users"):
        assert k in res, k
    assert [e for e, *_ in res["val_curve"]] == [2, 4] and res["epochs_run"] == 4
    assert res["best_epoch"] in (2, 4) and res["params"] > 0
    for p in ("exclude", "keep"):
        assert topk[p].shape == (U, 20) and topk[p].dtype == np.int64
        assert ((topk[p] >= 0) & (topk[p] < len(data["item_ids"]))).all()       # 60 items: no -1 slots here
        assert all(len(set(r)) == 20 for r in topk[p])                            # no duplicates
    ckpt = torch.load(os.path.join(out, "sasrec", "sasrec.pt"), weights_only=True)
    assert ckpt["config"]["num_items"] == len(data["item_ids"]) and "item.weight" in ckpt["state_dict"]
    assert "| SASRec (all" in log and "best epoch" in log
    # same seed, same data -> same numbers
    res2, topk2 = load(out2)
    assert res2["val_curve"] == res["val_curve"] and res2["exclude_history"] == res["exclude_history"]
    assert all((topk[p] == topk2[p]).all() for p in topk)


def test_exclusion_protocol(smoke):
    (out, _), _ = smoke
    _, topk = load(out)
    data = torch.load(os.path.join(out, "dataset.pt"), weights_only=True)
    for u, s in enumerate(data["sequences"]):
        hist, target = set(s[:-1]), s[-1]
        assert not hist & set(topk["exclude"][u].tolist()), u
        keep = topk["keep"][u].tolist()
        assert [i for i in keep if i not in hist] == topk["exclude"][u].tolist()[:len(keep) - len(hist & set(keep))]
        if target not in hist and target in keep:
            assert topk["exclude"][u].tolist().index(target) <= keep.index(target)


def write_successor_dataset(out, num_items=40, num_users=100, seed=0):
    """Every sequence follows i -> (i + 1) % N from a random start (length 8..12): the next item is a
    function of the last one, which most-popular cannot exploit."""
    g = np.random.default_rng(seed)
    seqs = []
    for _ in range(num_users):
        start, n = int(g.integers(num_items)), int(g.integers(8, 13))
        seqs.append([(start + t) % num_items for t in range(n)])
    train = [s[:-2] for s in seqs]
    pop = torch.zeros(num_items, dtype=torch.long)
    for s in train:
        pop += torch.bincount(torch.tensor(s), minlength=num_items)
    os.makedirs(out, exist_ok=True)
    torch.save({
        "dataset": "successor", "item_ids": [str(i) for i in range(num_items)],
        "texts": [f"item {i}" for i in range(num_items)], "user_ids": [str(u) for u in range(num_users)],
        "sequences": seqs, "train": train, "valid": torch.tensor([s[-2] for s in seqs]),
        "test": torch.tensor([s[-1] for s in seqs]), "popularity": pop,
        "category": torch.zeros(num_items, dtype=torch.long), "category_names": ["all"],
    }, os.path.join(out, "dataset.pt"))
    return out


def test_learns_successor_rule(tmp_path):
    out = write_successor_dataset(str(tmp_path / "succ"))
    r = run(SCRIPT, "--out-dir", out, "--epochs", "40", "--eval-every", "10", "--batch-size", "16",
            "--dim", "32", "--max-len", "12", "--dropout", "0.1", "--lr", "3e-3", "--device", "cpu")
    res = json.load(open(os.path.join(out, "sasrec", "eval_test.json")))
    for proto in ("exclude_history", "keep_history"):
        assert res[proto]["model"]["recall@1"] >= 0.9, (proto, res[proto], r.stdout)
        assert res[proto]["most_popular"]["recall@1"] < 0.2


def test_missing_dataset_is_one_line_error(tmp_path):
    err = assert_one_line_error(run(SCRIPT, "--out-dir", str(tmp_path / "nothing"), check=False))
    assert "dataset.pt not found" in err and "01_embed_items.py" in err


def test_bad_heads_is_one_line_error(synthetic_out):
    err = assert_one_line_error(run(SCRIPT, "--out-dir", synthetic_out, "--dim", "10", "--heads", "3",
                                    check=False))
    assert "--heads" in err
