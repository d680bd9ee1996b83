"""02_rqvae.py: the quantizer's math (residual identity, k-means init, collision suffix, centroids),
determinism, an 01 -> 02 smoke run on ML-100K, and bad input."""
import json
import os
import shutil

import numpy as np
import pytest
import torch

from conftest import load_script, ML100K, REPO, assert_one_line_error, make_synthetic_out, run


Q = load_script("02_rqvae.py")
TINY = ["--codebook-size", "4", "--levels", "2", "--latent-dim", "8", "--hidden", "32", "--steps", "40",
        "--batch-size", "32", "--log-every", "20", "--reseed-every", "10", "--device", "cpu"]


def blobs(n_per=50, centers=((0, 0), (10, 0), (0, 10)), seed=0):
    g = torch.Generator().manual_seed(seed)
    c = torch.tensor(centers, dtype=torch.float32)
    x = torch.cat([ci + 0.3 * torch.randn(n_per, 2, generator=g) for ci in c])
    return x, c, torch.arange(len(c)).repeat_interleave(n_per)


# --- math --------------------------------------------------------------------------------------------
def test_residual_quantization_identity():
    g = torch.Generator().manual_seed(0)
    z, codebooks = torch.randn(100, 8, generator=g), torch.randn(3, 16, 8, generator=g)
    codes, z_q, res = Q.residual_quantize(z, codebooks)
    assert codes.shape == (100, 3) and len(res) == 4
    chosen = sum(codebooks[l][codes[:, l]] for l in range(3))                     # sum of chosen codewords
    torch.testing.assert_close(z_q, chosen)
    torch.testing.assert_close(z - z_q, res[-1], atol=1e-5, rtol=0)               # r_L = z - z_q
    for l in range(3):                                                             # c_l is the nearest codeword
        brute = ((res[l][:, None, :] - codebooks[l][None]) ** 2).sum(-1).argmin(1)
        assert torch.equal(codes[:, l], brute)
        torch.testing.assert_close(res[l + 1], res[l] - codebooks[l][codes[:, l]])


def test_residual_norms_shrink_with_kmeans_codebooks():
    torch.manual_seed(0)
    model = Q.RQVAE(d=16, hidden=[32], latent=8, levels=3, k=16)
    with torch.no_grad():
        z = model.encoder(torch.randn(400, 16))
        codebooks = Q.rq_kmeans(z, 3, 16, 20, torch.Generator().manual_seed(0))[1]   # as train_rqvae's init
        _, _, res = Q.residual_quantize(z, codebooks)
    norms = [r.norm(dim=1).mean().item() for r in res]
    assert all(b < a for a, b in zip(norms, norms[1:])), norms


def test_kmeans_recovers_blobs_and_is_deterministic():
    x, true_c, labels = blobs()
    c1, a1 = Q.kmeans(x, 3, 20, torch.Generator().manual_seed(1))
    c2, a2 = Q.kmeans(x, 3, 20, torch.Generator().manual_seed(1))
    assert torch.equal(c1, c2) and torch.equal(a1, a2)
    match = torch.cdist(true_c, c1).argmin(1)                                     # true center -> found center
    assert sorted(match.tolist()) == [0, 1, 2]
    torch.testing.assert_close(c1[match], true_c, atol=0.2, rtol=0)
    assert torch.equal(a1, match[labels])                                         # every point in its blob
    for k in range(3):                                                             # Lloyd fixed point: center = mean
        torch.testing.assert_close(c1[k], x[a1 == k].mean(0))


def test_training_starts_from_kmeans_of_each_levels_residuals():
    """train_rqvae with no step (steps = 0 set by hand) returns its init: every codeword is the mean of its cell
    of the encoded items' level-l residuals (Lloyd's fixed point)."""
    torch.manual_seed(0)
    args = Q.parse_args(["--levels", "2", "--latent-dim", "2", "--kmeans-iters", "30", "--batch-size", "150"])
    args.steps, x = 0, torch.randn(150, 6)
    _, books, _, _, _, state = Q.train_rqvae(args, x, 3, [16], torch.Generator().manual_seed(0))
    model = Q.RQVAE(d=6, hidden=[16], latent=2, levels=2, k=3)
    model.load_state_dict(state)
    with torch.no_grad():
        r = model.encoder(x)
        for l in range(2):
            cb = books[l]
            a = torch.cdist(r, cb).argmin(1)
            for k in range(3):                                         # converged: codeword = mean of its cell
                if (a == k).any():
                    torch.testing.assert_close(cb[k], r[a == k].mean(0), atol=1e-4, rtol=0)
            r = r - cb[a]


def test_collision_suffix_unique_and_stable():
    codes = np.array([[1, 2], [0, 0], [1, 2], [3, 3], [1, 2], [0, 0]], dtype=np.int64)
    s = Q.collision_suffix(codes)
    assert s.tolist() == [0, 0, 1, 0, 2, 1]                                        # numbered in item order
    sids = np.concatenate([codes, s[:, None]], 1)
    assert len({tuple(r) for r in sids.tolist()}) == len(sids)
    rng = np.random.default_rng(0)
    big = rng.integers(0, 3, (500, 2))
    s = Q.collision_suffix(big)
    assert len({tuple(r) for r in np.concatenate([big, s[:, None]], 1).tolist()}) == 500
    assert np.array_equal(Q.collision_suffix(big[:200]), s[:200])                  # earlier items keep their suffix


def test_centroids_are_member_means():
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((30, 5)).astype(np.float32)
    sids = np.stack([rng.integers(0, 4, 30), rng.integers(0, 6, 30)], 1)
    sids[sids[:, 1] == 5, 1] = 0                                                   # code 5 unused at level 1
    cents, counts = Q.code_centroids(sids, emb, [4, 6])
    for l, k in enumerate([4, 6]):
        assert cents[l].shape == (k, 5) and int(counts[l].sum()) == 30
        for code in range(k):
            members = emb[sids[:, l] == code]
            assert int(counts[l][code]) == len(members)
            want = members.mean(0) if len(members) else np.zeros(5, np.float32)
            np.testing.assert_allclose(cents[l][code].numpy(), want, atol=1e-6)


def test_rq_kmeans_is_kmeans_on_each_levels_residual():
    x, _, _ = blobs()
    codes, books, res = Q.rq_kmeans(x, 2, 3, 20, torch.Generator().manual_seed(0))
    assert codes.shape == (150, 2) and books.shape == (2, 3, 2) and len(res) == 3
    c0, a0 = Q.kmeans(x, 3, 20, torch.Generator().manual_seed(0))                # level 0: k-means of x
    assert torch.equal(books[0], c0) and torch.equal(codes[:, 0], a0)
    torch.testing.assert_close(res[1], x - books[0][codes[:, 0]])                 # r_1 = x - e^0_{c_0}
    torch.testing.assert_close(res[2], x - books[0][codes[:, 0]] - books[1][codes[:, 1]])
    for l in range(2):                                                             # codes are nearest codewords
        assert torch.equal(codes[:, l], torch.cdist(res[l], books[l]).argmin(1))


def test_reassign_collisions_by_hand():
    book = torch.tensor([[0.0], [1.0], [2.0], [3.0]])                              # last level: 4 codewords
    codes = np.array([[0, 0], [0, 0], [0, 0], [0, 3], [1, 0], [1, 0]])
    r = torch.tensor([[0.1], [0.4], [1.8], [3.0], [0.0], [0.2]])
    new, moved, _ = Q.reassign_collisions(codes, r, book)
    # prefix 0: item 0 is nearest code 0 and keeps it; codes 1, 2 are free (3 is item 3's): item 2 (1.8) takes
    # 2 first (distance 0.2), then item 1 (0.4) takes 1; prefix 1: item 4 keeps 0, item 5 takes 1
    assert new.tolist() == [[0, 0], [0, 1], [0, 2], [0, 3], [1, 0], [1, 1]] and moved.tolist() == [1, 2, 5]
    assert len({tuple(c) for c in new.tolist()}) == len(new)


@pytest.mark.parametrize("quantizer", ["rqvae", "rqkmeans"])
def test_collision_free_sids_have_exactly_L_codes(tmp_path, quantizer):
    """--collisions reassign: unique SIDs of exactly L codes, only last-level codes changed (and only for
    items that collided), centroids = member means of the new codes; rqkmeans level-0 centroids = its
    k-means centers."""
    out = make_synthetic_out(str(tmp_path / "o"), num_items=40)
    for f in ("sids.npy", "centroids.pt"):
        os.remove(os.path.join(out, f))
    small = ["--codebook-size", "8", "--levels", "3", "--kmeans-iters", "30", "--device", "cpu"]
    run("02_rqvae.py", "--out-dir", out, "--quantizer", quantizer, "--collisions", "suffix", *small,
        *([] if quantizer == "rqkmeans" else TINY[4:]))
    suffix = np.load(os.path.join(out, "sids.npy"))
    r = run("02_rqvae.py", "--out-dir", out, "--quantizer", quantizer, "--collisions", "reassign", *small,
            *([] if quantizer == "rqkmeans" else TINY[4:]))
    sids, emb = np.load(os.path.join(out, "sids.npy")), np.load(os.path.join(out, "item_emb.npy"))
    summary = json.loads(open(os.path.join(out, "02_rqvae.json")).read())
    assert sids.shape == (40, 3) and len({tuple(s) for s in sids.tolist()}) == 40
    assert np.array_equal(sids[:, :2], suffix[:, :2])                              # same quantizer, same codes
    changed = np.flatnonzero(sids[:, 2] != suffix[:, 2])                           # one item per collision moves
    assert summary["moved_items"] == len(changed) == int((suffix[:, 3] > 0).sum()) > 0
    assert "re-assigned" in r.stdout and summary["quantizer"] == quantizer
    cen = torch.load(os.path.join(out, "centroids.pt"), weights_only=True)
    assert cen["codebook_sizes"] == [8, 8, 8] and len(cen["centroids"]) == 3
    for l in range(3):
        for k in np.unique(sids[:, l]):
            np.testing.assert_allclose(cen["centroids"][l][k].numpy(), emb[sids[:, l] == k].mean(0), atol=1e-5)
    if quantizer == "rqkmeans":
        books = torch.load(os.path.join(out, "rqvae.pt"), weights_only=True)["codebooks"]
        np.testing.assert_allclose(cen["centroids"][0].numpy(), books[0].numpy(), atol=1e-5)
    # more items under one prefix than last-level codes: one line, previous outputs intact
    err = assert_one_line_error(run("02_rqvae.py", "--out-dir", out, "--quantizer", quantizer, "--collisions",
                                    "reassign", *small[:1], "2", "--levels", "2", *small[4:], *([] if quantizer == "rqkmeans"
                                                                             else TINY[4:]), check=False))
    assert "--collisions suffix" in err and np.array_equal(np.load(os.path.join(out, "sids.npy")), sids)


# --- runs --------------------------------------------------------------------------------------------
def test_same_seed_same_sids(tmp_path):
    outs = []
    for name in ("a", "b"):
        out = make_synthetic_out(str(tmp_path / name))
        os.remove(os.path.join(out, "sids.npy"))
        run("02_rqvae.py", "--out-dir", out, "--seed", "3", *TINY)
        outs.append(np.load(os.path.join(out, "sids.npy")))
    assert np.array_equal(outs[0], outs[1])


@pytest.mark.skipif(not os.path.exists(os.path.join(ML100K, "ml-100k.inter")), reason="run `make setup`")
def test_smoke_01_then_02_on_ml100k(tmp_path):
    out = tmp_path / "ml"
    run("01_embed_items.py", "--dataset", "ml-100k", "--max-users", "5", "--out-dir", out, "--device", "cpu")
    r = run("02_rqvae.py", "--out-dir", out, "--steps", "60", "--batch-size", "64", "--codebook-size", "8",
            "--log-every", "20", "--device", "cpu")
    assert sum(line.startswith("step ") for line in r.stdout.splitlines()) == 3  # one line per interval
    emb = np.load(out / "item_emb.npy")
    sids = np.load(out / "sids.npy")
    N = emb.shape[0]
    assert sids.dtype == np.int64 and sids.shape == (N, 4) and len({tuple(s) for s in sids.tolist()}) == N
    assert sids[:, :3].max() < 8
    summary = json.loads((out / "02_rqvae.json").read_text())
    assert summary["num_items"] == N and summary["unique_sids"] == N and len(summary["codebook_usage"]) == 3
    assert summary["max_collision_group"] == sids[:, 3].max() + 1
    cen = torch.load(out / "centroids.pt", weights_only=True)
    assert cen["codebook_sizes"] == [8, 8, 8, summary["max_collision_group"]] and len(cen["centroids"]) == 4
    for l in range(4):
        k = np.bincount(sids[:, l]).argmax()                                       # the most used code
        np.testing.assert_allclose(cen["centroids"][l][k].numpy(), emb[sids[:, l] == k].mean(0), atol=1e-5)
    ck = torch.load(out / "rqvae.pt", weights_only=True)
    assert ck["config"]["codebook_size"] == 8 and len(ck["codebooks"]) == 3 and ck["codebooks"][0].shape == (8, 32)
    # the saved model reproduces the saved codes
    model = Q.RQVAE(ck["config"]["d"], ck["config"]["hidden"], ck["config"]["latent_dim"], 3, 8)
    model.load_state_dict(ck["state_dict"])
    with torch.no_grad():
        codes, _, _ = Q.residual_quantize(model.encoder(torch.from_numpy(emb)), model.codebooks)
    assert np.array_equal(codes.numpy(), sids[:, :3])


# --- bad input: one line, non-zero exit, previous outputs intact ---------------------------------------
def test_out_dir_without_step1(tmp_path):
    err = assert_one_line_error(run("02_rqvae.py", "--out-dir", tmp_path, *TINY, check=False))
    assert "item_emb.npy not found" in err and "01_embed_items.py" in err


def test_garbled_embeddings_keep_previous_outputs(tmp_path):
    out = make_synthetic_out(str(tmp_path / "out"))
    before = open(os.path.join(out, "sids.npy"), "rb").read()
    with open(os.path.join(out, "item_emb.npy"), "wb") as f:
        f.write(b"not a numpy file")
    err = assert_one_line_error(run("02_rqvae.py", "--out-dir", out, *TINY, check=False))
    assert "item_emb.npy is unreadable" in err
    # the same one-line exits, checked in-process (die() raises SystemExit with the message)
    np.save(os.path.join(out, "item_emb.npy"), np.full((60, 16), np.nan, np.float32))
    with pytest.raises(SystemExit, match="finite"):
        Q.load_embeddings(out)
    np.save(os.path.join(out, "item_emb.npy"), np.ones((59, 16), np.float32))      # 01's dataset.pt has 60 items
    with pytest.raises(SystemExit, match="re-run 01_embed_items.py"):
        Q.load_embeddings(out)
    assert open(os.path.join(out, "sids.npy"), "rb").read() == before
    assert not [f for f in os.listdir(out) if ".tmp" in f]


def test_unknown_flag(tmp_path):
    out = make_synthetic_out(str(tmp_path / "out"))
    before = open(os.path.join(out, "sids.npy"), "rb").read()
    err = assert_one_line_error(run("02_rqvae.py", "--out-dir", out, "--codebok-size", "8", check=False))
    assert "--codebok-size" in err
    assert open(os.path.join(out, "sids.npy"), "rb").read() == before
    shutil.rmtree(out)


def test_three_token_sids_flow_through_03_to_07(tmp_path):
    """02 --collisions reassign (3 codes, no suffix level) -> 03 -> 04 -> 05 -> 06 -> 07 on a tiny model:
    every item's SID is 3 tokens in the vocabulary, in 05's rows and in 06's ranked lists."""
    from conftest import make_tiny_model
    out = make_synthetic_out(str(tmp_path / "o"), num_items=40)
    tiny = make_tiny_model(str(tmp_path / "tiny"))
    run("02_rqvae.py", "--out-dir", out, "--quantizer", "rqkmeans", "--collisions", "reassign",
        "--codebook-size", "8", "--levels", "3", "--kmeans-iters", "30", "--device", "cpu")
    run("03_expand_vocab.py", "--out-dir", out, "--model", tiny, "--init", "centroid")
    vocab = json.load(open(os.path.join(out, "models", "centroid", "sid_vocab.json")))
    assert vocab["num_levels"] == 3 and all(len(t) == 3 for t in vocab["item_token_ids"])
    m = os.path.join(out, "models", "centroid")
    run("04_ground.py", "--out-dir", out, "--model", m, "--steps", 3, "--max-eval", 4, "--device", "cpu")
    run("05_sft.py", "--out-dir", out, "--model", m + "+gti", "--steps", 3, "--eval-every", 3, "--val-examples", 8,
        "--device", "cpu")
    j = json.load(open(os.path.join(m + "+gti+sft", "05_sft.json")))
    assert j["val_level_names"] == vocab["level_names"] and len(j["val_level_names"]) == 3
    run("06_eval.py", "--out-dir", out, "--model", m + "+gti+sft", "--beam", 5, "--users", 8, "--device", "cpu")
    topk = np.load(os.path.join(m + "+gti+sft", "eval_test_topk.npy"))
    assert topk.shape == (8, 5) and ((topk >= 0) & (topk < 40)).all()
    r = run("07_diagnose.py", "--out-dir", out, "--models", "centroid,centroid+gti+sft")
    d = json.load(open(os.path.join(out, "diagnostics.json")))
    assert set(d["models"]["centroid"]["levels"]) == set(vocab["level_names"]) | {"all"}, r.stdout
