"""07_diagnose.py: the diagnostics' math on constructed cases, then the script on tiny model folders that carry
SID tokens (built here, independently of 03, following docs/artifacts.md), and scripts/figures.py on its JSON."""
import json
import os
import shutil

import numpy as np
import pytest
import torch

from conftest import load_script, REPO, assert_one_line_error, make_synthetic_out, make_tiny_model, run

diag = load_script("07_diagnose.py")


# --- math ---------------------------------------------------------------------------------------
def test_effective_rank_identical_rows_is_one():
    X = np.tile(np.random.default_rng(0).standard_normal(16), (10, 1))
    s = diag.spectrum(X)                                  # centered: all rows at one point
    assert s["effective_rank"] == 1.0 and s["collapsed"] and s["top1_var_share"] == 1.0
    assert diag.spectrum(X, center=False)["effective_rank"] == pytest.approx(1.0)
    # mean init as transformers does it: the mean plus noise of 1e-9 x covariance is still one point
    Xn = X + 3e-5 * np.random.default_rng(1).standard_normal(X.shape)
    assert diag.spectrum(Xn)["collapsed"]


def test_effective_rank_orthonormal_set():
    Q = np.linalg.qr(np.random.default_rng(0).standard_normal((32, 8)))[0].T   # (8, 32) orthonormal rows
    assert diag.spectrum(Q, center=False)["effective_rank"] == pytest.approx(8, abs=1e-6)
    assert diag.spectrum(np.concatenate([Q, -Q]))["effective_rank"] == pytest.approx(8, abs=1e-6)  # mean 0
    assert diag.spectrum(Q)["effective_rank"] == pytest.approx(7, abs=1e-6)    # centering removes one
    s = diag.spectrum(np.diag([3.0, 1.0, 0.0]) @ np.eye(3), center=False)
    assert s["top1_var_share"] == pytest.approx(0.9)
    p = np.array([0.75, 0.25])                                                 # p_i = s_i / sum s, s = (3, 1)
    assert s["effective_rank"] == pytest.approx(np.exp(-(p * np.log(p)).sum()))  # exp(H(p)) = 1.755


def test_rankdata_and_spearman():
    assert diag.rankdata(np.array([10, 20, 20, 5])).tolist() == [2, 3.5, 3.5, 1]
    x = np.random.default_rng(0).standard_normal(50)
    assert diag.spearman(x, np.exp(x)) == pytest.approx(1.0)
    assert diag.spearman(x, -x ** 3) == pytest.approx(-1.0)
    assert diag.spearman(x, np.ones(50)) is None


def test_rsa_self_is_one_shuffled_is_zero():
    A = np.random.default_rng(0).standard_normal((80, 16))
    assert diag.rsa(A, A) == pytest.approx(1.0)
    assert diag.rsa(A, 3 * A + 5.0) == pytest.approx(1.0)                # scale / offset invariant
    lev = np.repeat([0, 1], 40)
    assert diag.rsa(A, A + 4.0 * lev[:, None], groups=lev) == pytest.approx(1.0)  # per-level offsets too
    shuffled = A[np.random.default_rng(1).permutation(len(A))]
    assert abs(diag.rsa(A, shuffled)) < 0.1


def test_ridge_probe():
    g = np.random.default_rng(0)
    X = g.standard_normal((120, 40))
    y = X @ g.standard_normal(40) + 0.05 * g.standard_normal(120)
    assert diag.ridge_probe_r2(X, y) > 0.9
    assert diag.ridge_probe_r2(X, g.standard_normal(120)) < 0.1          # nothing to find
    assert diag.ridge_probe_r2(X[:6], y[:6]) is None                     # too few rows for 5 folds
    # wide case as for SID rows (d > n): frequency written along a strong shared axis (Thm 3.1's drift)
    z = g.standard_normal(100)
    Xw = g.standard_normal((100, 300)) + 5 * z[:, None] * (g.standard_normal(300) / np.sqrt(300) * 3)
    assert diag.ridge_probe_r2(Xw, z) > 0.8


def test_knn_purity():
    g = np.random.default_rng(0)
    centers = 10 * np.eye(4, 8)
    labels = np.repeat(np.arange(4), 25)
    V = centers[labels] + 0.1 * g.standard_normal((100, 8))
    assert diag.knn_purity(V, labels, k=10) == 1.0
    chance = (25 - 1) / (100 - 1)
    assert abs(diag.knn_purity(g.standard_normal((100, 8)), labels, k=10) - chance) < 0.1


def test_majority_parent_and_pair_means():
    C = np.array([[1, .9, .1], [.9, 1, .2], [.1, .2, 1]])
    assert diag.pair_means(C, np.array([0, 0, 1])) == pytest.approx((0.9, 0.15))
    # diagnose: the parent of level-1 code k is the most frequent level-0 code of its items (first on ties)
    a = np.array([0, 0, 0, 1, 2, 2, 2, 1, 0, 0, 1, 1])                     # level-0 codes of 12 items
    b = np.repeat([0, 1, 2], 4)                                               # level-1 codes: parents 0, 2, 0
    sids, g = np.stack([a, b], 1), np.random.default_rng(0)
    tok = [np.arange(3), np.arange(3, 6)]                                     # rows of E: a_0..a_2, b_0..b_2
    E = g.standard_normal((6, 8))
    data = {"sids": sids, "pop": np.ones(12), "category": a, "names": ["a", "b"], "device": "cpu",
            "centroids": [g.standard_normal((3, 4)) for _ in range(2)],
            "codebooks": [g.standard_normal((3, 4)) for _ in range(2)]}
    item_tok = np.stack([tok[0][a], tok[1][b]], 1)
    res, _ = diag.diagnose(E, tok, item_tok, {"vocab_row_norm": 1.0, "vocab_spread": 1.0}, data, 0)
    lev_b, C = res["levels"]["b"], diag.cosine_matrix(E[3:])
    assert lev_b["parent_share"] == pytest.approx((0.75 + 0.75 + 0.5) / 3)  # share of the majority, mean over k
    assert lev_b["cos_within_parent"] == pytest.approx(C[0, 2])             # b_0 and b_2 share parent 0
    assert lev_b["cos_across_parent"] == pytest.approx((C[0, 1] + C[1, 2]) / 2)
    assert "parent_share" not in res["levels"]["a"]


def test_displacement_along_a_popularity_axis_is_found():
    """Thm 3.1's drift built in: dE_i = c freq_i u + small noise; PC1 of dE orders tokens by freq, past all shuffles"""
    g = np.random.default_rng(0)
    E0, freq = g.standard_normal((200, 32)), g.pareto(1.5, 200) * 10 + 1            # heavy-tailed frequencies
    u = g.standard_normal(32)
    dE = 0.1 / freq.mean() * freq[:, None] * (u / np.linalg.norm(u)) + 1e-3 * g.standard_normal((200, 32))
    res, proj = diag.displacement(E0, E0 + dE, freq, seed=0)
    rms, spread = np.sqrt((dE ** 2).sum(1).mean()), np.sqrt(((E0 - E0.mean(0)) ** 2).sum(1).mean())
    assert res["moved"] and res["rms"] == pytest.approx(rms) and res["spread"] == pytest.approx(spread)
    assert res["ratio"] == pytest.approx(rms / spread) and 0.03 < res["ratio"] < 0.1  # barely moved, as built
    assert res["pc1_freq_abs_spearman"] > 0.9 and res["perm_p"] < 0.01 and res["perm_p"] == pytest.approx(1 / 1001)
    assert abs(res["pc1_freq_spearman"]) == res["pc1_freq_abs_spearman"] == abs(diag.spearman(freq, proj))
    r = np.random.default_rng(0)                                   # the null: |Spearman| of shuffled freq, same draws
    null = [abs(diag.spearman(r.permutation(freq), proj)) for _ in range(1000)]
    assert res["perm_q95"] == pytest.approx(np.quantile(null, 0.95)) and res["perm_q95"] < 0.2


def test_displacement_isotropic_zero_shift_and_collapsed_init():
    g = np.random.default_rng(0)
    E0, freq = g.standard_normal((200, 32)), g.pareto(1.5, 200) * 10 + 1
    iso, _ = diag.displacement(E0, E0 + 0.1 * np.random.default_rng(3).standard_normal((200, 32)), freq, seed=0)
    assert iso["moved"] and iso["pc1_freq_abs_spearman"] < 0.15 and iso["perm_p"] > 0.05   # nothing to find
    pc1 = ["pc1_freq_spearman", "pc1_freq_abs_spearman", "perm_p", "perm_q95"]
    zero, proj = diag.displacement(E0, E0.copy(), freq)
    assert zero["moved"] is False and zero["rms"] == 0 and all(zero[k] is None for k in pc1) and not proj.any()
    shift, _ = diag.displacement(E0, E0 + 0.5, freq)                # all rows moved alike: no direction to read
    assert shift["moved"] and shift["rms"] == pytest.approx(0.5 * np.sqrt(32)) and shift["pc1_freq_spearman"] is None
    mean = np.tile(E0[0], (200, 1))                                  # mean init: no spread, ratio undefined
    coll, _ = diag.displacement(mean, E0, freq)
    assert coll["moved"] and coll["ratio"] is None and coll["pc1_freq_abs_spearman"] is not None


# --- the script on tiny model folders ------------------------------------------------------------
def add_sid_tokens(base, dst, out_dir, init):
    """Copy a tiny model, add one token per used (level, code), set the new rows, write sid_vocab.json."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    sids = np.load(os.path.join(out_dir, "sids.npy"))
    cents = torch.load(os.path.join(out_dir, "centroids.pt"), weights_only=True)["centroids"]
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    n_old, letters = len(tok), "abcdefgh"[:sids.shape[1]]
    used = [sorted(set(sids[:, l].tolist())) for l in range(sids.shape[1])]
    tok.add_tokens([f"<{letters[l]}_{k}>" for l in range(len(used)) for k in used[l]])
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    W = model.get_input_embeddings().weight.data                          # (V, d)
    token_ids = [[tok.convert_tokens_to_ids(f"<{letters[l]}_{k}>") if k in used[l] else -1
                  for k in range(len(cents[l]))] for l in range(len(used))]
    mean = W[:n_old].mean(0)
    for l, ids in enumerate(token_ids):
        for k, t in enumerate(ids):
            if t < 0:
                continue
            if init == "mean":
                W[t] = mean
            elif init == "centroid":                                      # zero-pad, shift to vocab mean
                c = cents[l][k] - cents[l][[u for u in used[l]]].mean(0)
                W[t] = mean + torch.nn.functional.pad(c, (0, W.shape[1] - c.shape[0]))
    model.save_pretrained(dst)
    tok.save_pretrained(dst)
    item_tok = [[token_ids[l][c] for l, c in enumerate(row)] for row in sids.tolist()]
    json.dump({"num_levels": len(used), "level_names": list(letters), "codebook_sizes": [len(c) for c in cents],
               "token_ids": token_ids, "item_token_ids": item_tok, "init": init,
               "item_sids": ["".join(f"<{letters[l]}_{c}>" for l, c in enumerate(r)) for r in sids.tolist()]},
              open(os.path.join(dst, "sid_vocab.json"), "w"))
    return dst


@pytest.fixture(scope="module")
def diag_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("diag")
    out = make_synthetic_out(str(root / "out"))
    g = torch.Generator().manual_seed(0)
    torch.save({"config": {"latent": 8}, "state_dict": {},
                "codebooks": [torch.randn(4, 8, generator=g) for _ in range(3)]}, os.path.join(out, "rqvae.pt"))
    base = make_tiny_model(str(root / "tiny"))
    for init in ("mean", "random", "centroid"):
        add_sid_tokens(base, os.path.join(out, "models", init), out, init)
    return out, base


def test_diagnose_runs_and_writes_json_then_figures(diag_setup):
    out, _ = diag_setup
    r = run("07_diagnose.py", "--out-dir", out)
    d = json.load(open(os.path.join(out, "diagnostics.json")))
    assert set(d["models"]) == {"mean", "random", "centroid"}, r.stdout
    assert not [f for f in os.listdir(out) if f.endswith(".png")]          # 07 measures; figures.py draws
    r = run("scripts/figures.py", "--diagnostics", os.path.join(out, "diagnostics.json"))
    for kind in ("spectra", "cosine", "popularity"):
        assert open(os.path.join(out, f"diagnostics_{kind}.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n", r.stdout
    mean, cent = d["models"]["mean"]["levels"], d["models"]["centroid"]["levels"]
    for lev in ("a", "b", "c", "all"):
        assert mean[lev]["collapsed"] and mean[lev]["effective_rank"] == 1.0
        assert mean[lev]["mean_cos"] == pytest.approx(1.0, abs=1e-4)
        assert cent[lev]["rsa_centroids"] == pytest.approx(1.0, abs=1e-6)  # padded centroids: same geometry
    assert set(mean) == {"a", "b", "c", "d", "all"}
    assert "cos_within_parent" in cent["b"] and "cos_within_level" in cent["all"]
    ref = d["reference"]
    assert all(0 <= ref[k] <= 1 for k in ("purity_chance", "purity_item_emb", "purity_random_sid_rows"))
    assert ref["purity_random_sid_rows"] > ref["purity_chance"] + 0.1    # category = level-0 code here
    assert d["models"]["mean"]["purity"] is None                         # collapsed: neighbours are all ties
    for m in (d["models"]["random"], d["models"]["centroid"]):
        assert 0 <= m["purity"] <= 1
    for m in d["models"].values():
        al = m["levels"]["all"]
        assert al["n"] == sum(m["levels"][x]["n"] for x in "abcd")


def test_diagnose_save_path_and_subset(diag_setup, tmp_path):
    out, _ = diag_setup
    save = str(tmp_path / "sub" / "after_init.json")
    run("07_diagnose.py", "--out-dir", out, "--models", "random," + os.path.join(out, "models", "mean"),
        "--save", save, "--names", "R,M")
    d = json.load(open(save))
    assert list(d["models"]) == ["R", "M"]
    run("scripts/figures.py", "--diagnostics", save)
    assert os.path.exists(str(tmp_path / "sub" / "after_init_cosine.png"))


def test_diagnose_inits_displacement_then_figure(diag_setup, tmp_path):
    out, _ = diag_setup
    plain, save = str(tmp_path / "plain.json"), str(tmp_path / "disp.json")
    run("07_diagnose.py", "--out-dir", out, "--models", "random,centroid,mean", "--save", plain)
    r = run("07_diagnose.py", "--out-dir", out, "--models", "random,centroid,mean", "--inits",
            os.path.join(out, "models", "random") + ",mean,", "--save", save)
    d, p = json.load(open(save))["models"], json.load(open(plain))["models"]
    assert "not moved" in r.stdout and "moved rms/spread   n/a  PC1(dE)~freq |rho|" in r.stdout  # centroid: from mean
    assert "displacement" not in d["mean"] and "displacement" not in p["random"]
    for m in d:                                                     # the other fields: the same numbers
        assert {k: v for k, v in d[m].items() if k != "displacement"} == p[m]
    same, cent = d["random"]["displacement"], d["centroid"]["displacement"]
    assert set(same["levels"]) == {"a", "b", "c", "d", "all"} and same["init_path"].endswith("random")
    for lv in same["levels"].values():
        assert lv["moved"] is False and lv["rms"] == 0 and lv["pc1_freq_abs_spearman"] is None and lv["perm_p"] is None
    assert cent["levels"]["all"]["moved"] and cent["levels"]["all"]["ratio"] is None   # the mean init is one point
    run("scripts/figures.py", "--diagnostics", save)
    assert open(str(tmp_path / "disp_displacement.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert not os.path.exists(str(tmp_path / "plain_displacement.png"))
    err = assert_one_line_error(run("07_diagnose.py", "--out-dir", out, "--models", "random,mean", "--inits", "random",
                                    check=False))
    assert "--inits" in err and "1 folder(s) for 2 model(s)" in err


def test_bad_inputs_one_line(diag_setup, tmp_path):
    out, base = diag_setup
    err = assert_one_line_error(run("07_diagnose.py", "--out-dir", out, "--models", base, check=False))
    assert "sid_vocab.json" in err and "03_expand_vocab.py" in err
    err = assert_one_line_error(run("07_diagnose.py", "--out-dir", str(tmp_path / "nothing"), check=False))
    assert "dataset.pt" in err
    bad = str(tmp_path / "bad")
    shutil.copytree(os.path.join(out, "models", "mean"), bad)
    voc = json.load(open(os.path.join(bad, "sid_vocab.json")))
    voc["item_token_ids"][0], voc["item_token_ids"][1] = voc["item_token_ids"][1], voc["item_token_ids"][0]
    json.dump(voc, open(os.path.join(bad, "sid_vocab.json"), "w"))
    err = assert_one_line_error(run("07_diagnose.py", "--out-dir", out, "--models", bad, check=False))
    assert "does not match sids.npy" in err
    empty = str(tmp_path / "empty_out")
    make_synthetic_out(empty)
    shutil.copy(os.path.join(out, "rqvae.pt"), empty)
    err = assert_one_line_error(run("07_diagnose.py", "--out-dir", empty, check=False))
    assert "no model folder" in err
    not_07 = str(tmp_path / "not_07.json")
    json.dump({"models": {}}, open(not_07, "w"))
    err = assert_one_line_error(run("scripts/figures.py", "--diagnostics", not_07, check=False))
    assert "lacks what 07_diagnose.py writes" in err
    err = assert_one_line_error(run("scripts/figures.py", "--diagnostics", str(tmp_path / "nope.json"), check=False))
    assert "nope.json not found" in err
