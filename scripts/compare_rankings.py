"""Compare two ranked lists of the same users (06's <name>_topk.npy files): metrics of each, their paired
differences with bootstrap 95% intervals, and how much the lists share (beam vs exact search, or two models).

    python scripts/compare_rankings.py out/ml-100k/models/centroid+gti+sft/eval_test_topk.npy \\
        out/ml-100k/models/centroid+gti+sft/eval_test_exact_topk.npy --names beam,exact
"""
import argparse
import importlib.util
import os
import sys

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("eval06", os.path.join(REPO, "06_eval.py"))
ev = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ev)                  # 06's metrics and bootstrap (not a numbered step)


def load(path, hint, read):
    """One line naming the file and what to do, never a traceback."""
    try:
        return read(path)
    except Exception as e:
        ev.die(f"{path}: {'not found' if not os.path.isfile(path) else type(e).__name__}; {hint}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--names", default="a,b", help="two labels")
    p.add_argument("--out-dir", default="", help="folder with dataset.pt (default: three levels above a)")
    p.add_argument("--split", default="test", choices=["test", "valid"])
    args = p.parse_args()
    na, nb = args.names.split(",")
    out_dir = args.out_dir or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(args.a))))
    A, B = (load(f, "run 06_eval.py first", lambda p: np.load(p, allow_pickle=False)) for f in (args.a, args.b))
    data = load(os.path.join(out_dir, "dataset.pt"), "pass --out-dir (the folder of 01's dataset.pt)",
                lambda p: torch.load(p, map_location="cpu", weights_only=True))
    if A.shape != B.shape:
        ev.die(f"{args.a} {A.shape} and {args.b} {B.shape} rank different users or lengths")
    t = data[args.split][:len(A)].numpy()
    ma, mb = ev.per_user_metrics(A, t), ev.per_user_metrics(B, t)
    print(f"{len(A)} users, lists of {A.shape[1]}")
    for k in ma:
        d = ev.paired_bootstrap(mb[k], ma[k])
        print(f"{k:10s} {na} {ma[k].mean():.4f}  {nb} {mb[k].mean():.4f}  {nb} - {na} {d[0]:+.4f} [{d[1]:+.4f}, {d[2]:+.4f}]")
    for k in (5, 10, A.shape[1]):
        if k <= A.shape[1]:
            share = np.mean([len(set(x[:k]) & set(y[:k])) / k for x, y in zip(A.tolist(), B.tolist())])
            print(f"top-{k} sets: {100 * share:.1f}% shared on average")
    print(f"identical lists: {int((A == B).all(1).sum())}/{len(A)}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
