"""Reference baseline: SASRec (Kang & McAuley 2018), a small causal Transformer over item-id embeddings.

Not a numbered step: a conventional ID-based sequential recommender to put the SID models (05/06) in
context, on the same dataset.pt, the same leave-one-out splits and the same metric function (06's
`rank_metrics`, loaded from 06_eval.py, not copied).

    x_t  = E[s_t] + P[t]                         E: (N+1) x d item embeddings (row 0 = padding), P: positions
    block(x) = x + Drop(Attn(LN(x)));  then  x + Drop(FFN(LN(x)))          (pre-LN, 2 blocks)
    Attn: softmax(Q K^T / sqrt(d_h) + M) V,  M[t, t'] = -inf unless t' <= t and s_t' is not padding
    h_t  = LN(block(block(x)))_t                 logits_t = h_t E[1:]^T      (item embeddings shared)
    loss = - mean over non-padding t of  log softmax(logits_t)[s_{t+1}]      full softmax over all N items
The original paper trains with one sampled negative per position and binary cross-entropy; here the loss is
the full softmax cross-entropy over all N items (cheap at this scale, and usually stronger).

Training: for each user the train part s = train[u] (= sequence[:-2]) gives inputs s[:-1] and targets s[1:],
cut from the end into consecutive windows of at most --max-len targets (every train target is used once
per epoch), left-padded to --max-len. Adam, shuffled windows. Every --eval-every epochs: validation
Recall@10 (history = train part, target = valid item, history items excluded); the best state is kept and
training stops after --patience evaluations without improvement.
Test: history = sequence[:-1] (train part + valid item), its last --max-len items are fed to the model,
target = test item, full ranking over all N items, top-20 lists under two protocols:
    exclude: items of the user's history get -inf before the top-K (RecBole's full-sort protocol)
    keep:    nothing removed (06_eval.py --protocol kept; the TIGER-style protocol)
(-1 in a list = fewer than 20 items left after the exclusion.) Cold targets: test items seen <= --cold-max
times in the train parts (as in 06).

Reads:  <out-dir>/dataset.pt (01_embed_items.py)
Writes: <out-dir>/sasrec/sasrec.pt (best state_dict + config), <out-dir>/sasrec/eval_test.json (metrics per
        protocol for all users and cold targets, most-popular under the same protocol, val curve, best epoch,
        seconds, params, args), <out-dir>/sasrec/eval_test_topk_{exclude,keep}.npy (int64 [U, 20], best first)

CPU:  OMP_NUM_THREADS=1 python baselines/sasrec.py --out-dir out/ml-100k
GPU:  python baselines/sasrec.py --out-dir out/ml-100k --device cuda
Good run on ML-100K (943 users, 1682 items, 2412 windows; 2 CPU cores, ~2.4 s/epoch, ~2 min in all): one
line per evaluation, e.g. "epoch 45 | loss 5.4372 | val R@10 0.2354 | 2.6 s/epoch", then two markdown tables;
test Recall@10 0.212 / NDCG@10 0.110 with history excluded (most popular: 0.086 / 0.045), 0.128 / 0.062 with
history kept (`python baselines/sasrec.py --out-dir out/ml-100k --epochs 45 --lr 3e-3`, 110 s of training).
The defaults were chosen to fit `make run`: with lr 1e-3 (up to 200 epochs, one thread) the best validation
epoch was 85 and the run took 6 min for the same test numbers (0.211 / 0.111 history excluded). Same seed ->
same numbers on CPU (CUDA kernels may differ slightly).
"""
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from common import (Parser, atomic_write, die, load_pt, load_step, nonneg_int, pick_device,  # noqa: E402
                    pos_float, pos_int, seed_everything)


def parse_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--out-dir", default="out/ml-100k",
                   help="artifacts folder with dataset.pt; results go to <out-dir>/sasrec/")
    p.add_argument("--max-len", type=pos_int, default=50,
                   help="items fed to the model (training windows and test histories are cut to this length)")
    p.add_argument("--dim", type=pos_int, default=64, help="embedding and hidden size d")
    p.add_argument("--blocks", type=pos_int, default=2, help="self-attention blocks")
    p.add_argument("--heads", type=pos_int, default=1, help="attention heads (must divide --dim)")
    p.add_argument("--dropout", type=float, default=0.2,
                   help="dropout on embeddings, attention weights and residual branches")
    p.add_argument("--lr", type=pos_float, default=3e-3,
                   help="Adam learning rate (1e-3 gives the same test numbers in 2.4x the epochs; see the docstring)")
    p.add_argument("--batch-size", type=pos_int, default=128, help="training windows per step")
    p.add_argument("--epochs", type=pos_int, default=45,
                   help="maximum passes over all training windows (the best validation epoch is kept)")
    p.add_argument("--eval-every", type=pos_int, default=5, help="validation Recall@10 every N epochs")
    p.add_argument("--patience", type=pos_int, default=5,
                   help="stop after this many evaluations without a better validation Recall@10")
    p.add_argument("--cold-max", type=nonneg_int, default=10,
                   help="a test target is cold when it occurs <= this many times in the train parts")
    p.add_argument("--users", type=nonneg_int, default=0,
                   help="score only the first N users on the test split (0: all); training always uses all users")
    p.add_argument("--eval-batch", type=pos_int, default=256, help="users per scoring batch")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                   help="auto = cuda, else mps, else cpu")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds random, numpy, torch (initialization, dropout, window order)")
    return p.parse_args(argv)


def save_npy(path: str, arr: np.ndarray):
    with open(path, "wb") as f:      # a file object: np.save would add .npy to a str path
        np.save(f, arr)


def markdown_table(rows):
    """rows: [(name, {metric: value})] -> a markdown table, one row per name (06 prints the same layout)."""
    keys = list(rows[0][1].keys())
    lines = ["| | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(f"{m[k]:.4f}" for k in keys) + " |" for name, m in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-LN Transformer block: masked multi-head self-attention, then a position-wise feed-forward."""

    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.p = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ffn = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Dropout(dropout), nn.Linear(d, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, x, allowed):                       # x (B, T, d); allowed (B, 1, T, T) bool
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=self.p if self.training else 0.0)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(B, T, d)))
        return x + self.drop(self.ffn(self.ln2(x)))


class SASRec(nn.Module):
    def __init__(self, num_items: int, max_len: int, d: int, blocks: int, heads: int, dropout: float):
        super().__init__()
        self.item = nn.Embedding(num_items + 1, d, padding_idx=0)   # item i -> row i + 1
        self.pos = nn.Embedding(max_len, d)
        nn.init.normal_(self.item.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.01)
        with torch.no_grad():
            self.item.weight[0].zero_()
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(blocks))
        self.ln = nn.LayerNorm(d)

    def forward(self, seq):                              # seq (B, T) of item index + 1, 0 = padding
        T = seq.shape[1]
        real = seq > 0
        x = self.drop(self.item(seq) + self.pos(torch.arange(T, device=seq.device))) * real[..., None]
        causal = torch.ones(T, T, dtype=torch.bool, device=seq.device).tril()
        eye = torch.eye(T, dtype=torch.bool, device=seq.device)
        allowed = (causal & (real[:, None, :] | eye))[:, None]      # padding rows attend to themselves only
        for blk in self.blocks:
            x = blk(x, allowed) * real[..., None]
        return self.ln(x)                                # (B, T, d)

    def logits(self, h):                                 # (..., d) -> (..., N), shared item embeddings
        return h @ self.item.weight[1:].T


def left_pad_items(rows, max_len: int) -> torch.Tensor:
    """Lists of item indices -> (B, max_len) LongTensor of index + 1, the last max_len items, left-padded with 0."""
    out = torch.zeros(len(rows), max_len, dtype=torch.long)
    for b, r in enumerate(rows):
        r = r[-max_len:]
        if len(r):
            out[b, max_len - len(r):] = torch.as_tensor(r, dtype=torch.long) + 1
    return out


def train_windows(train, max_len: int):
    """Each train part s -> consecutive (input, target) windows over s[:-1] -> s[1:], cut from the end."""
    inputs, targets = [], []
    for s in train:
        end = len(s) - 1                                 # targets are s[1 .. end]
        while end >= 1:
            start = max(0, end - max_len)
            inputs.append(s[start:end])
            targets.append(s[start + 1:end + 1])
            end = start
    return left_pad_items(inputs, max_len), left_pad_items(targets, max_len) - 1   # targets: -1 = padding (ignored)


@torch.no_grad()
def rank(model, histories, max_len: int, k: int, device, batch: int, exclude: bool) -> np.ndarray:
    """Top-k item indices (U, k), best first, scoring all N items from each history's last max_len items.
    exclude: every item of the (full) history gets -inf first; slots left at -inf become -1."""
    model.eval()
    n = model.item.num_embeddings - 1
    out = []
    for i in range(0, len(histories), batch):
        hist = histories[i:i + batch]
        scores = model.logits(model(left_pad_items(hist, max_len).to(device))[:, -1])      # (B, N)
        if exclude:
            seen = torch.zeros(len(hist), n + 1, dtype=torch.bool, device=device)
            seen.scatter_(1, left_pad_items(hist, max(1, max(map(len, hist)))).to(device), True)
            scores = scores.masked_fill(seen[:, 1:], float("-inf"))
        val, idx = scores.topk(min(k, n), dim=1)
        out.append(torch.where(val == float("-inf"), -1, idx).cpu())
    return torch.cat(out).numpy().astype(np.int64)


# ---------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------
def main():
    args = parse_args()
    seed_everything(args.seed)
    if args.dim % args.heads:
        die(f"--heads {args.heads} must divide --dim {args.dim}")
    if not 0.0 <= args.dropout < 1.0:
        die("--dropout must be in [0, 1)")
    device = pick_device(args.device)
    t0 = time.time()
    data = load_pt(os.path.join(args.out_dir, "dataset.pt"), "run 01_embed_items.py first")
    missing = [f for f in ("train", "valid", "test", "sequences", "popularity", "item_ids") if f not in data]
    if missing:
        die(f"{args.out_dir}/dataset.pt lacks {', '.join(missing)}; rerun 01_embed_items.py")
    ev = load_step("06_eval")                  # 06's rank_metrics and popular_topk
    n, train = len(data["item_ids"]), data["train"]
    valid, test, pop = data["valid"].numpy(), data["test"].numpy(), data["popularity"].numpy()
    x, y = train_windows(train, args.max_len)
    if len(x) == 0:
        die(f"{args.out_dir}/dataset.pt has no train part with 2+ items; nothing to train on")

    model = SASRec(n, args.max_len, args.dim, args.blocks, args.heads, args.dropout).to(device)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    order_rng = np.random.default_rng(args.seed)
    print(f"device {device}  users {len(train)}  items {n}  windows {len(x)}  targets {int((y >= 0).sum())}  "
          f"params {params:,}")

    val_curve, best, best_epoch, best_state, bad, epoch, loss_sum = [], -1.0, 0, None, 0, 0, 0.0
    t_train, t_ep = time.time(), time.time()
    for epoch in range(1, args.epochs + 1):
        model.train()
        loss_sum, count = 0.0, 0
        for b in np.array_split(order_rng.permutation(len(x)), max(1, -(-len(x) // args.batch_size))):
            xb, yb = x[b].to(device), y[b].to(device)
            real = yb >= 0                                                   # padding positions: no loss
            loss = F.cross_entropy(model.logits(model(xb)[real]), yb[real])  # logits (#targets, N)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            m = int(real.sum())
            loss_sum, count = loss_sum + loss.item() * m, count + m
        if epoch % args.eval_every and epoch != args.epochs:
            continue
        topk = rank(model, train, args.max_len, 10, device, args.eval_batch, exclude=True)
        m = ev.rank_metrics(topk, valid)
        r10 = m["recall@10"]
        val_curve.append([epoch, round(r10, 4), round(m["ndcg@10"], 4)])        # epoch, R@10, NDCG@10
        s_ep = (time.time() - t_ep) / (epoch - (val_curve[-2][0] if len(val_curve) > 1 else 0))
        print(f"epoch {epoch} | loss {loss_sum / count:.4f} | val R@10 {r10:.4f} | {s_ep:.1f} s/epoch", flush=True)
        t_ep = time.time()
        if r10 > best:
            best, best_epoch, best_ndcg, bad = r10, epoch, m["ndcg@10"], 0
            best_state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        else:
            bad += 1
            if bad >= args.patience:
                break
    train_s = time.time() - t_train
    model.load_state_dict(best_state)
    print(f"best epoch {best_epoch}  val R@10 {best:.4f}  epochs run {epoch}  train {train_s:.0f}s")

    # test: history = train part + valid item, target = test item
    seqs = data["sequences"][:args.users or None]
    histories, targets = [s[:-1] for s in seqs], test[:len(seqs)]
    cold = pop[targets] <= args.cold_max
    res = {"split": "test", "users": len(seqs), "cold_max": args.cold_max, "cold_users": int(cold.sum())}
    save_dir = os.path.join(args.out_dir, "sasrec")
    os.makedirs(save_dir, exist_ok=True)
    for proto, exclude in (("exclude", True), ("keep", False)):
        topk = rank(model, histories, args.max_len, 20, device, args.eval_batch, exclude)
        ptk = ev.popular_topk(pop, histories, min(20, n), exclude)    # most popular under the same protocol
        res[f"{proto}_history"] = {"model": ev.rank_metrics(topk, targets),
                                   "cold_model": ev.rank_metrics(topk[cold], targets[cold]),
                                   "most_popular": ev.rank_metrics(ptk, targets),
                                   "cold_most_popular": ev.rank_metrics(ptk[cold], targets[cold])}
        atomic_write(os.path.join(save_dir, f"eval_test_topk_{proto}.npy"), lambda t: save_npy(t, topk))
    res.update({"best_epoch": best_epoch, "best_val_recall@10": best, "best_val_ndcg@10": best_ndcg,
                "epochs_run": epoch, "val_curve": val_curve,
                "train_seconds": round(train_s, 2), "seconds": round(time.time() - t0, 2), "params": params,
                "args": vars(args)})
    config = {k: getattr(args, k) for k in ("max_len", "dim", "blocks", "heads", "dropout")} | {"num_items": n}
    atomic_write(os.path.join(save_dir, "sasrec.pt"),
                 lambda t: torch.save({"state_dict": best_state, "config": config}, t))
    atomic_write(os.path.join(save_dir, "eval_test.json"), lambda t: open(t, "w").write(json.dumps(res, indent=2)))
    for proto in ("exclude", "keep"):
        r = res[f"{proto}_history"]
        print(f"\ntest, history items {'excluded' if proto == 'exclude' else 'kept'} ({proto}_history):")
        print(markdown_table([(f"SASRec (all, n={len(seqs)})", r["model"]), ("most popular (all)", r["most_popular"]),
                                 (f"SASRec (cold <= {args.cold_max}, n={res['cold_users']})", r["cold_model"]),
                                 ("most popular (cold)", r["cold_most_popular"])]))
    print(f"wrote {os.path.join(save_dir, 'eval_test.json')}  ({time.time() - t0:.0f}s)")


if __name__ == "__main__":
    main()
