"""Step 7: spectral and geometric diagnostics of the SID-token embedding rows.

GTI (Chen et al. 2026, collapse diagnosis: SVD spectrum, cosines, RSA against the RQ-VAE codebook)
and centroid init (Loveland et al. 2026, Thm 3.1: rows learned from random init organize by token
frequency, not semantics; neighbour purity), on each model's SID rows, per level and all together:
  spectrum    s = singular values of the centered rows X - mean(X); effective rank exp(H(p)),
              p_i = s_i / sum s (Roy & Vetterli 2007); top-1 variance share s_1^2 / sum s^2
  cosine      C = cos(row_i, row_j) in (level, code) order; mean C within a shared parent vs across
              (the parent of level-l code k: the majority level-(l-1) code of the items carrying k)
  RSA         Spearman(upper triangle of cos(rows centered per level), same of centroids/codebooks)
  popularity  freq(token) = training interactions of the items carrying it; |Spearman(freq,
              projection on PC1)|; 5-fold ridge probe R^2 for log(1 + freq), lambda by inner CV
  purity      item vector = mean of its SID rows; share of its 10 nearest items (cosine) in its
              category, vs item_emb.npy, random Gaussian SID rows and chance (null when collapsed)
  displacement (--inits) dE = rows - init rows: rms / init spread, |Spearman(freq, PC1 of dE)| vs shuffled freq

Reads  <out-dir>/dataset.pt, item_emb.npy, sids.npy, centroids.pt, rqvae.pt (01-02), model folders (03-05)
Writes <out-dir>/diagnostics.json (or --save); figures: python scripts/figures.py --diagnostics <that json>
CPU:  python 07_diagnose.py --out-dir out/ml-100k                      (seconds)
GPU:  python 07_diagnose.py --out-dir out/ml-100k --device cuda        (for the purity search)
Good run: a line per model, e.g. `random  erank 480.1  rsa_cent 0.02  pop|rho| 0.05  purity 0.31`;
mean init shows erank 1.0 (collapsed), centroid init a high rsa_cent; item_emb purity: the ceiling.
"""

import os
import time

import numpy as np
import torch

from common import Parser, die, load_json, load_npy, load_pt, pick_device, write_json

PURITY_K, PROBE_FOLDS = 10, 5   # neighbours of an item for its purity; folds of the popularity probe (and inner CV)
COLLAPSE_RTOL = 1e-3            # collapsed: ||X - mean||_F <= rtol ||X||_F; float noise: s_i <= rtol s_1


def parse_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--out-dir", default="", help="artifacts folder of 01-02; empty: out/<dataset>")
    p.add_argument("--dataset", default="ml-100k", help="only picks the default --out-dir")
    p.add_argument("--models", default="", help="comma-separated folders or names in <out-dir>/models; empty: all")
    p.add_argument("--names", default="", help="comma-separated labels for --models; empty: dirs")
    p.add_argument("--inits", default="", help="comma-separated 03/04 folders --models started from (empty: none)")
    p.add_argument("--save", default="", help="JSON to write; empty: <out-dir>/diagnostics.json")
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda", "mps"], help="the purity's kNN search")
    p.add_argument("--seed", type=int, default=0, help="seeds the random rows and the probe folds")
    return p.parse_args(argv)


# --- The diagnostics' math: spectrum, cosines, RSA, popularity probe, purity ----------------------
def spectrum(X: np.ndarray, center: bool = True, rtol: float = COLLAPSE_RTOL):
    """Singular values, effective rank exp(H(p)), p_i = s_i / sum_j s_j, top-1 share. Collapsed rows (mean init,
    even with transformers' 1e-9-covariance noise) have no direction: effective rank 1, top-1 share 1."""
    Xc = X - X.mean(0, keepdims=True) if center else X                # (n, d)
    if np.linalg.norm(Xc) <= rtol * np.linalg.norm(X):
        return {"effective_rank": 1.0, "top1_var_share": 1.0, "collapsed": True, "singular_values": []}
    s = np.linalg.svd(Xc, compute_uv=False)                            # (min(n, d),)
    s = s[s > rtol * s[0]]                                             # the rest is float noise
    p = s / s.sum()                                                    # p_i = s_i / sum s
    return {"effective_rank": float(np.exp(-(p * np.log(p)).sum())),  # exp(H(p))
            "top1_var_share": float(s[0] ** 2 / (s ** 2).sum()), "collapsed": False, "singular_values": s.tolist()}


def cosine_matrix(X: np.ndarray) -> np.ndarray:
    Xn = X / np.maximum(np.linalg.norm(X, axis=1, keepdims=True), 1e-12)
    return Xn @ Xn.T                                                   # (n, n)


def pair_means(C: np.ndarray, groups: np.ndarray):
    """Mean off-diagonal C over pairs in the same group and over pairs in different groups."""
    same = groups[:, None] == groups[None, :]
    w, a = C[same & ~np.eye(len(C), dtype=bool)], C[~same]
    return (float(w.mean()) if w.size else None), (float(a.mean()) if a.size else None)


def rankdata(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties get the average of the ranks they span (scipy.stats.rankdata 'average')."""
    _, inv, count = np.unique(x, return_inverse=True, return_counts=True)
    return (np.cumsum(count) - (count - 1) / 2.0)[inv]                # last rank - (ties - 1) / 2


def spearman(a, b):
    """Spearman rho = Pearson correlation of the (average-tie) ranks; None when undefined."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if len(a) < 3:
        return None
    ra, rb = rankdata(a) - (len(a) + 1) / 2, rankdata(b) - (len(b) + 1) / 2
    den = np.sqrt((ra ** 2).sum() * (rb ** 2).sum())
    return float((ra * rb).sum() / den) if den > 0 else None


def rsa(A: np.ndarray, B: np.ndarray, groups=None):
    """RSA: Spearman between the upper triangles of cos(A - mean A) and cos(B - mean B), rows the
    same tokens. Centering (per level with `groups`) drops an offset, e.g. centroid init's shift."""
    groups = np.zeros(len(A), int) if groups is None else groups
    u, inv = np.unique(groups, return_inverse=True)
    center = lambda X: X - np.stack([X[groups == g].mean(0) for g in u])[inv]   # minus level mean
    iu = np.triu_indices(len(A), 1)
    return spearman(cosine_matrix(center(A))[iu], cosine_matrix(center(B))[iu])


def ridge_predict(Xtr, ytr, Xte, lambdas):
    """Ridge y ~ X w + b on standardized (Xtr, ytr): predictions on Xte per lambda, dual form as
    d > n: K = X X^T = U diag(e) U^T, alpha = U diag(1 / (e + lam n)) U^T y, w = X^T alpha."""
    mu, ym = Xtr.mean(0), ytr.mean()
    sc = np.sqrt(((Xtr - mu) ** 2).sum(1).mean() / Xtr.shape[1]) + 1e-12
    A, B = (Xtr - mu) / sc, (Xte - mu) / sc
    e, U = np.linalg.eigh(A @ A.T)                                      # (n_tr,), (n_tr, n_tr)
    Uy, KteU = U.T @ (ytr - ym), (B @ A.T) @ U                          # (n_tr,), (n_te, n_tr)
    return np.stack([KteU @ (Uy / (np.clip(e, 0, None) + lam * len(ytr))) + ym for lam in lambdas])


def ridge_probe_r2(X, y, folds=PROBE_FOLDS, seed=0, lambdas=(1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1e3, 1e4)):
    """Out-of-fold R^2 = 1 - SS_res / SS_tot of a ridge probe, lambda (x n_train) by an inner k-fold on each
    training part only. None when n < 2 * folds or y is constant."""
    n = len(y)
    if n < 2 * folds or np.ptp(y) == 0:
        return None
    perm, pred = np.random.default_rng(seed).permutation(n), np.empty(n)
    split = lambda idx, f: (idx[f::folds], np.concatenate([idx[g::folds] for g in range(folds) if g != f]))
    for f in range(folds):
        te, tr = split(perm, f)
        err = np.zeros(len(lambdas))
        for g in range(folds):                                          # inner CV on the train part
            ite, itr = split(tr, g)
            err += ((ridge_predict(X[itr], y[itr], X[ite], lambdas) - y[ite]) ** 2).sum(1)
        pred[te] = ridge_predict(X[tr], y[tr], X[te], [lambdas[int(err.argmin())]])[0]
    return float(1 - ((y - pred) ** 2).sum() / ((y - y.mean()) ** 2).sum())


def knn_purity(V: np.ndarray, labels: np.ndarray, k=PURITY_K, chunk=2048, device="cpu") -> float:
    """Mean over items of the share of their k nearest other items (cosine) with the same label."""
    Vn = V / np.maximum(np.linalg.norm(V, axis=1, keepdims=True), 1e-12)
    Vn, lab, hits = torch.from_numpy(Vn).float().to(device), torch.from_numpy(labels).to(device), []
    for s in range(0, len(Vn), chunk):
        S = Vn[s:s + chunk] @ Vn.T                                      # (chunk, N)
        r = torch.arange(len(S), device=S.device)
        S[r, r + s] = -float("inf")                                     # not its own neighbour
        nn = S.topk(k, dim=1).indices                                   # (chunk, k)
        hits.append((lab[nn] == lab[s:s + chunk, None]).float().mean(1))
    return float(torch.cat(hits).mean())


def displacement(E0, E1, freq, seed=0, perms=1000, rtol=COLLAPSE_RTOL):
    """dE = E1 - E0 (n, d); rms = sqrt(mean_i |dE_i|^2), spread = sqrt(mean_i |E0_i - mean E0|^2) (the init's), ratio
    = rms / spread; rho = Spearman(freq, dE - mean dE on its PC1) vs `perms` shuffles of freq. Thm 3.1 (centroid
    paper): a row's gradient gains a term ~ its token frequency. Not moved or a shift: pc1_*, perm_* null."""
    n, dE = len(E0), E1 - E0
    rms, spread, norm0 = (float(np.sqrt((Y ** 2).sum(1).mean())) for Y in (dE, E0 - E0.mean(0), E0))
    flat = spread <= rtol * norm0                                       # mean init: no spread to compare with
    out = {"n": n, "rms": rms, "spread": spread, "ratio": None if flat else rms / spread,
           "moved": bool(rms > rtol * (norm0 if flat else spread)),
           **dict.fromkeys(["pc1_freq_spearman", "pc1_freq_abs_spearman", "perm_p", "perm_q95"])}
    Dc, proj = dE - dE.mean(0), np.zeros(n)
    if not out["moved"] or np.linalg.norm(Dc) <= rtol * np.linalg.norm(dE):
        return out, proj                                                # -> (results, PC1 coordinates (n,))
    proj = Dc @ np.linalg.svd(Dc, full_matrices=False)[2][0]           # on dE's top direction (n,)
    if (rho := spearman(freq, proj)) is not None:                       # shuffling freq shuffles its ranks
        rf, rp, g = rankdata(freq) - (n + 1) / 2, rankdata(proj) - (n + 1) / 2, np.random.default_rng(seed)
        null = np.abs(np.stack([g.permutation(rf) for _ in range(perms)]) @ rp) / np.sqrt((rf @ rf) * (rp @ rp))
        out.update(pc1_freq_spearman=rho, pc1_freq_abs_spearman=abs(rho), perm_q95=float(np.quantile(null, 0.95)),
                   perm_p=float(((null >= abs(rho) - 1e-12).sum() + 1) / (perms + 1)))
    return out, proj


# --- Data: 01-02's artifacts, the model folders' SID rows -----------------------------------------
def load_step_artifacts(out: str):
    """Loading: dataset.pt, item_emb.npy and {sids, pop, category, centroids, codebooks}."""
    ds = load_pt(os.path.join(out, "dataset.pt"), "run 01_embed_items.py and 02_rqvae.py first")
    sids = load_npy(os.path.join(out, "sids.npy"), "run 02_rqvae.py first")
    item_emb = load_npy(os.path.join(out, "item_emb.npy"), "run 01_embed_items.py first")
    cents, rq = (load_pt(os.path.join(out, f), "run 02_rqvae.py first") for f in ("centroids.pt", "rqvae.pt"))
    try:
        data = {"sids": sids, "pop": ds["popularity"].numpy().astype(np.float64), "category": ds["category"].numpy(),
                "centroids": [c.float().numpy() for c in cents["centroids"]],
                "codebooks": [c.float().numpy() for c in rq["codebooks"]]}
    except (KeyError, AttributeError, TypeError) as e:
        die(f"{out}: dataset.pt / centroids.pt / rqvae.pt lack field {e}; rerun 01 and 02")
    if sids.ndim != 2 or sids.dtype.kind not in "iu" or item_emb.ndim != 2:
        die(f"{out}: sids.npy must be an int array [N, L+1] and item_emb.npy [N, d]; rerun 01, 02")
    sizes = {len(sids), len(item_emb), len(data["category"]), len(data["pop"])}
    if len(sizes) > 1 or len(data["centroids"]) != sids.shape[1]:
        die(f"{out}: dataset.pt, item_emb.npy, sids.npy, centroids.pt disagree in size; rerun 01")
    levels = sids.shape[1] - (rq.get("config", {}).get("collisions", "suffix") == "suffix")
    if len(data["codebooks"]) != levels:                               # codes before a suffix
        die(f"{out}/rqvae.pt has {len(data['codebooks'])} codebooks for {levels} levels; rerun 02")
    return ds, item_emb, data


def load_embedding(folder: str) -> np.ndarray:
    """The input-embedding matrix (V, d) as float32, read from safetensors without the model."""
    from safetensors import safe_open
    for path in [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".safetensors")]:
        try:
            with safe_open(path, framework="pt") as f:
                if keys := [k for k in f.keys() if "embed_tokens" in k]:
                    return f.get_tensor(keys[0]).float().numpy()
        except Exception as e:                                    # truncated or not safetensors
            die(f"{path} is unreadable ({type(e).__name__}); rebuild {folder} with its step")
    die(f"no embed_tokens weight in {folder}/*.safetensors; is it a 03/04/05 model folder?")


def load_model_rows(folder: str, sids: np.ndarray):
    """sid_vocab.json (checked against sids.npy), its ids remapped to rows of E[ids] (n_tokens, d), vocab stats"""
    path = os.path.join(folder, "sid_vocab.json")
    voc = load_json(path, "give a folder written by 03_expand_vocab.py (or fix --models)")
    try:
        tok = [np.asarray(t, dtype=np.int64) for t in voc["token_ids"]]
        item_tok = np.asarray(voc["item_token_ids"], dtype=np.int64)    # (N, L+1)
    except (KeyError, TypeError, ValueError) as e:
        die(f"{path} lacks what 03_expand_vocab.py writes ({type(e).__name__}: {e}); rerun 03")
    fits = item_tok.shape == sids.shape and len(tok) == sids.shape[1] and all(
        sids[:, l].max() < len(t) for l, t in enumerate(tok))
    if not fits or not np.array_equal(np.stack([t[sids[:, l]] for l, t in enumerate(tok)], 1), item_tok):
        die(f"{path} does not match sids.npy (different SIDs); rerun 03_expand_vocab.py after 02")
    E = load_embedding(folder)                                         # (V, d) float32
    if item_tok.max() >= len(E):
        die(f"{folder}: SID token id {item_tok.max()} >= embedding rows {len(E)}; inconsistent")
    ids = np.unique(np.concatenate([t[t >= 0] for t in tok]))          # SID token ids, sorted
    other = E[np.random.default_rng(0).permutation(np.setdiff1d(np.arange(len(E)), ids))[:4000]].astype(np.float64)
    vocab = {"vocab_row_norm": float(np.linalg.norm(other, axis=1).mean()),
             "vocab_spread": float(np.sqrt(((other - other.mean(0)) ** 2).sum(1).mean()))}
    remap = lambda t: np.where(t >= 0, np.searchsorted(ids, t), -1)   # token id -> row of E[ids]
    return voc, [remap(t) for t in tok], remap(item_tok), E[ids].astype(np.float64), vocab


# --- Diagnose one model's SID rows, per level and all together ------------------------------------
def measure_rows(X, f, cent, book, seed, parent=None, lev=None):
    """Spectrum, norms, cosines, RSA, popularity of rows X (n, d), token frequencies f -> (results, s, PC1 proj)"""
    sp, C = spectrum(X), cosine_matrix(X)
    out = {"n": len(X), **{k: v for k, v in sp.items() if k != "singular_values"},
           "effective_rank_uncentered": spectrum(X, center=False)["effective_rank"],
           "row_norm": float(np.linalg.norm(X, axis=1).mean()),
           "spread": float(np.sqrt(((X - X.mean(0)) ** 2).sum(1).mean())),  # RMS distance to mean
           "mean_cos": float(C[~np.eye(len(C), dtype=bool)].mean()) if len(C) > 1 else None,
           "rsa_centroids": rsa(X, cent, lev),
           "rsa_codebook": None if book is None else rsa(X[:len(book)], book, None if lev is None else lev[:len(book)])}
    if parent is not None:
        out["cos_within_parent"], out["cos_across_parent"] = pair_means(C, parent)
    Xc, proj = X - X.mean(0), np.zeros(len(X))
    out["pop_spearman_abs"] = out["pop_probe_r2"] = None
    if len(X) >= 3 and not sp["collapsed"]:
        proj = Xc @ np.linalg.svd(Xc, full_matrices=False)[2][0]       # on the top direction (n,)
        out["pop_spearman_abs"] = abs(rho) if (rho := spearman(f, proj)) is not None else None
        out["pop_probe_r2"] = ridge_probe_r2(X, np.log1p(f), seed=seed)
    return out, sp["singular_values"], proj


def diagnose(E, tok, item_tok, vocab, data, seed: int, init=None):
    """E: the model's SID rows (n_tokens, d), tok / item_tok index into E; init: (folder, its E) or None"""
    sids, pop, cents, books = data["sids"], data["pop"], data["centroids"], data["codebooks"]
    codes = [np.flatnonzero(t >= 0) for t in tok]                      # used codes per level
    rows = [E[tok[l][c]] for l, c in enumerate(codes)]                 # (K_l, d)
    freq = [np.bincount(sids[:, l], weights=pop, minlength=len(tok[l]))[c] for l, c in enumerate(codes)]
    per_level = {}
    for l, c in enumerate(codes):
        up = [np.bincount(sids[sids[:, l] == k, l - 1]) for k in c] if l > 0 else None  # level-(l-1) codes of k's items
        parent = None if up is None else np.array([n.argmax() for n in up])            # k's parent: the majority
        book = books[l][c].astype(np.float64) if l < len(books) else None
        out, _, _ = measure_rows(rows[l], freq[l], cents[l][c].astype(np.float64), book, seed, parent)
        if l > 0:
            out["parent_share"] = float(np.mean([n.max() / n.sum() for n in up]))     # how well "majority" fits
        per_level[data["names"][l]] = out
    X, f, lev = (np.concatenate(z) for z in (rows, freq, [np.full(len(r), l) for l, r in enumerate(rows)]))
    book = np.concatenate([books[l][codes[l]] for l in range(len(books))]).astype(np.float64)
    cent = np.concatenate([cents[l][c] for l, c in enumerate(codes)]).astype(np.float64)
    allb, s, proj = measure_rows(X, f, cent, book, seed, lev=lev)
    allb["cos_within_level"], allb["cos_across_level"] = pair_means(cosine_matrix(X), lev)
    purity = None if allb["collapsed"] else knn_purity(E[item_tok].mean(1), data["category"], device=data["device"])
    res = {"levels": {**per_level, "all": allb}, "purity": purity, **vocab, "d_model": int(E.shape[1]),
           "spread_ratio_vocab_over_sid": None if allb["collapsed"] else vocab["vocab_spread"] / allb["spread"]}
    fig = {"s": s, "proj": proj, "freq": f, "level": lev, "X": X}
    if init is not None:                                                # the same tokens' rows at init
        X0 = np.concatenate([init[1][tok[l][c]] for l, c in enumerate(codes)])
        dis = {data["names"][l]: displacement(X0[lev == l], rows[l], freq[l], seed)[0] for l in range(len(rows))}
        dis["all"], fig["dproj"] = displacement(X0, X, f, seed)
        res["displacement"] = {"init_path": init[0], "levels": dis}
    return res, fig


# --- main: artifacts -> the models to diagnose -> references -> each model -> save ----------------
def main():
    a, t0 = parse_args(), time.time()
    out = a.out_dir or os.path.join("out", a.dataset)
    ds, item_emb, data = load_step_artifacts(out)
    sids, cat, root = data["sids"], data["category"], os.path.join(out, "models")
    where = lambda m: m if os.path.isdir(m) or os.sep in m else os.path.join(root, m)   # a folder or a name
    if a.models:
        folders = [where(m) for m in a.models.split(",")]
    else:                                                              # every <out>/models/* with sid_vocab.json
        mine = sorted(os.listdir(root)) if os.path.isdir(root) else []
        folders = [os.path.join(root, m) for m in mine if os.path.exists(os.path.join(root, m, "sid_vocab.json"))]
        if not folders:
            die(f"no model folder with sid_vocab.json under {root}; run 03_expand_vocab.py first")
    if PURITY_K >= len(sids):
        die(f"purity needs more than {PURITY_K} items (its neighbours); {out} has {len(sids)}")
    labels = a.names.split(",") if a.names else [os.path.basename(os.path.normpath(f)) for f in folders]
    if len(labels) != len(folders) or len(set(labels)) != len(labels):
        die(f"--names must give {len(folders)} distinct labels, one per model (got {labels})")
    inits = a.inits.split(",") if a.inits else [""] * len(folders)
    if len(inits) != len(folders):
        die(f"--inits names {len(inits)} folder(s) for {len(folders)} model(s); give one per model (empty: none)")
    loaded = [(f, *load_model_rows(f, sids)) for f in folders]    # validate all before any work
    starts = [i and (where(i), *load_model_rows(where(i), sids)) for i in inits]   # as `loaded`, or ""
    for (f, voc, _, _, E, _), st in zip(loaded, starts):
        if st and (st[1]["token_ids"] != voc["token_ids"] or st[4].shape != E.shape):
            die(f"--inits {st[0]} has other SID tokens or row widths than {f}; give the folder it started from")
    names = data["names"] = loaded[0][1].get("level_names") or [chr(97 + l) for l in range(sids.shape[1])]
    rand_rows = np.random.default_rng(a.seed).standard_normal(loaded[0][4].shape)  # reference: a row per token
    dev = data["device"] = pick_device(a.device)
    reference = {"k": PURITY_K, "purity_item_emb": knn_purity(item_emb, cat, device=dev),
                 "purity_random_sid_rows": knn_purity(rand_rows[loaded[0][3]].mean(1), cat, device=dev),
                 "purity_chance": float(((np.bincount(cat)[cat] - 1) / (len(cat) - 1)).mean())}
    print(f"purity@{PURITY_K}: item_emb {reference['purity_item_emb']:.3f}  random SID rows "
          f"{reference['purity_random_sid_rows']:.3f}  chance {reference['purity_chance']:.3f}")
    results, f3 = {}, lambda v, f="5.2f": "  n/a" if v is None else format(v, f)
    for name, (folder, voc, tok, item_tok, E, vocab), st in zip(labels, loaded, starts):
        res, _ = diagnose(E, tok, item_tok, vocab, data, a.seed, (st[0], st[4]) if st else None)
        results[name], al = {"path": folder, "init": voc.get("init"), **res}, res["levels"]["all"]
        dv = st and res["displacement"]["levels"]["all"]
        print(f"{name:<22} erank {al['effective_rank']:6.1f}  top1 {al['top1_var_share']:.2f}  mean_cos "
              f"{f3(al['mean_cos'])}  rsa_cent {f3(al['rsa_centroids'])}  rsa_book {f3(al['rsa_codebook'])}  "
              f"pop|rho| {f3(al['pop_spearman_abs'])}  probe_r2 {f3(al['pop_probe_r2'])}  purity {f3(res['purity'])}"
              + ("" if not st else "  not moved" if not dv["moved"] else f"  moved rms/spread {f3(dv['ratio'])}  "
                 f"PC1(dE)~freq |rho| {f3(dv['pc1_freq_abs_spearman'])} (p {f3(dv['perm_p'], '.3f')})"))
    save = a.save or os.path.join(out, "diagnostics.json")
    os.makedirs(os.path.dirname(os.path.abspath(save)), exist_ok=True)
    summary = {"out_dir": out, "dataset": ds.get("dataset"), "num_items": int(len(sids)), "level_names": names,
               "reference": reference, "models": results, "seconds": round(time.time() - t0, 2)}
    write_json(save, summary)
    print(f"wrote {save} in {summary['seconds']:.1f}s")


if __name__ == "__main__":
    main()
