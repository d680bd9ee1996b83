"""Step 5: supervised fine-tuning (SFT) of the whole model on next-item prediction in SID tokens.

Paper step: the recommendation task of both papers (TIGER-style generative retrieval; GTI, Chen et al. 2026, sec. 4.1
"standard SFT"; centroid init, Loveland et al. 2026, sec. 5); `--aux-tasks` adds LC-Rec's item text <-> SID tasks
(Zheng et al. 2024), `--aux-tokens` of their target tokens per recommendation target token (1:1 by default: LC-Rec
trains them as a sizeable share of the data; 0.25 rows per sequence row were ~4% of the target tokens). The rows:
build_examples, aux_examples.        loss = - (1/#targets) sum_{target tokens t} log p(x_t | x_<t)
Both papers normalize a target over the vocabulary V (`--softmax full`): log p(y) = z_y - logsumexp_{v in V} z_v.
The default `--softmax level` normalizes a SID target over its own level's codes only (docs/design.md: not
worse, val NDCG@10 +0.008 [+0.002, +0.014] over full, and 1.1x the target items/s on sequence rows):
    log p(y) = z_y - logsumexp_{v in level(y)} z_v                 (06 ranks with the same softmax)
The validation item (s_u[-2]) picks the best checkpoint (lowest validation loss); the test item is never read.

Reads --model (a 03/04 folder), <out-dir>/dataset.pt. Writes --save (default <model>+sft): the best model,
sft_config.json (read by 06), 05_sft.json, <save>.resume.pt while training, with --keep-checkpoints every
validation's model in <save>.checkpoints/step_<N>/ (their fields: docs/artifacts.md).
CPU:  python 05_sft.py --model out/ml-100k/models/centroid+gti
GPU:  python 05_sft.py --model out/ml-100k/models/centroid+gti --device cuda --epochs 10 --batch-size 64 \
          --lr 3e-4 --warmup 100 --eval-every 200 --val-examples 0    (torchrun --nproc_per_node=4: DDP)
Prints "step 50/300 | loss 2.91 | lr 1.9e-04 | ..." every --log-every steps, "step 110/220 | val loss ..." at each
validation and "best step ... val loss ..." at the end.
"""
import argparse
import enum
import json
import math
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common import (Parser, add_device_flags, die, init_distributed, load_resume, load_sid_model, nonneg_float,
                    nonneg_int, pad_id, pick_autocast, pos_float, pos_int, save_folder, save_resume, seed_everything,
                    warmup_cosine, write_json)

IGNORE = -100                 # the label of a position that is not supervised
AUX_TEXT_TOKENS = 32          # an auxiliary row keeps the first 32 tokens of the item text
MIN_LR_FRAC = 0.1             # the cosine schedule ends at lr * MIN_LR_FRAC
WEIGHT_DECAY = 0.01           # AdamW, on the matrices only
CLIP = 1.0                    # gradient-norm clipping


def parse_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--model", default="out/ml-100k/models/centroid+gti", help="input model folder (03 or 04)")
    p.add_argument("--save", default="", help="output folder (empty: <model>+sft)")
    p.add_argument("--out-dir", default="", help="folder with dataset.pt (empty: two levels above --model)")
    p.add_argument("--objective", default="sequence", choices=["sequence", "prompt"], help="see build_examples")
    p.add_argument("--softmax", default="level", choices=["full", "level"], help="over V (the papers') or y's level")
    p.add_argument("--max-history", type=pos_int, default=20, help="history items before a target")
    p.add_argument("--aux-tasks", action=argparse.BooleanOptionalAction, default=False, help="LC-Rec's text <-> SID")
    p.add_argument("--aux-tokens", type=nonneg_float, default=1.0, help="aux target tokens per rec target token")
    p.add_argument("--steps", type=pos_int, default=220, help="optimizer steps (ignored when --epochs > 0)")
    p.add_argument("--epochs", type=nonneg_float, default=0.0, help="passes over all examples (sets the steps)")
    p.add_argument("--batch-size", type=pos_int, default=8, help="examples per micro-step, all processes")
    p.add_argument("--grad-accum", type=pos_int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--lr", type=pos_float, default=1e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=nonneg_int, default=20, help="linear warmup steps")
    p.add_argument("--eval-every", type=pos_int, default=110, help="validation + best-model save every N steps")
    p.add_argument("--val-examples", type=nonneg_int, default=128, help="validation users (0: all)")
    p.add_argument("--log-every", type=pos_int, default=10, help="one log line every N steps")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=False, help="go on from <save>.resume.pt")
    p.add_argument("--keep-checkpoints", action=argparse.BooleanOptionalAction, default=False,
                   help="also save every validation's model to <save>.checkpoints/step_<N>")
    add_device_flags(p, "auto = bf16 on CUDA and on CPUs with native bf16")
    p.add_argument("--seed", type=int, default=0, help="seeds random, numpy, torch and the example order")
    return p.parse_args(argv)


# --- the paper's math: the loss; the LM body on every position, the head on the supervised ones --------
class SIDLoss(torch.nn.Module):
    """The causal LM and its loss in one module, so DistributedDataParallel wraps all of it."""

    def __init__(self, lm, softmax: str, level_tok):
        super().__init__()
        self.lm, self.softmax = lm, softmax
        cols = torch.cat([t[t >= 0] for t in level_tok])                        # (C,) SID token ids
        level = torch.cat([torch.full((int((t >= 0).sum()),), l) for l, t in enumerate(level_tok)])
        col_of = torch.full((lm.get_output_embeddings().weight.shape[0],), -1, dtype=torch.long)
        col_of[cols] = torch.arange(len(cols))
        self.register_buffer("cols", cols, persistent=False)
        self.register_buffer("level", level, persistent=False)                # (C,) column's level
        self.register_buffer("col_of", col_of, persistent=False)              # (V,) token -> column

    def forward(self, ids, mask, pos, labels):
        """Summed CE over the supervised tokens, and hits (N,): argmax == label, row-major."""
        h = self.lm.base_model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state
        h, y = h[labels != IGNORE], labels[labels != IGNORE]                    # (B, T, d) -> (N, d), (N,)
        head = self.lm.get_output_embeddings()
        col = self.col_of[y]                                                    # (N,) -1: not a SID
        sub = col >= 0 if self.softmax == "level" else torch.zeros_like(col, dtype=torch.bool)
        loss, hits = h.new_zeros((), dtype=torch.float32), torch.zeros_like(y, dtype=torch.bool)
        if (~sub).any():                      # the papers: z_y - logsumexp over the whole vocabulary
            z = head(h[~sub]).float()                                           # (N1, V)
            loss = loss + F.cross_entropy(z, y[~sub], reduction="sum")
            hits[~sub] = z.argmax(-1) == y[~sub]
        if sub.any():                         # level softmax: z_y - logsumexp over the codes of y's level
            b = head.bias[self.cols] if head.bias is not None else None
            z = F.linear(h[sub], head.weight[self.cols], b).float()             # (N2, C) SID columns
            z = z.masked_fill(self.level[None, :] != self.level[col[sub]][:, None], -math.inf)
            loss = loss + F.cross_entropy(z, col[sub], reduction="sum")
            hits[sub] = z.argmax(-1) == col[sub]
        return loss, hits


# --- data: an example is a triple (kind, a, b), made into token ids only when batched -----------------
Kind = enum.IntEnum("Kind", ["PROMPT_ROW", "TEXT_TO_SID", "SID_TO_TEXT", "WINDOW"], start=0)
TEMPLATES = {"sequence": "User history: {history}", "prompt": "User history: {history}\nNext item:"}
AUX_TEMPLATES = {Kind.TEXT_TO_SID: "Item: {text}\nSemantic ID:", Kind.SID_TO_TEXT: "Semantic ID: {sid}\nItem:"}


def build_examples(train, objective: str, max_history: int):
    """The recommendation rows, from the train parts s_u[:-2] only (the validation / test items are not even passed in):
    sequence: windows w_1 .. w_n (n <= H+1) cut from the end of each train part with stride H (every train
        target once per epoch): "User history: " SID(w_1) .. SID(w_n), targets SID(w_2) .. SID(w_n)
    prompt (LC-Rec / GTI): one row per train target s_i, "User history: " SID(s_{i-H}) .. SID(s_{i-1})
        "\\nNext item:" SID(s_i) EOS, targets SID(s_i) EOS."""
    if objective == "sequence":
        return [(Kind.WINDOW, u, e) for u, s in enumerate(train) for e in range(len(s), 1, -max_history)]
    return [(Kind.PROMPT_ROW, u, i) for u, s in enumerate(train) for i in range(1, len(s))]


def aux_examples(rows, num_items: int, tokens: float, seed: int):
    """LC-Rec rows of a random item x direction, round(tokens / m) of them: `tokens` target tokens in expectation,
    m = the mean target tokens of an auxiliary row over every item and both directions."""
    m = target_tokens(rows, [(k, i, 0) for i in range(num_items) for k in AUX_TEMPLATES]) / (2 * num_items)
    pick = torch.randint(0, 2 * num_items, (round(tokens / m),), generator=torch.Generator().manual_seed(seed))
    return [(Kind.SID_TO_TEXT if p % 2 else Kind.TEXT_TO_SID, p // 2, 0) for p in pick.tolist()]  # item x direction


def target_tokens(rows, examples) -> int:
    return sum(sum(rows.row(ex)[1]) for ex in examples)                 # the supervised tokens of the rows


class RowBuilder:
    """row(example) -> (ids, is_target): the prompt's token ids, then the target's, and a 0/1 flag per
    token (1 = supervised). SID tokens are inserted as ids: tokenization never merges or splits them."""

    def __init__(self, tok, objective, item_tok, texts, seqs, max_history):
        enc = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731
        self.pre, self.post = map(enc, TEMPLATES[objective].split("{history}"))
        self.aux = {k: [enc(x) for x in t.split("{text}" if k == Kind.TEXT_TO_SID else "{sid}")]
                    for k, t in AUX_TEMPLATES.items()}
        self.enc, self.item_tok, self.texts = enc, item_tok.tolist(), texts
        self.seqs, self.H, self.eos = seqs, max_history, tok.eos_token_id
        self.end = [] if objective == "sequence" else [self.eos]       # what follows a predicted SID

    def sid(self, items):
        return [t for i in items for t in self.item_tok[i]]

    def row(self, example):
        kind, a, b = example
        if kind == Kind.WINDOW:                     # user a's items s[b-H-1:b]: the first is context only
            w = self.seqs[a][max(0, b - self.H - 1):b]
            prompt, target = self.pre + self.sid(w[:1]), self.sid(w[1:])
        elif kind == Kind.PROMPT_ROW:               # user a: history s[b-H:b] -> s[b] (06's prompt, tested)
            prompt = self.pre + self.sid(self.seqs[a][max(0, b - self.H):b]) + self.post
            target = self.sid([self.seqs[a][b]]) + self.end
        elif kind == Kind.TEXT_TO_SID:              # auxiliary: item a's text -> its SID
            (pre, post), text = self.aux[kind], self.enc(self.texts[a])[:AUX_TEXT_TOKENS]
            prompt, target = pre + text + post, self.sid([a]) + [self.eos]
        else:                                       # auxiliary: item a's SID -> its text
            (pre, post), text = self.aux[kind], self.enc(" " + self.texts[a])[:AUX_TEXT_TOKENS]
            prompt, target = pre + self.sid([a]) + post, text + [self.eos]
        return prompt + target, [0] * len(prompt) + [1] * len(target)


def collate(rows, pad_id: int):
    """Left-pad (ids, is_target) rows. Returns ids, mask, positions, labels (B, T); labels[b, j] =
    ids[b, j+1] where that token is supervised (the logit at j predicts token j+1), else IGNORE."""
    T = max(len(x) for x, _ in rows)
    ids = torch.tensor([[pad_id] * (T - len(x)) + x for x, _ in rows])                   # (B, T)
    mask = torch.tensor([[0] * (T - len(x)) + [1] * len(x) for x, _ in rows])            # (B, T) 0: pad
    target = torch.tensor([[0] * (T - len(t)) + t for _, t in rows], dtype=torch.bool)   # (B, T)
    labels = torch.full_like(ids, IGNORE)
    labels[:, :-1] = ids[:, 1:].masked_fill(~target[:, 1:] | (mask[:, :-1] == 0), IGNORE)  # token j+1 at j
    pos = (mask.cumsum(1) - 1).clamp(min=0)                 # positions ignore the left pad
    return ids, mask, pos, labels


def stream_batch(n: int, offset: int, size: int, seed: int):
    """Examples offset .. offset+size-1 of the endless stream where epoch e = randperm(n, seed + e): a
    pure function of (seed, offset), so a resumed run and every DDP process read the same order."""
    perm = {e: torch.randperm(n, generator=torch.Generator().manual_seed(seed + e)).tolist()
            for e in range(offset // n, (offset + size - 1) // n + 1)}
    return [perm[o // n][o % n] for o in range(offset, offset + size)]


# --- main: rows -> loss -> one loop (validation, best save, resume state) -> 05_sft.json --------------
def main():
    args = parse_args()
    ddp, rank, world, device = init_distributed(args.device)          # launched by torchrun: DDP
    master, log = rank == 0, print if rank == 0 else (lambda *a, **k: None)   # rank 0 logs and saves
    if args.batch_size % world:
        die(f"--batch-size {args.batch_size} must be divisible by the {world} processes")
    per_rank, (ctx, dtype_note) = args.batch_size // world, pick_autocast(args.dtype, device)
    save = args.save or args.model.rstrip("/") + "+sft"
    out_dir = args.out_dir or os.path.dirname(os.path.dirname(os.path.abspath(args.model)))
    resume_path = f"{save}.resume.pt"
    seed_everything(args.seed)
    log(f"device {device}  world {world}  {dtype_note}  model {args.model}")

    # rows: training examples from the train parts only; validation: a fixed random subset of the users
    model, tok, vocab, data, _, item_tok, _ = load_sid_model(args.model, out_dir, device)
    train, val_seqs = data["train"], [s + [v] for s, v in zip(data["train"], data["valid"].tolist())]  # + s_u[-2]
    rows = RowBuilder(tok, args.objective, item_tok, data["texts"], train, args.max_history)
    if not (rec := build_examples(train, args.objective, args.max_history)):
        die(f"{out_dir}/dataset.pt has no training positions (train parts shorter than 2 items)")
    rec_tok = target_tokens(rows, rec)                                  # aux: --aux-tokens x as many (expected)
    aux = aux_examples(rows, len(item_tok), args.aux_tokens * rec_tok, args.seed) if args.aux_tasks else []
    examples, aux_tok = rec + aux, target_tokens(rows, aux)
    users = [u for u in range(len(train)) if len(train[u]) > 0]         # a validation row needs a history
    pick = torch.randperm(len(users), generator=torch.Generator().manual_seed(args.seed))[:args.val_examples or None]
    users = sorted(users[i] for i in pick.tolist())                     # --val-examples of them (0: all)
    val = RowBuilder(tok, args.objective, item_tok, data["texts"], val_seqs, args.max_history)
    val_rows = [val.row((Kind.PROMPT_ROW, u, len(train[u]))) for u in users]   # the prompt row of item s_u[-2]
    positions = vocab["level_names"] + ([] if args.objective == "sequence" else ["eos"])   # K tokens per target
    pad = pad_id(tok)
    per_step = args.batch_size * args.grad_accum                       # examples per optimizer step
    total = math.ceil(args.epochs * len(examples) / per_step) if args.epochs > 0 else args.steps
    targets = sum(len(s) - 1 for s in train if len(s) > 1)
    log(f"objective {args.objective}  softmax {args.softmax}  examples {len(rec)} ({targets} target items) + "
        f"{len(aux)} auxiliary rows (aux:rec target tokens {aux_tok / rec_tok:.2f}), val {len(users)}  "
        f"steps {total} x {per_step} ({total * per_step / len(examples):.2f} epochs)")

    # loss: the LM inside SIDLoss; AdamW (weight decay on the matrices only), warmup then cosine
    loss_model = SIDLoss(model, args.softmax, [torch.tensor(t) for t in vocab["token_ids"]]).to(device).train()
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=device.type in ("cuda", "cpu"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: warmup_cosine(step, args.warmup, total, MIN_LR_FRAC))
    state = dict(step=0, best_val=math.inf, best_step=-1, loss_curve=[], val_curve=[], val_level_acc=[], seconds=0.0)
    free = ("save", "out_dir", "log_every", "resume", "keep_checkpoints", "device")    # may change on --resume
    key = {k: v for k, v in vars(args).items() if k not in free and (k != "aux_tokens" or args.aux_tasks)}
    key |= {"examples": len(examples), "world size": world}           # aux_tokens only matters with --aux-tasks
    if args.resume:     # model, optimizer, schedule and `state` as at the last validation (the loop draws no RNG)
        state = load_resume(resume_path, key, model=model, optimizer=opt, scheduler=sched)["state"]
        log(f"resumed from {resume_path} at step {state['step']}")
    train_model = DDP(loss_model, device_ids=[device.index] if device.type == "cuda" else None) if ddp else loss_model
    sft_config = {"objective": args.objective, "template": TEMPLATES[args.objective], "max_history": args.max_history,
                  "softmax": args.softmax, "target": "SID tokens" + ("" if args.objective == "sequence" else " + eos"),
                  "aux_tasks": args.aux_tasks, "aux_templates": AUX_TEMPLATES}
    files = {"sid_vocab.json": json.dumps(vocab), "sft_config.json": json.dumps(sft_config, indent=2)}

    # the loop: `step` = optimizer steps done; validation at step 0, every --eval-every steps and at the end
    first, t_start, t_log = state["step"], time.time(), time.time()
    for step in range(first, total + 1):
        if (step % args.eval_every == 0 or step == total) and not (step == first and args.resume):
            state["seconds"] += time.time() - t_start           # the clock counts training only
            loss_model.eval()                                   # validation: every process scores all rows
            with torch.no_grad(), ctx:
                out = [loss_model(*(x.to(device) for x in collate(val_rows[s:s + per_rank], pad)))
                       for s in range(0, len(val_rows), per_rank)]                 # [(summed loss, hits)]
            loss_model.train()
            hits = torch.cat([h for _, h in out]).view(len(val_rows), -1).double()  # (rows, K) 1: argmax right
            vloss = (sum(loss.double() for loss, _ in out) / hits.numel()).item()  # mean over target tokens
            vacc, vpos = (hits.sum() / hits.numel()).item(), (hits.sum(0) / len(val_rows)).tolist()
            state["val_curve"].append([step, round(vloss, 5), round(vacc, 5)])
            state["val_level_acc"].append([step, [round(x, 4) for x in vpos]])
            if better := vloss < state["best_val"]:
                state["best_val"], state["best_step"] = vloss, step
            for dst in [save] * better + [f"{save}.checkpoints/step_{step}"] * args.keep_checkpoints:
                if master:                                       # the best model; every one with --keep-checkpoints
                    save_folder(dst, model, tok, files)
            log(f"step {step}/{total} | val loss {vloss:.4f} | val token acc {vacc:.3f} (" + " ".join(
                f"{n} {x:.2f}" for n, x in zip(positions, vpos)) + ")" + (" | best, saved" if better else ""))
            if master and 0 < step < total:                      # the state --resume continues from
                save_resume(resume_path, key, {"state": state}, model=model, optimizer=opt, scheduler=sched)
            t_start = t_log = time.time()
        if step == total:
            break
        # one optimizer step: grad_accum micro-batches (this process's slice of each); the summed loss is
        # divided by the target tokens of the whole step over all processes (DDP = one process's gradient)
        offsets = [(step * args.grad_accum + micro) * args.batch_size + rank * per_rank
                   for micro in range(args.grad_accum)]
        batches = [collate([rows.row(examples[i]) for i in stream_batch(len(examples), o, per_rank, args.seed)], pad)
                   for o in offsets]
        n = torch.tensor([float(sum(int((b[3] != IGNORE).sum()) for b in batches))], device=device)
        tot = torch.zeros(1, dtype=torch.float64, device=device)        # summed loss of this step
        if ddp:
            dist.all_reduce(n)                                 # target tokens of the step, all processes
        for micro, batch in enumerate(batches):                # DDP all-reduces the gradients on the last only
            with train_model.no_sync() if ddp and micro < args.grad_accum - 1 else nullcontext():
                with ctx:
                    loss, _ = train_model(*(x.to(device) for x in batch))          # summed CE, (ids, mask, pos, labels)
                (loss * world / n[0]).backward()               # DDP averages over processes: sum / targets
            tot += loss.detach().double()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if ddp:
            dist.all_reduce(tot)
        state["loss_curve"].append([step + 1, round((tot[0] / n[0]).item(), 5)])
        state["step"] = step + 1
        if (step + 1) % args.log_every == 0 or step + 1 == total:
            ms = 1000 * (time.time() - t_log) / ((step + 1) % args.log_every or args.log_every)
            log(f"step {step + 1}/{total} | loss {state['loss_curve'][-1][1]:.4f} | "
                f"lr {sched.get_last_lr()[0]:.2e} | gnorm {gnorm:.2f} | {ms:.0f} ms/step")
            t_log = time.time()

    if master:                                                 # 05_sft.json beside the best model
        if not os.path.isdir(save):
            die(f"no checkpoint was saved to {save} (validation loss never finite)")
        s_per_step = round(state["seconds"] / max(1, state["step"]), 3)
        write_json(os.path.join(save, "05_sft.json"), {
            "loss_curve": state["loss_curve"], "val_curve": state["val_curve"], "best_step": state["best_step"],
            "val_level_acc": state["val_level_acc"], "val_level_names": positions, "best_val_loss": state["best_val"],
            "steps": total, "examples": len(rec), "target_items": targets, "aux_examples": len(aux),
            "rec_target_tokens": rec_tok, "aux_target_tokens": aux_tok, "aux_token_ratio": round(aux_tok / rec_tok, 4),
            "val_examples": len(users), "world_size": world, "batch_size": args.batch_size,
            "grad_accum": args.grad_accum, "seconds": round(state["seconds"], 1), "s_per_step": s_per_step,
            "device": str(device), "autocast": dtype_note, "args": vars(args)})
        if os.path.exists(resume_path):                        # the finished run needs no resume state
            os.remove(resume_path)
        log(f"best step {state['best_step']} val loss {state['best_val']:.4f}  ({s_per_step:.2f} s/step)  saved {save}")
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
