"""Step 6: trie-constrained beam search over the SIDs that exist; Recall@K, NDCG@K, cold items.

The evaluation of TIGER (Rajput et al. 2023, sec. 3.2), LC-Rec, GTI (Chen et al. 2026, sec. 5) and centroid init
(Loveland et al. 2026, sec. 5): leave-one-out, all items ranked by a beam search restricted to valid SIDs (a trie):
    score(item) = sum_l log p(c_l | prompt, c_<l)   normalized as 05 trained (sft_config.json "softmax":
                  full = over the vocabulary, the papers'; level = over the level's codes)
    beam step:  keep the B best (prefix, code) pairs with trie[prefix, code] valid; invalid -> -inf
    Recall@K = 1[rank <= K]      NDCG@K = 1[rank <= K] / log2(rank + 1)      (rank is 1-based)
--protocol excluded ranks only unseen items (RecBole full-sort), kept all items (TIGER-style). Beam search can miss
an item scoring above its B-th: the json gives the share of lists its own bound certifies exact (bench/exact_search.py).

Reads:  <model>/ (HF folder + sid_vocab.json [+ sft_config.json]), <out-dir>/dataset.pt, [<out-dir>/sasrec/eval_*.json].
Writes: <model>/eval_<split>[_keep].json (_keep: history kept; model, most popular [, SASRec], cold, model - most
        popular with a paired bootstrap 95% interval, certified share, seconds), beside it <name>_topk.npy (int64).
CPU:  python 06_eval.py --model out/ml-100k/models/centroid+gti+sft   (943 users, beam 20, both)
GPU:  python 06_eval.py --model out/ml-100k/models/centroid+gti+sft --device cuda --batch-size 128
Good run prints per protocol a table (model, most popular, SASRec; all and cold targets) and model - most popular.
"""
import copy
import math
import os
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from common import (Parser, add_device_flags, atomic_write, die, load_json, load_sid_model, nonneg_int,
                    pad_id, pick_autocast, pick_device, pos_int, write_json)

DEFAULT_TEMPLATE = "User history: {history}\nNext item:"   # 05_sft.py's prompt-objective default


def parse_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--model", default="out/ml-100k/models/centroid+gti+sft", help="05's folder (03's, 04's)")
    p.add_argument("--out-dir", default="", help="folder with dataset.pt ('': two levels above --model)")
    p.add_argument("--split", default="test", choices=["test", "valid"],
                   help="test: target = the last item | valid: target = the validation item")
    p.add_argument("--beam", type=pos_int, default=20, help="beam width = length of each ranked list")
    p.add_argument("--batch-size", type=pos_int, default=16, help="users per batch (x beam after prefill)")
    p.add_argument("--cold-max", type=nonneg_int, default=10, help="cold target: seen <= N times in train")
    p.add_argument("--users", type=nonneg_int, default=0, help="evaluate only the first N users (0: all)")
    p.add_argument("--protocol", default="both", choices=["excluded", "kept", "both"],
                   help="excluded: rank only unseen items (RecBole) | kept: all items (TIGER-style)")
    add_device_flags(p, "auto = bf16 on CUDA and native-bf16 CPUs; the head + log-softmax stay fp32")
    return p.parse_args(argv)


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


class LevelScorer:
    """scorer(h, l): h (R, d) last hidden states -> (R, K_l) log p(code | prefix) at SID level l, fp32 (unused: -inf),
    normalized as 05 trained: over the vocabulary ("full", the papers') or the level's codes ("level", 05's default)."""
    def __init__(self, model, token_ids, softmax: str):
        self.head, self.softmax = model.get_output_embeddings(), softmax
        self.tok = [torch.tensor(t, device=self.head.weight.device) for t in token_ids]  # (K_l,) -1: unused

    def __call__(self, h, l):
        tok, ids, b = self.tok[l], self.tok[l].clamp(min=0), self.head.bias
        with torch.autocast(h.device.type, enabled=False):
            if self.softmax == "full":
                lp = self.head(h.float()).float().log_softmax(-1)[:, ids]
            else:                                                  # the head's K_l rows of level l
                lp = F.linear(h.float(), self.head.weight[ids].float(), None if b is None else b[ids].float())
                lp = lp.masked_fill(tok < 0, -math.inf).log_softmax(-1)
            return lp.masked_fill(tok < 0, -math.inf)


# --- Batched constrained beam search: one prefill per prompt, one forward per later level --------
@torch.no_grad()
def prefill(model, prompts, pad_id: int, ctx=nullcontext()):
    """One forward over the left-padded prompts: (KV cache, last hidden (B, d), mask (B, P))."""
    P = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (P - len(p)) + list(p) for p in prompts], device=model.device)  # (B, P)
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    pos = (mask.cumsum(1) - 1).clamp(min=0)                              # ignore the left pad
    with ctx:
        out = model.base_model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    return out.cache, out.last_hidden_state[:, -1], mask


@torch.no_grad()
def beam_search(model, prompts, scorer, nxt, beam: int, pad_id: int, alive=None, ctx=nullcontext(),
                start=None, with_bound=False):
    """prompts: B token-id lists (or start: their prefill(), consumed); scorer: LevelScorer; nxt: build_trie's
    tables; alive: unseen_masks (history excluded) or None; the LM body may run under autocast (ctx). Returns items
    (B, beam) best first (-1: fewer valid SIDs), scores (B, beam) [, with_bound: (B,) best score pruned, any level]."""
    cache, h, mask = start if start is not None else prefill(model, prompts, pad_id, ctx)
    B, dev = h.shape[0], model.device
    scores = torch.zeros(B, 1, device=dev)                         # (B, nb) summed log-probs
    bound = torch.full((B,), -math.inf, device=dev)                # (B,) best pruned candidate
    nodes = torch.zeros(B, 1, dtype=torch.long, device=dev)        # (B, nb) trie node per beam
    for l, nxt_l in enumerate(nxt):
        K, nb = nxt_l.shape[1], nodes.shape[1]
        lp = scorer(h, l).view(B, nb, K)                           # (B, nb, K) log p(code | prefix)
        child = nxt_l.to(dev)[nodes.clamp(min=0)].masked_fill(nodes[..., None] < 0, -1)  # (B, nb, K) trie[prefix, code]
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
        parent = (torch.arange(B, device=dev)[:, None] * nb + idx // K).view(-1)  # (B*width,) beam idx // K
        cache.reorder_cache(parent)                                # (B*nb, ...) -> (B*width, ...)
        token = scorer.tok[l].clamp(min=0)[idx % K].view(B * width, 1)   # (B*width, 1) SID token
        mask = torch.cat([mask[parent], mask.new_ones(B * width, 1)], 1)   # the width may change per level
        with ctx:                                                  # position = real tokens before it
            out = model.base_model(input_ids=token, attention_mask=mask, position_ids=mask.sum(1, keepdim=True) - 1,
                                   cache=cache, use_cache=True)
        h = out.last_hidden_state[:, -1]                           # (B*width, d)
    pad = (0, beam - width)                                        # fewer items than beams: -1 / -inf
    nodes, scores = F.pad(nodes, pad, value=-1), F.pad(scores, pad, value=-math.inf)
    return (nodes, scores, bound) if with_bound else (nodes, scores)


# --- Data: prompts (the template, the history's SID tokens inserted as ids) and seen items -------
def build_prompts(tok, template, item_tok, histories, max_history):
    """Token ids of the template, the last max_history items' SID tokens inserted as ids."""
    if template.count("{history}") != 1:
        die(f"prompt template {template!r} must contain {{history}} exactly once")
    pre, post = (tok(s, add_special_tokens=False).input_ids for s in template.split("{history}"))
    return [pre + [t for i in h[-max_history:] for t in item_tok[i].tolist()] + post for h in histories]


def unseen_masks(codes: np.ndarray, nxt, histories):
    """alive[l] (B, nodes): node still leads to an item user b has not seen (else it never takes a beam)."""
    unseen = torch.ones(len(histories), len(codes))                      # (B, N) 1: not in b's history
    for b, h in enumerate(histories):
        unseen[b, torch.tensor(h, dtype=torch.long)] = 0
    alive, path = [], torch.zeros(len(codes), dtype=torch.long)
    for l, table in enumerate(nxt):
        path = table[path, torch.from_numpy(codes[:, l])]                # (N,) node of each item
        alive.append(unseen.new_zeros(len(histories), int(path.max()) + 1).index_add_(1, path, unseen) > 0)
    return alive


# --- The loop: all users in batches of similar length, both protocols from one prefill ----------
def rank_all(model, prompts, scorer, nxt, beam, pad_id, batch_size, histories=None, codes=None,
             excludes=(False,), ctx=nullcontext(), progress=True):
    """Top-`beam` lists per protocol in excludes (True: each user's history, SIDs = codes, excluded in the search;
    one prefill, its cache copied) -> per protocol items (U, beam), scores (U, beam), ties by item index, and
    width (U,): beam where the list is certified exact, else 0."""
    U, order = len(prompts), sorted(range(len(prompts)), key=lambda u: len(prompts[u]))
    out = [(torch.full((U, beam), -1, dtype=torch.long), torch.full((U, beam), -math.inf),
            torch.zeros(U, dtype=torch.long)) for _ in excludes]
    with ctx:                   # one autocast region: the bf16 copies of the weights are made once
        for s in tqdm(range(0, U, batch_size), desc="beam search", leave=False, disable=not progress):
            us = order[s:s + batch_size]
            start = prefill(model, [prompts[u] for u in us], pad_id, ctx)
            for p, exclude in enumerate(excludes):                 # the last protocol consumes the prefill
                mine = start if p == len(excludes) - 1 else (copy.deepcopy(start[0]), *start[1:])
                alive = unseen_masks(codes, nxt, [histories[u] for u in us]) if exclude else None
                it, sc, bound = beam_search(model, None, scorer, nxt, beam, pad_id, alive, ctx, mine, True)
                exact = (sc[:, beam - 1] > bound) | (bound == -math.inf)   # exact: no pruned prefix beats
                width = torch.where(exact.cpu(), beam, 0)      # the last kept (scores only fall: log-p <= 0)
                it, sc = by_score_then_index(it.cpu(), sc.cpu())
                out[p][0][us], out[p][1][us], out[p][2][us] = it, sc, width
    return out


def by_score_then_index(items, scores):
    """Sort each row by score (best first), equal scores by item index: one order for exact ties."""
    idx = torch.where(items >= 0, items, torch.iinfo(torch.long).max).argsort(dim=1, stable=True)  # by index
    idx = idx.gather(1, scores.gather(1, idx).argsort(dim=1, descending=True, stable=True))      # then by score
    return items.gather(1, idx), scores.gather(1, idx)


# --- Eval: Recall@K, NDCG@K; the most-popular baseline; paired bootstrap intervals -------------
def per_user_metrics(topk, targets, ks=(1, 5, 10, 20), ndcg_ks=(5, 10, 20)) -> dict:
    """Recall@k = 1[rank <= k], NDCG@k = 1[rank <= k] / log2(rank + 1) (rank 1-based) per user."""
    hit = topk == targets[:, None]                                       # (U, K)
    rank = np.where(hit.any(1), hit.argmax(1), np.iinfo(np.int64).max)  # 0-based, max = absent
    recall = {f"recall@{k}": (rank < k).astype(np.float64) for k in ks if k <= topk.shape[1]}
    return recall | {f"ndcg@{k}": np.where(rank < k, 1.0 / np.log2(np.minimum(rank, k) + 2.0), 0.0)
                     for k in ndcg_ks if k <= topk.shape[1]}


def rank_metrics(topk: np.ndarray, targets: np.ndarray, ks=(1, 5, 10, 20), ndcg_ks=(5, 10, 20)):
    """topk: (U, K) item indices best first; targets: (U,). Recall@k, NDCG@k averaged over users."""
    return {k: float(v.mean()) if len(v) else 0.0 for k, v in per_user_metrics(topk, targets, ks, ndcg_ks).items()}


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


# --- Save: per protocol a json, the ranked lists and a printed table ------------------------------
def report(args, protocol, exclude, topk, width, targets, histories, pop, out_dir, extra, tag=""):
    """One protocol's metrics, SASRec's if it scored the same users -> eval_<split><tag>[_keep].json, _topk.npy."""
    w, n = width.numpy(), len(width)                               # users per certifying width
    exact = {"certified_exact_share": round(float((w > 0).mean()), 4) if n else 0.0,
             "certified_width_counts": {str(v): int(c) for v, c in zip(*np.unique(w, return_counts=True))}}
    print(f"lists certified exact: {int((w > 0).sum())}/{n} (per width: {exact['certified_width_counts']})")
    pop_topk, cold = popular_topk(pop, histories, args.beam, exclude), pop[targets] <= args.cold_max
    ours, popular = per_user_metrics(topk, targets), per_user_metrics(pop_topk, targets)
    res = {"split": args.split, "protocol": protocol, "exclude_history": exclude, **extra, **exact,
           "model": rank_metrics(topk, targets), "most_popular": rank_metrics(pop_topk, targets),
           "model_minus_most_popular": {k: paired_bootstrap(ours[k], popular[k]) for k in ours},
           "cold_max": args.cold_max, "cold_users": int(cold.sum()),
           "cold_model": rank_metrics(topk[cold], targets[cold]),
           "cold_most_popular": rank_metrics(pop_topk[cold], targets[cold]),
           "targets_in_history": int(sum(t in set(h) for t, h in zip(targets.tolist(), histories)))}
    sasrec = os.path.join(out_dir, "sasrec", f"eval_{args.split}.json")   # same protocol's row
    ref = load_json(sasrec, "rerun baselines/sasrec.py") if os.path.exists(sasrec) else {}
    if ref.get("users") == len(targets) and (row := ref.get("exclude_history" if exclude else "keep_history")):
        res["sasrec"], res["cold_sasrec"] = row["model"], row["cold_model"]
    path = os.path.join(args.model, f"eval_{args.split}{tag}{'' if exclude else '_keep'}")
    write_json(f"{path}.json", res)
    atomic_write(f"{path}_topk.npy", lambda t: np.save(open(t, "wb"), topk))
    rows = [(f"model (all, n={len(targets)})", "model"), ("most popular (all)", "most_popular"),
            ("SASRec (all)", "sasrec"), (f"model (cold <= {args.cold_max}, n={res['cold_users']})", "cold_model"),
            ("most popular (cold)", "cold_most_popular"), ("SASRec (cold)", "cold_sasrec")]
    keys = list(res["model"])                                      # the table: one row per metrics dict
    print(f"\n{protocol}, {args.split} split:\n| | " + " | ".join(keys) + " |\n" + "|---" * (len(keys) + 1) + "|")
    for name, k in [r for r in rows if r[1] in res]:
        print(f"| {name} | " + " | ".join(f"{res[k][m]:.4f}" for m in keys) + " |")
    at10 = {k: v for k, v in res["model_minus_most_popular"].items() if k.endswith("@10") or args.beam < 10}
    print("model - most popular (mean, 95% paired bootstrap over users): "
          + ", ".join(f"{k} {v[0]:+.4f} [{v[1]:+.4f}, {v[2]:+.4f}]" for k, v in at10.items()))
    print(f"wrote {path}.json")


# --- Main ----------------------------------------------------------------------------------------
def main():
    args = parse_args()
    device = pick_device(args.device)
    ctx, dtype_note = pick_autocast(args.dtype, device)
    out_dir = args.out_dir or os.path.dirname(os.path.dirname(os.path.abspath(args.model)))
    excludes = {"excluded": [True], "kept": [False], "both": [True, False]}[args.protocol]
    print(f"device {device}  {dtype_note} (head + log-softmax fp32)  model {args.model}  split {args.split}")
    t0 = time.time()
    model, tok, vocab, data, sids, item_tok, sft_cfg = load_sid_model(args.model, out_dir, device)
    template, softmax = sft_cfg.get("template", DEFAULT_TEMPLATE), sft_cfg.get("softmax", "full")
    max_history = sft_cfg.get("max_history", 20)
    if softmax not in ("full", "level"):                           # 05's former "sid" softmax
        die(f"{args.model}/sft_config.json: softmax {softmax!r}; 06 scores full | level (retrain with 05)")
    histories = [s[:-1] if args.split == "test" else s[:-2] for s in data["sequences"][:args.users or None]]
    targets = data[args.split][:len(histories)].numpy()          # test: the history includes the valid item
    prompts = build_prompts(tok, template, item_tok, histories, max_history)
    scorer = LevelScorer(model, vocab["token_ids"], softmax)
    nxt = build_trie(sids, [len(t) for t in vocab["token_ids"]])
    pad = pad_id(tok)
    print(f"users {len(prompts)}  items {len(sids)}  levels {len(nxt)}  beam {args.beam}  "
          f"softmax {softmax}  prompt tokens mean {np.mean([len(p) for p in prompts]):.0f}")

    t1 = time.time()
    ranked = rank_all(model, prompts, scorer, nxt, args.beam, pad, args.batch_size, histories, sids, excludes, ctx)
    search_s = time.time() - t1
    print(f"beam search {search_s:.1f}s for {len(prompts)} users x {len(excludes)} protocol(s) "
          f"({1000 * search_s / len(prompts):.0f} ms/user)")
    extra = {"users": len(prompts), "search": "beam", "beam": args.beam, "max_history": max_history,
             "template": template, "softmax": softmax, "search_seconds_all_protocols": round(search_s, 2),
             "seconds": round(time.time() - t0, 2), "autocast": dtype_note}
    for exclude, (items, _, width) in zip(excludes, ranked):
        report(args, "history excluded" if exclude else "history kept", exclude, items.numpy(), width,
               targets, histories, data["popularity"].numpy(), out_dir, extra)


if __name__ == "__main__":
    main()
