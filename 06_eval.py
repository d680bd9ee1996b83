"""Step 6: trie-constrained beam search over the SIDs that exist; Recall@K, NDCG@K, cold items.

Paper step: the evaluation protocol of both papers (TIGER, Rajput et al. 2023, sec. 3.2; LC-Rec;
GTI, Chen et al. 2026, sec. 5; centroid init, Loveland et al. 2026, sec. 5): leave-one-out, full
ranking of all items by beam search restricted to valid SIDs (a prefix trie), Recall@K and NDCG@K.

    score(item) = sum_l log p(c_l | prompt, c_<l)   normalized as 05 trained (sft_config.json
                  "softmax": full = over the vocabulary, the papers'; level = over the level's codes)
    beam step:  keep the B best (prefix, code) pairs with trie[prefix, code] valid; invalid -> -inf
    Recall@K = 1[rank <= K]      NDCG@K = 1[rank <= K] / log2(rank + 1)      (rank is 1-based)

--protocol: "history excluded" ranks only unseen items (RecBole full-sort; a trie node whose items were
all seen is pruned in the search), "history kept" every item (TIGER-style); most-popular alike. Prompt:
sft_config.json's template and max_history (else 05's prompt template, 20 items). --split test: history
= sequence[:-1], target = last item; valid: history = train part. Cold: target seen <= --cold-max times
in training. Beam search can miss an item scoring above its B-th: the json gives the share of lists its
own bound certifies exact (bench/exact_search.py: the certified-exact top-K).

Reads:  <model>/ (HF folder + sid_vocab.json [+ sft_config.json]), <out-dir>/dataset.pt (default:
        two levels above --model), [<out-dir>/sasrec/eval_<split>.json].
Writes: <model>/eval_<split>[_keep].json (_keep: history kept): model, most-popular [, SASRec], cold,
        model - most popular (paired bootstrap 95% over users), certified share, seconds; beside it
        <name>_topk.npy (int64 [U, beam], items best first, ties by item index; -1 = no more SIDs).

CPU:  python 06_eval.py --model out/ml-100k/models/centroid+gti+sft   (943 users, beam 20, both)
GPU:  python 06_eval.py --model out/ml-100k/models/centroid+gti+sft --device cuda --batch-size 128
Good run prints per protocol a table (model, most popular, SASRec; all and cold targets), then
model - most popular with its 95% interval.
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
                    pick_autocast, pick_device, pos_int, write_json)

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
    """log p(code | prefix) at SID level l, normalized as 05 trained: log_softmax over the vocabulary
    ("full", the papers'), or over the level's codes only ("level", 05's default; docs/design.md)."""
    def __init__(self, model, token_ids, softmax: str):
        self.head, self.softmax = model.get_output_embeddings(), softmax
        self.tok = [torch.tensor(t, device=self.head.weight.device) for t in token_ids]  # (K_l,) -1: unused

    def __call__(self, h, l):
        """h: (R, d) last hidden states -> (R, K_l) log p(code | prefix), fp32; unused: -inf."""
        tok = self.tok[l]
        with torch.autocast(h.device.type, enabled=False):
            if self.softmax == "full":
                lp = self.head(h.float()).float().log_softmax(-1)[:, tok.clamp(min=0)]
            else:                                                  # the head's K_l rows of level l
                ids = tok.clamp(min=0)
                b = self.head.bias[ids] if self.head.bias is not None else None
                lp = F.linear(h.float(), self.head.weight[ids].float(), None if b is None else b.float())
                lp = lp.masked_fill(tok < 0, -math.inf).log_softmax(-1)
            return lp.masked_fill(tok < 0, -math.inf)


# --- Batched constrained beam search: one prefill per prompt, one forward per later level --------
@torch.no_grad()
def prefill(model, prompts, pad_id: int, ctx=nullcontext()):
    """One forward over the left-padded prompts: (KV cache, last hidden (B, d), mask (B, P))."""
    P = max(map(len, prompts))
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)        # (B, P)
    mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p)
        mask[b, P - len(p):] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    pos = (mask.cumsum(1) - 1).clamp(min=0)                              # ignore the left pad
    with ctx:
        out = model.base_model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    return out.cache, out.last_hidden_state[:, -1], mask


@torch.no_grad()
def beam_search(model, prompts, scorer, nxt, beam: int, pad_id: int, alive=None, ctx=nullcontext(),
                start=None, with_bound=False):
    """prompts: B token-id lists; scorer: LevelScorer; nxt: build_trie's tables; alive: unseen_masks
    (history exclusion) or None; start: prefill()'s output if already computed (it is consumed); the
    LM body may run under autocast (ctx). Returns items (B, beam) best first (-1: fewer valid SIDs) and
    their scores (B, beam); with_bound=True adds bound (B,): the best score pruned at any level."""
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


# --- Data: prompts (the template, the history's SID tokens inserted as ids) and seen items -------
def build_prompts(tok, template, item_tok, histories, max_history):
    """Token ids of the template, the last max_history items' SID tokens inserted as ids."""
    if template.count("{history}") != 1:
        die(f"prompt template {template!r} must contain {{history}} exactly once")
    pre, post = (tok(s, add_special_tokens=False).input_ids for s in template.split("{history}"))
    return [pre + [t for i in h[-max_history:] for t in item_tok[i].tolist()] + post for h in histories]


def unseen_masks(codes: np.ndarray, nxt, histories):
    """alive[l] (B, nodes): node still leads to an item user b has not seen (else it never takes a beam)."""
    alive, path = [], torch.zeros(len(codes), dtype=torch.long)
    for l, table in enumerate(nxt):
        path = table[path, torch.from_numpy(codes[:, l])]                # (N,) node of each item
        total = torch.bincount(path, minlength=int(path.max()) + 1)       # items under each node
        seen = torch.zeros(len(histories), len(total), dtype=torch.long)
        for b, h in enumerate(histories):
            items = torch.tensor(sorted(set(h)), dtype=torch.long)
            seen[b].index_add_(0, path[items], torch.ones_like(items))
        alive.append(seen < total)
    return alive


# --- The loop: all users in batches of similar length, both protocols from one prefill ----------
def rank_all(model, prompts, scorer, nxt, beam, pad_id, batch_size, histories=None, codes=None,
             excludes=(False,), ctx=nullcontext(), progress=True):
    """Top-`beam` lists per protocol in excludes (True: the items of each user's history, SIDs = codes,
    are excluded in the search; one prefill, its cache copied). Returns per protocol items (U, beam) and
    scores (U, beam), ties by item index, and width (U,): beam where the list is certified exact, else 0."""
    U, order = len(prompts), sorted(range(len(prompts)), key=lambda u: len(prompts[u]))
    out = [(torch.full((U, beam), -1, dtype=torch.long), torch.full((U, beam), -math.inf),
            torch.zeros(U, dtype=torch.long)) for _ in excludes]
    with ctx:                   # one autocast region: the bf16 copies of the weights are made once
        for s in tqdm(range(0, U, batch_size), desc="beam search", leave=False, disable=not progress):
            us = order[s:s + batch_size]
            batch = [prompts[u] for u in us]
            start = prefill(model, batch, pad_id, ctx)
            for p, exclude in enumerate(excludes):
                alive = unseen_masks(codes, nxt, [histories[u] for u in us]) if exclude else None
                last = p == len(excludes) - 1                      # the last protocol consumes it
                mine = start if last else (copy.deepcopy(start[0]), *start[1:])
                it, sc, bound = beam_search(model, batch, scorer, nxt, beam, pad_id, alive, ctx,
                                            start=mine, with_bound=True)
                exact = (sc[:, beam - 1] > bound) | (bound == -math.inf)   # exact: no pruned prefix beats
                width = torch.where(exact.cpu(), beam, 0)      # the last kept (scores only fall: log-p <= 0)
                it, sc = by_score_then_index(it.cpu(), sc.cpu())
                out[p][0][us], out[p][1][us], out[p][2][us] = it, sc, width
    return out


def by_score_then_index(items, scores):
    """Sort each row by score (best first), equal scores by item index: one order for exact ties."""
    idx = torch.where(items >= 0, items, torch.iinfo(torch.long).max).argsort(dim=1, stable=True)
    items, scores = items.gather(1, idx), scores.gather(1, idx)
    idx = scores.argsort(dim=1, descending=True, stable=True)
    return items.gather(1, idx), scores.gather(1, idx)


# --- Eval: Recall@K, NDCG@K; the most-popular baseline; paired bootstrap intervals -------------
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


# --- Save: per protocol a json, the ranked lists and a printed table ------------------------------
def markdown_table(rows):
    keys = list(rows[0][1].keys())
    lines = ["| | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(f"{m[k]:.4f}" for k in keys) + " |" for name, m in rows]
    return "\n".join(lines)


def report(args, protocol, exclude, topk, width, targets, histories, pop, out_dir, extra, tag=""):
    """One protocol: model, most popular, SASRec if it scored the same users, cold targets, model - most
    popular, lists certified exact (width > 0) -> eval_<split><tag>[_keep].json, _topk.npy, a table."""
    w, n = width.numpy(), len(width)                               # users per certifying width
    exact = {"certified_exact_share": round(float((w > 0).mean()), 4) if n else 0.0,
             "certified_width_counts": {str(v): int(c) for v, c in zip(*np.unique(w, return_counts=True))}}
    print(f"lists certified exact: {int((w > 0).sum())}/{n} (per width: {exact['certified_width_counts']})")
    pop_topk = popular_topk(pop, histories, args.beam, exclude)
    cold = pop[targets] <= args.cold_max
    ours, popular = per_user_metrics(topk, targets), per_user_metrics(pop_topk, targets)
    res = {"split": args.split, "protocol": protocol, "exclude_history": exclude, **extra, **exact,
           "model": rank_metrics(topk, targets), "most_popular": rank_metrics(pop_topk, targets),
           "model_minus_most_popular": {k: paired_bootstrap(ours[k], popular[k]) for k in ours},
           "cold_max": args.cold_max, "cold_users": int(cold.sum()),
           "cold_model": rank_metrics(topk[cold], targets[cold]),
           "cold_most_popular": rank_metrics(pop_topk[cold], targets[cold]),
           "targets_in_history": int(sum(t in set(h) for t, h in zip(targets.tolist(), histories)))}
    sasrec = os.path.join(out_dir, "sasrec", f"eval_{args.split}.json")   # same protocol's row
    key = "exclude_history" if exclude else "keep_history"
    ref = load_json(sasrec, "rerun baselines/sasrec.py") if os.path.exists(sasrec) else {}
    if ref.get("users") == len(targets) and key in ref:
        res["sasrec"], res["cold_sasrec"] = ref[key]["model"], ref[key]["cold_model"]
    rows = [(f"model (all, n={len(targets)})", res["model"]), ("most popular (all)", res["most_popular"]),
            ("SASRec (all)", res.get("sasrec")),
            (f"model (cold <= {args.cold_max}, n={res['cold_users']})", res["cold_model"]),
            ("most popular (cold)", res["cold_most_popular"]), ("SASRec (cold)", res.get("cold_sasrec"))]
    path = os.path.join(args.model, f"eval_{args.split}{tag}{'' if exclude else '_keep'}")
    write_json(f"{path}.json", res)
    atomic_write(f"{path}_topk.npy", lambda t: np.save(open(t, "wb"), topk))
    print(f"\n{protocol}, {args.split} split:\n{markdown_table([r for r in rows if r[1] is not None])}")
    diff = res["model_minus_most_popular"]
    at10 = {k: v for k, v in diff.items() if k.endswith("@10")} or diff
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

    seqs = data["sequences"][:args.users or None]
    cut = 1 if args.split == "test" else 2                         # test history includes valid
    histories = [s[:-cut] for s in seqs]
    targets = data[args.split][:len(seqs)].numpy()
    prompts = build_prompts(tok, template, item_tok, histories, max_history)
    scorer = LevelScorer(model, vocab["token_ids"], softmax)
    nxt = build_trie(sids, [len(t) for t in vocab["token_ids"]])
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    print(f"users {len(prompts)}  items {len(sids)}  levels {len(nxt)}  beam {args.beam}  "
          f"softmax {softmax}  prompt tokens mean {np.mean([len(p) for p in prompts]):.0f}")

    t1 = time.time()
    ranked = rank_all(model, prompts, scorer, nxt, args.beam, pad_id, args.batch_size, histories, sids,
                      excludes, ctx)
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
