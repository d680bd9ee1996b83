"""Figures of the SID rows: the README's spectra figure, and the three figures of a 07 diagnostics JSON.

    make figures     (= 04 on models/mean if mean+gti is missing, then this script)
    python scripts/figures.py --out-dir out/ml-100k --save results/ml-100k_spectra.png
    python scripts/figures.py --diagnostics out/ml-100k/diagnostics.json     (after 07_diagnose.py)

The first reads <out-dir>/sids.npy and the model folders' SID rows with 07_diagnose.py's own loader and
spectrum (common.load_step) and writes one PNG. The second reads the JSON 07 wrote (its out_dir, models
and level names), gets each model's SID rows again with 07's loader and `diagnose`, and writes beside it
<stem>_spectra.png (the spectra overlaid), <stem>_cosine.png (cosine heatmaps in (level, code) order, raw
and centered per level, one column per model) and <stem>_popularity.png (log token frequency against the
projection on PC1); where 07 had --inits, <stem>_displacement.png (token frequency against the coordinate on
PC1 of dE = rows - init rows). Centered rows; p_i = s_i / sum s; erank = exp(H(p)).
"""
import os
import sys

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from common import Parser, atomic_write, die, load_json, load_npy, load_step  # noqa: E402

diag = load_step("07_diagnose")
HEATMAP_MAX = 1024      # tokens per cosine heatmap at most (evenly subsampled beyond it)


def readme_spectra(a):
    """The README's figure: spectra of --models' SID rows (centered) in one panel."""
    sids = load_npy(os.path.join(a.out_dir, "sids.npy"), "run 02_rqvae.py (or make run) first")
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for name in a.models.split(","):
        rows = diag.load_model_rows(os.path.join(a.out_dir, "models", name), sids)[3]  # (S, d)
        sp = diag.spectrum(rows)
        s = np.asarray(sp["singular_values"]) if not sp["collapsed"] else np.ones(1)
        label = f"{name} (erank {sp['effective_rank']:.1f}" + (", collapsed)" if sp["collapsed"] else ")")
        ax.plot(np.arange(1, len(s) + 1), s / s.sum(), marker="o" if len(s) == 1 else None, label=label)
    ax.set(yscale="log", xlabel="component", ylabel="s_i / sum s",
           title=f"SID rows ({len(rows)} tokens), centered: singular-value spectrum")
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(a.save, lambda t: fig.savefig(t, dpi=110, format="png"))
    print(f"wrote {a.save}")


def diagnostics_figures(path):
    """07's figures beside its JSON: the spectra overlaid, then panels per model (cosine, popularity)."""
    d = load_json(path, "write it with 07_diagnose.py first")
    try:
        out, names, models = d["out_dir"], d["level_names"], {m: r["path"] for m, r in d["models"].items()}
    except (KeyError, TypeError) as e:
        die(f"{path} lacks what 07_diagnose.py writes ({type(e).__name__}: {e}); rerun 07")
    _, _, data = diag.load_step_artifacts(out)
    data["names"], data["device"] = names, "cpu"
    results, raw = {}, {}
    for m, folder in models.items():                                    # the rows, as 07 measured them
        _, tok, item_tok, E, vocab = diag.load_model_rows(folder, data["sids"])
        init = d["models"][m].get("displacement", {}).get("init_path")   # rows at init, as 07 read them
        init = init and (init, diag.load_model_rows(init, data["sids"])[3])
        results[m], raw[m] = diag.diagnose(E, tok, item_tok, vocab, data, 0, init or None)
    stem = os.path.splitext(path)[0]
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in raw:
        s, erank = np.asarray(raw[m]["s"]), results[m]["levels"]["all"]["effective_rank"]
        ax.semilogy(np.arange(1, len(s) + 1), s / max(s.sum(), 1e-30),
                    label=f"{m} (erank {erank:.1f}{', collapsed' if not len(s) else ''})")
    ax.set(xlabel="component", ylabel="s_i / sum s",
           title="SID rows, centered: singular value spectrum")
    ax.legend(fontsize=7)
    nc = min(4, len(raw))
    nr = (len(raw) + nc - 1) // nc                                     # rows of panels
    figs = [save(fig, f"{stem}_spectra.png"), plot_cosine(f"{stem}_cosine.png", raw, nr, nc),
            plot_popularity(f"{stem}_popularity.png", results, raw, names, nc)]
    if any("dproj" in r for r in raw.values()):
        figs.append(plot_displacement(f"{stem}_displacement.png", results, raw, names))
    print(f"wrote {', '.join(figs)}")


def plot_cosine(path, raw, nr, nc):
    fig, axes = plt.subplots(2 * nr, nc, figsize=(3.2 * nc, 6.4 * nr), squeeze=False)
    for i, m in enumerate(raw):                                   # raw, then centered per level
        lev, X = raw[m]["level"], raw[m]["X"]
        idx = np.arange(len(lev))
        if len(idx) > HEATMAP_MAX:                                     # even subsample, level order
            idx = np.round(np.linspace(0, len(lev) - 1, HEATMAP_MAX)).astype(int)
        u = np.unique(lev)
        Xc = X - np.stack([X[lev == l].mean(0) for l in u])[np.searchsorted(u, lev)]
        for row, (Y, what) in enumerate([(X, "raw"), (Xc, "centered per level")]):
            ax, C = axes[row * nr + i // nc, i % nc], diag.cosine_matrix(Y[idx])
            ax.imshow(C, vmin=-1, vmax=1, cmap="RdBu_r", interpolation="nearest")
            for b in np.flatnonzero(np.diff(lev[idx])) + 0.5:
                ax.axhline(b, color="k", lw=0.4)
                ax.axvline(b, color="k", lw=0.4)
            off = C[~np.eye(len(C), dtype=bool)].mean()
            ax.set_title(f"{m} ({what})\nmean off-diag cos {off:.2f}", fontsize=8)
            ax.set(xticks=[], yticks=[])
    for i in range(len(raw), nr * nc):
        axes[i // nc, i % nc].axis("off")
        axes[nr + i // nc, i % nc].axis("off")
    fig.suptitle("SID-row cosine, (level, code) order\ntop: raw; bottom: minus level mean",
                 fontsize=8)
    return save(fig, path)


def level_scatter(path, models, names, level, x, y, title, xlabel, ylabel, nc, log_x=False):
    """One panel per model: x(m) against y(m), one colour per SID level, the title title(m); unused panels off."""
    nr = (len(models) + nc - 1) // nc
    fig, axes = plt.subplots(nr, nc, figsize=(3.2 * nc, 3 * nr), squeeze=False)
    for ax, m in zip(axes.flat, models):
        for l in np.unique(level(m)):
            k = level(m) == l
            ax.scatter(x(m)[k], y(m)[k], s=4, label=names[l])
        if log_x:
            ax.set_xscale("log")
        ax.set_title(title(m), fontsize=8)
        ax.set_xlabel(xlabel, fontsize=7)
        ax.set_ylabel(ylabel, fontsize=7)
    for ax in list(axes.flat)[len(models):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6, markerscale=2)
    return save(fig, path)


def plot_popularity(path, results, raw, names, nc):
    """log(1 + token freq) against the rows' coordinate on their PC1 (PC1's sign is arbitrary: rho >= 0 shown)."""
    fr = {m: np.log1p(raw[m]["freq"]) for m in raw}
    sign = {m: -1.0 if np.dot(fr[m] - fr[m].mean(), raw[m]["proj"]) < 0 else 1.0 for m in raw}
    rho = lambda m: results[m]["levels"]["all"]["pop_spearman_abs"]  # noqa: E731
    return level_scatter(path, list(raw), names, lambda m: raw[m]["level"], fr.get, lambda m: sign[m] * raw[m]["proj"],
                         lambda m: f"{m}: |rho| {rho(m) if rho(m) is None else round(rho(m), 2)}",
                         "log(1 + token freq)", "projection on PC1", nc)


def plot_displacement(path, results, raw, names):
    """Per model with an init: 1 + token freq (log) against the coordinate on PC1 of dE (sign: rho >= 0)."""
    ms = [m for m in raw if "dproj" in raw[m]]
    dv = {m: results[m]["displacement"]["levels"]["all"] for m in ms}
    f2 = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    sign = {m: -1.0 if (dv[m]["pc1_freq_spearman"] or 0) < 0 else 1.0 for m in ms}
    return level_scatter(path, ms, names, lambda m: raw[m]["level"], lambda m: 1 + raw[m]["freq"],
                         lambda m: sign[m] * raw[m]["dproj"],
                         lambda m: f"{m}: |rho| {f2(dv[m]['pc1_freq_abs_spearman'])}, rms/spread {f2(dv[m]['ratio'])}"
                         + ("" if dv[m]["moved"] else " (not moved)"),
                         "1 + token freq", "coordinate on PC1 of dE", min(4, len(ms)), log_x=True)


def save(fig, path):
    fig.tight_layout()
    atomic_write(path, lambda t: fig.savefig(t, dpi=110, format="png"))
    plt.close(fig)
    return path


def main():
    p = Parser(__doc__)
    p.add_argument("--out-dir", default="out/ml-100k", help="the folder `make run` wrote")
    p.add_argument("--models", default="mean,mean+gti,centroid", help="folders under <out-dir>/models")
    p.add_argument("--save", default="results/ml-100k_spectra.png", help="the PNG to write")
    p.add_argument("--diagnostics", default="",
                   help="a JSON written by 07_diagnose.py: draw its three figures beside it instead")
    a = p.parse_args()
    if a.diagnostics:
        diagnostics_figures(a.diagnostics)
    else:
        readme_spectra(a)


if __name__ == "__main__":
    main()
