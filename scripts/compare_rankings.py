"""Compare two ranked lists of the same users (06's <name>_topk.npy files): metrics of each, their paired
differences with bootstrap 95% intervals, and how much the lists share (beam vs exact search, or two models).
The exact lists come from bench/exact_search.py.

    python scripts/compare_rankings.py out/ml-100k/models/centroid+gti+sft/eval_test_topk.npy \\
        out/ml-100k/models/centroid+gti+sft/eval_test_exact_topk.npy --names beam,exact
"""
import os
import sys

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from common import Parser, die, load_npy, load_pt, load_step  # noqa: E402

ev = load_step("06_eval")                     # 06's metrics and bootstrap (not a numbered step)


def main():
    p = Parser(__doc__)
    p.add_argument("a", help="a <name>_topk.npy of 06_eval.py or bench/exact_search.py")
    p.add_argument("b", help="another one, same users and length")
    p.add_argument("--names", default="a,b", help="two labels")
    p.add_argument("--out-dir", default="", help="folder with dataset.pt (default: three levels above a)")
    p.add_argument("--split", default="test", choices=["test", "valid"])
    args = p.parse_args()
    na, nb = args.names.split(",")
    out_dir = args.out_dir or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(args.a))))
    A, B = (load_npy(f, "run 06_eval.py first") for f in (args.a, args.b))
    data = load_pt(os.path.join(out_dir, "dataset.pt"), "pass --out-dir (the folder of 01's dataset.pt)")
    if A.shape != B.shape:
        die(f"{args.a} {A.shape} and {args.b} {B.shape} rank different users or lengths")
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
