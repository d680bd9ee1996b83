"""Step 3: add one LM token per Semantic-ID code and initialize the new embedding rows four ways.

Paper step: vocabulary expansion before grounding/SFT. `centroid` is Algorithm 1 of the centroid
paper (Loveland et al. 2026); `shuffled` is its ablation; `random` and `mean` are the baselines of
both papers (centroid paper: "standard" = Gaussian with the pretrained rows' statistics; GTI paper:
mean init, what Hugging Face `resize_token_embeddings(mean_resizing=True)` gives).

    token (l, k) = "<{letter_l}_{k}>" for every code k used at level l (0..L-1 and the suffix level)
    vocab_mean, sigma = per-dimension mean / std of the pretrained rows                      (D,)
    random:   e_{l,k} ~ N(vocab_mean, diag(sigma^2))
    mean:     e_{l,k} = vocab_mean
    centroid: c_{l,k} = mean of x_i over items with code k at level l   (02's centroids.pt, d dims)
              c'_{l,k} = P(c_{l,k})   P = truncate to D (d >= D, the paper's case), else a seeded
                                      orthonormal d -> D map (keeps all distances)
              Algorithm 1 (--centroid-scale plain):  e_{l,k} = c'_{l,k} - mean_{l,k} c' + vocab_mean
              default (--centroid-scale level): each level l centered on its own mean and scaled to
              the pretrained rows' rms spread, then + vocab_mean (matched: one scale for all levels)
    shuffled: the centroid rows permuted among the codes of each level (no semantic alignment)

Rows are written by token id (never weight[-n:]: Qwen-style checkpoints pad rows past the
tokenizer). An untied output head gets the same recipe with its own statistics. Existing rows: the
tokenizer's (no padding rows).

Reads:  <out-dir>/dataset.pt (01: item count and fingerprint), sids.npy, centroids.pt (02),
        the base model
Writes: <out-dir>/models/<init>/ (model + tokenizer via save_pretrained, plus sid_vocab.json),
        <out-dir>/03_expand_vocab.json (per init: num_new_tokens, norms of new vs old rows, seconds)
CPU:  python 03_expand_vocab.py                 (all four inits)
GPU:  same command (nothing here needs a GPU); any HF causal LM: --model Qwen/Qwen3-0.6B
Good run prints the number of new tokens per level and, per init, the mean norm of new vs old rows:
  init=centroid  new rows |e| 3.3 (old 3.2)  -> out/ml-100k/models/centroid
"""
import argparse
import json
import os
import time

import numpy as np
import torch

from common import (Parser, die, items_key, load_hf, load_npy, load_pt, pick_device, save_folder,
                    seed_everything, write_json)

INITS = ("random", "mean", "centroid", "shuffled")
SHUFFLE_SEED = 1                         # --seed offset of the shuffle's generator


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(__doc__)
    p.add_argument("--dataset", default="ml-100k", help="only picks the default --out-dir (out/<dataset>)")
    p.add_argument("--out-dir", default="",
                   help="artifacts folder: reads dataset.pt, sids.npy, centroids.pt; writes models/<init>/, "
                        "03_expand_vocab.json (default: out/<dataset>)")
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct",
                   help="base causal LM: a Hugging Face folder or hub name (tied or untied head)")
    p.add_argument("--init", default="all", choices=[*INITS, "all"],
                   help="the new rows' init; all = the four folders from one load of the base model")
    p.add_argument("--centroid-scale", default="level", choices=["plain", "matched", "level"],
                   help="centroid init: plain (Algorithm 1: the paper's mean shift only) | matched (also "
                        "scale all rows to the existing rows' spread) | level (each level centered on its "
                        "own mean, scaled to that spread)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                   help="where the statistics are computed (cpu is fast enough); auto = cuda, else mps, "
                        "else cpu")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds random, numpy and torch (random rows, orthonormal map, shuffle)")
    return p.parse_args(argv)


# --- The paper step: four initializations of the new rows (centroid: Algorithm 1) ----------------
def new_rows(init: str, old: torch.Tensor, cents: list, scale: str = "level", seed: int = 0):
    """Rows for the new tokens in (level, code) order -> (n, D). old: (V_old, D) fp32 pretrained rows;
    cents: per level (n_l, d) centroids of the used codes; scale: --centroid-scale; seed: --seed."""
    n = sum(len(c) for c in cents)
    vocab_mean, sigma = old.mean(0), old.std(0)               # per-dimension statistics        (D,)
    gen = torch.Generator().manual_seed(seed)
    if init == "random":
        return vocab_mean + sigma * torch.randn(n, old.shape[1], generator=gen)  # N(mean, sigma^2)
    if init == "mean":
        return vocab_mean.expand(n, -1).clone()                           # e = vocab_mean   (n, D)
    # centroid / shuffled. Algorithm 1: map to the LM width, center, shift to the vocabulary mean
    c = map_to_width(torch.cat(cents), old.shape[1], gen)                  # c' = P(c)        (n, D)
    if scale == "plain":
        rows = c - c.mean(0) + vocab_mean                       # e = c' - mean_{l,k} c' + vocab_mean
    else:
        # The default deviates: `level` centers each level on its own mean and scales it to the
        # pretrained rows' rms spread (`matched`: all levels at once). Measured reasons: plain rows
        # are small next to the distance 04's grounding moves them (lr 1e-2, 120 steps: RSA to the
        # centroids 1.00 -> 0.19 plain vs 0.95 matched, results/ml-100k_grounding.md); per level
        # beats matched in 05 (val loss at step 66: 2.118 / 2.128 vs 2.443 / 2.301, seeds 0 / 1;
        # level c accuracy 0.59 / 0.61 vs 0.37 / 0.47: deeper levels' centroids are tighter than
        # level a's; results/ml-100k_suffix.md).
        spread = lambda x: x.pow(2).sum(1).mean().sqrt().clamp_min(1e-12)  # rms norm, centered rows
        groups = c.split([len(cl) for cl in cents]) if scale == "level" else [c]
        groups = [g - g.mean(0) for g in groups]                           # c' - mean of its group
        groups = [g * (spread(old - vocab_mean) / spread(g)) for g in groups]   # s = rms old / c'
        rows = torch.cat(groups) + vocab_mean                              # + vocab_mean     (n, D)
    if init == "shuffled":                                                 # permute within a level
        perm_gen, start, order = torch.Generator().manual_seed(seed + SHUFFLE_SEED), 0, []
        for cl in cents:
            order.append(start + torch.randperm(len(cl), generator=perm_gen))
            start += len(cl)
        rows = rows[torch.cat(order)]
    return rows


def map_to_width(c: torch.Tensor, d_model: int, gen: torch.Generator) -> torch.Tensor:
    """P: (n, d) centroids -> (n, d_model). Truncation for d >= d_model (the paper: MRL prefixes);
    else a seeded orthonormal map, which keeps all distances."""
    n, d = c.shape
    if d >= d_model:
        return c[:, :d_model]                                  # truncate (the paper's choice)
    q, r = torch.linalg.qr(torch.randn(d_model, d, generator=gen, dtype=torch.float64))  # q (D, d)
    q = q * torch.sign(torch.diagonal(r))                      # unique (Haar) orthonormal columns
    return (c.double() @ q.T).to(c.dtype)                      # x -> Q x keeps all distances


# --- Data: the codes actually used, their centroids, the token names and sid_vocab.json ----------
def load_codes(out_dir: str):
    """02's codes and centroids, checked against 01's dataset.pt before anything is written."""
    path = os.path.join(out_dir, "sids.npy")
    sids = load_npy(path, "run 02_rqvae.py first (or pass --out-dir)")
    if sids.ndim != 2 or sids.dtype.kind not in "iu" or len(sids) == 0 or sids.min() < 0:
        die(f"{path} must be a non-negative int array [N, L+1]; rerun 02_rqvae.py")
    ds = load_pt(os.path.join(out_dir, "dataset.pt"),
                 "run 01_embed_items.py first (or pass --out-dir)")
    n_ds = len(ds.get("item_ids", [])) if isinstance(ds, dict) else "?"
    if n_ds != len(sids) or len(ds.get("texts", [])) != len(sids):
        die(f"{path} has {len(sids)} rows but {out_dir}/dataset.pt has {n_ds} items; "
            "rerun 02_rqvae.py after 01")
    cp = load_pt(os.path.join(out_dir, "centroids.pt"), "run 02_rqvae.py first")
    if not isinstance(cp, dict) or "centroids" not in cp or len(cp["centroids"]) != sids.shape[1]:
        die(f"{out_dir}/centroids.pt has no per-level `centroids` for {sids.shape[1]} levels; "
            "rerun 02_rqvae.py")
    used = [np.unique(sids[:, l]).tolist() for l in range(sids.shape[1])]   # codes used per level
    for l, u in enumerate(used):
        if u[-1] >= len(cp["centroids"][l]):
            die(f"sids.npy uses code {u[-1]} at level {l} but centroids.pt has "
                f"{len(cp['centroids'][l])}; rerun 02")
    cents = [cp["centroids"][l].float()[u] for l, u in enumerate(used)]      # per level (n_l, d)
    sizes = [int(len(cp["centroids"][l])) for l in range(sids.shape[1])]
    return sids.astype(np.int64), used, cents, sizes, ds


def level_letter(l: int) -> str:
    """a, b, ..., z, then aa, ab, ... (more than 26 levels is unusual but stays readable)."""
    return chr(97 + l) if l < 26 else level_letter(l // 26 - 1) + chr(97 + l % 26)


def sid_vocab(sids, used, sizes, letters, ids, ds) -> dict:
    """sid_vocab.json: token ids per level and code, each item's SID (tokens, string, codes), and
    the fingerprint of the dataset.pt these items index."""
    L1 = sids.shape[1]
    tid = {(l, k): int(i) for (l, k), i in zip([(l, k) for l in range(L1) for k in used[l]], ids)}
    return {
        "num_levels": L1, "level_names": letters, "codebook_sizes": sizes,
        "token_ids": [[tid.get((l, k), -1) for k in range(sizes[l])] for l in range(L1)],
        "item_token_ids": [[tid[(l, int(c))] for l, c in enumerate(row)] for row in sids],
        "item_sids": ["".join(f"<{letters[l]}_{int(c)}>" for l, c in enumerate(row))
                      for row in sids],
        "item_codes": sids.tolist(),            # = sids.npy: 04-06 build the trie from the folder
        "items_key": items_key(ds),             # the dataset.pt these items index (04-06 check it)
    }


# --- The model: new tokens, their rows written by token id ---------------------------------------
def add_sid_tokens(args, names):
    """Add the SID tokens to the tokenizer; resize the embedding matrix only if it is too small.
    -> tok, model, the new rows' token ids (n,), the matrices to fill, untied?, old vocab size"""
    tok, model = load_hf(args.model, "pass a Hugging Face causal LM folder (`make setup` makes the "
                         "default)", dtype="auto")
    vocab_before = len(tok)
    if any(t in tok.get_vocab() for t in names):
        die(f"--model {args.model} already has SID tokens (e.g. {names[0]}); pass the base model, "
            "not a 03 output")
    tok.add_tokens(names)                                  # plain added tokens: "<a_1><b_2>" splits
    ids = torch.tensor(tok.convert_tokens_to_ids(names))    # token id of each new row         (n,)
    if len(tok) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tok), mean_resizing=False)  # rows overwritten by id
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    untied = head is not None and head.weight.data_ptr() != emb.weight.data_ptr()
    mats = {"embed": emb.weight} | ({"head": head.weight} if untied else {})
    return tok, model, ids, mats, untied, vocab_before


def fill_rows(args, init: str, mats: dict, olds: dict, ids, cents, device):
    """Write each matrix's new rows (by token id); returns their norms next to the old rows'."""
    norms = {}
    rms = lambda x: round(float((x - x.mean(0)).pow(2).sum(1).mean().sqrt()), 4)   # rms spread
    with torch.no_grad():
        for k, w in mats.items():
            rows = new_rows(init, olds[k], [c.to(device) for c in cents], args.centroid_scale,
                            args.seed)                                                   # (n, D)
            w[ids.to(w.device)] = rows.to(w.device, w.dtype)                 # write by token id
            norms[k] = {"new_mean_norm": round(float(rows.norm(dim=1).mean()), 4),
                        "old_mean_norm": round(float(olds[k].norm(dim=1).mean()), 4),
                        "new_rms_spread": rms(rows), "old_rms_spread": rms(olds[k])}
    return norms


def load_summary(path: str) -> dict:
    """03_expand_vocab.json of an earlier run (another --init); {} if there is none or it is bad."""
    if os.path.exists(path):
        try:
            return json.load(open(path))
        except Exception:
            return {}
    return {}


# --- main: codes -> tokens -> one Hugging Face folder per init (save_folder: temp, then swapped in)
def main(argv=None):
    args = parse_args(argv)
    args.out_dir = args.out_dir or os.path.join("out", args.dataset)
    inits = list(INITS) if args.init == "all" else [args.init]
    seed_everything(args.seed)
    device = pick_device(args.device)
    t0 = time.time()
    sids, used, cents, sizes, ds = load_codes(args.out_dir)
    L1 = sids.shape[1]
    letters = [level_letter(l) for l in range(L1)]
    names = [f"<{letters[l]}_{k}>" for l in range(L1) for k in used[l]]
    per_level = ", ".join(f"{letters[l]}={len(u)}" for l, u in enumerate(used))
    print(f"{len(sids)} items, {L1} levels; new tokens per level: {per_level} (total {len(names)})")

    tok, model, ids, mats, untied, vocab_before = add_sid_tokens(args, names)
    rows_before = mats["embed"].shape[0]
    old_ids = torch.arange(min(vocab_before, rows_before))                    # pre-existing tokens
    olds = {k: w.detach()[old_ids].to(device, torch.float32) for k, w in mats.items()}  # (V_old, D)
    print(f"model {args.model}: vocab {vocab_before} -> {len(tok)}, matrix rows {rows_before}, "
          f"d_model {mats['embed'].shape[1]}, head {'untied' if untied else 'tied'}; "
          f"centroid d = {cents[0].shape[1]}")
    vocab = sid_vocab(sids, used, sizes, letters, ids, ds)

    summary_path = os.path.join(args.out_dir, "03_expand_vocab.json")
    summary = load_summary(summary_path)              # keep the other inits' rows when writing one
    os.makedirs(os.path.join(args.out_dir, "models"), exist_ok=True)
    for init in inits:
        t1 = time.time()
        norms = fill_rows(args, init, mats, olds, ids, cents, device)
        dst = os.path.join(args.out_dir, "models", init)
        save_folder(dst, model, tok, {"sid_vocab.json": json.dumps(vocab | {"init": init})})
        summary[init] = {"init": init, "num_new_tokens": len(names), "model": args.model,
                         "vocab_before": vocab_before, "vocab_after": len(tok), "tied": not untied,
                         "centroid_scale": args.centroid_scale,
                         "norms": norms, "seconds": round(time.time() - t1, 2)}
        e = norms["embed"]
        print(f"init={init:9s} new rows |e| {e['new_mean_norm']:.3f} "
              f"(old {e['old_mean_norm']:.3f}), spread {e['new_rms_spread']:.3f} "
              f"(old {e['old_rms_spread']:.3f})  -> {dst}")
    write_json(summary_path, summary)
    print(f"done in {time.time() - t0:.1f}s; summary -> {summary_path}")


if __name__ == "__main__":
    main()
