"""Benchmark (not a test): our batched trie-constrained beam search (06_eval.py) vs Hugging Face
`model.generate(num_beams=B, num_return_sequences=B, prefix_allowed_tokens_fn=...)` (how LC-Rec, LETTER and
MiniOneRec decode; history kept, log-softmax over the whole vocabulary as generate does) vs the bare
forward passes any such search needs (the "forward floor": one prefill per
user, the cache copied to the B beams, then one forward per later SID level over users x beams).

Then the certified-exact search (bench/exact_search.py, 06's former --search exact), and how often the top-K
of a beam of width K (and of a wider beam, --wide) is the exact top-K.

Same model, same prompts (06's template over the test histories), same batches of users. Prints the
times, whether the top-K lists agree (up to exact score ties), and a last line
`speedup vs generate: X.Xx, overhead vs forward floor: Y.YYx, exact vs beam: Z.Zx time, P% of beam lists exact`.

CPU:  python bench/beam_search.py --model out/ml-100k/models/centroid --users 16 --beam 20
      python bench/beam_search.py --model out/ml-100k/models/centroid --users 943 --beam 20 --no-generate
GPU:  python bench/beam_search.py --model out/ml-100k/models/centroid --users 256 --beam 20 --device cuda \
          --batch-size 64
"""
import argparse
import math
import os
import sys
import time

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (Parser, load_sid_model, load_step, nonneg_int, pad_id, pick_autocast, pick_device,  # noqa: E402
                    pos_int)
from exact_search import rank_exact  # noqa: E402
from flops import body_params, gflops, matmul_flops  # noqa: E402

ev = load_step("06_eval")                     # 06's prompts, trie, scorer and search (not a numbered step)


def parse_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--model", default="out/ml-100k/models/centroid", help="a model folder with SID tokens (03/04/05)")
    p.add_argument("--out-dir", default="", help="artifacts folder ('': two levels above --model)")
    p.add_argument("--users", type=pos_int, default=16, help="the first N users (test split histories)")
    p.add_argument("--beam", type=pos_int, default=20, help="beam width = top-K")
    p.add_argument("--batch-size", type=pos_int, default=16, help="users per batch, for all three methods")
    p.add_argument("--generate", default=True, action=argparse.BooleanOptionalAction,
                   help="also time model.generate (slow: it runs every prompt once per beam)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "mps", "auto"], help="auto = cuda, mps, cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "auto", "bfloat16"],
                   help="autocast of the LM body (06's rule)")
    p.add_argument("--wide", type=pos_int, default=80, help="a wider beam whose top-K is also compared with the exact")
    p.add_argument("--repeats", type=pos_int, default=2,
                   help="time ours and the floor this many times (interleaved) and keep the fastest")
    p.add_argument("--exact-first", type=nonneg_int, default=0,
                   help="width of the exact search's first round (0: its default, 4 x beam)")
    p.add_argument("--softmax", default="full", choices=["full", "level"],
                   help="the normalization our searches use: full (over the vocabulary, as generate() scores) | "
                        "level; generate() is only compared under full")
    p.add_argument("--max-history", type=pos_int, default=20,
                   help="history items in the prompt (sft_config.json's value when present)")
    return p.parse_args(argv)


def left_pad(prompts, pad_id, device):
    """Token-id lists -> left-padded ids (B, P) and attention mask (B, P), as 06's prefill pads them."""
    P = max(map(len, prompts))
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p)
        mask[b, P - len(p):] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def forward_floor(model, prompts, levels, beam, pad_id, batch_size):
    """The forward passes alone: prefill once, copy the cache to the beams, one step per later level."""
    order = sorted(range(len(prompts)), key=lambda u: len(prompts[u]))
    for s in range(0, len(order), batch_size):
        ids, mask = left_pad([prompts[u] for u in order[s:s + batch_size]], pad_id, model.device)
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        cache, first = out.cache, mask.sum(1, keepdim=True).repeat_interleave(beam, 0)
        cache.batch_repeat_interleave(beam)
        mask = mask.repeat_interleave(beam, 0)
        token = ids[:, -1:].repeat_interleave(beam, 0)                      # any token: same cost
        for l in range(levels - 1):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
            out = model(input_ids=token, attention_mask=mask, position_ids=first + l, cache=cache, use_cache=True)


@torch.no_grad()
def hf_generate(model, prompts, item_tok, beam, pad_id, batch_size):
    """model.generate with a prefix trie in prefix_allowed_tokens_fn; returns (U, beam) items and scores."""
    n, L = item_tok.shape
    children = {}
    for row in item_tok.tolist():
        for t in range(L):
            children.setdefault(tuple(row[:t]), set()).add(row[t])
    children = {k: sorted(v) for k, v in children.items()}
    item_of = {tuple(r): i for i, r in enumerate(item_tok.tolist())}
    items = torch.full((len(prompts), beam), -1, dtype=torch.long)
    scores = torch.full((len(prompts), beam), -math.inf)
    for s in range(0, len(prompts), batch_size):
        us = list(range(s, min(s + batch_size, len(prompts))))
        ids, mask = left_pad([prompts[u] for u in us], pad_id, model.device)
        P = ids.shape[1]
        fn = lambda b, x: children.get(tuple(x[P:].tolist()), [pad_id])  # noqa: E731
        out = model.generate(input_ids=ids, attention_mask=mask, num_beams=beam, num_return_sequences=beam,
                             max_new_tokens=L, min_new_tokens=L, prefix_allowed_tokens_fn=fn, do_sample=False,
                             length_penalty=0.0, early_stopping=True, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=pad_id, eos_token_id=None)
        seq = out.sequences[:, P:].view(len(us), beam, -1).cpu()
        sc = out.sequences_scores.view(len(us), beam).float().cpu()
        for j, u in enumerate(us):
            items[u] = torch.tensor([item_of.get(tuple(x[:L].tolist()), -1) for x in seq[j]])
            scores[u] = sc[j]
    return items, scores


def search_flops(prompts, batch_size, beam, body, d, head_cols):
    """Model FLOPs of rank_all's passes (bench/flops.py): per batch of users sorted by length, a prefill
    over B x P padded tokens + the head on B rows, then per later level B x beam tokens + the head on
    as many rows; head_cols[l] = the columns scored at level l."""
    lengths, flop = sorted(map(len, prompts)), 0.0
    for s in range(0, len(lengths), batch_size):
        B, P = len(lengths[s:s + batch_size]), max(lengths[s:s + batch_size])
        flop += 2 * (body * B * P + d * head_cols[0] * B)
        flop += sum(2 * (body + d * c) * B * beam for c in head_cols[1:])
    return flop


def overlap(a_items, a_scores, b_items, b_scores):
    """Mean share of b's items that a's list holds, and the largest score change of an item in both lists
    (the same item scored in batches of another shape: 0 in fp32 up to rounding, ~1e-3 nats under bf16)."""
    share, diff = 0.0, 0.0
    for ai, asc, bi, bsc in zip(a_items.tolist(), a_scores.tolist(), b_items.tolist(), b_scores.tolist()):
        common = set(ai) & set(bi) - {-1}
        share += len(common) / len(bi)
        diff = max([diff] + [abs(asc[ai.index(i)] - bsc[bi.index(i)]) for i in common])
    return share / len(a_items), diff


def agreement(a_items, a_scores, b_items, b_scores, tol=1e-4):
    """Users whose lists are identical, and users whose score lists match position by position (within tol):
    those differ only in the order of, or choice among, items with equal scores."""
    same = (a_items == b_items).all(1)
    tie_only = torch.tensor([torch.allclose(a_scores[u], b_scores[u], atol=tol) for u in range(len(a_items))])
    finite = torch.isfinite(a_scores) & torch.isfinite(b_scores)
    diff = (a_scores - b_scores)[finite].abs().max().item() if finite.any() else 0.0
    return int(same.sum()), int(tie_only.sum()), diff


def main():
    args = parse_args()
    device = pick_device(args.device)
    ctx, dtype_note = pick_autocast(args.dtype, device)
    torch.manual_seed(0)
    out_dir = args.out_dir or os.path.dirname(os.path.dirname(os.path.abspath(args.model)))
    model, tok, vocab, data, sids, item_tok, cfg = load_sid_model(args.model, out_dir, device)
    seqs = data["sequences"][:args.users]
    prompts = ev.build_prompts(tok, cfg.get("template", ev.DEFAULT_TEMPLATE), item_tok, [s[:-1] for s in seqs],
                               cfg.get("max_history", args.max_history))
    scorer = ev.LevelScorer(model, vocab["token_ids"], args.softmax)   # generate() normalizes over the vocabulary
    nxt = ev.build_trie(sids, [len(t) for t in vocab["token_ids"]])
    pad = pad_id(tok)
    L = len(nxt)
    print(f"device {device}  {dtype_note}  softmax {args.softmax}  users {len(prompts)}  beam {args.beam}  "
          f"levels {L}  items {len(sids)}  prompt tokens mean {np.mean([len(p) for p in prompts]):.0f}  "
          f"batch {args.batch_size}  threads {torch.get_num_threads()}")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(f):
        sync()
        t = time.perf_counter()
        r = f()
        sync()
        return time.perf_counter() - t, r

    ev.beam_search(model, prompts[:2], scorer, nxt, args.beam, pad, ctx=ctx)       # warm-up
    t_ours, t_floor = math.inf, math.inf
    for _ in range(args.repeats):
        t, [(items, scores, width)] = timed(lambda: ev.rank_all(model, prompts, scorer, nxt, args.beam, pad,
                                                                args.batch_size, ctx=ctx, progress=False))
        t_ours = min(t_ours, t)
        t_floor = min(t_floor, timed(lambda: forward_floor(model, prompts, L, args.beam, pad, args.batch_size))[0])
    print(f"ours (trie beam search)     {t_ours:8.2f} s   {1000 * t_ours / len(prompts):7.1f} ms/user")
    print(f"forward floor               {t_floor:8.2f} s   {1000 * t_floor / len(prompts):7.1f} ms/user")
    body, (V, d) = body_params(model), model.get_output_embeddings().weight.shape
    sizes = [len(t) for t in vocab["token_ids"]]
    cols = {"full": [V] * L, "level": sizes}[args.softmax]
    f_ours = search_flops(prompts, args.batch_size, args.beam, body, d, cols)
    f_floor = search_flops(prompts, args.batch_size, args.beam, body, d, [V] * L)   # floor: full head
    peak = matmul_flops(device, ctx)
    print(f"model FLOP/s (2 x params x tokens, bench/flops.py): ours {gflops(f_ours / t_ours)} "
          f"({f_ours / t_ours / peak:.0%}), floor {gflops(f_floor / t_floor)} ({f_floor / t_floor / peak:.0%}) "
          f"of a 2048^3 matmul's {gflops(peak)} ({dtype_note})")

    # exact top-K (bench/exact_search.py) and how many beam lists it confirms, at width K and a wider beam
    t_exact, [(x_items, x_scores, x_width)] = timed(lambda: rank_exact(
        model, prompts, scorer, nxt, args.beam, pad, args.batch_size, ctx=ctx, progress=False,
        first_width=args.exact_first))
    widths = dict(zip(*[v.tolist() for v in x_width.unique(return_counts=True)]))
    print(f"exact top-{args.beam} (certified)    {t_exact:8.2f} s   {1000 * t_exact / len(prompts):7.1f} ms/user   "
          f"users per certifying width {widths}")
    t_wide, [(w_items, w_scores, _)] = timed(lambda: ev.rank_all(
        model, prompts, scorer, nxt, args.wide, pad, max(1, args.batch_size * args.beam // args.wide), ctx=ctx,
        progress=False))
    print(f"beam {args.wide:<4d} (top-{args.beam} kept)     {t_wide:8.2f} s   {1000 * t_wide / len(prompts):7.1f} ms/user")
    share = {}
    for B, (it, sc) in {args.beam: (items, scores), args.wide: (w_items, w_scores)}.items():
        same, tie_ok, diff = agreement(it[:, :args.beam], sc[:, :args.beam], x_items, x_scores)
        share[B] = 100 * tie_ok / len(prompts)
        share_common, score_diff = overlap(it[:, :args.beam], sc[:, :args.beam], x_items, x_scores)
        print(f"beam {B}: top-{args.beam} equals the exact list for {same}/{len(prompts)} users, {tie_ok}/{len(prompts)} up "
              f"to score ties; mean overlap {share_common:.1%}; max |score change| of a shared item {score_diff:.1e}")
    print(f"beam {args.beam}: certified exact by its own bound for {int((width > 0).sum())}/{len(prompts)} users")
    speed = "skipped"
    if args.generate and args.softmax == "full":
        t_gen, (g_items, g_scores) = timed(lambda: hf_generate(model, prompts, item_tok, args.beam, pad,
                                                                args.batch_size))
        same, tie_ok, diff = agreement(items, scores, g_items, g_scores)
        print(f"model.generate(num_beams)   {t_gen:8.2f} s   {1000 * t_gen / len(prompts):7.1f} ms/user")
        print(f"top-{args.beam} lists identical for {same}/{len(prompts)} users, {tie_ok}/{len(prompts)} up to "
              f"exact score ties; max |score difference| {diff:.2e}")
        speed = f"{t_gen / t_ours:.1f}x"
    print(f"speedup vs generate: {speed}, overhead vs forward floor: {t_ours / t_floor:.2f}x, "
          f"exact vs beam: {t_exact / t_ours:.1f}x time, {share[args.beam]:.0f}% of beam lists exact")


if __name__ == "__main__":
    sys.exit(main())
