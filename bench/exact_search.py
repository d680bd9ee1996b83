"""Certified-exact top-K (beyond the papers): 06_eval.py's beam search, widened per user until the
ranked list is provably the exact top-K of the model's scores. Writes the files `06_eval.py --search
exact` wrote before the search moved here.

Beam search is an approximate top-K: a prefix pruned early can hold an item scoring above the K kept.
Every term of a score is a log-probability <= 0, so no item scores above its prefixes:
    bound = the best score of any candidate the search pruned, at any level   (06's beam_search)
    certified(top-K) = s_K > bound    (s_K = the K-th best complete score; strict: ties are safe)
Exact search: a beam of width 4K (--first-width), then twice the width for the users not certified
(from the same prefill), until every list is certified (at the widest trie level's node count nothing
is pruned, so it always ends). "Exact" is with respect to the scores the search computes.

Reads:  what 06_eval.py reads (same flags, same prompt, same protocols).
Writes: <model>/eval_<split>_exact[_keep].json (06's fields, "search": "exact", certified share 1.0
        and the users per certifying width) and beside each <name>_topk.npy (06's format).

CPU:  python bench/exact_search.py --model out/ml-100k/models/centroid+gti+sft --protocol excluded
      python scripts/compare_rankings.py out/ml-100k/models/centroid+gti+sft/eval_test{,_exact}_topk.npy \\
          --names beam,exact
GPU:  python bench/exact_search.py --model out/ml-100k/models/centroid+gti+sft --device cuda --batch-size 64
Good run prints 06's tables and "lists certified exact: U/U".
"""
import copy
import math
import os
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
from tqdm import tqdm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from common import (Parser, add_device_flags, die, load_sid_model, load_step, nonneg_int,  # noqa: E402
                    pad_id, pick_autocast, pick_device, pos_int)

ev = load_step("06_eval")            # 06's trie, scorer, prefill, beam_search, metrics and report


def parse_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--model", default="out/ml-100k/models/centroid+gti+sft", help="as in 06_eval.py")
    p.add_argument("--out-dir", default="", help="folder with dataset.pt ('': two levels above --model)")
    p.add_argument("--split", default="test", choices=["test", "valid"], help="as in 06_eval.py")
    p.add_argument("--beam", type=pos_int, default=20, help="K: the length of each exact ranked list")
    p.add_argument("--batch-size", type=pos_int, default=16,
                   help="users per prefill; a round holds at most batch_size x beam beams")
    p.add_argument("--cold-max", type=nonneg_int, default=10, help="cold target: seen <= N times in train")
    p.add_argument("--users", type=nonneg_int, default=0, help="evaluate only the first N users (0: all)")
    p.add_argument("--protocol", default="both", choices=["excluded", "kept", "both"],
                   help="excluded: rank only unseen items (RecBole) | kept: all items (TIGER-style)")
    p.add_argument("--first-width", type=nonneg_int, default=0,
                   help="beam width of the first round (0: 4 x beam; docs/design.md measured 4K faster than K)")
    add_device_flags(p, "auto = bf16 on CUDA and native-bf16 CPUs; the head + log-softmax stay fp32")
    return p.parse_args(argv)


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
            it, sc, bound = ev.beam_search(model, None, scorer, nxt, max(width, k), 0, sub_alive, ctx,
                                           start=(rows, h[us.to(dev)], mask[us.to(dev)]),
                                           with_bound=True)
            ok = certified(sc, bound, k).cpu() | (width >= widest)
            done = us[ok]
            items[done.to(dev)], scores[done.to(dev)] = it[ok.to(dev), :k], sc[ok.to(dev), :k]
            width_of[done] = width
            left.append(us[~ok])
        todo, width = torch.cat(left), min(2 * width, widest)
    return items, scores, width_of


def rank_exact(model, prompts, scorer, nxt, k, pad_id, batch_size, histories=None, codes=None,
               excludes=(False,), ctx=nullcontext(), progress=True, first_width=0):
    """06's rank_all with exact_search in place of the beam search: per protocol items (U, k),
    scores (U, k), ties by item index, and the width that certified each list (U,)."""
    U, order = len(prompts), sorted(range(len(prompts)), key=lambda u: len(prompts[u]))
    out = [(torch.full((U, k), -1, dtype=torch.long), torch.full((U, k), -math.inf),
            torch.zeros(U, dtype=torch.long)) for _ in excludes]
    with ctx:                   # one autocast region: the bf16 copies of the weights are made once
        for s in tqdm(range(0, U, batch_size), desc="exact search", leave=False, disable=not progress):
            us = order[s:s + batch_size]
            start = ev.prefill(model, [prompts[u] for u in us], pad_id, ctx)
            for p, exclude in enumerate(excludes):                 # works on copies of the prefill
                alive = ev.unseen_masks(codes, nxt, [histories[u] for u in us]) if exclude else None
                it, sc, width = exact_search(model, scorer, nxt, k, start, alive, ctx, batch_size * k,
                                             first_width)
                it, sc = ev.by_score_then_index(it.cpu(), sc.cpu())
                out[p][0][us], out[p][1][us], out[p][2][us] = it, sc, width
    return out


def main():
    """06_eval.py's main with the exact search: the same prompts, protocols, json and lists."""
    args = parse_args()
    device = pick_device(args.device)
    ctx, dtype_note = pick_autocast(args.dtype, device)
    out_dir = args.out_dir or os.path.dirname(os.path.dirname(os.path.abspath(args.model)))
    excludes = {"excluded": [True], "kept": [False], "both": [True, False]}[args.protocol]
    print(f"device {device}  {dtype_note} (head + log-softmax fp32)  model {args.model}  split {args.split}")
    t0 = time.time()
    model, tok, vocab, data, sids, item_tok, sft_cfg = load_sid_model(args.model, out_dir, device)
    template, softmax = sft_cfg.get("template", ev.DEFAULT_TEMPLATE), sft_cfg.get("softmax", "full")
    max_history = sft_cfg.get("max_history", 20)
    if softmax not in ("full", "level"):
        die(f"{args.model}/sft_config.json: softmax {softmax!r}; 06 scores full | level (retrain with 05)")
    seqs = data["sequences"][:args.users or None]
    cut = 1 if args.split == "test" else 2                         # test history includes valid
    histories = [s[:-cut] for s in seqs]
    targets = data[args.split][:len(seqs)].numpy()
    prompts = ev.build_prompts(tok, template, item_tok, histories, max_history)
    scorer = ev.LevelScorer(model, vocab["token_ids"], softmax)
    nxt = ev.build_trie(sids, [len(t) for t in vocab["token_ids"]])
    pad = pad_id(tok)
    print(f"users {len(prompts)}  items {len(sids)}  levels {len(nxt)}  beam {args.beam}  "
          f"softmax {softmax}  prompt tokens mean {np.mean([len(p) for p in prompts]):.0f}")

    t1 = time.time()
    ranked = rank_exact(model, prompts, scorer, nxt, args.beam, pad, args.batch_size, histories, sids,
                        excludes, ctx, first_width=args.first_width)
    search_s = time.time() - t1
    print(f"exact search {search_s:.1f}s for {len(prompts)} users x {len(excludes)} protocol(s) "
          f"({1000 * search_s / len(prompts):.0f} ms/user)")
    extra = {"users": len(prompts), "search": "exact", "beam": args.beam, "max_history": max_history,
             "template": template, "softmax": softmax, "search_seconds_all_protocols": round(search_s, 2),
             "seconds": round(time.time() - t0, 2), "autocast": dtype_note}
    for exclude, (items, _, width) in zip(excludes, ranked):
        ev.report(args, "history excluded" if exclude else "history kept", exclude, items.numpy(), width,
                  targets, histories, data["popularity"].numpy(), out_dir, extra, tag="_exact")


if __name__ == "__main__":
    main()
