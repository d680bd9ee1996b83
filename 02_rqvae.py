"""Step 2: RQ-VAE semantic IDs - residual quantization of item embeddings, collision suffix, per-code centroids.

Paper step: TIGER's Semantic-ID tokenizer (Rajput et al. 2023, sec. 3.1, Fig. 3), used by both papers; the
per-code centroids are the centroid paper's mu_{l,k} (Loveland et al. 2026, Algorithm 1, line 2).

    z = enc(x)                                   MLP encoder, x = item text embedding (d) -> latent (D)
    r_0 = z;  c_l = argmin_k ||r_l - e^l_k||;  r_{l+1} = r_l - e^l_{c_l}        l = 0..L-1   (eq. 1)
    z_q = sum_l e^l_{c_l};  x_hat = dec(z + sg[z_q - z])                    straight-through estimator
    loss = ||x - x_hat||^2 + sum_l ( ||sg[r_l] - e^l_{c_l}||^2 + beta ||r_l - sg[e^l_{c_l}]||^2 ),  beta = 0.25
    codebook init: k-means on the first batch, level by level on the residuals
    dead codes: every --reseed-every steps, codes no batch picked since the last check get a random
                current residual of their level (so every code stays in play)
    collision suffix (TIGER): SID = (c_0, ..., c_{L-1}, s), s = 0, 1, 2, ... among items sharing c_0..c_{L-1},
                numbered in item order (stable), so every SID is unique
    centroids: mu_{l,k} = mean of x_i over the items with code k at level l (item-embedding space), l = 0..L

--quantizer rqkmeans (the centroid paper's SIDs; also MiniOneRec's and OpenOneRec's): no encoder, residual
    k-means on x itself: c_0 = k-means(x), r_1 = x - e^0_{c_0}, c_1 = k-means(r_1), ... (same k-means, seeded).
    03 receives the same centroids.pt as for the RQ-VAE: mu_{l,k} = mean of the items' x (the paper's proxy).
    At level 0 these are the k-means centers themselves; at deeper levels the k-means centers are means of
    residuals (rqvae.pt "codebooks", what 07's RSA-to-codebook compares with), not of items.
--collisions reassign (LC-Rec's idea, greedy instead of Sinkhorn): exactly L codes, no suffix level. Among
    items that share all L codes the one nearest the last-level codeword keeps it; the others move to free
    codes of the last level under the same prefix (c_0..c_{L-2}), closest (item, code) pair first. The
    summary reports how many moved and how much farther their residual is from its new codeword.

Reads:  <out-dir>/item_emb.npy (from 01_embed_items.py); dataset.pt only to check the item count.
Writes: <out-dir>/sids.npy (int64 [N, L+1]), centroids.pt, rqvae.pt, 02_rqvae.json (docs/artifacts.md).
--codebook-size 0 (auto) = 64 codes per level for N <= 4096 items (ML-100K: 1,682), else 256 (Beauty: 12,101).
Same seed -> identical sids.npy on CPU (--threads 1). On CUDA, index_add_ (k-means) and the backward pass
use atomic adds, so codes can differ slightly between runs.

CPU:  python 02_rqvae.py --out-dir out/ml-100k                  (1,500 steps x ~30 ms: ~50-60 s)
      python 02_rqvae.py --out-dir out/amazon-beauty            (K=256: ~60 s)
GPU:  python 02_rqvae.py --out-dir out/amazon-beauty --device cuda --batch-size 2048 --steps 5000
Good run (ml-100k) prints one line per interval, ending "step 1500 | loss 0.64 (quant 0.32) | recon_mse 8.4e-04 |
... | usage 1.00/1.00/1.00", then "collision rate 0.0202 (...; largest group 2) -> 0 duplicate SIDs after the suffix".
"""
import argparse
import ast
import dataclasses
import inspect
import json
import os
import random
import sys
import time
import typing
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Args:
    dataset: str = "ml-100k"
    """only picks the default --out-dir (out/<dataset>)"""
    out_dir: str = ""
    """artifacts folder with 01's item_emb.npy (default: out/<dataset>)"""
    quantizer: Literal["rqvae", "rqkmeans"] = "rqvae"
    """rqvae (TIGER: MLP encoder + residual quantization, trained) | rqkmeans (residual k-means on the item
    embeddings, no training: the centroid paper's SIDs)"""
    collisions: Literal["suffix", "reassign"] = "suffix"
    """suffix (TIGER's extra level numbering the items that share L codes) | reassign (exactly L codes: move
    colliding items to free last-level codes, nearest first)"""
    levels: Annotated[int, ">= 1"] = 3
    """L, number of residual quantization levels (the collision suffix adds one more)"""
    codebook_size: Annotated[int, ">= 0"] = 0
    """K codes per level (0 = auto: 64 for N <= 4096 items, else 256)"""
    latent_dim: Annotated[int, ">= 1"] = 32
    """D, width of the RQ-VAE latent"""
    hidden: str = "256,128"
    """encoder MLP widths (the decoder mirrors them)"""
    steps: Annotated[int, ">= 1"] = 1500
    """optimizer steps"""
    batch_size: Annotated[int, ">= 1"] = 512
    """items per step (the first batch also seeds the k-means codebooks)"""
    lr: Annotated[float, "> 0"] = 3e-3
    """AdamW learning rate"""
    weight_decay: float = 1e-4
    """AdamW weight decay (MLP weights only, not the codebooks)"""
    beta: float = 0.25
    """commitment weight"""
    kmeans_iters: Annotated[int, ">= 0"] = 25
    """Lloyd iterations of the k-means codebook init (rqvae) or of each level's k-means (rqkmeans)"""
    reseed_every: Annotated[int, ">= 0"] = 100
    """re-seed codes unused for this many steps (0 = never)"""
    log_every: Annotated[int, ">= 1"] = 250
    """steps between log lines"""
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    """auto = cuda, else mps, else cpu"""
    threads: Annotated[int, ">= 0"] = 1
    """CPU threads for torch (0 = torch's default; this small MLP runs fastest on 1, esp. on a busy machine)"""
    seed: int = 0
    """seeds random, numpy and torch"""


# ---------------------------------------------------------------------------------------------------
# The math: k-means init, residual quantization, RQ-VAE, collision suffix, centroids
# ---------------------------------------------------------------------------------------------------
def kmeans(x, k: int, iters: int, gen: torch.Generator):
    """k-means++ seeding + Lloyd iterations. x (n, D) -> centers (k, D), assignment (n,).
    An empty cluster keeps its previous center; with n < k the extra centers repeat points (dead codes)."""
    n = x.shape[0]
    first = torch.randint(n, (1,), generator=gen, device="cpu").item()
    centers = [x[first]]
    d2 = ((x - x[first]) ** 2).sum(-1)                                        # (n,) distance to nearest center
    for _ in range(1, k):
        p = d2.double().cpu() if d2.sum() > 0 else torch.ones(n, dtype=torch.float64)
        i = torch.multinomial(p / p.sum(), 1, generator=gen).item()           # D^2 sampling
        centers.append(x[i])
        d2 = torch.minimum(d2, ((x - x[i]) ** 2).sum(-1))
    centers = torch.stack(centers)                                            # (k, D)
    for _ in range(iters):
        assign = torch.cdist(x, centers).argmin(1)                            # (n,)
        sums = torch.zeros_like(centers).index_add_(0, assign, x)             # (k, D)
        counts = torch.bincount(assign, minlength=k).unsqueeze(1)             # (k, 1)
        centers = torch.where(counts > 0, sums / counts.clamp(min=1), centers)
    return centers, torch.cdist(x, centers).argmin(1)


def residual_quantize(z, codebooks):
    """z (B, D), codebooks (L, K, D) -> codes (B, L), z_q = sum_l e^l_{c_l} (B, D), residuals [r_0..r_L].
    Codewords enter the residual chain detached: r_{l+1} = r_l - sg[e^l_{c_l}] (gradients reach z only)."""
    r, codes, z_q, residuals = z, [], torch.zeros_like(z), [z]
    for cb in codebooks:                                                      # cb (K, D)
        c = torch.cdist(r.detach(), cb.detach()).argmin(1)                    # c_l = argmin_k ||r_l - e_k||  (B,)
        e = cb[c]                                                             # e^l_{c_l}  (B, D)
        z_q = z_q + e                                                         # z_q = sum_l e^l_{c_l}
        r = r - e.detach()                                                    # r_{l+1} = r_l - e  (B, D)
        codes.append(c)
        residuals.append(r)
    return torch.stack(codes, 1), z_q, residuals


def mlp(widths):
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.SiLU()]
    return nn.Sequential(*layers[:-1])                                        # no activation on the output


class RQVAE(nn.Module):
    def __init__(self, d: int, hidden, latent: int, levels: int, k: int):
        super().__init__()
        self.encoder = mlp([d, *hidden, latent])
        self.decoder = mlp([latent, *reversed(hidden), d])
        self.codebooks = nn.Parameter(torch.zeros(levels, k, latent))          # e^l_k  (L, K, D)

    @torch.no_grad()
    def kmeans_init(self, x, iters: int, gen: torch.Generator):
        """Each level's codebook = k-means centers of that level's residuals on x (the first batch)."""
        r = self.encoder(x)
        for l in range(self.codebooks.shape[0]):
            centers, assign = kmeans(r, self.codebooks.shape[1], iters, gen)
            self.codebooks.data[l] = centers
            r = r - centers[assign]

    def forward(self, x, beta: float):
        z = self.encoder(x)                                                   # (B, D)
        codes, z_q, residuals = residual_quantize(z, self.codebooks)
        x_hat = self.decoder(z + (z_q - z).detach())                          # straight-through  (B, d)
        recon = ((x - x_hat) ** 2).sum(-1).mean()                             # ||x - x_hat||^2
        quant = 0.0
        for l in range(self.codebooks.shape[0]):
            e, r = self.codebooks[l][codes[:, l]], residuals[l]               # (B, D) each
            quant = quant + ((r.detach() - e) ** 2).sum(-1).mean()            # codebook: ||sg[r_l] - e||^2
            quant = quant + beta * ((r - e.detach()) ** 2).sum(-1).mean()     # commitment: beta ||r_l - sg[e]||^2
        return recon + quant, recon, x_hat, codes, residuals


def collision_suffix(codes: np.ndarray) -> np.ndarray:
    """TIGER's extra level: s_i = #earlier items (lower index) with the same codes (N, L) -> (N,). Stable."""
    suffix, seen = np.zeros(len(codes), np.int64), {}
    for i, key in enumerate(map(tuple, codes.tolist())):
        suffix[i] = seen.get(key, 0)
        seen[key] = suffix[i] + 1
    return suffix


def rq_kmeans(x, levels: int, k: int, iters: int, gen: torch.Generator):
    """Residual k-means: k-means on the embeddings, then on what is left, level by level.
    x (N, d) -> codes (N, L), codebooks (L, K, d), residuals [r_0 = x, r_1, .., r_L] (each (N, d))."""
    r, codes, books, residuals = x, [], [], [x]
    for _ in range(levels):
        centers, assign = kmeans(r, k, iters, gen)                            # c_l = argmin_k ||r_l - e^l_k||
        r = r - centers[assign]                                               # r_{l+1} = r_l - e^l_{c_l}
        codes.append(assign)
        books.append(centers)
        residuals.append(r)
    return torch.stack(codes, 1), torch.stack(books), residuals


def reassign_collisions(codes: np.ndarray, r_last, codebook):
    """Collision-free SIDs with exactly L codes. codes (N, L); r_last (N, D) = the residual each item had
    at the last level; codebook (K, D) = that level's codewords. Among items sharing all L codes, the one
    nearest the codeword keeps it; the others take last-level codes no item of their prefix (c_0..c_{L-2})
    uses, the closest (item, free code) pair first (distance ||r - e_k||). Returns new codes, moved items
    and the distances (N, K) it used (for the report)."""
    codes, K = codes.copy(), codebook.shape[0]
    dist = torch.cdist(r_last.float(), codebook.float()).numpy()              # (N, K)
    by_prefix = {}
    for i, key in enumerate(map(tuple, codes[:, :-1].tolist())):
        by_prefix.setdefault(key, []).append(i)
    moved = []
    for prefix, items in by_prefix.items():
        if len(set(codes[items, -1].tolist())) == len(items):
            continue                                                          # no collision under this prefix
        if len(items) > K:
            die(f"{len(items)} items share the prefix {prefix} but the last level has {K} codes; use "
                "--collisions suffix or a larger --codebook-size")
        keep = {}                                                             # code -> the item nearest to it
        for i in items:
            c = codes[i, -1]
            if c not in keep or dist[i, c] < dist[keep[c], c]:
                keep[c] = i
        movers = [i for i in items if keep[codes[i, -1]] != i]
        free = [c for c in range(K) if c not in keep]
        while movers:
            sub = dist[np.ix_(movers, free)]                                  # (movers, free codes)
            a, b = np.unravel_index(sub.argmin(), sub.shape)
            codes[movers[a], -1] = free.pop(b)
            moved.append(movers.pop(a))
    return codes, np.array(sorted(moved), dtype=np.int64), dist


def code_centroids(sids: np.ndarray, emb: np.ndarray, sizes):
    """mu_{l,k} = mean of x_i over items with sids[i, l] == k -> ([K_l, d] per level, counts [K_l])."""
    x = torch.from_numpy(emb)
    cents, counts = [], []
    for l, k in enumerate(sizes):
        c = torch.from_numpy(sids[:, l])
        n = torch.bincount(c, minlength=k)                                    # (K_l,)
        s = torch.zeros(k, x.shape[1]).index_add_(0, c, x)                    # (K_l, d)
        cents.append(s / n.clamp(min=1).unsqueeze(1).float())                 # zero rows for unused codes
        counts.append(n)
    return cents, counts


# ---------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------
def load_embeddings(out_dir: str) -> np.ndarray:
    path = os.path.join(out_dir, "item_emb.npy")
    hint = "run 01_embed_items.py first (or pass --out-dir with its output)"
    emb = load_npy(path, hint)
    if emb.ndim != 2 or emb.shape[0] < 2 or not np.issubdtype(emb.dtype, np.floating) or not np.isfinite(emb).all():
        die(f"{path} must be a finite float array [N, d] with N >= 2 (got {emb.dtype} {emb.shape}); {hint}")
    ds_path = os.path.join(out_dir, "dataset.pt")
    if os.path.exists(ds_path):
        n = len(load_pt(ds_path, hint).get("item_ids", []))
        if n != emb.shape[0]:
            die(f"{path} has {emb.shape[0]} rows but {ds_path} has {n} items; re-run 01_embed_items.py")
    return emb.astype(np.float32)


# ---------------------------------------------------------------------------------------------------
# main: train -> assign codes -> suffix -> centroids -> save
# ---------------------------------------------------------------------------------------------------
def train_rqvae(args: Args, x_all, K: int, hidden, gen):
    """The RQ-VAE loop: k-means init on the first batch, AdamW on reconstruction + quantization losses,
    dead codes re-seeded every --reseed-every steps. Returns the model and how many codes were re-seeded."""
    N, d, device = *x_all.shape, x_all.device
    model = RQVAE(d, hidden, args.latent_dim, args.levels, K).to(device)
    perm, pos = torch.randperm(N, generator=gen), 0
    model.kmeans_init(x_all[perm[:max(args.batch_size, min(N, K))].to(device)], args.kmeans_iters, gen)
    decay = [p for n, p in model.named_parameters() if n != "codebooks" and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if n == "codebooks" or p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=args.lr)

    used = torch.zeros(args.levels, K, dtype=torch.bool, device=device)        # picked since last re-seed check
    logged = torch.zeros(args.levels, K, dtype=torch.bool, device=device)      # picked since last log line
    t_log, last_log, reseeded = time.time(), 0, 0
    for step in range(1, args.steps + 1):
        if pos + args.batch_size > N and pos > 0:                              # new epoch, new order
            perm, pos = torch.randperm(N, generator=gen), 0
        idx = perm[pos:pos + args.batch_size].to(device)
        pos += args.batch_size
        x = x_all[idx]                                                          # (B, d)
        loss, recon, x_hat, codes, residuals = model(x, args.beta)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        for l in range(args.levels):
            used[l, codes[:, l]] = True
            logged[l, codes[:, l]] = True
        if args.reseed_every and step % args.reseed_every == 0 and step < args.steps:
            with torch.no_grad():                                              # dead codes <- random residuals
                for l in range(args.levels):
                    dead = (~used[l]).nonzero().squeeze(1)
                    if len(dead):
                        pick = torch.randint(len(x), (len(dead),), generator=gen).to(device)
                        model.codebooks.data[l, dead] = residuals[l].detach()[pick]
                        reseeded += len(dead)
            used.zero_()
        if step % args.log_every == 0 or step == args.steps:
            mse = F.mse_loss(x_hat.detach(), x).item()
            usage = "/".join(f"{u:.2f}" for u in logged.float().mean(1).tolist())
            ms = (time.time() - t_log) * 1000 / (step - last_log)
            print(f"step {step:5d} | loss {loss.item():.4f} (quant {loss.item() - recon.item():.4f}) | "
                  f"recon_mse {mse:.2e} | lr {args.lr:.1e} | "
                  f"{ms:.1f} ms/step | usage {usage} | re-seeded {reseeded}", flush=True)
            logged.zero_()
            t_log, last_log = time.time(), step
    return model.eval(), reseeded


def main():
    args = parse_args()
    t0 = time.time()
    seed_everything(args.seed)
    out_dir = args.out_dir or os.path.join("out", args.dataset)
    device = pick_device(args.device)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    print(f"device {device}  dtype float32  threads {torch.get_num_threads()}")
    try:
        hidden = [int(h) for h in args.hidden.split(",") if h.strip()]
    except ValueError:
        die(f"--hidden must be comma-separated ints, got {args.hidden!r}")

    emb = load_embeddings(out_dir)                                             # (N, d)
    N, d = emb.shape
    K = args.codebook_size or (64 if N <= 4096 else 256)
    x_all = torch.from_numpy(emb).to(device)
    gen = torch.Generator().manual_seed(args.seed)                             # batch order + k-means
    print(f"items {N}  d {d}  {args.quantizer}  levels {args.levels} x {K} codes  collisions {args.collisions}")

    # Quantize: train the RQ-VAE and encode every item, or residual k-means on the embeddings directly
    if args.quantizer == "rqvae":
        model, reseeded = train_rqvae(args, x_all, K, hidden, gen)
        with torch.no_grad():
            codes, z_q, residuals = residual_quantize(model.encoder(x_all), model.codebooks)  # (N, L)
            x_hat, books = model.decoder(z_q), model.codebooks.detach()
        state = {k: v.cpu() for k, v in model.state_dict().items()}
    else:
        codes, books, residuals = rq_kmeans(x_all, args.levels, K, args.kmeans_iters, gen)
        x_hat, reseeded, state = x_all - residuals[-1], 0, {}                 # x_hat = sum_l e^l_{c_l}
    err = ((x_hat - x_all) ** 2).sum()                                         # sum_i ||x_i - x_hat_i||^2
    recon_mse = (err / x_all.numel()).item()
    recon_rel_err = (err / ((x_all - x_all.mean(0)) ** 2).sum()).item()        # 1 - R^2 of the reconstruction

    # ------------------------------------------------------------------------------------------------
    # Make every SID unique (suffix level or re-assignment), report, compute centroids
    # ------------------------------------------------------------------------------------------------
    codes = codes.cpu().numpy().astype(np.int64)
    groups = {}
    for key in map(tuple, codes.tolist()):
        groups[key] = groups.get(key, 0) + 1
    collision_rate = 1.0 - len(groups) / N                                     # share of items with suffix > 0
    max_group = max(groups.values())
    usage = [float(len(np.unique(codes[:, l]))) / K for l in range(args.levels)]
    moved = {}
    if args.collisions == "suffix":
        sids = np.concatenate([codes, collision_suffix(codes)[:, None]], 1)   # (N, L+1)
        sizes = [K] * args.levels + [max_group]
    else:
        r_last, book = residuals[args.levels - 1].cpu(), books[-1].cpu()
        sids, who, dist = reassign_collisions(codes, r_last, book)            # (N, L), (M,), (N, K)
        moved = {"moved_items": len(who), "moved_share": round(len(who) / N, 6),
                 "moved_mean_dist_before": float(dist[who, codes[who, -1]].mean()) if len(who) else 0.0,
                 "moved_mean_dist_after": float(dist[who, sids[who, -1]].mean()) if len(who) else 0.0,
                 "all_mean_dist": float(dist[np.arange(N), codes[:, -1]].mean())}
        sizes = [K] * args.levels
    unique = len({tuple(r) for r in sids.tolist()})
    print(f"codebook usage per level {' / '.join(f'{u:.3f}' for u in usage)}  recon_mse {recon_mse:.3e}  "
          f"relative error {recon_rel_err:.3f}")
    print(f"collision rate {collision_rate:.4f} ({N - len(groups)} items share their {args.levels} codes; "
          f"largest group {max_group}) -> {N - unique} duplicate SIDs after the {args.collisions}")
    if moved:
        print(f"re-assigned {moved['moved_items']} items ({100 * moved['moved_share']:.1f}%) to free last-level "
              f"codes: distance to their codeword {moved['moved_mean_dist_before']:.3f} -> "
              f"{moved['moved_mean_dist_after']:.3f} (all items: {moved['all_mean_dist']:.3f})")
    cents, counts = code_centroids(sids, emb, sizes)

    # ------------------------------------------------------------------------------------------------
    # Save
    # ------------------------------------------------------------------------------------------------
    config = {"quantizer": args.quantizer, "collisions": args.collisions,
              "d": d, "levels": args.levels, "codebook_size": K, "latent_dim": args.latent_dim, "hidden": hidden,
              "beta": args.beta, "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
              "weight_decay": args.weight_decay, "kmeans_iters": args.kmeans_iters,
              "reseed_every": args.reseed_every, "seed": args.seed}
    atomic_write(os.path.join(out_dir, "sids.npy"), lambda t: np.save(open(t, "wb"), sids))
    atomic_write(os.path.join(out_dir, "centroids.pt"),
                 lambda t: torch.save({"centroids": cents, "counts": counts, "codebook_sizes": sizes}, t))
    atomic_write(os.path.join(out_dir, "rqvae.pt"), lambda t: torch.save(
        {"config": config, "state_dict": state, "codebooks": [c.cpu().clone() for c in books]}, t))
    summary = {"quantizer": args.quantizer, "collisions": args.collisions, **moved,
               "num_items": N, "unique_sids": unique, "collision_rate": round(collision_rate, 6),
               "max_collision_group": max_group, "codebook_usage": usage, "recon_mse": recon_mse,
               "recon_rel_err": recon_rel_err, "codebook_sizes": sizes, "reseeded_codes": reseeded,
               "seconds": round(time.time() - t0, 1)}
    atomic_write(os.path.join(out_dir, "02_rqvae.json"), lambda t: open(t, "w").write(json.dumps(summary, indent=2)))
    print(f"wrote {out_dir}/sids.npy {sids.shape}, centroids.pt, rqvae.pt, 02_rqvae.json in {summary['seconds']} s")


# --------------------------------------------------------------------------------------------------
# Helpers: the same text in every script that has them (tests/test_plumbing.py checks it);
# no script imports another. Below main(): Python looks names up when main() runs.
# --------------------------------------------------------------------------------------------------
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


def load_npy(path: str, hint: str) -> np.ndarray:
    return load_artifact(path, hint, lambda p: np.load(p, allow_pickle=False))


if __name__ == "__main__":
    main()
