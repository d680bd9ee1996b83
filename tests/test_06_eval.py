"""06_eval.py: beam search == brute force, only valid SIDs, metrics by hand, bad input, end-to-end run;
bench/exact_search.py: the certified-exact search == brute force; bench/beam_search.py runs."""
import json
import math
import os
import shutil

import numpy as np
import pytest
import torch
from common import load_sid_model
from conftest import load_script, assert_one_line_error, make_synthetic_out, make_tiny_model, run
from sid_model import make_sid_model


@pytest.fixture(scope="module")
def sid_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("e6")
    out = make_synthetic_out(str(root / "out"))
    tiny = make_tiny_model(str(root / "tiny"))
    model_dir = make_sid_model(out, tiny, str(root / "out" / "models" / "mean"))
    return out, tiny, model_dir


def prepared(ev, out, model_dir, users=8, softmax="full"):
    model, tok, vocab, data, sids, item_tok, _ = load_sid_model(model_dir, out, torch.device("cpu"))
    histories = [s[:-1] for s in data["sequences"][:users]]
    prompts = ev.build_prompts(tok, ev.DEFAULT_TEMPLATE, item_tok, histories, 20)
    scorer = ev.LevelScorer(model, vocab["token_ids"], softmax)
    nxt = ev.build_trie(sids, [len(t) for t in vocab["token_ids"]])
    return model, tok, item_tok, prompts, scorer, nxt, histories, sids, vocab


@torch.no_grad()
def brute_force(model, prompt, item_tok, vocab=None, softmax="full"):
    """Score every item: sum of the model's log-probs of its SID tokens after the prompt (no cache, no pad),
    normalized over the vocabulary, or over the token's level (by hand)."""
    n, L = item_tok.shape
    seq = torch.cat([torch.tensor(prompt).expand(n, -1), item_tok], 1)       # (N, P+L)
    logits = model(input_ids=seq).logits[:, -L - 1:-1].float()              # (N, L, V)
    if softmax == "full":
        logp = logits.log_softmax(-1)
    else:
        levels = [[t for t in lvl if t >= 0] for lvl in vocab["token_ids"]]
        logp = torch.full_like(logits, -float("inf"))
        for l in range(L):
            logp[:, l, levels[l]] = logits[:, l, levels[l]].log_softmax(-1)
    return logp.gather(2, item_tok[..., None]).squeeze(-1).sum(1)            # (N,)


def spread_sid_rows(model, vocab):
    """Random SID rows (tied with the head): scores spread over nats, and a beam fed the wrong parent's
    tokens or cache scores differently (at init every SID row is nearly the same)."""
    emb = model.get_input_embeddings().weight
    sid = [t for lvl in vocab["token_ids"] for t in lvl if t >= 0]
    with torch.no_grad():
        emb[sid] = torch.randn(len(sid), emb.shape[1], generator=torch.Generator().manual_seed(0))
    return emb, sid


@pytest.mark.parametrize("softmax", ["full", "level"])
@pytest.mark.parametrize("spread", [False, True])
def test_beam_search_equals_brute_force(sid_setup, softmax, spread):
    ev = load_script("06_eval.py")
    out, _, model_dir = sid_setup
    model, tok, item_tok, prompts, scorer, nxt, histories, sids, vocab = prepared(ev, out, model_dir,
                                                                                   softmax=softmax)
    if spread:
        spread_sid_rows(model, vocab)
    n = item_tok.shape[0]
    # prompts of different lengths in one batch: left padding must not change any score
    assert len({len(p) for p in prompts}) > 1
    items, scores = ev.beam_search(model, prompts, scorer, nxt, beam=n, pad_id=tok.eos_token_id)
    # both protocols from one prefill (a copied cache) = two separate searches
    both = ev.rank_all(model, prompts, scorer, nxt, 5, tok.eos_token_id, 8, histories, sids, (True, False),
                       progress=False)
    for exclude, (it, sc, _) in zip((True, False), both):
        one = ev.rank_all(model, prompts, scorer, nxt, 5, tok.eos_token_id, 8, histories, sids, (exclude,),
                          progress=False)[0]
        assert torch.equal(it, one[0]) and torch.equal(sc, one[1])
    for b, p in enumerate(prompts):
        ref = brute_force(model, p, item_tok, vocab, softmax)
        ref_order = torch.argsort(ref, descending=True, stable=True)
        assert torch.allclose(scores[b], ref[ref_order], atol=1e-4), (scores[b][:5], ref[ref_order][:5])
        assert torch.allclose(ref[items[b]], scores[b], atol=1e-4)          # each item carries its own score
        assert sorted(items[b].tolist()) == list(range(n))                 # every item exactly once


@pytest.mark.parametrize("softmax", ["full", "level"])
def test_exact_search_equals_brute_force_with_ties(sid_setup, softmax):
    """bench/exact_search.py returns brute force's top-k (score, then item index) for every user, under both
    protocols, with exact score ties at the list boundary; a beam list certified exact is never wrong, and
    some beam lists are not certified (so the check has something to catch)."""
    ev, ex = load_script("06_eval.py"), load_script("bench/exact_search.py")
    out, _, model_dir = sid_setup
    model, tok, item_tok, prompts, scorer, nxt, histories, sids, vocab = prepared(ev, out, model_dir, users=16,
                                                                                   softmax=softmax)
    emb, _ = spread_sid_rows(model, vocab)                           # tied with the head
    lvl = [t for t in vocab["token_ids"][2] if t >= 0]
    with torch.no_grad():
        emb[lvl] = emb[lvl[0]].clone()             # one row for all codes of level 3: items differing only there tie
    n, k = item_tok.shape[0], 5
    ties = 0
    for exclude in (False, True):
        ex_items, ex_scores, ex_width = ex.rank_exact(model, prompts, scorer, nxt, k, tok.eos_token_id, 4, histories,
                                                      sids, (exclude,), progress=False)[0]
        bm_items, bm_scores, bm_width = ev.rank_all(model, prompts, scorer, nxt, k, tok.eos_token_id, 4, histories,
                                                    sids, (exclude,), progress=False)[0]
        assert (ex_width >= k).all() and set(bm_width.tolist()) <= {0, k}
        assert (bm_width == 0).any()                                  # beam search misses items here
        for u, p in enumerate(prompts):
            ref = brute_force(model, p, item_tok, vocab, softmax)
            pool = torch.tensor([i for i in range(n) if not (exclude and i in set(histories[u]))])
            top = ref[pool].sort(descending=True).values[:k]           # brute force's top-k scores
            ties += int((ref[pool] - top[-1]).abs().lt(1e-4).sum()) > 1  # a tie at the list's boundary
            must = pool[ref[pool] > top[-1] + 1e-4]                    # beats the k-th: must be listed
            lists = [(ex_items[u], ex_scores[u])] + ([(bm_items[u], bm_scores[u])] if bm_width[u] else [])
            for items, scores in lists:                               # a certified beam list must be exact too
                assert len(set(items.tolist())) == k and set(items.tolist()) <= set(pool.tolist())
                assert torch.allclose(scores, top, atol=1e-4) and torch.allclose(ref[items], top, atol=1e-4)
                assert set(must.tolist()) <= set(items.tolist()), (u, exclude)
    assert ties > 0                                                   # tied scores did reach the boundary


def test_certificate_by_hand():
    ev, ex = load_script("06_eval.py"), load_script("bench/exact_search.py")
    scores = torch.tensor([[-1.0, -2.0], [-1.0, -2.0], [-1.0, -2.0], [-1.0, -math.inf]])
    bound = torch.tensor([-2.5, -2.0, -1.5, -math.inf])
    # 2nd best beats the best pruned: exact; a pruned tie or better: not; nothing pruned: exact
    assert ex.certified(scores, bound, 2).tolist() == [True, False, False, True]
    items, s = ev.by_score_then_index(torch.tensor([[4, 2, 7, -1]]), torch.tensor([[-1.0, -1.0, -0.5, -math.inf]]))
    assert items.tolist() == [[7, 2, 4, -1]] and s.tolist() == [[-0.5, -1.0, -1.0, -math.inf]]


def test_history_exclusion_inside_the_search(sid_setup):
    """--exclude-history: with beam = all items the list is exactly the unseen items in brute-force order;
    at any beam width no history item comes back, every slot holds an item while unseen ones remain, and
    a target outside the history is ranked where brute force over the unseen items puts it."""
    ev = load_script("06_eval.py")
    out, _, model_dir = sid_setup
    data = torch.load(os.path.join(out, "dataset.pt"), weights_only=True)
    model, tok, item_tok, prompts, scorer, nxt, histories, sids, _ = prepared(ev, out, model_dir, users=12)
    n = item_tok.shape[0]
    for beam in (n, 5, 1):
        items, scores, _ = ev.rank_all(model, prompts, scorer, nxt, beam, tok.eos_token_id, 4, histories, sids,
                                       (True,), progress=False)[0]
        for u, h in enumerate(histories):
            unseen = sorted(set(range(n)) - set(h))
            got = [i for i in items[u].tolist() if i >= 0]
            assert not set(got) & set(h) and len(got) == min(beam, len(unseen))
            if beam == n:
                ref = brute_force(model, prompts[u], item_tok)
                order = [i for i in torch.argsort(ref, descending=True, stable=True).tolist() if i not in h]
                assert torch.allclose(scores[u][:len(order)], ref[order], atol=1e-4)
                target = int(data["test"][u])
                if target not in h:
                    assert target in got                                           # never dropped
    masks = ev.unseen_masks(sids, nxt, [[0, 1, 2], []])
    assert not masks[-1][0, :3].any() and masks[-1][0, 3:].all() and masks[-1][1].all()


def test_popular_topk_excludes_history():
    ev = load_script("06_eval.py")
    pop = np.array([5, 9, 9, 1, 0, 7])
    assert ev.popular_topk(pop, [[1], []], 3, exclude=False).tolist() == [[1, 2, 5], [1, 2, 5]]
    assert ev.popular_topk(pop, [[1, 5], []], 3, exclude=True).tolist() == [[2, 0, 3], [1, 2, 5]]
    assert ev.popular_topk(pop, [[0, 1, 2, 3, 4]], 3, exclude=True).tolist() == [[5, -1, -1]]


def test_paired_bootstrap_interval():
    ev = load_script("06_eval.py")
    a, b = np.array([1.0, 0, 1, 1, 0, 1] * 50), np.zeros(300)
    mean, lo, hi = ev.paired_bootstrap(a, b)
    assert mean == pytest.approx(2 / 3, abs=1e-5) and lo < mean < hi and hi - lo < 0.15
    assert ev.paired_bootstrap(b, b) == [0.0, 0.0, 0.0]


def test_only_valid_unique_sids(sid_setup):
    ev = load_script("06_eval.py")
    out, _, model_dir = sid_setup
    model, tok, item_tok, prompts, scorer, nxt, _, _, _ = prepared(ev, out, model_dir)
    n = item_tok.shape[0]
    for beam in (1, 5, n + 10):
        items, scores = ev.beam_search(model, prompts, scorer, nxt, beam=beam, pad_id=tok.eos_token_id)
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
    r = run("06_eval.py", "--model", model_dir, "--beam", "20", "--batch-size", "16", "--split", "valid",
            "--protocol", "kept")
    res = json.load(open(os.path.join(model_dir, "eval_valid_keep.json")))
    topk = np.load(os.path.join(model_dir, "eval_valid_keep_topk.npy"))
    assert res["protocol"] == "history kept"
    run("06_eval.py", "--model", model_dir, "--beam", "10", "--users", "8", "--protocol", "excluded")
    ex = json.load(open(os.path.join(model_dir, "eval_test.json")))
    seen = np.load(os.path.join(model_dir, "eval_test_topk.npy"))
    data = torch.load(os.path.join(out, "dataset.pt"), weights_only=True)
    assert ex["protocol"] == "history excluded" and ex["users"] == 8
    assert len(ex["model_minus_most_popular"]) == 5                        # beam 10: recall@1, @5, @10, ndcg@5, @10
    assert not any(set(seen[u].tolist()) & set(data["sequences"][u][:-1]) for u in range(8))
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
    # a folder trained with 05's former "sid" softmax (over all SID tokens), which 06 no longer scores
    old = str(tmp_path / "sid_softmax")
    shutil.copytree(model_dir, old)
    json.dump({"softmax": "sid"}, open(os.path.join(old, "sft_config.json"), "w"))
    err = assert_one_line_error(run("06_eval.py", "--model", old, "--out-dir", out, check=False))
    assert "softmax 'sid'" in err and "full | level" in err
    for bad in (["--beam", "0"], ["--protocol", "all"], ["--users", "-1"]):
        assert "--help" in assert_one_line_error(run("06_eval.py", "--model", model_dir, *bad, check=False))


def test_exact_search_script_writes_what_06_writes(sid_setup):
    """bench/exact_search.py (06's former --search exact): eval_<split>_exact[_keep].json with 06's fields,
    every list certified exact, and the ranked lists beside them."""
    out, _, model_dir = sid_setup
    run("06_eval.py", "--model", model_dir, "--beam", "5", "--users", "8", "--split", "valid")
    r = run("bench/exact_search.py", "--model", model_dir, "--beam", "5", "--users", "8", "--split", "valid",
            "--batch-size", "3")
    assert "lists certified exact: 8/8" in r.stdout
    for keep in ("", "_keep"):
        beam = json.load(open(os.path.join(model_dir, f"eval_valid{keep}.json")))
        exact = json.load(open(os.path.join(model_dir, f"eval_valid_exact{keep}.json")))
        topk = np.load(os.path.join(model_dir, f"eval_valid_exact{keep}_topk.npy"))
        assert list(exact) == list(beam) and exact["search"] == "exact" and beam["search"] == "beam"
        assert exact["certified_exact_share"] == 1.0 and exact["protocol"] == beam["protocol"]
        assert topk.shape == (8, 5) and ((topk >= 0) & (topk < 60)).all()


def test_bench_agrees_with_generate(sid_setup):
    """bench/beam_search.py runs, and model.generate(num_beams) returns the same ranked lists (up to ties)."""
    out, _, model_dir = sid_setup
    r = run("bench/beam_search.py", "--model", model_dir, "--users", "4", "--beam", "5", "--batch-size", "2",
            "--repeats", "1", "--wide", "10")
    assert "4/4 up to exact score ties" in r.stdout, r.stdout
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("speedup vs generate: ") and " exact vs beam: " in last and "of beam lists exact" in last
    assert "exact top-5 (certified)" in r.stdout and "beam 10: top-5 equals the exact list" in r.stdout
