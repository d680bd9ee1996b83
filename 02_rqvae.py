"""Step 2: Semantic IDs - residual quantization of the item embeddings, unique SIDs, code centroids.

Paper step: TIGER's Semantic-ID tokenizer (Rajput et al. 2023, sec. 3.1, Fig. 3), both papers;
centroid_{l,k} below is what centroid init (Loveland et al. 2026, Alg. 1) builds 03's new rows from.

    z = enc(x)                          MLP encoder: item text embedding x (d) -> latent (D)
    r_0 = z;  c_l = argmin_k ||r_l - e^l_k||;  r_{l+1} = r_l - e^l_{c_l}     l = 0..L-1   (eq. 1)
    z_q = sum_l e^l_{c_l};  x_hat = dec(z + sg[z_q - z])                 straight-through estimator
    loss = ||x - x_hat||^2 + sum_l ( ||sg[r_l] - e^l_{c_l}||^2 + beta ||r_l - sg[e^l_{c_l}]||^2 )
    codebooks: k-means on the first batch; codes unused for --reseed-every steps <- residuals (ours, not TIGER's)
    suffix:    SID = (c_0, ..., c_{L-1}, s), s = 0, 1, ... numbers the items sharing c_0..c_{L-1}
    centroids: centroid_{l,k} = mean of x_i over the items with code k at level l, l = 0..L
    --quantizer rqkmeans (the centroid paper's SIDs): eq. 1 on x itself with k-means codebooks
    --collisions reassign (LC-Rec's idea, greedy): L codes; all but the nearest of colliding items take free codes

Reads:  <out-dir>/item_emb.npy (01); dataset.pt only to check the item count (docs/artifacts.md).
Writes: <out-dir>/sids.npy (int64 [N, L+1]), centroids.pt, rqvae.pt, 02_rqvae.json
CPU:  python 02_rqvae.py --out-dir out/ml-100k
GPU:  python 02_rqvae.py --out-dir out/amazon-beauty --device cuda --batch-size 2048 --steps 5000
Good run (ml-100k): "step 1500 | loss 0.64 ... | usage 1.00/1.00/1.00", "collision rate 0.0202 ... -> 0 duplicate SIDs"
"""

import os
import time

import numpy as np
import torch
import torch.nn as nn

from common import (Parser, atomic_write, die, load_npy, load_pt, nonneg_int, pick_device,
                    pos_float, pos_int, seed_everything, write_json)


def parse_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--dataset", default="ml-100k", help="only picks the default --out-dir")
    p.add_argument("--out-dir", default="", help="01's output folder; empty: out/<dataset>")
    p.add_argument("--quantizer", default="rqvae", choices=["rqvae", "rqkmeans"], help="TIGER's | residual k-means")
    p.add_argument("--collisions", default="suffix", choices=["suffix", "reassign"], help="TIGER's | LC-Rec (L codes)")
    p.add_argument("--levels", type=pos_int, default=3, help="L, levels (the suffix adds one)")
    p.add_argument("--codebook-size", type=nonneg_int, default=0, help="K per level (0: 64 if N <= 4096, else 256)")
    p.add_argument("--latent-dim", type=pos_int, default=32, help="D, width of the RQ-VAE latent")
    p.add_argument("--hidden", default="256,128", help="encoder MLP widths (decoder: reversed)")
    p.add_argument("--steps", type=pos_int, default=1500, help="optimizer steps")
    p.add_argument("--batch-size", type=pos_int, default=512, help="items per step (the first seeds the k-means)")
    p.add_argument("--lr", type=pos_float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=1e-4, help="AdamW weight decay of the MLP weights")
    p.add_argument("--beta", type=float, default=0.25, help="commitment weight")
    p.add_argument("--kmeans-iters", type=nonneg_int, default=25, help="Lloyd iterations of each level's k-means")
    p.add_argument("--reseed-every", type=nonneg_int, default=100, help="re-seed codes unused this long (0 = never)")
    p.add_argument("--log-every", type=pos_int, default=250, help="steps between log lines")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"], help="auto: cuda, mps, cpu")
    p.add_argument("--seed", type=int, default=0, help="seeds random, numpy and torch")
    return p.parse_args(argv)


# --- The paper step: residual quantization (TIGER eq. 1), residual k-means, the RQ-VAE ----------
def residual_quantize(z, codebooks):
    """Eq. 1. z (B, D), codebooks (L, K, D) -> codes (B, L), z_q (B, D), [r_0..r_L]; sg[e] in r."""
    r, codes, z_q, residuals = z, [], torch.zeros_like(z), [z]
    for cb in codebooks:                                                   # cb (K, D)
        c = torch.cdist(r.detach(), cb.detach()).argmin(1)                 # c_l (B,)
        e = cb[c]                                                          # e^l_{c_l}  (B, D)
        z_q = z_q + e                                                      # z_q = sum_l e^l_{c_l}
        r = r - e.detach()                                                 # r_{l+1} = r_l - e
        codes.append(c)
        residuals.append(r)
    return torch.stack(codes, 1), z_q, residuals


def kmeans(x, k: int, iters: int, gen: torch.Generator):
    """k-means++ seeding + Lloyd iterations. x (n, D) -> centers (k, D), assignment (n,)."""
    n = x.shape[0]
    first = torch.randint(n, (1,), generator=gen, device="cpu").item()
    centers = [x[first]]
    d2 = ((x - x[first]) ** 2).sum(-1)                                     # (n,) to nearest center
    for _ in range(1, k):
        p = d2.double().cpu() if d2.sum() > 0 else torch.ones(n, dtype=torch.float64)  # n < k
        i = torch.multinomial(p / p.sum(), 1, generator=gen).item()        # D^2 sampling
        centers.append(x[i])
        d2 = torch.minimum(d2, ((x - x[i]) ** 2).sum(-1))
    centers = torch.stack(centers)                                         # (k, D)
    for _ in range(iters):
        assign = torch.cdist(x, centers).argmin(1)                         # (n,)
        sums = torch.zeros_like(centers).index_add_(0, assign, x)          # (k, D)
        counts = torch.bincount(assign, minlength=k).unsqueeze(1)          # (k, 1)
        centers = torch.where(counts > 0, sums / counts.clamp(min=1), centers)  # empty: kept
    return centers, torch.cdist(x, centers).argmin(1)


def rq_kmeans(x, levels: int, k: int, iters: int, gen: torch.Generator):
    """Residual k-means, level by level. x (N, d) -> codes (N, L), codebooks (L, K, d), [r_0..]"""
    r, codes, books, residuals = x, [], [], [x]
    for _ in range(levels):
        centers, assign = kmeans(r, k, iters, gen)                         # c_l
        r = r - centers[assign]                                            # r_{l+1} = r_l - e_{c_l}
        codes.append(assign)
        books.append(centers)
        residuals.append(r)
    return torch.stack(codes, 1), torch.stack(books), residuals


class RQVAE(nn.Module):
    def __init__(self, d: int, hidden, latent: int, levels: int, k: int):
        super().__init__()
        pairs = lambda w: [m for a, b in zip(w, w[1:]) for m in (nn.Linear(a, b), nn.SiLU())]
        self.encoder = nn.Sequential(*pairs([d, *hidden, latent])[:-1])   # no output activation
        self.decoder = nn.Sequential(*pairs([latent, *reversed(hidden), d])[:-1])
        self.codebooks = nn.Parameter(torch.zeros(levels, k, latent))       # e^l_k  (L, K, D)

    def forward(self, x, beta: float):
        z = self.encoder(x)                                                # (B, D)
        codes, z_q, residuals = residual_quantize(z, self.codebooks)
        x_hat = self.decoder(z + (z_q - z).detach())                       # straight-through
        recon = ((x - x_hat) ** 2).sum(-1).mean()                          # ||x - x_hat||^2
        quant = 0.0
        for l in range(self.codebooks.shape[0]):
            e, r = self.codebooks[l][codes[:, l]], residuals[l]            # (B, D) each
            quant = quant + ((r.detach() - e) ** 2).sum(-1).mean()         # ||sg[r_l] - e||^2
            quant = quant + beta * ((r - e.detach()) ** 2).sum(-1).mean()  # beta ||r_l - sg[e]||^2
        return recon + quant, recon, x_hat, codes, residuals


# --- Unique SIDs: TIGER's collision suffix, or re-assignment (--collisions reassign); centroids ---
def collision_suffix(codes: np.ndarray) -> np.ndarray:
    """TIGER's extra level: s_i = #earlier items with the same codes. (N, L) -> (N,)"""
    suffix, seen = np.zeros(len(codes), np.int64), {}
    for i, key in enumerate(map(tuple, codes.tolist())):
        suffix[i] = seen.get(key, 0)
        seen[key] = suffix[i] + 1
    return suffix


def reassign_collisions(codes: np.ndarray, r_last, codebook):
    """Of the items sharing all L codes the nearest (||r - e_k||) keeps its code, the others take the codes free
    under their prefix, closest pair first. codes (N, L), r_last (N, D), codebook (K, D) -> codes, moved, dist"""
    codes, K = codes.copy(), codebook.shape[0]
    dist = torch.cdist(r_last.float(), codebook.float()).numpy()           # (N, K)
    by_prefix, moved = {}, []
    for i, key in enumerate(map(tuple, codes[:, :-1].tolist())):
        by_prefix.setdefault(key, []).append(i)
    for prefix, items in by_prefix.items():                                # no collision: no movers
        if len(items) > K:
            die(f"{len(items)} items share the prefix {prefix} but the last level has {K} codes; "
                "use --collisions suffix or a larger --codebook-size")
        keep = {}                                                          # code -> nearest item
        for i in sorted(items, key=lambda i: dist[i, codes[i, -1]]):       # stable: ties keep order
            keep.setdefault(codes[i, -1], i)
        movers = [i for i in items if keep[codes[i, -1]] != i]
        free = [c for c in range(K) if c not in keep]
        while movers:
            sub = dist[np.ix_(movers, free)]                               # (movers, free codes)
            a, b = np.unravel_index(sub.argmin(), sub.shape)
            codes[movers[a], -1] = free.pop(b)
            moved.append(movers.pop(a))
    return codes, np.array(sorted(moved), dtype=np.int64), dist


def code_centroids(sids: np.ndarray, emb: np.ndarray, sizes):
    """centroid_{l,k} = mean of x_i over the items with sids[i, l] == k -> [K_l, d], [K_l] per l"""
    x, cents, counts = torch.from_numpy(emb), [], []
    for l, k in enumerate(sizes):
        c = torch.from_numpy(sids[:, l])
        n = torch.bincount(c, minlength=k)                                 # (K_l,)
        s = torch.zeros(k, x.shape[1]).index_add_(0, c, x)                 # (K_l, d)
        cents.append(s / n.clamp(min=1).unsqueeze(1).float())              # zero rows: unused codes
        counts.append(n)
    return cents, counts


# --- Data: 01's output, checked before anything is written --------------------------------------
def load_embeddings(out_dir: str) -> np.ndarray:
    path, ds_path = os.path.join(out_dir, "item_emb.npy"), os.path.join(out_dir, "dataset.pt")
    hint = "run 01_embed_items.py first (or pass --out-dir with its output)"
    emb = load_npy(path, hint)
    if emb.ndim != 2 or emb.shape[0] < 2 or not np.issubdtype(emb.dtype, np.floating) or not np.isfinite(emb).all():
        die(f"{path} must be a finite float array [N, d] with N >= 2 (got {emb.dtype} {emb.shape}); {hint}")
    n = len(load_pt(ds_path, hint).get("item_ids", [])) if os.path.exists(ds_path) else len(emb)
    if n != emb.shape[0]:
        die(f"{path} has {emb.shape[0]} rows but {ds_path} has {n} items; re-run 01_embed_items.py")
    return emb.astype(np.float32)


# --- The loop: k-means init, AdamW, dead codes re-seeded ----------------------------------------
def train_rqvae(args, x_all, K: int, hidden, gen):
    """-> codes (N, L), codebooks, [r_0..r_L], x_hat (N, d) of every item, #re-seeded codes, state_dict"""
    N, d, device = *x_all.shape, x_all.device
    model = RQVAE(d, hidden, args.latent_dim, args.levels, K).to(device)
    perm, pos = torch.randperm(N, generator=gen), 0
    first = perm[:max(args.batch_size, min(N, K))].to(device)             # >= K items if N allows
    with torch.no_grad():                                                  # e^l = residual k-means of enc(x)
        model.codebooks.data[:] = rq_kmeans(model.encoder(x_all[first]), args.levels, K, args.kmeans_iters, gen)[1]
    decay = [p for n, p in model.named_parameters() if n != "codebooks" and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if n == "codebooks" or p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=args.lr)
    used = logged = torch.zeros(args.levels, K, dtype=torch.bool, device=device)  # rebound below
    t_log, last_log, reseeded = time.time(), 0, 0
    for step in range(1, args.steps + 1):
        if pos + args.batch_size > N and pos > 0:                           # new epoch, new order
            perm, pos = torch.randperm(N, generator=gen), 0
        x = x_all[perm[pos:pos + args.batch_size].to(device)]               # (B, d)
        pos += args.batch_size
        loss, recon, x_hat, codes, residuals = model(x, args.beta)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        hit = nn.functional.one_hot(codes, K).any(0)                        # (L, K)
        used, logged = used | hit, logged | hit                   # picked since the re-seed / log
        if args.reseed_every and step % args.reseed_every == 0 and step < args.steps:
            for l in range(args.levels):                                    # dead <- residuals
                dead = (~used[l]).nonzero().squeeze(1)
                pick = torch.randint(len(x), (len(dead),), generator=gen).to(device)
                model.codebooks.data[l, dead] = residuals[l].detach()[pick]
                reseeded += len(dead)
            used.zero_()
        if step % args.log_every == 0 or step == args.steps:
            mse = nn.functional.mse_loss(x_hat.detach(), x).item()
            usage = "/".join(f"{u:.2f}" for u in logged.float().mean(1).tolist())
            ms, quant = (time.time() - t_log) * 1000 / (step - last_log), loss.item() - recon.item()
            print(f"step {step:5d} | loss {loss.item():.4f} (quant {quant:.4f}) | recon_mse {mse:.2e} | "
                  f"lr {args.lr:.1e} | {ms:.1f} ms/step | usage {usage} | re-seeded {reseeded}", flush=True)
            logged.zero_()
            t_log, last_log = time.time(), step
    with torch.no_grad():                                                  # encode every item
        codes, z_q, residuals = residual_quantize(model.eval().encoder(x_all), model.codebooks)
        x_hat, books = model.decoder(z_q), model.codebooks.detach()
    return codes, books, residuals, x_hat, reseeded, {k: v.cpu() for k, v in model.state_dict().items()}


# --- main: embeddings -> codes -> unique SIDs -> centroids -> save --------------------------------
def main():
    args = parse_args()
    t0 = time.time()
    seed_everything(args.seed)
    out_dir = args.out_dir or os.path.join("out", args.dataset)
    device = pick_device(args.device)
    torch.set_num_threads(1)                                              # this small MLP: fastest on one thread
    print(f"device {device}  dtype float32  threads {torch.get_num_threads()}")
    try:
        hidden = [int(h) for h in args.hidden.split(",") if h.strip()]
    except ValueError:
        die(f"--hidden must be comma-separated ints, got {args.hidden!r}")
    emb = load_embeddings(out_dir)                                         # (N, d)
    N, d = emb.shape
    K = args.codebook_size or (64 if N <= 4096 else 256)                 # TIGER: K = 256
    x_all = torch.from_numpy(emb).to(device)
    gen = torch.Generator().manual_seed(args.seed)                         # batch order + k-means
    print(f"items {N}  d {d}  {args.quantizer}  levels {args.levels} x {K} codes  collisions {args.collisions}")
    if args.quantizer == "rqvae":
        codes, books, residuals, x_hat, reseeded, state = train_rqvae(args, x_all, K, hidden, gen)
    else:
        codes, books, residuals = rq_kmeans(x_all, args.levels, K, args.kmeans_iters, gen)
        x_hat, reseeded, state = x_all - residuals[-1], 0, {}              # x_hat = sum_l e^l_{c_l}
    err = ((x_hat - x_all) ** 2).sum()                                     # sum ||x - x_hat||^2
    recon = {"recon_mse": (err / x_all.numel()).item(),
             "recon_rel_err": (err / ((x_all - x_all.mean(0)) ** 2).sum()).item()}  # 1 - R^2
    L, codes = args.levels, codes.cpu().numpy().astype(np.int64)       # -> SIDs: suffix (N, L+1) | reassign (N, L)
    group_sizes = np.unique(codes, axis=0, return_counts=True)[1]         # items per L-code tuple
    n_groups, max_group = len(group_sizes), int(group_sizes.max())
    collision_rate = 1.0 - n_groups / N                                    # share with suffix > 0
    usage = [float(len(np.unique(codes[:, l]))) / K for l in range(L)]
    moved, sizes = {}, [K] * L + ([max_group] if args.collisions == "suffix" else [])
    if args.collisions == "suffix":
        sids = np.concatenate([codes, collision_suffix(codes)[:, None]], 1)   # (N, L+1)
    else:
        sids, who, dist = reassign_collisions(codes, residuals[L - 1].cpu(), books[-1].cpu())
        mean_dist = lambda c: float(dist[who, c].mean()) if len(who) else 0.0
        moved = {"moved_items": len(who), "moved_share": round(len(who) / N, 6),
                 "moved_mean_dist_before": mean_dist(codes[who, -1]), "moved_mean_dist_after": mean_dist(sids[who, -1]),
                 "all_mean_dist": float(dist[np.arange(N), codes[:, -1]].mean())}
    unique = len({tuple(r) for r in sids.tolist()})
    print(f"codebook usage per level {' / '.join(f'{u:.3f}' for u in usage)}  "
          f"recon_mse {recon['recon_mse']:.3e}  relative error {recon['recon_rel_err']:.3f}")
    print(f"collision rate {collision_rate:.4f} ({N - n_groups} items share their {L} codes; "
          f"largest group {max_group}) -> {N - unique} duplicate SIDs after the {args.collisions}")
    if moved:
        print(f"re-assigned {moved['moved_items']} items ({100 * moved['moved_share']:.1f}%) to free last-level "
              f"codes: distance to their codeword {moved['moved_mean_dist_before']:.3f} -> "
              f"{moved['moved_mean_dist_after']:.3f} (all items: {moved['all_mean_dist']:.3f})")
    cents, counts = code_centroids(sids, emb, sizes)
    config = {"quantizer": args.quantizer, "collisions": args.collisions, "d": d, "levels": args.levels,
              "codebook_size": K, "latent_dim": args.latent_dim, "hidden": hidden, "beta": args.beta,
              "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "weight_decay": args.weight_decay,
              "kmeans_iters": args.kmeans_iters, "reseed_every": args.reseed_every, "seed": args.seed}
    atomic_write(os.path.join(out_dir, "sids.npy"), lambda t: np.save(open(t, "wb"), sids))
    atomic_write(os.path.join(out_dir, "centroids.pt"), lambda t: torch.save(
        {"centroids": cents, "counts": counts, "codebook_sizes": sizes}, t))
    atomic_write(os.path.join(out_dir, "rqvae.pt"), lambda t: torch.save(
        {"config": config, "state_dict": state, "codebooks": [c.cpu().clone() for c in books]}, t))
    summary = {"quantizer": args.quantizer, "collisions": args.collisions, **moved, "num_items": N,
               "unique_sids": unique, "collision_rate": round(collision_rate, 6), "max_collision_group": max_group,
               "codebook_usage": usage, **recon, "codebook_sizes": sizes, "reseeded_codes": reseeded,
               "seconds": round(time.time() - t0, 1)}
    write_json(os.path.join(out_dir, "02_rqvae.json"), summary)
    print(f"wrote {out_dir}/sids.npy {sids.shape}, centroids.pt, rqvae.pt, 02_rqvae.json in {summary['seconds']} s")


if __name__ == "__main__":
    main()
