"""Step 7: spectral and geometric diagnostics of the SID-token embedding rows.

Papers: GTI (Chen et al. 2026, collapse diagnosis: SVD spectrum, cosine matrices, RSA against the RQ-VAE
codebook) and centroid init (Loveland et al. 2026, Thm 3.1: rows learned from random init organize by token
frequency, not semantics; semantic purity of nearest neighbours). For the SID rows of the input embedding of
each model folder, per level and for all levels together:
  spectrum     s = singular values of the centered rows X - mean(X); effective rank exp(H(p)), p_i = s_i / sum s
               (Roy & Vetterli 2007); share of variance in the top component s_1^2 / sum s^2.
  cosine       C = cos(row_i, row_j) ordered by (level, code); mean C within a shared parent vs across, where
               the parent of level-l code k is the majority level-(l-1) code of the items carrying k.
  RSA          Spearman(upper triangle of cos(rows centered per level), same of centroids.pt / RQ-VAE codebooks).
  popularity   freq(token) = training interactions of the items carrying it; |Spearman(freq, projection on PC1)|
               and a 5-fold ridge probe R^2 for log(1 + freq) (lambda chosen by an inner 5-fold CV on each
               training part).
  purity       item vector = mean of its SID rows; share of its 10 nearest items (cosine) with its category,
               against the same on item_emb.npy, on random Gaussian SID rows, and chance (null when the rows
               are collapsed: every neighbour is then a tie).

Reads  <out-dir>/dataset.pt, item_emb.npy, sids.npy, centroids.pt, rqvae.pt (steps 01-02), and model folders
       (default: every <out-dir>/models/* holding sid_vocab.json, from steps 03-05).
Writes <out-dir>/diagnostics.json (or --save) and beside it <stem>_spectra.png, <stem>_cosine.png,
       <stem>_popularity.png.

CPU:  python 07_diagnose.py --out-dir out/ml-100k                      (seconds)
GPU:  not needed; the same command (only embedding rows are read, via safetensors).
Good run: one line per model, e.g. `random   erank 480.1  rsa_cent 0.02  pop|rho| 0.05  purity 0.31`; mean init
shows erank 1.0 (collapsed), centroid init a high rsa_cent; item_emb purity is the semantic ceiling.
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


@dataclass
class Args:
    out_dir: str = ""
    """artifacts folder of steps 01-02 (default: out/<dataset>)"""
    dataset: str = "ml-100k"
    """dataset name, only used for the default --out-dir"""
    models: str = ""
    """comma-separated model folders (or names under <out-dir>/models); default: all with sid_vocab.json"""
    names: str = ""
    """comma-separated labels for --models (default: each folder's name)"""
    save: str = ""
    """diagnostics JSON path (default: <out-dir>/diagnostics.json); figures go beside it"""
    k: Annotated[int, ">= 1"] = 10
    """neighbours for semantic purity"""
    folds: Annotated[int, ">= 1"] = 5
    """cross-validation folds of the popularity probe"""
    rtol: float = 1e-3
    """rows whose centered norm is <= rtol of their norm are collapsed (effective rank 1); singular values
    <= rtol * the largest are dropped as float noise"""
    heatmap_max: Annotated[int, ">= 1"] = 1024
    """at most this many tokens per cosine heatmap (evenly subsampled per level beyond it)"""
    figures: bool = True
    """write the PNG figures"""
    device: Literal["auto", "cpu", "cuda", "mps"] = "cpu"
    """for the nearest-neighbour search of the purity (the rest is small numpy math)"""
    seed: int = 0
    """seeds the random-row purity reference and the probe folds"""


# ---------------------------------------------------------------------------------------------------
# The diagnostics' math (numpy, float64; every matrix here is at most a few thousand rows)
# ---------------------------------------------------------------------------------------------------
def spectrum(X: np.ndarray, center: bool = True, rtol: float = 1e-3):
    """Singular values, effective rank exp(H(p)) with p_i = s_i / sum_j s_j (Roy & Vetterli 2007), top-1 share.

    Collapse: when the centered rows keep at most rtol of the rows' norm (||X - mean||_F <= rtol ||X||_F; mean
    init, also with transformers' 1e-9-covariance noise) the spread has no direction; we define the effective
    rank as 1 (exp of the entropy of a point mass; the rank of n identical rows before centering), the top-1
    share as 1, and flag `collapsed`. Otherwise singular values <= rtol * s_1 are float noise and dropped.
    Centering n orthonormal rows leaves rank n - 1."""
    Xc = X - X.mean(0, keepdims=True) if center else X                # (n, d)
    if np.linalg.norm(Xc) <= rtol * np.linalg.norm(X):
        return {"effective_rank": 1.0, "top1_var_share": 1.0, "collapsed": True, "singular_values": []}
    s = np.linalg.svd(Xc, compute_uv=False)                            # (min(n, d),)
    s = s[s > rtol * s[0]]
    p = s / s.sum()                                                    # p_i = s_i / sum s
    return {"effective_rank": float(np.exp(-(p * np.log(p)).sum())),  # exp(H(p))
            "top1_var_share": float(s[0] ** 2 / (s ** 2).sum()), "collapsed": False,
            "singular_values": s.tolist()}


def rankdata(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties get the average of the ranks they span (as scipy.stats.rankdata 'average')."""
    order = np.argsort(x, kind="stable")
    xs = x[order]
    start = np.r_[True, xs[1:] != xs[:-1]]                             # first element of each tie group
    group = np.cumsum(start) - 1
    first = np.flatnonzero(start)
    last = np.r_[first[1:], len(x)] - 1
    r = np.empty(len(x))
    r[order] = (first[group] + last[group]) / 2.0 + 1.0                # average rank of the group
    return r


def spearman(a, b):
    """Spearman rho = Pearson correlation of the (average-tie) ranks; None when undefined."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if len(a) < 3:
        return None
    ra, rb = rankdata(a) - (len(a) + 1) / 2, rankdata(b) - (len(b) + 1) / 2
    den = np.sqrt((ra ** 2).sum() * (rb ** 2).sum())
    return float((ra * rb).sum() / den) if den > 0 else None


def cosine_matrix(X: np.ndarray) -> np.ndarray:
    Xn = X / np.maximum(np.linalg.norm(X, axis=1, keepdims=True), 1e-12)
    return Xn @ Xn.T                                                   # (n, n)


def rsa(A: np.ndarray, B: np.ndarray, groups=None):
    """Representational similarity: Spearman between the upper triangles of cos(A - mean A) and cos(B - mean B).
    Rows of A and B are the same tokens. Centering removes a shared offset (e.g. the mean shift of centroid
    init), which says nothing about which tokens are alike; with `groups` (the level of each row) each level
    is centered on its own, so per-level offsets do not count either."""
    groups = np.zeros(len(A), int) if groups is None else groups
    def center(X):
        u, inv = np.unique(groups, return_inverse=True)
        return X - np.stack([X[groups == g].mean(0) for g in u])[inv]      # minus its level's mean
    iu = np.triu_indices(len(A), 1)
    return spearman(cosine_matrix(center(A))[iu], cosine_matrix(center(B))[iu])


def ridge_predict(Xtr, ytr, Xte, lambdas):
    """Ridge y ~ X w + b fitted on (Xtr, ytr), predictions on Xte for every lambda: (len(lambdas), n_te).

    Features are centered and scaled to unit mean variance on the training rows; dual (kernel) form, because
    SID rows have d > n: K = X X^T = U diag(e) U^T, alpha = U diag(1 / (e + lam n)) U^T y, w = X^T alpha."""
    mu, ym = Xtr.mean(0), ytr.mean()
    sc = np.sqrt(((Xtr - mu) ** 2).sum(1).mean() / Xtr.shape[1]) + 1e-12
    A, B = (Xtr - mu) / sc, (Xte - mu) / sc
    e, U = np.linalg.eigh(A @ A.T)                                      # (n_tr,), (n_tr, n_tr)
    Uy, KteU = U.T @ (ytr - ym), (B @ A.T) @ U                          # (n_tr,), (n_te, n_tr)
    return np.stack([KteU @ (Uy / (np.clip(e, 0, None) + lam * len(ytr))) + ym for lam in lambdas])


def ridge_probe_r2(X: np.ndarray, y: np.ndarray, folds: int = 5, seed: int = 0,
                   lambdas=(1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1e3, 1e4)):
    """Out-of-fold R^2 = 1 - SS_res / SS_tot of a linear ridge probe, k-fold; lambda (times n_train) is chosen
    by an inner k-fold on each training part only. None when n < 2 * folds or y is constant."""
    n = len(y)
    if n < 2 * folds or np.ptp(y) == 0:
        return None
    perm = np.random.default_rng(seed).permutation(n)
    pred = np.empty(n)
    for f in range(folds):
        te, tr = perm[f::folds], np.concatenate([perm[g::folds] for g in range(folds) if g != f])
        err = np.zeros(len(lambdas))
        for g in range(folds):                                          # inner CV on the training part
            ite, itr = tr[g::folds], np.concatenate([tr[h::folds] for h in range(folds) if h != g])
            err += ((ridge_predict(X[itr], y[itr], X[ite], lambdas) - y[ite]) ** 2).sum(1)
        pred[te] = ridge_predict(X[tr], y[tr], X[te], [lambdas[int(err.argmin())]])[0]
    return float(1 - ((y - pred) ** 2).sum() / ((y - y.mean()) ** 2).sum())


def knn_purity(V: np.ndarray, labels: np.ndarray, k: int = 10, chunk: int = 2048, device="cpu") -> float:
    """Mean over items of the share of their k nearest other items (cosine) that carry the same label."""
    Vn = torch.from_numpy(V / np.maximum(np.linalg.norm(V, axis=1, keepdims=True), 1e-12)).float().to(device)
    lab = torch.from_numpy(labels).to(device)
    hits = []
    for s in range(0, len(Vn), chunk):
        S = Vn[s:s + chunk] @ Vn.T                                      # (chunk, N)
        r = torch.arange(len(S), device=S.device)
        S[r, r + s] = -float("inf")                                     # not its own neighbour
        nn = S.topk(k, dim=1).indices                                   # (chunk, k)
        hits.append((lab[nn] == lab[s:s + chunk, None]).float().mean(1))
    return float(torch.cat(hits).mean())


def majority_parent(sids: np.ndarray, level: int, codes: np.ndarray):
    """Parent of code k at `level` = most frequent level-1 code among the items carrying k; also its share."""
    parent, share = np.zeros(len(codes), int), np.zeros(len(codes))
    for j, k in enumerate(codes):
        c = np.bincount(sids[sids[:, level] == k, level - 1])
        parent[j], share[j] = c.argmax(), c.max() / c.sum()
    return parent, share


def pair_means(C: np.ndarray, groups: np.ndarray):
    """Mean off-diagonal C over pairs in the same group and over pairs in different groups."""
    same = groups[:, None] == groups[None, :]
    off = ~np.eye(len(C), dtype=bool)
    w, a = C[same & off], C[~same]
    return (float(w.mean()) if w.size else None), (float(a.mean()) if a.size else None)


# ---------------------------------------------------------------------------------------------------
# Data: 01/02 artifacts, each model's sid_vocab.json and embedding rows
# ---------------------------------------------------------------------------------------------------
def load_embedding(folder: str) -> np.ndarray:
    """The input-embedding matrix (V, d) as float32, read from safetensors without building the model."""
    from safetensors import safe_open
    files = [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".safetensors")]
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                keys = [k for k in f.keys() if "embed_tokens" in k]
                if keys:
                    return f.get_tensor(keys[0]).float().numpy()
        except Exception as e:                                          # truncated or not safetensors
            die(f"{path} is unreadable ({type(e).__name__}); rebuild {folder} with the step that made it")
    try:                                                                # other layouts: build the model
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        return m.get_input_embeddings().weight.detach().float().numpy()
    except Exception as e:
        die(f"cannot read the input embedding of {folder} ({type(e).__name__}); is it a 03/04/05 model folder?")


def load_model_rows(folder: str, sids: np.ndarray):
    path = os.path.join(folder, "sid_vocab.json")
    if not os.path.isdir(folder):
        die(f"model folder {folder} does not exist; run 03_expand_vocab.py first or fix --models")
    if not os.path.exists(path):
        die(f"{folder} has no SID tokens ({path} missing); give a folder written by 03_expand_vocab.py")
    voc = load_json(path, "rerun 03_expand_vocab.py")
    try:
        tok = [np.asarray(t, dtype=np.int64) for t in voc["token_ids"]]
        item_tok = np.asarray(voc["item_token_ids"], dtype=np.int64)    # (N, L+1)
    except (KeyError, TypeError, ValueError) as e:
        die(f"{path} lacks what 03_expand_vocab.py writes ({type(e).__name__}: {e}); rerun 03_expand_vocab.py")
    if item_tok.shape != sids.shape or len(tok) != sids.shape[1]:
        die(f"{path} has {item_tok.shape} item tokens but sids.npy is {sids.shape}; rerun 03_expand_vocab.py after 02")
    expect = np.stack([tok[l][sids[:, l]] for l in range(sids.shape[1])], 1) if all(
        sids[:, l].max() < len(tok[l]) for l in range(len(tok))) else None
    if expect is None or not np.array_equal(expect, item_tok):
        die(f"{path} does not match sids.npy (different SIDs); rerun 03_expand_vocab.py after 02_rqvae.py")
    E = load_embedding(folder)                                         # (V, d) float32
    if item_tok.max() >= len(E):
        die(f"{folder}: SID token id {item_tok.max()} >= embedding rows {len(E)}; the folder is inconsistent")
    ids = np.unique(np.concatenate([t[t >= 0] for t in tok]))          # SID token ids, sorted
    other = np.setdiff1d(np.arange(len(E)), ids)                       # the pretrained (old) rows
    other = E[np.random.default_rng(0).permutation(other)[:4000]].astype(np.float64)
    vocab = {"vocab_row_norm": float(np.linalg.norm(other, axis=1).mean()),
             "vocab_spread": float(np.sqrt(((other - other.mean(0)) ** 2).sum(1).mean()))}
    remap = lambda t: np.where(t >= 0, np.searchsorted(ids, t), -1)   # token id -> row of `rows`
    return voc, [remap(t) for t in tok], remap(item_tok), E[ids].astype(np.float64), vocab


# ---------------------------------------------------------------------------------------------------
# Diagnose one model
# ---------------------------------------------------------------------------------------------------
def diagnose(E, tok, item_tok, vocab, data, a: Args):
    """E: the model's SID rows (n_tokens, d); tok / item_tok index into E. Returns (results, figure data)."""
    sids, pop, cents, books = data["sids"], data["pop"], data["centroids"], data["codebooks"]
    L1 = sids.shape[1]
    codes = [np.flatnonzero(t >= 0) for t in tok]                      # used codes per level
    rows = [E[tok[l][codes[l]]] for l in range(L1)]                    # (K_l, d)
    freq = [np.bincount(sids[:, l], weights=pop, minlength=len(tok[l]))[codes[l]] for l in range(L1)]

    def block(X, f, cent, book, parent=None, lev=None):
        sp = spectrum(X, rtol=a.rtol)
        C = cosine_matrix(X)
        out = {"n": len(X), **{k: v for k, v in sp.items() if k != "singular_values"},
               "effective_rank_uncentered": spectrum(X, center=False, rtol=a.rtol)["effective_rank"],
               "row_norm": float(np.linalg.norm(X, axis=1).mean()),
               "spread": float(np.sqrt(((X - X.mean(0)) ** 2).sum(1).mean())),  # RMS distance to the mean
               "mean_cos": float(C[~np.eye(len(C), dtype=bool)].mean()) if len(C) > 1 else None,
               "rsa_centroids": rsa(X, cent, lev),
               "rsa_codebook": rsa(X[:len(book)], book, None if lev is None else lev[:len(book)]) if book is not None else None}
        if parent is not None:
            out["cos_within_parent"], out["cos_across_parent"] = pair_means(C, parent)
        Xc = X - X.mean(0)
        if len(X) >= 3 and not sp["collapsed"]:
            pc1 = np.linalg.svd(Xc, full_matrices=False)[2][0]         # top principal direction (d,)
            proj = Xc @ pc1
            rho = spearman(f, proj)
            out["pop_spearman_abs"] = abs(rho) if rho is not None else None
            out["pop_probe_r2"] = ridge_probe_r2(X, np.log1p(f), a.folds, a.seed)
        else:
            proj, out["pop_spearman_abs"], out["pop_probe_r2"] = np.zeros(len(X)), None, None
        return out, sp["singular_values"], proj

    per_level = {}
    for l in range(L1):
        parent = None
        if l > 0:
            parent, share = majority_parent(sids, l, codes[l])
        out, _, _ = block(rows[l], freq[l], cents[l][codes[l]].astype(np.float64),
                          books[l][codes[l]].astype(np.float64) if l < len(books) else None, parent)
        if l > 0:
            out["parent_share"] = float(share.mean())                   # how well "majority parent" fits
        per_level[data["names"][l]] = out
    X, f = np.concatenate(rows), np.concatenate(freq)
    lev = np.concatenate([np.full(len(r), l) for l, r in enumerate(rows)])
    book = np.concatenate([books[l][codes[l]] for l in range(len(books))]).astype(np.float64)
    allb, s, proj = block(X, f, np.concatenate([cents[l][codes[l]] for l in range(L1)]).astype(np.float64), book,
                          lev=lev)
    allb["cos_within_level"], allb["cos_across_level"] = pair_means(cosine_matrix(X), lev)
    per_level["all"] = allb
    V = E[item_tok].mean(1)                                            # item = mean of its SID rows (N, d)
    purity = None if allb["collapsed"] else knn_purity(V, data["category"], a.k, device=data["device"])  # no ties
    res = {"levels": per_level, "purity": purity, **vocab, "d_model": int(E.shape[1])}
    res["spread_ratio_vocab_over_sid"] = None if allb["collapsed"] else res["vocab_spread"] / allb["spread"]
    return res, {"s": s, "proj": proj, "freq": f, "level": lev, "X": X}


# ---------------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------------
def figures(stem: str, results: dict, raw: dict, names: list, heatmap_max: int):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models, paths = list(raw), {}
    fig, ax = plt.subplots(figsize=(6, 4))                             # spectra overlaid
    for m in models:
        s = np.asarray(raw[m]["s"])
        ax.semilogy(np.arange(1, len(s) + 1), s / max(s.sum(), 1e-30), label=f"{m} (erank "
                    f"{results[m]['levels']['all']['effective_rank']:.1f}{', collapsed' if not len(s) else ''})")
    ax.set(xlabel="component", ylabel="s_i / sum s", title="SID rows, centered: singular value spectrum")
    ax.legend(fontsize=7)
    paths["spectra"] = _save(fig, f"{stem}_spectra.png")
    nc = min(4, len(models))
    nr = (len(models) + nc - 1) // nc
    fig, axes = plt.subplots(2 * nr, nc, figsize=(3.2 * nc, 6.4 * nr), squeeze=False)
    for i, m in enumerate(models):                                     # cosine heatmaps: raw, then centered
        lev, X = raw[m]["level"], raw[m]["X"]
        idx = np.arange(len(lev))
        if len(idx) > heatmap_max:                                     # even subsample, keeps level order
            idx = np.round(np.linspace(0, len(lev) - 1, heatmap_max)).astype(int)
        Xc = X - np.stack([X[lev == l].mean(0) for l in np.unique(lev)])[np.searchsorted(np.unique(lev), lev)]
        for row, (Y, what) in enumerate([(X, "raw"), (Xc, "centered per level")]):
            ax = axes[row * nr + i // nc, i % nc]
            C = cosine_matrix(Y[idx])
            ax.imshow(C, vmin=-1, vmax=1, cmap="RdBu_r", interpolation="nearest")
            for b in np.flatnonzero(np.diff(lev[idx])) + 0.5:
                ax.axhline(b, color="k", lw=0.4)
                ax.axvline(b, color="k", lw=0.4)
            ax.set_title(f"{m} ({what})\nmean off-diag cos {C[~np.eye(len(C), dtype=bool)].mean():.2f}", fontsize=8)
            ax.set_xticks([])
            ax.set_yticks([])
    for i in range(len(models), nr * nc):
        axes[i // nc, i % nc].axis("off")
        axes[nr + i // nc, i % nc].axis("off")
    fig.suptitle(f"SID-row cosine, (level, code) order\ntop: raw; bottom: minus level mean", fontsize=8)
    paths["cosine"] = _save(fig, f"{stem}_cosine.png")
    fig, axes = plt.subplots(nr, nc, figsize=(3.2 * nc, 3 * nr), squeeze=False)
    for ax, m in zip(axes.flat, models):                               # popularity scatter
        r, fr = raw[m], np.log1p(raw[m]["freq"])
        sign = -1.0 if np.dot(fr - fr.mean(), r["proj"]) < 0 else 1.0   # PC1's sign is arbitrary
        for l in np.unique(r["level"]):
            k = r["level"] == l
            ax.scatter(fr[k], sign * r["proj"][k], s=4, label=names[l])
        rho = results[m]["levels"]["all"]["pop_spearman_abs"]
        ax.set_title(f"{m}: |rho| {rho if rho is None else round(rho, 2)}", fontsize=8)
        ax.set_xlabel("log(1 + token freq)", fontsize=7)
        ax.set_ylabel("projection on PC1", fontsize=7)
    for ax in list(axes.flat)[len(models):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6, markerscale=2)
    paths["popularity"] = _save(fig, f"{stem}_popularity.png")
    return paths


def _save(fig, path):
    fig.tight_layout()
    atomic_write(path, lambda t: fig.savefig(t, dpi=110, format="png"))
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------
def main():
    a = parse_args()
    if a.folds < 2:
        die(f"--folds {a.folds}: the popularity probe needs >= 2 folds")
    t0 = time.time()
    seed_everything(a.seed)
    out = a.out_dir or os.path.join("out", a.dataset)
    hint = "run 01_embed_items.py and 02_rqvae.py first"
    ds = load_pt(os.path.join(out, "dataset.pt"), hint)
    sids = load_npy(os.path.join(out, "sids.npy"), "run 02_rqvae.py first")
    item_emb = load_npy(os.path.join(out, "item_emb.npy"), "run 01_embed_items.py first")
    cents = load_pt(os.path.join(out, "centroids.pt"), "run 02_rqvae.py first")
    rq = load_pt(os.path.join(out, "rqvae.pt"), "run 02_rqvae.py first")
    try:
        cat, pop = ds["category"].numpy(), ds["popularity"].numpy().astype(np.float64)
        data = {"sids": sids, "pop": pop, "category": cat,
                "centroids": [c.float().numpy() for c in cents["centroids"]],
                "codebooks": [c.float().numpy() for c in rq["codebooks"]]}
    except (KeyError, AttributeError, TypeError) as e:
        die(f"{out}: dataset.pt / centroids.pt / rqvae.pt lack field {e}; rerun 01 and 02")
    if sids.ndim != 2 or sids.dtype.kind not in "iu" or item_emb.ndim != 2:
        die(f"{out}: sids.npy must be an int array [N, L+1] and item_emb.npy [N, d]; rerun 01 and 02")
    if not (len(sids) == len(item_emb) == len(cat) == len(pop)) or len(data["centroids"]) != sids.shape[1]:
        die(f"{out}: dataset.pt, item_emb.npy, sids.npy, centroids.pt disagree in size; rerun 01 and 02")
    levels = sids.shape[1] - (rq.get("config", {}).get("collisions", "suffix") == "suffix")   # codes before a suffix
    if len(data["codebooks"]) != levels:
        die(f"{out}/rqvae.pt has {len(data['codebooks'])} codebooks for {levels} levels; rerun 02")

    if a.models:
        folders = [m if os.path.isdir(m) or os.sep in m else os.path.join(out, "models", m) for m in a.models.split(",")]
    else:
        root = os.path.join(out, "models")
        folders = sorted(os.path.join(root, m) for m in (os.listdir(root) if os.path.isdir(root) else [])
                         if os.path.exists(os.path.join(root, m, "sid_vocab.json")))
        if not folders:
            die(f"no model folder with sid_vocab.json under {root}; run 03_expand_vocab.py first")
    if a.k >= len(sids):
        die(f"--k {a.k}: purity needs fewer neighbours than the {len(sids)} items")
    labels = a.names.split(",") if a.names else [os.path.basename(os.path.normpath(f)) for f in folders]
    if len(labels) != len(folders) or len(set(labels)) != len(labels):
        die(f"--names must give {len(folders)} distinct labels, one per model (got {labels}); folder names clash")
    loaded = [(f, *load_model_rows(f, sids)) for f in folders]         # validate all before any work
    names = loaded[0][1].get("level_names") or [chr(97 + l) for l in range(sids.shape[1])]
    data["names"] = names

    # --- references that do not depend on a model
    g = np.random.default_rng(a.seed)
    rand_rows = g.standard_normal(loaded[0][4].shape)                  # one Gaussian row per SID token
    chance = np.bincount(cat)[cat]
    dev = data["device"] = pick_device(a.device)
    reference = {"k": a.k, "purity_item_emb": knn_purity(item_emb, cat, a.k, device=dev),
                 "purity_random_sid_rows": knn_purity(rand_rows[loaded[0][3]].mean(1), cat, a.k, device=dev),
                 "purity_chance": float(((chance - 1) / (len(cat) - 1)).mean())}
    print(f"purity@{a.k}: item_emb {reference['purity_item_emb']:.3f}  random SID rows "
          f"{reference['purity_random_sid_rows']:.3f}  chance {reference['purity_chance']:.3f}")

    results, raw = {}, {}
    for name, (folder, voc, tok, item_tok, E, vocab) in zip(labels, loaded):
        res, raw[name] = diagnose(E, tok, item_tok, vocab, data, a)
        results[name] = {"path": folder, "init": voc.get("init"), **res}
        al = res["levels"]["all"]
        f3 = lambda v: "  n/a" if v is None else f"{v:5.2f}"
        print(f"{name:<22} erank {al['effective_rank']:6.1f}  top1 {al['top1_var_share']:.2f}  "
              f"mean_cos {f3(al['mean_cos'])}  rsa_cent {f3(al['rsa_centroids'])}  rsa_book {f3(al['rsa_codebook'])}  "
              f"pop|rho| {f3(al['pop_spearman_abs'])}  probe_r2 {f3(al['pop_probe_r2'])}  purity {f3(res['purity'])}")

    save = a.save or os.path.join(out, "diagnostics.json")
    os.makedirs(os.path.dirname(os.path.abspath(save)), exist_ok=True)
    stem = os.path.splitext(save)[0]
    figs = figures(stem, results, raw, names, a.heatmap_max) if a.figures else {}
    summary = {"out_dir": out, "dataset": ds.get("dataset"), "num_items": int(len(sids)), "level_names": names,
               "reference": reference, "models": results, "figures": figs, "seconds": round(time.time() - t0, 2)}
    atomic_write(save, lambda t: open(t, "w").write(json.dumps(summary, indent=2)))
    print(f"wrote {save} and {len(figs)} figures in {summary['seconds']:.1f}s")


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


def load_json(path: str, hint: str):
    return load_artifact(path, hint, lambda p: json.loads(open(p, encoding="utf-8").read()))


if __name__ == "__main__":
    main()
