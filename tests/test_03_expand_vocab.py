"""03_expand_vocab.py: the four initializations, row placement by token id, untied heads, bad input;
scripts/suffix_study.py's random suffix rows (03's new_rows on the semantic levels)."""
import json
import os

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import REPO, assert_one_line_error, load_script, make_synthetic_out, run


def load(folder):
    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    v = json.load(open(os.path.join(folder, "sid_vocab.json")))
    ids = [t for lvl in v["token_ids"] for t in lvl if t >= 0]      # (level, code) order
    return m, v, torch.tensor(ids)


def centroids_in_order(out_dir):
    """Used-code centroids of every level in (level, code) order, as 03 reads them."""
    sids = np.load(os.path.join(out_dir, "sids.npy"))
    cp = torch.load(os.path.join(out_dir, "centroids.pt"), weights_only=True)
    per_level = [cp["centroids"][l][np.unique(sids[:, l])] for l in range(sids.shape[1])]
    return per_level, torch.cat(per_level)


@pytest.fixture
def all_inits(tmp_path, tiny_model):
    """The four folders, centroid as Algorithm 1 (--centroid-scale plain); d = 64 >= d_model = 32: truncation."""
    out = make_synthetic_out(str(tmp_path / "o"), d=64)
    run("03_expand_vocab.py", "--out-dir", out, "--model", tiny_model, "--init", "all", "--centroid-scale", "plain")
    return out, tiny_model


def test_vocab_file_and_tokenizer_agree(all_inits):
    out, base = all_inits
    folder = os.path.join(out, "models", "centroid")
    tok, v = AutoTokenizer.from_pretrained(folder), json.load(open(os.path.join(folder, "sid_vocab.json")))
    sids = np.load(os.path.join(out, "sids.npy"))
    assert v["num_levels"] == sids.shape[1] and v["level_names"] == ["a", "b", "c", "d"] and v["init"] == "centroid"
    for l in range(sids.shape[1]):                       # -1 exactly for the unused codes
        used = set(np.unique(sids[:, l]).tolist())
        assert {k for k, t in enumerate(v["token_ids"][l]) if t >= 0} == used
    for i in (0, 7, len(sids) - 1):
        assert v["item_sids"][i] == "".join(f"<{'abcd'[l]}_{c}>" for l, c in enumerate(sids[i]))
        assert tok(v["item_sids"][i], add_special_tokens=False).input_ids == v["item_token_ids"][i]
        assert v["item_token_ids"][i] == [v["token_ids"][l][c] for l, c in enumerate(sids[i])]
    summary = json.load(open(os.path.join(out, "03_expand_vocab.json")))
    assert set(summary) == {"random", "mean", "centroid", "shuffled"}
    assert summary["mean"]["num_new_tokens"] == sum(len(np.unique(sids[:, l])) for l in range(sids.shape[1]))


def test_old_rows_untouched_and_mean_rows(all_inits):
    out, base = all_inits
    old = AutoModelForCausalLM.from_pretrained(base).get_input_embeddings().weight.detach()
    m, v, ids = load(os.path.join(out, "models", "mean"))
    w = m.get_input_embeddings().weight.detach()
    assert torch.equal(w[:len(old)], old)                              # pretrained rows bit-identical
    assert torch.allclose(w[ids], old.mean(0).expand(len(ids), -1), atol=1e-6)


def test_mean_matches_transformers_mean_resizing(synthetic_out, tiny_untied_model):
    """The GTI paper's baseline is what resize_token_embeddings(mean_resizing=True) gives (input and head)."""
    run("03_expand_vocab.py", "--out-dir", synthetic_out, "--model", tiny_untied_model, "--init", "mean")
    m, v, ids = load(os.path.join(synthetic_out, "models", "mean"))
    ref = AutoModelForCausalLM.from_pretrained(tiny_untied_model, dtype=torch.float32)
    n_old = ref.get_input_embeddings().weight.shape[0]
    torch.manual_seed(0)
    ref.resize_token_embeddings(n_old + len(ids), mean_resizing=True)
    for get in ("get_input_embeddings", "get_output_embeddings"):
        ours, theirs = getattr(m, get)().weight.detach(), getattr(ref, get)().weight.detach()
        assert torch.allclose(ours[ids], theirs[n_old:], atol=1e-3)


def test_centroid_rows_by_token_id_and_mean_shift(all_inits):
    """Algorithm 1 exactly (--centroid-scale plain): the row of (l, k), at token_ids[l][k], is
    c'_{l,k} - mean_{l,k}(c') + mean(old rows), c' = c truncated to the LM width (64 -> 32)."""
    out, base = all_inits
    old = AutoModelForCausalLM.from_pretrained(base).get_input_embeddings().weight.detach()
    m, v, ids = load(os.path.join(out, "models", "centroid"))
    w = m.get_input_embeddings().weight.detach()
    per_level, c = centroids_in_order(out)
    c = c[:, :w.shape[1]]                                                       # truncate 64 -> 32
    expect = c - c.mean(0) + old.mean(0)
    sids = np.load(os.path.join(out, "sids.npy"))
    j = 0
    for l in range(sids.shape[1]):                       # placement by token id, code by code
        for k in np.unique(sids[:, l]):
            assert torch.allclose(w[v["token_ids"][l][k]], expect[j], atol=1e-5), (l, k)
            j += 1
    assert torch.allclose(w[ids].mean(0), old.mean(0), atol=1e-5)               # the mean-shift property


def test_shuffled_is_a_permutation_within_each_level(all_inits):
    out, _ = all_inits
    _, v, _ = load(os.path.join(out, "models", "shuffled"))
    ws = load(os.path.join(out, "models", "shuffled"))[0].get_input_embeddings().weight.detach()
    wc = load(os.path.join(out, "models", "centroid"))[0].get_input_embeddings().weight.detach()
    moved = 0
    for lvl in v["token_ids"]:
        ids = torch.tensor([t for t in lvl if t >= 0])
        a, b = ws[ids], wc[ids]
        key = lambda x: x[torch.from_numpy(np.lexsort(x.T.numpy()[::-1].copy()))]
        assert torch.equal(key(a), key(b))                                      # same multiset of rows
        moved += int((a != b).any(1).sum())
    assert moved > 0                                                            # and actually shuffled


def test_random_rows_follow_old_statistics(all_inits):
    out, base = all_inits
    old = AutoModelForCausalLM.from_pretrained(base).get_input_embeddings().weight.detach()
    m, _, ids = load(os.path.join(out, "models", "random"))
    rows = m.get_input_embeddings().weight.detach()[ids]
    assert abs(rows.std().item() - old.std(0).mean().item()) < 0.3 * old.std(0).mean().item()
    assert len(torch.unique(rows, dim=0)) == len(ids)


@pytest.mark.parametrize("d", [16, 64])   # d < d_model = 32: the orthonormal map; d >= d_model: truncation
def test_centroid_map_keeps_geometry_and_matched_scale(tmp_path, tiny_model, d):
    out = make_synthetic_out(str(tmp_path / "o"), d=d)
    run("03_expand_vocab.py", "--out-dir", out, "--model", tiny_model, "--init", "centroid",
        "--centroid-scale", "plain")
    _, c = centroids_in_order(out)
    m, _, ids = load(os.path.join(out, "models", "centroid"))
    rows = m.get_input_embeddings().weight.detach()[ids]
    ref = c[:, :32] if d >= 32 else c                     # truncation keeps the prefix; the map keeps all
    assert torch.allclose(torch.cdist(rows, rows), torch.cdist(ref, ref), atol=1e-4)
    run("03_expand_vocab.py", "--out-dir", out, "--model", tiny_model, "--init", "centroid",
        "--centroid-scale", "matched")
    old = AutoModelForCausalLM.from_pretrained(tiny_model).get_input_embeddings().weight.detach()
    rows = load(os.path.join(out, "models", "centroid"))[0].get_input_embeddings().weight.detach()[ids]
    spread = lambda x: (x - x.mean(0)).pow(2).sum(1).mean().sqrt()
    assert torch.allclose(spread(rows), spread(old), rtol=1e-4)
    assert torch.allclose(rows.mean(0), old.mean(0), atol=1e-5)


def test_untied_head_gets_both_matrices(synthetic_out, tiny_untied_model):
    run("03_expand_vocab.py", "--out-dir", synthetic_out, "--model", tiny_untied_model, "--init", "centroid")
    base = AutoModelForCausalLM.from_pretrained(tiny_untied_model)
    m, _, ids = load(os.path.join(synthetic_out, "models", "centroid"))
    assert not m.config.tie_word_embeddings
    for get in ("get_input_embeddings", "get_output_embeddings"):
        old, w = getattr(base, get)().weight.detach(), getattr(m, get)().weight.detach()
        assert torch.equal(w[:len(old)], old)
        assert torch.allclose(w[ids].mean(0), old.mean(0), atol=1e-5)     # each with its own statistics
        assert len(torch.unique(w[ids], dim=0)) == len(ids)
    e, h = m.get_input_embeddings().weight.detach(), m.get_output_embeddings().weight.detach()
    assert not torch.allclose(e[ids], h[ids])


def test_level_scale_centers_and_matches_each_level(tmp_path, tiny_model):
    out = make_synthetic_out(str(tmp_path / "o"), d=16)
    run("03_expand_vocab.py", "--out-dir", out, "--model", tiny_model, "--init", "centroid",
        "--centroid-scale", "level")
    per_level, _ = centroids_in_order(out)
    m, v, _ = load(os.path.join(out, "models", "centroid"))
    old = AutoModelForCausalLM.from_pretrained(tiny_model).get_input_embeddings().weight.detach()
    w = m.get_input_embeddings().weight.detach()
    spread = lambda x: (x - x.mean(0)).pow(2).sum(1).mean().sqrt()
    for l, c in enumerate(per_level):
        rows = w[torch.tensor([t for t in v["token_ids"][l] if t >= 0])]
        assert torch.allclose(rows.mean(0), old.mean(0), atol=1e-5)             # each level on the vocab mean
        if len(c) > 1:
            assert torch.allclose(spread(rows), spread(old), rtol=1e-4)         # each level at the vocab spread
            d_rows, d_c = torch.pdist(rows), torch.pdist(c)                     # within-level geometry kept
            assert torch.allclose(d_rows / d_rows.mean(), d_c / d_c.mean(), atol=1e-4)


def test_bad_input_one_line(tmp_path, synthetic_out, tiny_model):
    empty = tmp_path / "empty"
    empty.mkdir()
    err = assert_one_line_error(run("03_expand_vocab.py", "--out-dir", empty, "--model", tiny_model, check=False))
    assert "sids.npy" in err and "02_rqvae.py" in err
    err = assert_one_line_error(run("03_expand_vocab.py", "--out-dir", synthetic_out,
                                    "--model", tmp_path / "no_such_model", check=False))
    assert "no_such_model" in err
    err = assert_one_line_error(run("03_expand_vocab.py", "--out-dir", synthetic_out, "--model", tiny_model,
                                    "--init", "zeros", check=False))
    assert "zeros" in err
    run("03_expand_vocab.py", "--out-dir", synthetic_out, "--model", tiny_model, "--init", "mean")
    err = assert_one_line_error(run("03_expand_vocab.py", "--out-dir", synthetic_out, "--model",
                                    os.path.join(synthetic_out, "models", "mean"), check=False))
    assert "already has SID tokens" in err


@pytest.mark.parametrize("init", ["centroid", "shuffled"])
def test_suffix_study_random_suffix_rows(tmp_path, tiny_model, monkeypatch, init):
    """scripts/suffix_study.py's matched+random config: the suffix level's rows are drawn like random init's; the
    semantic levels are the rows 03 gives without a suffix level (same centering and scale); collision-free SIDs
    (02 --collisions reassign) are plain 03; 03's own new_rows is back in place afterwards."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "scripts"))           # its `from grounding_study import`
    monkeypatch.chdir(REPO)
    suffix_study = load_script("scripts/suffix_study.py")
    out = make_synthetic_out(str(tmp_path / "o"), d=16)
    suffix_study.expand_vocab(out, tiny_model, "matched+random", 0, init=init)
    per_level, _ = centroids_in_order(out)
    m, v, ids = load(os.path.join(out, "models", init))
    old = AutoModelForCausalLM.from_pretrained(tiny_model).get_input_embeddings().weight.detach()
    w = m.get_input_embeddings().weight.detach()
    level_rows = [w[torch.tensor([t for t in v["token_ids"][l] if t >= 0])] for l in range(len(per_level))]
    semantic, tail = torch.cat(level_rows[:-1]), level_rows[-1]
    spread = lambda x: (x - x.mean(0)).pow(2).sum(1).mean().sqrt()
    assert torch.allclose(semantic.mean(0), old.mean(0), atol=1e-5)         # levels a..c centered and matched
    assert torch.allclose(spread(semantic), spread(old), rtol=1e-4)          # without the suffix rows
    if init == "centroid":
        c = torch.cat(per_level[:-1])
        assert torch.allclose(torch.pdist(semantic) / torch.pdist(semantic).mean(),
                              torch.pdist(c) / torch.pdist(c).mean(), atol=1e-4)
    assert len(tail) > 1 and len(torch.unique(tail, dim=0)) == len(tail)      # random rows: spread like the vocab's
    assert 0.5 < (tail - old.mean(0)).div(old.std(0)).std().item() < 2.0
    step03 = suffix_study.load_step("03_expand_vocab")
    assert step03.new_rows.__name__ == "new_rows"                            # restored
    # without a suffix level (02 --collisions reassign) the config is plain 03 --centroid-scale matched
    rq = torch.load(os.path.join(out, "rqvae.pt"), weights_only=True)
    torch.save(rq | {"config": rq["config"] | {"collisions": "reassign"}}, os.path.join(out, "rqvae.pt"))
    rows = {}
    for config in ("matched+random", "matched"):
        suffix_study.expand_vocab(out, tiny_model, config, 0, init=init)
        rows[config] = load(os.path.join(out, "models", init))[0].get_input_embeddings().weight.detach()[ids]
    assert torch.equal(rows["matched+random"], rows["matched"])
    assert not torch.equal(rows["matched"][-len(tail):], tail)                # and with one, the suffix rows differ
