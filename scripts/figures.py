"""The README's figure: singular-value spectra of the SID rows for mean, mean + GTI and centroid init.

    make figures     (= 04 on models/mean if mean+gti is missing, then this script)
    python scripts/figures.py --out-dir out/ml-100k --save results/ml-100k_spectra.png

Reads <out-dir>/sids.npy and the model folders' SID rows with 07_diagnose.py's own loader and
spectrum (loaded by path); writes one PNG. Centered rows; p_i = s_i / sum s; erank = exp(H(p)).
"""
import argparse
import importlib.util
import os

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default="out/ml-100k", help="the folder `make run` wrote")
    p.add_argument("--models", default="mean,mean+gti,centroid", help="folders under <out-dir>/models")
    p.add_argument("--save", default="results/ml-100k_spectra.png", help="the PNG to write")
    a = p.parse_args()
    spec = importlib.util.spec_from_file_location("diag07", os.path.join(REPO, "07_diagnose.py"))
    diag = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(diag)
    sids = diag.load_npy(os.path.join(a.out_dir, "sids.npy"), "run 02_rqvae.py (or make run) first")
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
    diag.atomic_write(a.save, lambda t: fig.savefig(t, dpi=110, format="png"))    # 07's own writer
    print(f"wrote {a.save}")


if __name__ == "__main__":
    main()
