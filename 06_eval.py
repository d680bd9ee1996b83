"""Step 6: trie-constrained beam search over the SIDs that exist; Recall@K, NDCG@K, cold items.

Paper step: the evaluation protocol of both papers (TIGER, Rajput et al. 2023, sec. 3.2; LC-Rec;
GTI, Chen et al. 2026, sec. 5; centroid init, Loveland et al. 2026, sec. 5): leave-one-out, full
ranking of all items by beam search restricted to valid SIDs (a prefix trie), Recall@K and NDCG@K.

    score(item) = sum_l log p(c_l | prompt, c_<l)   normalized as 05 trained (sft_config.json
                  "softmax": full = vocabulary, sid = all SID tokens, level = the level's codes)
    beam step:  keep the B best (prefix, code) pairs with trie[prefix, code] valid; invalid -> -inf
    Recall@K = 1[rank <= K]      NDCG@K = 1[rank <= K] / log2(rank + 1)      (rank is 1-based)

One prefill per prompt, its KV cache copied to the B beams, then one forward per later SID level
over users x beams. --protocol: "history excluded" ranks only unseen items (RecBole full-sort; in
the search a trie node whose items were all seen is pruned), for the model and most-popular alike;
"history kept" ranks every item (TIGER-style). Prompt: sft_config.json's template over the last
max_history items (without it: 05's prompt-objective template, 20 items). --split test: history =
sequence[:-1], target = last item; valid: history = train part, target = validation item. Cold
targets: seen <= --cold-max times in the train parts. model - most-popular differences get a paired
bootstrap 95% interval over users. Beyond the papers (after main): --search exact, certified top-K.

Reads:  <model>/ (HF folder + sid_vocab.json [+ sft_config.json]), <out-dir>/dataset.pt,
        [<out-dir>/sasrec/eval_<split>.json]. Default --out-dir: two levels above --model.
Writes: <model>/eval_<split>[_exact][_keep].json (_keep: history kept; _exact: --search exact):
        metrics, cold metrics + count, most-popular, bootstrap intervals, certified share, seconds;
        beside each <name>_topk.npy (int64 [U, beam], item indices best first, equal scores by
        item index; -1 = no more valid SIDs).

CPU:  python 06_eval.py --model out/ml-100k/models/centroid+gti+sft   (943 users, beam 20, both)
GPU:  python 06_eval.py --model out/ml-100k/models/centroid+gti+sft --device cuda --batch-size 128
Good run prints per protocol a markdown table, model vs most-popular (vs SASRec when it scored the
same users), all users and cold targets, then model - most popular with its 95% interval.
"""
import argparse
import ast
import copy
import dataclasses
import hashlib
import inspect
import json
import math
import os
import random
import sys
import time
import typing
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm


@dataclass
class Args:
    model: str = "out/ml-100k/models/centroid+gti+sft"
    """model folder (05_sft.py output; any 03/04 folder works too)"""
    out_dir: str = ""
    """artifacts folder with dataset.pt (default: two levels above --model)"""
    split: Literal["test", "valid"] = "test"
    """test: history = sequence[:-1], target = last item | valid: target = the validation item"""
    beam: Annotated[int, ">= 1"] = 20
    """beam width = length of each user's ranked list"""
    batch_size: Annotated[int, ">= 1"] = 16
    """users per batch (each becomes batch_size x beam rows after the prefill)"""
    cold_max: Annotated[int, ">= 0"] = 10
    """a test target is cold when it occurs <= this many times in the train parts"""
    users: Annotated[int, ">= 0"] = 0
    """evaluate only the first N users (0: all)"""
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    """auto = cuda, else mps, else cpu"""
    protocol: Literal["excluded", "kept", "both"] = "both"
    """excluded: rank only unseen items (RecBole) | kept: all (TIGER-style) | both: one prefill"""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """bf16 autocast of the LM body (auto: CUDA, native-bf16 CPUs); head + log-softmax stay fp32"""
    search: Literal["beam", "exact"] = "beam"
    """beam: one beam search of width --beam (the papers') | exact: certified-exact top-K"""
    seed: int = 0
    """seeds random, numpy and torch"""


# --- Prompts: the template with the history's SID tokens inserted as ids -------------------------
DEFAULT_TEMPLATE = "User history: {history}\nNext item:"   # 05_sft.py's prompt-objective default
DEFAULT_MAX_HISTORY = 20                                    # history items without sft_config.json


def build_prompts(tok, template, item_tok, histories, max_history):
    """Token ids of the template, the last max_history items' SID tokens inserted as ids."""
    if template.count("{history}") != 1:
        die(f"prompt template {template!r} must contain {{history}} exactly once")
    pre, post = (tok(s, add_special_tokens=False).input_ids for s in template.split("{history}"))
    return [pre + [t for i in h[-max_history:] for t in item_tok[i].tolist()] + post
            for h in histories]


# --- The prefix trie as tensors: nxt[l][node, code] = child at level l+1 (the item at the last) -
def build_trie(codes: np.ndarray, sizes):
    """codes: (N, L+1) unique rows. Returns nxt: LongTensors (nodes_l, K_l), -1 = no such child."""
    n, levels = codes.shape
    node, n_nodes, nxt = np.zeros(n, np.int64), 1, []
    for l in range(levels):
        table = np.full((n_nodes, sizes[l]), -1, np.int64)
        if l < levels - 1:
            keys = node * sizes[l] + codes[:, l]                   # (N,) prefix id of length l+1
            uniq, child = np.unique(keys, return_inverse=True)
            table[uniq // sizes[l], uniq % sizes[l]] = np.arange(len(uniq))
            node, n_nodes = child.reshape(-1), len(uniq)
        else:
            table[node, codes[:, l]] = np.arange(n)                 # leaves are the items
        nxt.append(torch.from_numpy(table))
    return nxt


def trie_paths(codes: np.ndarray, nxt):
    """paths[l][i] = the node item i passes through after l+1 codes (its own index at the last)."""
    node, paths = torch.zeros(len(codes), dtype=torch.long), []
    for l, table in enumerate(nxt):
        node = table[node, torch.from_numpy(codes[:, l])]
        paths.append(node)
    return paths


def unseen_masks(paths, histories):
    """History exclusion inside the search: alive[l][b, node] = node still leads to an item user b
    has not seen. A prefix whose items were all seen is pruned where it stands, so it never takes a
    beam slot. Returns a list of (B, nodes_{l+1}) bool tensors."""
    alive = []
    for path in paths:
        total = torch.bincount(path, minlength=int(path.max()) + 1)       # items under each node
        seen = torch.zeros(len(histories), len(total), dtype=torch.long)
        for b, h in enumerate(histories):
            items = torch.tensor(sorted(set(h)), dtype=torch.long)
            seen[b].index_add_(0, path[items], torch.ones_like(items))
        alive.append(seen < total)
    return alive


# --- Scores of one SID level, normalized as 05 trained: log_softmax over full | sid | level ------
class LevelScorer:
    def __init__(self, model, token_ids, softmax: str):
        self.head, self.softmax = model.get_output_embeddings(), softmax
        dev = self.head.weight.device
        self.tok = [torch.tensor(t, device=dev) for t in token_ids]       # (K_l,) -1 = unused
        self.cols = torch.cat([t[t >= 0] for t in self.tok])              # (C,) SID token ids
        col_of = torch.full((self.head.weight.shape[0],), -1, dtype=torch.long, device=dev)
        col_of[self.cols] = torch.arange(len(self.cols), device=dev)
        self.col = [torch.where(t >= 0, col_of[t.clamp(min=0)], -1) for t in self.tok]  # (K_l,)

    def logits(self, h, ids):
        b = self.head.bias[ids] if self.head.bias is not None else None
        return F.linear(h.float(), self.head.weight[ids].float(), None if b is None else b.float())

    def __call__(self, h, l):
        """h: (R, d) last hidden states -> (R, K_l) log p(code | prefix), fp32; unused: -inf."""
        tok = self.tok[l]
        with torch.autocast(h.device.type, enabled=False):
            if self.softmax == "full":
                lp = self.head(h.float()).float().log_softmax(-1)[:, tok.clamp(min=0)]
            elif self.softmax == "sid":
                lp = self.logits(h, self.cols).log_softmax(-1)[:, self.col[l].clamp(min=0)]
            else:
                lp = self.logits(h, tok.clamp(min=0)).masked_fill(tok < 0, -math.inf)
                lp = lp.log_softmax(-1)
            return lp.masked_fill(tok < 0, -math.inf)


# --- Batched constrained beam search: one prefill per prompt, one forward per later level --------
def left_pad(prompts, pad_id, device):
    P = max(map(len, prompts))
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p)
        mask[b, P - len(p):] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def prefill(model, prompts, pad_id: int, ctx=nullcontext()):
    """One forward over the left-padded prompts: (KV cache, last hidden (B, d), mask (B, P))."""
    ids, mask = left_pad(prompts, pad_id, model.device)                  # (B, P)
    pos = (mask.cumsum(1) - 1).clamp(min=0)                              # ignore the left pad
    with ctx:
        out = model.base_model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    return out.cache, out.last_hidden_state[:, -1], mask


@torch.no_grad()
def beam_search(model, prompts, scorer, nxt, beam: int, pad_id: int, alive=None, ctx=nullcontext(),
                start=None, with_bound=False):
    """prompts: B token-id lists; scorer: LevelScorer; nxt: build_trie's tables; alive: unseen_masks
    (history exclusion) or None; start: prefill()'s output if already computed (it is consumed).
    The LM body may run under autocast (ctx); the head and the log-softmax run in fp32.
    Returns items (B, beam) best first (-1: fewer valid SIDs) and their scores; with_bound=True
    adds bound (B,): the best score of any candidate pruned, at any level (-inf: none)."""
    dev = model.device
    cache, h, mask = start if start is not None else prefill(model, prompts, pad_id, ctx)
    B = h.shape[0]
    first = mask.sum(1, keepdim=True)                              # (B, 1) position of SID token 0
    scores = torch.zeros(B, 1, device=dev)                         # (B, nb) summed log-probs
    bound = torch.full((B,), -math.inf, device=dev)                # (B,) best pruned candidate
    nodes = torch.zeros(B, 1, dtype=torch.long, device=dev)        # (B, nb) trie node per beam
    for l, nxt_l in enumerate(nxt):
        K, nb = nxt_l.shape[1], nodes.shape[1]
        lp = scorer(h, l).view(B, nb, K)                           # (B, nb, K) log p(code | prefix)
        child = nxt_l.to(dev)[nodes.clamp(min=0)]                  # (B, nb, K) trie[prefix, code]
        child = child.masked_fill(nodes[..., None] < 0, -1)
        dead = child < 0
        if alive is not None:                                      # every item below already seen
            dead |= ~alive[l].to(dev).gather(1, child.clamp(min=0).view(B, -1)).view(B, nb, K)
        cand = (scores[..., None] + lp).masked_fill(dead, -math.inf).view(B, nb * K)
        width = max(1, min(beam, int(torch.isfinite(cand).sum(1).max())))  # only beams that exist
        scores, idx = cand.topk(width, dim=1)                      # (B, width) sorted best first
        bound = torch.maximum(bound, cand.scatter(1, idx, -math.inf).amax(1))  # best not kept
        nodes = child.view(B, -1).gather(1, idx).masked_fill(scores == -math.inf, -1)
        if l == len(nxt) - 1:
            break
        if l == 0:
            cache.batch_repeat_interleave(width)                   # (B, ...) -> (B*width, ...)
            mask, first = mask.repeat_interleave(width, 0), first.repeat_interleave(width, 0)
        else:                                                      # beam continues parent idx // K
            parent = (torch.arange(B, device=dev)[:, None] * nb + idx // K).view(-1)  # (B*width,)
            cache.reorder_cache(parent)
            mask, first = mask[parent], first[parent]              # the width may change per level
        token = scorer.tok[l].clamp(min=0)[idx % K].view(B * width, 1)   # (B*width, 1) SID token
        mask = torch.cat([mask, mask.new_ones(B * width, 1)], 1)
        with ctx:
            out = model.base_model(input_ids=token, attention_mask=mask, position_ids=first + l,
                                   cache=cache, use_cache=True)
        h = out.last_hidden_state[:, -1]                           # (B*width, d)
    if width < beam:                                               # fewer items than beams: pad
        nodes = torch.cat([nodes, nodes.new_full((B, beam - width), -1)], 1)
        scores = torch.cat([scores, scores.new_full((B, beam - width), -math.inf)], 1)
    return (nodes, scores, bound) if with_bound else (nodes, scores)


def rank_all(model, prompts, scorer, nxt, beam, pad_id, batch_size, histories=None, paths=None,
             excludes=(False,), ctx=nullcontext(), progress=True, search="beam", first_width=0):
    """Top-`beam` lists for all prompts in batches of similar length, once per protocol in excludes
    (True: each user's seen items, from histories + paths = trie_paths, are excluded inside the
    search); the protocols share each batch's prefill (the cache is copied). search="beam": one
    beam search of width `beam`; "exact": exact_search (first_width: its first round, 0 = 4 x beam).
    Returns per protocol (items (U, beam), scores (U, beam), width (U,)), ties broken by item index;
    width = the beam width that certified the list exact (0: not certified, beam search only)."""
    U, order = len(prompts), sorted(range(len(prompts)), key=lambda u: len(prompts[u]))
    out = [(torch.full((U, beam), -1, dtype=torch.long), torch.full((U, beam), -math.inf),
            torch.zeros(U, dtype=torch.long)) for _ in excludes]
    with ctx:                   # one autocast region: the bf16 copies of the weights are made once
        for s in tqdm(range(0, U, batch_size), desc=f"{search} search", leave=False,
                      disable=not progress):
            us = order[s:s + batch_size]
            batch = [prompts[u] for u in us]
            start = prefill(model, batch, pad_id, ctx)
            for p, exclude in enumerate(excludes):
                alive = unseen_masks(paths, [histories[u] for u in us]) if exclude else None
                if search == "exact":                              # works on copies of the prefill
                    it, sc, width = exact_search(model, scorer, nxt, beam, start, alive, ctx,
                                                 batch_size * beam, first_width)
                else:
                    last = p == len(excludes) - 1                  # the last protocol consumes it
                    mine = start if last else (copy.deepcopy(start[0]), *start[1:])
                    it, sc, bound = beam_search(model, batch, scorer, nxt, beam, pad_id, alive, ctx,
                                                start=mine, with_bound=True)
                    width = torch.where(certified(sc, bound, beam).cpu(), beam, 0)
                it, sc = by_score_then_index(it.cpu(), sc.cpu())
                out[p][0][us], out[p][1][us], out[p][2][us] = it, sc, width
    return out


def by_score_then_index(items, scores):
    """Sort each row by score (best first), equal scores by item index: one order for exact ties."""
    idx = torch.where(items >= 0, items, torch.iinfo(torch.long).max).argsort(dim=1, stable=True)
    items, scores = items.gather(1, idx), scores.gather(1, idx)
    idx = scores.argsort(dim=1, descending=True, stable=True)
    return items.gather(1, idx), scores.gather(1, idx)


# --- Metrics, the most-popular baseline, paired bootstrap intervals ------------------------------
def rank_metrics(topk: np.ndarray, targets: np.ndarray, ks=(1, 5, 10, 20), ndcg_ks=(5, 10, 20)):
    """topk: (U, K) item indices best first; targets: (U,). Recall@k, NDCG@k averaged over users."""
    per_user = per_user_metrics(topk, targets, ks, ndcg_ks)
    return {k: float(v.mean()) if len(v) else 0.0 for k, v in per_user.items()}


def per_user_metrics(topk, targets, ks=(1, 5, 10, 20), ndcg_ks=(5, 10, 20)) -> dict:
    """Recall@k = 1[rank <= k], NDCG@k = 1[rank <= k] / log2(rank + 1) (rank 1-based) per user."""
    hit = topk == targets[:, None]                                       # (U, K)
    rank = np.where(hit.any(1), hit.argmax(1), np.iinfo(np.int64).max)  # 0-based, max = absent
    out = {f"recall@{k}": (rank < k).astype(np.float64) for k in ks if k <= topk.shape[1]}
    for k in ndcg_ks:
        if k <= topk.shape[1]:
            out[f"ndcg@{k}"] = np.where(rank < k, 1.0 / np.log2(np.minimum(rank, k) + 2.0), 0.0)
    return out


def popular_topk(popularity: np.ndarray, histories, k: int, exclude: bool) -> np.ndarray:
    """Most-popular list per user (train-part counts, ties by item index); exclude: skip seen."""
    order = np.argsort(-popularity, kind="stable")
    if not exclude:
        return np.broadcast_to(order[:k], (len(histories), k)).copy()
    out = np.full((len(histories), k), -1, dtype=np.int64)
    for u, h in enumerate(histories):
        seen = set(h)
        top = [i for i in order[:k + len(seen)] if i not in seen][:k]
        out[u, :len(top)] = top
    return out


def paired_bootstrap(a: np.ndarray, b: np.ndarray, n: int = 2000, seed: int = 0):
    """Mean of a - b over users and its 95% bootstrap interval (users drawn with replacement)."""
    d = a - b
    idx = np.random.default_rng(seed).integers(0, len(d), (n, len(d)))
    lo, hi = np.percentile(d[idx].mean(1), [2.5, 97.5])
    return [round(float(d.mean()), 5), round(float(lo), 5), round(float(hi), 5)]


# --- Report: per protocol a json, the ranked lists and a printed table ---------------------------
def markdown_table(rows):
    keys = list(rows[0][1].keys())
    lines = ["| | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(f"{m[k]:.4f}" for k in keys) + " |" for name, m in rows]
    return "\n".join(lines)


def report(args, protocol, exclude, topk, targets, histories, pop, out_dir, extra):
    """Metrics of one protocol: model, most-popular (same protocol), SASRec if scored, cold targets;
    the paired bootstrap of model - most-popular; the json, the _topk.npy and the printed table."""
    pop_topk = popular_topk(pop, histories, args.beam, exclude)
    cold = pop[targets] <= args.cold_max
    ours, popular = per_user_metrics(topk, targets), per_user_metrics(pop_topk, targets)
    res = {
        "split": args.split, "protocol": protocol, "exclude_history": exclude, **extra,
        "model": rank_metrics(topk, targets), "most_popular": rank_metrics(pop_topk, targets),
        "model_minus_most_popular": {k: paired_bootstrap(ours[k], popular[k]) for k in ours},
        "cold_max": args.cold_max, "cold_users": int(cold.sum()),
        "cold_model": rank_metrics(topk[cold], targets[cold]),
        "cold_most_popular": rank_metrics(pop_topk[cold], targets[cold]),
        "targets_in_history": int(sum(t in set(h) for t, h in zip(targets.tolist(), histories))),
    }
    rows = [(f"model (all, n={len(targets)})", res["model"]),
            ("most popular (all)", res["most_popular"])]
    sasrec = os.path.join(out_dir, "sasrec", f"eval_{args.split}.json")   # same protocol's row
    key = "exclude_history" if exclude else "keep_history"
    ref = load_json(sasrec, "rerun baselines/sasrec.py") if os.path.exists(sasrec) else {}
    if ref.get("users") == len(targets) and key in ref:
        res["sasrec"], res["cold_sasrec"] = ref[key]["model"], ref[key]["cold_model"]
        rows.append(("SASRec (all)", res["sasrec"]))
    rows += [(f"model (cold <= {args.cold_max}, n={res['cold_users']})", res["cold_model"]),
             ("most popular (cold)", res["cold_most_popular"])]
    if "cold_sasrec" in res:
        rows.append(("SASRec (cold)", res["cold_sasrec"]))
    exact, keep = "_exact" if args.search == "exact" else "", "" if exclude else "_keep"
    name = f"eval_{args.split}{exact}{keep}"
    path = os.path.join(args.model, name)
    atomic_write(f"{path}.json", lambda t: open(t, "w").write(json.dumps(res, indent=2)))
    atomic_write(f"{path}_topk.npy", lambda t: np.save(open(t, "wb"), topk))
    print(f"\n{protocol}, {args.split} split:")
    print(markdown_table(rows))
    diff = res["model_minus_most_popular"]
    at10 = {k: v for k, v in diff.items() if k.endswith("@10")} or diff
    print("model - most popular (mean, 95% paired bootstrap over users): "
          + ", ".join(f"{k} {v[0]:+.4f} [{v[1]:+.4f}, {v[2]:+.4f}]" for k, v in at10.items()))
    print(f"wrote {path}.json")


# --- Main ----------------------------------------------------------------------------------------
def main():
    args = parse_args()
    seed_everything(args.seed)
    device = pick_device(args.device)
    ctx, dtype_note = pick_autocast(args.dtype, device)
    out_dir = args.out_dir or os.path.dirname(os.path.dirname(os.path.abspath(args.model)))
    excludes = {"excluded": [True], "kept": [False], "both": [True, False]}[args.protocol]
    print(f"device {device}  {dtype_note} (head + log-softmax fp32)  model {args.model}  "
          f"split {args.split}")
    t0 = time.time()
    model, tok, vocab, data, sids, item_tok, sft_cfg = load_sid_model(args.model, out_dir, device)
    template = sft_cfg.get("template", DEFAULT_TEMPLATE)
    softmax = sft_cfg.get("softmax", "full")
    max_history = sft_cfg.get("max_history", DEFAULT_MAX_HISTORY)

    seqs = data["sequences"][:args.users or None]
    cut = 1 if args.split == "test" else 2                         # test history includes valid
    histories = [s[:-cut] for s in seqs]
    targets = data[args.split][:len(seqs)].numpy()
    prompts = build_prompts(tok, template, item_tok, histories, max_history)
    scorer = LevelScorer(model, vocab["token_ids"], softmax)
    nxt = build_trie(sids, [len(t) for t in vocab["token_ids"]])
    paths = trie_paths(sids, nxt)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    print(f"users {len(prompts)}  items {len(sids)}  levels {len(nxt)}  beam {args.beam}  "
          f"softmax {softmax}  prompt tokens mean {np.mean([len(p) for p in prompts]):.0f}")

    t1 = time.time()
    ranked = rank_all(model, prompts, scorer, nxt, args.beam, pad_id, args.batch_size, histories,
                      paths, excludes, ctx, search=args.search)
    search_s = time.time() - t1
    print(f"{args.search} search {search_s:.1f}s for {len(prompts)} users x {len(excludes)} "
          f"protocol(s) ({1000 * search_s / len(prompts):.0f} ms/user)")
    extra = {"users": len(prompts), "search": args.search, "beam": args.beam,
             "max_history": max_history, "template": template, "softmax": softmax,
             "search_seconds_all_protocols": round(search_s, 2),
             "seconds": round(time.time() - t0, 2), "autocast": dtype_note}
    for exclude, (items, _, width) in zip(excludes, ranked):
        report(args, "history excluded" if exclude else "history kept", exclude, items.numpy(),
               targets, histories, data["popularity"].numpy(), out_dir,
               {**extra, **exactness(width, args.beam)})


# --- Beyond the papers: certified exact top-K ----------------------------------------------------
# Beam search is an approximate top-K: a prefix pruned early can hold an item scoring above the B
# kept. Every term of a score is a log-probability <= 0, so no item scores above its prefixes:
#     bound = the best score of any candidate the search pruned, at any level
#     certified(top-K) = s_K > bound     (s_K = the K-th best complete score; strict: ties are safe)
# Exact search: width 4K, then twice the width for the users not certified (same prefill), until
# every list is certified (at the widest trie level's node count nothing is pruned).
def certified(scores, bound, k: int):
    """The top-k is exact when its k-th score beats every pruned candidate, or nothing was pruned.
    scores: (B, >=k) best first; bound: (B,)."""
    return (scores[:, k - 1] > bound) | (bound == -math.inf)


@torch.no_grad()
def exact_search(model, scorer, nxt, k: int, start, alive=None, ctx=nullcontext(),
                 max_rows: int = 320, first_width: int = 0):
    """Certified-exact top-k: a beam search of width first_width (0: 4k) from the prefill `start`,
    then twice the width for the users not certified, and so on. start is kept intact (each round
    works on a copy of its users' rows); a round holds at most max_rows beams. Returns items (B, k),
    scores (B, k) and the width that certified each list."""
    cache, h, mask = start
    B, dev = h.shape[0], h.device
    widest = max([t.shape[0] for t in nxt[1:]] + [int(nxt[-1].max()) + 1])  # most nodes, any level
    items = torch.full((B, k), -1, dtype=torch.long, device=dev)
    scores = torch.full((B, k), -math.inf, device=dev)
    width_of = torch.zeros(B, dtype=torch.long)
    todo, width = torch.arange(B), min(max(k, first_width or 4 * k), widest)
    while len(todo):
        left = []
        per = max(1, max_rows // width)                            # users per round-batch
        for us in todo.split(per):
            rows = copy.deepcopy(cache)
            rows.reorder_cache(us.to(dev))                         # the prefill rows of these users
            sub_alive = None if alive is None else [a[us] for a in alive]
            it, sc, bound = beam_search(model, None, scorer, nxt, max(width, k), 0, sub_alive, ctx,
                                        start=(rows, h[us.to(dev)], mask[us.to(dev)]),
                                        with_bound=True)
            ok = certified(sc, bound, k).cpu() | (width >= widest)
            done = us[ok]
            items[done.to(dev)], scores[done.to(dev)] = it[ok.to(dev), :k], sc[ok.to(dev), :k]
            width_of[done] = width
            left.append(us[~ok])
        todo, width = torch.cat(left), min(2 * width, widest)
    return items, scores, width_of


def exactness(width, k: int) -> dict:
    """What the json says about how exact the lists are: the share certified exact (all, for the
    exact search) and how wide the search had to go (users per certifying width, 0 = not)."""
    w, n = width.numpy(), len(width)
    counts = {str(v): int(c) for v, c in zip(*np.unique(w, return_counts=True))}
    out = {"certified_exact_share": round(float((w > 0).mean()), 4) if n else 0.0,
           "certified_width_counts": counts}
    print(f"top-{k} lists certified exact: {int((w > 0).sum())}/{n} (users per certifying width, "
          f"0 = not certified: {counts})")
    return out


# --------------------------------------------------------------------------------------------------
# Helpers: the same text in every script that has them (tests/test_plumbing.py checks it);
# no script imports another. Below main(): Python looks names up when main() runs.
# --------------------------------------------------------------------------------------------------
os.environ.setdefault("HF_HUB_OFFLINE", "1")            # nothing is fetched from a hub at run time
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def die(msg: str):
    """Bad input ends the run with one clear line on stderr and exit status 1."""
    sys.exit(f"error: {msg}")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage dump
        die(f"{message} (see `python {self.prog} --help`)")


def parse_args() -> Args:
    """The CLI generated from Args: help = the docstring under each field, --flag/--no-flag for a
    bool, choices = a Literal's values, and a bound Annotated[int, ">= 1"] checked here."""
    body = ast.parse(inspect.getsource(Args)).body[0].body
    docs = {a.target.id: b.value.value for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr)}
    hints = typing.get_type_hints(Args, include_extras=True)
    p = _Parser(prog=os.path.basename(sys.argv[0]), description=__doc__.split("\n\n")[0])
    bounds = {}
    for f in dataclasses.fields(Args):
        flag, t, kw = "--" + f.name.replace("_", "-"), hints[f.name], {"default": f.default}
        if typing.get_origin(t) is Annotated:
            t, bounds[f.name] = typing.get_args(t)[:2]
        if t is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(t) is Literal:
            kw["choices"] = typing.get_args(t)
        else:
            kw["type"] = t
        p.add_argument(flag, help=f"{docs.get(f.name, '')} (default: {f.default})", **kw)
    args = Args(**vars(p.parse_args()))
    for name, bound in bounds.items():                                 # ">= 1", ">= 0" or "> 0"
        op, limit = bound.split()
        v = getattr(args, name)
        if not (v >= float(limit) if op == ">=" else v > float(limit)):
            p.error(f"argument --{name.replace('_', '-')}: must be {bound} (got {v})")
    return args


def pick_device(name: str) -> torch.device:
    """--device auto -> cuda, else mps, else cpu; a device that is not there is one line."""
    if name == "auto":
        mps = torch.backends.mps.is_available()
        name = "cuda" if torch.cuda.is_available() else "mps" if mps else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        die("--device cuda but CUDA is not available; use --device cpu")
    if name == "mps" and not torch.backends.mps.is_available():
        die("--device mps but MPS is not available; use --device cpu")
    return torch.device(name)


def pick_autocast(name: str, device: torch.device, cpu_bf16_pays: bool = True):
    """The one dtype rule: weights, optimizer state and softmaxes stay fp32; only the matmuls may
    run in bf16 (autocast). Returns (autocast context, a note the script prints).
      float32:  no autocast.
      bfloat16: bf16 autocast on CUDA and CPU (emulated and slower without bf16 instructions);
                fp32 on MPS.
      auto:     bf16 on CUDA, and on CPUs with native bf16 (AVX512-BF16 / AMX) in the steps where it
                measured faster (cpu_bf16_pays; docs/design.md); float32 elsewhere."""
    native_cpu = device.type == "cpu" and getattr(torch.cpu, "_is_avx512_bf16_supported",
                                                  lambda: False)()
    if name == "auto":
        fast = device.type == "cuda" or (native_cpu and cpu_bf16_pays)
        name = "bfloat16" if fast else "float32"
    if name == "float32" or device.type == "mps":
        return nullcontext(), "float32"
    note = f"bf16 autocast on {device.type} (fp32 weights)"
    return torch.autocast(device.type, dtype=torch.bfloat16), note


def seed_everything(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def atomic_write(path: str, write):
    """write(tmp_path) then rename: an interrupted step leaves the previous artifact intact.
    torch:  atomic_write(p, lambda t: torch.save(obj, t))
    numpy:  atomic_write(p, lambda t: np.save(open(t, "wb"), arr))   (a str path would get .npy)
    json:   atomic_write(p, lambda t: open(t, "w").write(json.dumps(d, indent=2)))"""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# Guarded loaders, one per file kind: a missing or broken artifact is one line that names the file
# and what to do (`hint`: which step makes it), never a traceback.
def load_artifact(path: str, hint: str, read):
    if not os.path.isfile(path):
        die(f"{path} not found; {hint}")
    try:
        return read(path)
    except Exception as e:
        die(f"{path} is unreadable ({type(e).__name__}); {hint}")


def load_pt(path: str, hint: str):           # tensors, lists, dicts; never pickled objects
    return load_artifact(path, hint, lambda p: torch.load(p, map_location="cpu", weights_only=True))


def load_json(path: str, hint: str):
    return load_artifact(path, hint, lambda p: json.loads(open(p, encoding="utf-8").read()))


def load_hf(folder: str, hint: str, dtype=torch.float32):
    """(tokenizer, causal LM) from a Hugging Face folder (or hub name, offline: only if cached)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()                          # stderr stays one line on bad input
    try:
        tok = AutoTokenizer.from_pretrained(folder)
        return tok, AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    except Exception as e:
        why = "not found" if not os.path.exists(folder) else f"unreadable ({type(e).__name__})"
        die(f"{folder}: {why}; {hint}")


def items_key(ds: dict) -> str:
    """Fingerprint of dataset.pt's items (ids and texts, in order). 03 writes it into
    sid_vocab.json, so a model folder knows which dataset its SIDs index; 04-06 refuse another."""
    return hashlib.sha256(json.dumps([ds["item_ids"], ds["texts"]]).encode()).hexdigest()[:16]


def load_sid_model(model_dir: str, out_dir: str, device):
    """A folder made by 03, 04 or 05 (HF model + tokenizer + sid_vocab.json [+ sft_config.json])
    and the dataset.pt whose items its SIDs name, checked against each other. Returns the fp32
    model on `device`, tokenizer, sid_vocab, dataset, codes (N, L+1) every item's SID as codes,
    item_tok (N, L+1) the same as token ids, and sft_config.json ({} when absent)."""
    path = os.path.join(model_dir, "sid_vocab.json")
    hint = "use a folder made by 03_expand_vocab.py (or 04/05)"
    vocab = load_json(path, hint)
    data = load_pt(os.path.join(out_dir, "dataset.pt"),
                   "run 01_embed_items.py first (or pass --out-dir)")
    fields = {"item_ids", "texts", "sequences", "train", "valid", "test", "popularity"}
    if not isinstance(data, dict) or not fields <= data.keys():
        die(f"{out_dir}/dataset.pt lacks the fields 01_embed_items.py writes; "
            "rerun it (or pass --out-dir)")
    try:
        codes = np.array(vocab["item_codes"], dtype=np.int64)                    # (N, L+1)
        item_tok = torch.tensor(vocab["item_token_ids"], dtype=torch.long)       # (N, L+1)
        names = [f"<{vocab['level_names'][l]}_{c}>" for row in codes.tolist()
                 for l, c in enumerate(row)]
    except (KeyError, TypeError, ValueError, IndexError) as e:
        die(f"{path} lacks what 03_expand_vocab.py writes ({type(e).__name__}: {e}); "
            "rebuild the folder with 03")
    if vocab.get("items_key") != items_key(data) or codes.shape != item_tok.shape:
        die(f"{path} was built for another dataset than {out_dir}/dataset.pt ({len(codes)} items "
            f"vs {len(data['item_ids'])}, or other ids/texts); rerun 03_expand_vocab.py "
            f"--out-dir {out_dir} or pass --out-dir")
    tok, model = load_hf(model_dir, hint)
    if tok.convert_ids_to_tokens(item_tok.flatten().tolist()) != names:
        die(f"{model_dir}: the tokenizer does not hold the SID tokens listed in sid_vocab.json; "
            "rebuild the folder with 03_expand_vocab.py")
    if model.get_input_embeddings().num_embeddings <= int(item_tok.max()):
        die(f"{model_dir}: embedding matrix smaller than the SID token ids; "
            "rebuild it with 03_expand_vocab.py")
    cfg_path = os.path.join(model_dir, "sft_config.json")
    sft_cfg = load_json(cfg_path, "rerun 05_sft.py") if os.path.exists(cfg_path) else {}
    return model.to(device).eval(), tok, vocab, data, codes, item_tok, sft_cfg


if __name__ == "__main__":
    main()
