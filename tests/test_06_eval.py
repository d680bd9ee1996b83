"""06_eval.py: beam search == brute force, only valid SIDs, metrics by hand, bad input, end-to-end run."""
import json
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import load_script, REPO, assert_one_line_error, make_synthetic_out, make_tiny_model, run
from sid_model import make_sid_model


@pytest.fixture(scope="module")
def sid_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("e6")
    out = make_synthetic_out(str(root / "out"))
    tiny = make_tiny_model(str(root / "tiny"))
    model_dir = make_sid_model(out, tiny, str(root / "out" / "models" / "mean"))
    return out, tiny, model_dir


def prepared(ev, out, model_dir, users=8):
    model, tok, vocab, data, sids, item_tok, _ = ev.load_sid_model(model_dir, out, torch.device("cpu"),
                                                                   torch.float32)
    prompts = ev.build_prompts(tok, ev.DEFAULT_TEMPLATE, item_tok, [s[:-1] for s in data["sequences"][:users]], 20)
    level_tok = [torch.tensor(t).clamp(min=0) for t in vocab["token_ids"]]
    nxt = ev.build_trie(sids, [len(t) for t in level_tok])
    return model, tok, item_tok, prompts, level_tok, nxt


@torch.no_grad()
def brute_force(model, prompt, item_tok):
    """Score every item: sum of the model's log-probs of its SID tokens after the prompt (no cache, no pad)."""
    n, L = item_tok.shape
    seq = torch.cat([torch.tensor(prompt).expand(n, -1), item_tok], 1)       # (N, P+L)
    logp = model(input_ids=seq).logits[:, -L - 1:-1].float().log_softmax(-1)  # (N, L, V)
    return logp.gather(2, item_tok[..., None]).squeeze(-1).sum(1)            # (N,)


def test_beam_search_equals_brute_force(sid_setup):
    ev = load_script("06_eval.py")
    out, _, model_dir = sid_setup
    model, tok, item_tok, prompts, level_tok, nxt = prepared(ev, out, model_dir)
    n = item_tok.shape[0]
    # prompts of different lengths in one batch: left padding must not change any score
    assert len({len(p) for p in prompts}) > 1
    items, scores = ev.beam_search(model, prompts, level_tok, nxt, beam=n, pad_id=tok.eos_token_id)
    for b, p in enumerate(prompts):
        ref = brute_force(model, p, item_tok)
        ref_order = torch.argsort(ref, descending=True, stable=True)
        assert torch.allclose(scores[b], ref[ref_order], atol=1e-4), (scores[b][:5], ref[ref_order][:5])
        assert torch.allclose(ref[items[b]], scores[b], atol=1e-4)          # each item carries its own score
        assert sorted(items[b].tolist()) == list(range(n))                 # every item exactly once


def test_only_valid_unique_sids(sid_setup):
    ev = load_script("06_eval.py")
    out, _, model_dir = sid_setup
    model, tok, item_tok, prompts, level_tok, nxt = prepared(ev, out, model_dir)
    n = item_tok.shape[0]
    for beam in (1, 5, n + 10):
        items, scores = ev.beam_search(model, prompts, level_tok, nxt, beam=beam, pad_id=tok.eos_token_id)
        assert items.shape == (len(prompts), beam)
        real = items[:, :min(beam, n)]
        assert ((real >= 0) & (real < n)).all() and torch.isfinite(scores[:, :min(beam, n)]).all()
        assert (items[:, n:] == -1).all() and (scores[:, n:] == -float("inf")).all()
        for row in real.tolist():
            assert len(set(row)) == len(row)
        assert (scores[:, 1:] <= scores[:, :-1]).all()                        # best first


def test_trie_tables():
    ev = load_script("06_eval.py")
    codes = np.array([[0, 1, 0], [0, 1, 1], [1, 0, 0]])
    nxt = ev.build_trie(codes, [2, 2, 2])
    assert nxt[0].tolist() == [[0, 1]]                                          # root -> prefixes (0,), (1,)
    assert nxt[1].tolist() == [[-1, 0], [1, -1]]                                # (0,1) and (1,0)
    assert nxt[2].tolist() == [[0, 1], [2, -1]]                                 # leaves are the item indices


def test_metrics_by_hand():
    ev = load_script("06_eval.py")
    topk = np.array([[7, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6], [9, 8, 7, 6, 5, 4]])
    targets = np.array([7, 0, 6])       # user 0: rank 1; user 1: absent; user 2: rank 4
    m = ev.rank_metrics(topk, targets, ks=(1, 5), ndcg_ks=(1, 5))
    assert m["recall@1"] == pytest.approx(1 / 3)
    assert m["recall@5"] == pytest.approx(2 / 3)
    assert m["ndcg@1"] == pytest.approx(1 / 3)                                  # 1/log2(2) = 1 for user 0
    assert m["ndcg@5"] == pytest.approx((1.0 + 0.0 + 1 / np.log2(5)) / 3)      # rank 4: 1/log2(4+1)
    assert ev.rank_metrics(topk[:0], targets[:0], ks=(1,), ndcg_ks=(5,)) == {"recall@1": 0.0, "ndcg@5": 0.0}


def test_eval_end_to_end_and_bad_input(sid_setup, tmp_path):
    out, tiny, model_dir = sid_setup
    r = run("06_eval.py", "--model", model_dir, "--beam", "20", "--batch-size", "16", "--split", "valid")
    res = json.load(open(os.path.join(model_dir, "eval_valid.json")))
    topk = np.load(os.path.join(model_dir, "eval_valid_topk.npy"))
    assert topk.shape == (40, 20) and res["users"] == 40 and "| most popular (all) |" in r.stdout
    # recompute the metrics from the saved lists: the json is what the lists say
    data = torch.load(os.path.join(out, "dataset.pt"), weights_only=True)
    assert res["model"]["recall@10"] == pytest.approx(np.mean((topk[:, :10] == data["valid"].numpy()[:, None]).any(1)))
    # a model without SID tokens
    err = assert_one_line_error(run("06_eval.py", "--model", tiny, "--out-dir", out, check=False))
    assert "sid_vocab.json" in err
    # a tokenizer that lacks the tokens sid_vocab.json names
    bare = str(tmp_path / "bare")
    shutil.copytree(tiny, bare)
    shutil.copy(os.path.join(model_dir, "sid_vocab.json"), bare)
    err = assert_one_line_error(run("06_eval.py", "--model", bare, "--out-dir", out, check=False))
    assert "tokenizer" in err
    # a dataset whose SIDs differ from the model's
    other = make_synthetic_out(str(tmp_path / "other"), seed=1)
    err = assert_one_line_error(run("06_eval.py", "--model", model_dir, "--out-dir", other, check=False))
    assert "03_expand_vocab.py" in err


def test_bench_agrees_with_generate(sid_setup):
    """bench/beam_search.py runs, and model.generate(num_beams) returns the same ranked lists (up to ties)."""
    out, _, model_dir = sid_setup
    r = run("bench/beam_search.py", "--model", model_dir, "--users", "4", "--beam", "5", "--batch-size", "2",
            "--repeats", "1")
    assert "4/4 up to exact score ties" in r.stdout, r.stdout
    assert r.stdout.strip().splitlines()[-1].startswith("speedup vs generate: ")
