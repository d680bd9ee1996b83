"""Step 5: supervised fine-tuning (SFT) of the whole model on next-item prediction in SID tokens.

Paper step: the recommendation task shared by both papers (TIGER-style generative retrieval; GTI,
Chen et al. 2026, sec. 4.3 "standard SFT"; centroid init, Loveland et al. 2026, sec. 5).
`--aux-tasks` mixes in a 2-task subset of LC-Rec's language <-> SID tasks (item text -> SID,
SID -> item text; Zheng et al. 2024; the GTI paper's LC-Rec baseline).

Rows (--objective), laid out exactly as 06_eval.py prompts the model (sft_config.json):
    sequence (default): a window w = (w_1 .. w_n) of <= H+1 consecutive train items of one user,
        ids = "User history: " SID(w_1) SID(w_2) ... SID(w_n)
        loss = - (1/#targets) sum_{j=2..n} sum_{t in SID(w_j)} log p(x_t | x_<t)
        cut from the end of each train part with stride H: every train target once per epoch.
    prompt: one (history -> next item) instruction row (the LC-Rec / GTI format),
        ids = template(SID(s_{i-H}) .. SID(s_{i-1})) SID(s_i) EOS,   loss on SID(s_i) + EOS only.
Loss (--softmax full | sid | level, see SIDLoss): the SID targets normalized over the vocabulary,
over the SID tokens, or over the target level's codes; 06 scores with the same one.
    lr(step) = lr * (step+1) / warmup for step < warmup, then cosine from lr to lr * MIN_LR_FRAC
The validation item (s_u[-2]) only feeds the validation loss (and, with --rank-users, 06's
Recall/NDCG@10 on it) that picks the best checkpoint (--select); the test item is never read.
SID tokens are inserted as ids, never tokenized from text.

Reads:  --model (a 03/04 folder: HF model + tokenizer + sid_vocab.json with every item's SID),
        <out-dir>/dataset.pt (default --out-dir: the folder two levels above --model).
Writes: --save (default <model>+sft): the best model (lowest val loss, or highest val NDCG@10)
        + tokenizer + sid_vocab.json + sft_config.json (objective, template, max_history,
        softmax; read by 06) + 05_sft.json (loss curve, val curve [+ rank_curve: step,
        Recall@10, NDCG@10], accuracy per target position, best step, seconds);
        <save>.resume.pt and <save>.rank while training.

CPU:  python 05_sft.py --model out/ml-100k/models/centroid+gti
GPU:  python 05_sft.py --model out/ml-100k/models/centroid+gti --device cuda --epochs 10 \
          --batch-size 64 --lr 3e-4 --warmup 100 --eval-every 200 --val-examples 0
Good run prints one line per --log-every steps, e.g. "step 50/300 | loss 2.91 | lr 1.9e-04 | ...",
the validation loss every --eval-every steps, and "best step ... val loss ..." at the end.
"""
import argparse
import ast
import dataclasses
import hashlib
import inspect
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
import typing
from contextlib import nullcontext
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Annotated, Literal

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass
class Args:
    model: str = "out/ml-100k/models/centroid+gti"
    """input model folder (04_ground.py's output by default; any 03 folder works too)"""
    save: str = ""
    """output folder (default: <model>+sft)"""
    out_dir: str = ""
    """artifacts folder with dataset.pt (default: two levels above --model)"""
    objective: Literal["sequence", "prompt"] = "sequence"
    """sequence: every item of a window is a target; prompt: one target per instruction row"""
    softmax: Literal["full", "sid", "level"] = "level"
    """normalize SID targets over the vocabulary (full), the SID tokens (sid), the level (level)"""
    max_history: Annotated[int, ">= 1"] = 20
    """history items before a target (sequence: windows of max_history + 1 items)"""
    template: str = ""
    """prompt with {history} (default: 'User history: {history}', + '\nNext item:' for prompt)"""
    aux_tasks: bool = False
    """mix in LC-Rec-style item text -> SID and SID -> item text examples"""
    aux_ratio: float = 0.25
    """auxiliary examples per recommendation example (a window or a row; with --aux-tasks)"""
    steps: Annotated[int, ">= 1"] = 220
    """optimizer steps (the CPU default; ignored when --epochs > 0)"""
    epochs: float = 0.0
    """passes over all examples (sets the number of steps; the GPU setting)"""
    batch_size: Annotated[int, ">= 1"] = 8
    """examples per micro-step, over all processes together"""
    grad_accum: Annotated[int, ">= 1"] = 1
    """micro-steps per optimizer step"""
    lr: Annotated[float, "> 0"] = 1e-3
    """peak learning rate (AdamW)"""
    warmup: Annotated[int, ">= 0"] = 20
    """linear warmup steps"""
    eval_every: Annotated[int, ">= 1"] = 110
    """validation loss, best-model save and resume checkpoint every N steps"""
    val_examples: Annotated[int, ">= 0"] = 128
    """validation examples (one per user, a fixed random subset; 0: all users)"""
    rank_users: Annotated[int, ">= 0"] = 0
    """at each validation 06_eval.py ranks the validation item of the first N users (0: off)"""
    select: Literal["loss", "ndcg"] = "loss"
    """keep the checkpoint of lowest validation loss, or of highest validation NDCG@10"""
    patience: Annotated[int, ">= 0"] = 0
    """stop when the --select metric has not improved for N validations (0: run every step)"""
    log_every: Annotated[int, ">= 1"] = 10
    """one log line every N steps"""
    resume: bool = False
    """continue from <save>.resume.pt (same arguments)"""
    resumable: bool = True
    """write <save>.resume.pt (model + optimizer state, ~3x the model) at each validation"""
    stop_at: Annotated[int, ">= 0"] = 0
    """stop abruptly after this step, as if killed (to test --resume); 0: off"""
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    """auto = cuda, else mps, else cpu (under torchrun: cuda if available, else gloo on cpu)"""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """bf16 autocast or not; weights, optimizer, loss stay fp32 (auto: bf16 where native)"""
    seed: int = 0
    """seeds random, numpy, torch and the example order"""


# --- 1. Rows: an example is a triple (kind, a, b), made into token ids only when batched ----------
PROMPT_ROW = 0    # prompt objective, user a: target = train item b, history = the H items before it
TEXT_TO_SID = 1   # LC-Rec auxiliary: item a's text -> its SID
SID_TO_TEXT = 2   # LC-Rec auxiliary: item a's SID -> its text
VALID_ROW = 3     # validation, user a: history = the last H train items, target = the valid. item
WINDOW = 4        # sequence objective, user a: train items s[max(0, b-H-1):b], all but 1st targets
TEMPLATES = {"sequence": "User history: {history}", "prompt": "User history: {history}\nNext item:"}
AUX_TEMPLATES = {TEXT_TO_SID: "Item: {text}\nSemantic ID:",
                 SID_TO_TEXT: "Semantic ID: {sid}\nItem:"}
AUX_TEXT_TOKENS = 32          # an auxiliary row keeps the first 32 tokens of the item text
IGNORE = -100                 # the label of a position that is not supervised
MIN_LR_FRAC = 0.1             # the cosine schedule ends at lr * MIN_LR_FRAC
WEIGHT_DECAY = 0.01           # AdamW, on the matrices only
CLIP = 1.0                    # gradient-norm clipping


def build_examples(train, num_items: int, objective: str, max_history: int, aux_ratio: float,
                   seed: int):
    """train: the train parts only (s_u[:-2]); the validation / test items are not even passed in.
    sequence: windows of <= H+1 items cut from the end of each train part with stride H, so every
    train target (positions 1 .. n-1) is supervised once per epoch, the longest history last."""
    if objective == "sequence":
        rec = [(WINDOW, u, e) for u, s in enumerate(train) for e in range(len(s), 1, -max_history)]
    else:
        rec = [(PROMPT_ROW, u, i) for u, s in enumerate(train) for i in range(1, len(s))]
    aux = []
    if aux_ratio > 0:
        g = torch.Generator().manual_seed(seed)
        n_aux = round(aux_ratio * len(rec))
        pick = torch.randint(0, 2 * num_items, (n_aux,), generator=g).tolist()   # item x direction
        aux = [(SID_TO_TEXT if p % 2 else TEXT_TO_SID, p // 2, 0) for p in pick]
    return rec, aux


def validation_users(train, n: int, seed: int):
    """User ids whose train part is non-empty (their validation prompt has a history); with
    0 < n < their number, a fixed random subset of n of them (sorted), mapped back to user ids."""
    users = [u for u in range(len(train)) if len(train[u]) > 0]
    if n and n < len(users):
        g = torch.Generator().manual_seed(seed)
        users = sorted(users[i] for i in torch.randperm(len(users), generator=g)[:n].tolist())
    return users


def check_template(template: str, objective: str):
    if template.count("{history}") != 1:
        die(f"--template {template!r} must contain {{history}} exactly once")
    if objective == "sequence" and not template.endswith("{history}"):
        die(f"--template {template!r}: with --objective sequence the next item's SID follows the "
            "history directly, so the template must end with {history}")


class Encoder:
    """Turns an example triple into (ids, is_target): token ids and a 0/1 flag per token
    (1 = supervised). SID tokens are inserted as ids: tokenization never merges or splits them."""

    def __init__(self, tok, template, objective, item_tok, texts, data_seqs, valid, max_history):
        check_template(template, objective)
        enc = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731
        self.pre, self.post = map(enc, template.split("{history}"))
        self.aux = {k: [enc(x) for x in t.split("{text}" if k == TEXT_TO_SID else "{sid}")]
                    for k, t in AUX_TEMPLATES.items()}
        self.enc, self.item_tok, self.texts = enc, item_tok.tolist(), texts
        self.train, self.valid, self.H = data_seqs, valid, max_history
        self.eos = tok.eos_token_id
        self.end = [] if objective == "sequence" else [self.eos]      # what follows a predicted SID

    def sid(self, items):
        return [t for i in items for t in self.item_tok[i]]

    def prompt(self, history):
        """The evaluation prompt for a history: 06_eval.py builds the same ids (tested)."""
        return self.pre + self.sid(history[-self.H:]) + self.post

    def __call__(self, ex):
        kind, a, b = ex
        if kind == WINDOW:                                # s[b-H-1:b]: loss on items 2.. of it
            w = self.train[a][max(0, b - self.H - 1):b]
            first = len(self.pre) + len(self.item_tok[w[0]])
            ids = self.pre + self.sid(w)
            return ids, [0] * first + [1] * (len(ids) - first)
        if kind == PROMPT_ROW:                              # history s[b-H:b] -> s[b]
            s = self.train[a]
            prompt, target = self.prompt(s[:b]), self.sid([s[b]]) + self.end
        elif kind == VALID_ROW:                             # history s[-H:] -> validation item
            prompt, target = self.prompt(self.train[a]), self.sid([self.valid[a]]) + self.end
        else:                                               # auxiliary: item a's text <-> its SID
            (pre, post), text = self.aux[kind], self.texts[a]
            if kind == TEXT_TO_SID:
                prompt = pre + self.enc(text)[:AUX_TEXT_TOKENS] + post
                target = self.sid([a]) + [self.eos]
            else:
                prompt = pre + self.sid([a]) + post
                target = self.enc(" " + text)[:AUX_TEXT_TOKENS] + [self.eos]
        return prompt + target, [0] * len(prompt) + [1] * len(target)


def collate(rows, pad_id: int):
    """Left-pad (ids, is_target) rows. Returns ids, mask, positions, labels (B, T); labels[b, j] =
    ids[b, j+1] where that token is supervised (the logit at j predicts token j+1), else IGNORE."""
    T = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    labels = torch.full((len(rows), T), IGNORE, dtype=torch.long)
    for b, (x, t) in enumerate(rows):
        x, t = torch.tensor(x), torch.tensor(t, dtype=torch.bool)
        ids[b, T - len(x):], mask[b, T - len(x):] = x, 1
        labels[b, T - len(x):T - 1] = x[1:].masked_fill(~t[1:], IGNORE)   # token j+1 at position j
    pos = (mask.cumsum(1) - 1).clamp(min=0)                 # positions ignore the left pad
    return ids, mask, pos, labels


# --- 2. The loss: the LM body on every position, the head only on the supervised ones ------------
#   full:  log p(y) = z_y - logsumexp_{v in V} z_v                  (the whole vocabulary)
#   sid:   log p(y) = z_y - logsumexp_{v in SID tokens} z_v         (SID targets; others as full)
#   level: log p(y) = z_y - logsumexp_{v in level(y)} z_v           (the codes of y's level)
# 06_eval.py scores with the same softmax (sft_config.json), so training and ranking agree.
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
        h = self.lm.base_model(input_ids=ids, attention_mask=mask, position_ids=pos,
                               use_cache=False).last_hidden_state               # (B, T, d)
        sel = labels != IGNORE
        h, y = h[sel], labels[sel]                                              # (N, d), (N,)
        head = self.lm.get_output_embeddings()
        col = self.col_of[y]                                                    # (N,) -1: not a SID
        sub = col >= 0 if self.softmax != "full" else torch.zeros_like(col, dtype=torch.bool)
        loss, hits = h.new_zeros((), dtype=torch.float32), torch.zeros_like(y, dtype=torch.bool)
        if (~sub).any():                                                        # full vocabulary
            z = head(h[~sub]).float()                                           # (N1, V)
            loss = loss + F.cross_entropy(z, y[~sub], reduction="sum")
            hits[~sub] = z.argmax(-1) == y[~sub]
        if sub.any():                                                           # SID columns only
            b = head.bias[self.cols] if head.bias is not None else None
            z = F.linear(h[sub], head.weight[self.cols], b).float()             # (N2, C)
            if self.softmax == "level":                                         # other levels: -inf
                z = z.masked_fill(self.level[None, :] != self.level[col[sub]][:, None], -math.inf)
            loss = loss + F.cross_entropy(z, col[sub], reduction="sum")
            hits[sub] = z.argmax(-1) == col[sub]
        return loss, hits


# --- 3. The loop: AdamW + warmup/cosine over a seeded example stream; validation keeps the best
def stream_batch(n: int, offset: int, size: int, seed: int, perms: dict):
    """Examples offset .. offset+size-1 of the endless stream: epoch e = randperm(n, seed + e)."""
    out = []
    for o in range(offset, offset + size):
        e = o // n
        if e not in perms:
            perms.clear()
            perms[e] = torch.randperm(n, generator=torch.Generator().manual_seed(seed + e)).tolist()
        out.append(perms[e][o % n])
    return out


def lr_lambda(args, total):
    def f(step):                                            # multiplier of args.lr at step `step`
        if step < args.warmup:
            return (step + 1) / args.warmup
        p = (step - args.warmup) / max(1, total - args.warmup)
        cos = 1 + math.cos(math.pi * min(1.0, p))                   # 2 -> 0 over the run
        return MIN_LR_FRAC + (1 - MIN_LR_FRAC) * 0.5 * cos
    return f


@torch.no_grad()
def validate(model, val_rows, batch_size, pad_id, device, ctx, K, rank=0, world=1):
    """Validation loss, token accuracy, and accuracy per target position (the K tokens every
    validation target has: SID levels [+ eos]), summed over all processes."""
    model.eval()
    tot = torch.zeros(3 + K, dtype=torch.float64, device=device)
    mine = val_rows[rank::world]
    for s in range(0, len(mine), batch_size):
        ids, mask, pos, labels = (x.to(device) for x in collate(mine[s:s + batch_size], pad_id))
        with ctx:
            loss, hits = model(ids, mask, pos, labels)
        per_pos = hits.view(-1, K).sum(0)                           # every row has K targets  (K,)
        n = torch.tensor(float(len(hits)), dtype=torch.float64, device=device)
        tot += torch.cat([torch.stack([loss.double(), n, hits.sum().double()]), per_pos.double()])
    if world > 1:
        dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item(), (tot[2] / tot[1]).item(), (tot[3:] / (tot[1] / K)).tolist()


# --- Main: rows -> loss -> loop, then save --------------------------------------------------------
def main():
    args = parse_args()
    run = sft_setup(args)                       # processes, device, autocast, paths, seed, template
    run.log(f"device {run.device}  world {run.world}  {run.dtype_note}  model {args.model}")

    # 1. rows: training examples from the train parts only, one validation row per user
    model, tok, vocab, data, _, item_tok, _ = load_sid_model(args.model, run.out_dir, "cpu")
    rows = sft_rows(args, run, tok, vocab, data, item_tok)
    per_step = args.batch_size * args.grad_accum                       # examples per optimizer step
    total = (math.ceil(args.epochs * len(rows.examples) / per_step) if args.epochs > 0
             else args.steps)
    run.log(f"objective {args.objective}  softmax {args.softmax}  examples {len(rows.rec)} "
            f"recommendation ({rows.targets} target items) + {len(rows.aux)} auxiliary, val "
            f"{len(rows.val)}  steps {total} x {per_step} examples "
            f"({total * per_step / len(rows.examples):.2f} epochs)")

    # 2. loss: the LM inside SIDLoss (over the --softmax set); AdamW, warmup then cosine
    model.to(run.device)
    level_tok = [torch.tensor(t) for t in vocab["token_ids"]]
    loss_model = SIDLoss(model, args.softmax, level_tok).to(run.device)
    opt = sft_optimizer(args, model, run.device)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args, total))

    # 3. loop (--resume first restores model, optimizer, schedule and this state), 4. save
    state = {"step": 0, "best_val": float("inf"), "best_score": float("inf"), "best_step": -1,
             "loss_curve": [], "val_curve": [], "val_level_acc": [], "rank_curve": [],
             "seconds": 0.0, "rank_seconds": 0.0, "stopped_at": total}
    resume_key = {"args": {k: getattr(args, k) for k in RESUME_KEYS},
                  "examples": len(rows.examples), "world": run.world}
    if args.resume:
        state = load_resume(run.ckpt, resume_key, model, opt, sched, run.device)
        run.log(f"resumed from {run.ckpt} at step {state['step']}")
    train_model = wrap_ddp(loss_model, run.device)
    files = sft_files(args, run.template, vocab)
    save_best = lambda dst=run.save: save_folder(dst, model, tok, files)  # noqa: E731
    save_state = lambda: save_resume(  # noqa: E731
        run.ckpt, model, opt, sched, state, resume_key, run.device)
    if sft_loop(args, run, rows, state, total, model, train_model, opt, sched, save_best,
                save_state):
        write_sft_json(args, run, rows, state, total)
    if dist.is_initialized():
        dist.destroy_process_group()


def sft_setup(args):
    """Processes (one, or torchrun's), device, autocast, the output paths and the seed."""
    if args.epochs < 0:
        die(f"--epochs {args.epochs}: must be >= 0")
    if args.select == "ndcg" and not args.rank_users:
        die("--select ndcg needs validation NDCG: pass --rank-users N (e.g. 943, all of ML-100K)")
    rank, world, device = start_processes(args.device)
    if args.batch_size % world:
        die(f"--batch-size {args.batch_size} must be divisible by the {world} processes")
    ctx, dtype_note = pick_autocast(args.dtype, device)
    save = args.save or args.model.rstrip("/") + "+sft"
    out_dir = args.out_dir or os.path.dirname(os.path.dirname(os.path.abspath(args.model)))
    if args.resume and not os.path.exists(f"{save}.resume.pt"):
        die(f"--resume: {save}.resume.pt not found (a finished run removes it); "
            "run without --resume")
    seed_everything(args.seed)
    template = args.template or TEMPLATES[args.objective]
    check_template(template, args.objective)
    return SimpleNamespace(rank=rank, world=world, device=device, master=rank == 0,
                           log=print if rank == 0 else (lambda *a, **k: None),
                           per_rank=args.batch_size // world, ctx=ctx, dtype_note=dtype_note,
                           save=save, ckpt=f"{save}.resume.pt", out_dir=out_dir, template=template,
                           rank_dir=f"{save}.rank")


def sft_rows(args, run, tok, vocab, data, item_tok):
    """The examples (train parts only), their Encoder, and the validation rows (one per user)."""
    train, valid = data["train"], data["valid"].tolist()
    rec, aux = build_examples(train, len(item_tok), args.objective, args.max_history,
                              args.aux_ratio if args.aux_tasks else 0.0, args.seed)
    if not rec:
        die(f"{run.out_dir}/dataset.pt has no training positions "
            "(train parts shorter than 2 items)")
    encode = Encoder(tok, run.template, args.objective, item_tok, data["texts"], train, valid,
                     args.max_history)
    users = validation_users(train, args.val_examples, args.seed)
    return SimpleNamespace(
        rec=rec, aux=aux, examples=rec + aux, encode=encode,
        val=[encode((VALID_ROW, u, 0)) for u in users],
        positions=vocab["level_names"] + ([] if args.objective == "sequence" else ["eos"]),
        pad_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        targets=sum(len(s) - 1 for s in train if len(s) > 1))


def sft_optimizer(args, model, device):
    """AdamW; weight decay on the matrices only (not on norms and biases)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                              {"params": no_decay, "weight_decay": 0.0}], lr=args.lr,
                             betas=(0.9, 0.95), fused=device.type in ("cuda", "cpu"))  # fused


def sft_files(args, template, vocab):
    """What the saved folder carries besides the model: sid_vocab.json and sft_config.json."""
    target = "SID tokens" + ("" if args.objective == "sequence" else " + eos")
    sft_config = {"objective": args.objective, "template": template,
                  "max_history": args.max_history, "softmax": args.softmax, "target": target,
                  "aux_tasks": args.aux_tasks, "aux_templates": AUX_TEMPLATES}
    return {"sid_vocab.json": json.dumps(vocab),
            "sft_config.json": json.dumps(sft_config, indent=2)}


def sft_loop(args, run, rows, state, total, model, train_model, opt, sched, save_best, save_state):
    """`step` = optimizer steps done. Validates at step 0, every --eval-every steps and at the end
    (a resumed step was validated already). Returns False when --stop-at ended the run early."""
    train_model.train()
    perms, first = {}, state["step"]
    t_start = t_log = time.time()
    for step in range(first, total + 1):
        if (step % args.eval_every == 0 or step == total) and not (step == first and args.resume):
            state["seconds"] += time.time() - t_start
            validate_and_keep(args, run, rows, state, step, total, train_model, save_best,
                              save_state)
            t_start = t_log = time.time()
            late = sum(1 for s, *_ in state["val_curve"] if s > state["best_step"])
            if args.patience and late >= args.patience and step < total:
                run.log(f"no better validation for {late} evaluations: stopping at step {step}")
                state["stopped_at"] = step
                return True
        if step == total:
            return True
        if args.stop_at and step == args.stop_at and step > first:
            run.log(f"stopped after step {step} (--stop-at); continue with --resume")
            return False
        loss, gnorm = sft_step(args, run, rows, step, perms, model, train_model, opt, sched)
        state["loss_curve"].append([step + 1, round(loss, 5)])
        state["step"] = step + 1
        if (step + 1) % args.log_every == 0 or step + 1 == total:
            ms = 1000 * (time.time() - t_log) / ((step + 1) % args.log_every or args.log_every)
            run.log(f"step {step + 1}/{total} | loss {state['loss_curve'][-1][1]:.4f} | "
                    f"lr {sched.get_last_lr()[0]:.2e} | gnorm {gnorm:.2f} | {ms:.0f} ms/step")
            t_log = time.time()


def validate_and_keep(args, run, rows, state, step, total, train_model, save_best, save_state):
    """Validation loss and accuracies [+ 06's Recall/NDCG@10 on the validation item]; rank 0
    saves the best model (by --select) and the resumable state."""
    vloss, vacc, vpos = validate(train_model, rows.val, run.per_rank, rows.pad_id, run.device,
                                 run.ctx, len(rows.positions), run.rank, run.world)
    state["val_curve"].append([step, round(vloss, 5), round(vacc, 5)])
    state["val_level_acc"].append([step, [round(x, 4) for x in vpos]])
    ranked = ""
    if args.rank_users:
        recall, ndcg = rank_validation(args, run, state, save_best)
        state["rank_curve"].append([step, recall, ndcg])
        ranked = f" | val Recall@10 {recall:.4f} NDCG@10 {ndcg:.4f}"
    score = -state["rank_curve"][-1][2] if args.select == "ndcg" else vloss   # lower is better
    better = score < state["best_score"]
    if better:
        state["best_score"], state["best_val"], state["best_step"] = score, vloss, step
        if run.master:
            save_best()
    run.log(f"step {step}/{total} | val loss {vloss:.4f} | val token acc {vacc:.3f} ("
            + " ".join(f"{n} {x:.2f}" for n, x in zip(rows.positions, vpos)) + ")" + ranked
            + (" | best, saved" if better else ""))
    if run.master and args.resumable and 0 < step < total:     # the last step needs no resume state
        save_state()
    if dist.is_initialized():
        dist.barrier()


def rank_validation(args, run, state, save_best):
    """Rank 0 saves the model to <save>.rank and runs 06_eval.py on it: the validation item of the
    first --rank-users users, history excluded, beam 20 (06's code and protocol; the test item is
    not read). Returns (Recall@10, NDCG@10), the same on every process."""
    res = [0.0, 0.0]
    if run.master:
        t = time.time()
        save_best(run.rank_dir)
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "06_eval.py")
        cmd = [sys.executable, script, "--model", run.rank_dir, "--out-dir", run.out_dir,
               "--split", "valid", "--protocol", "excluded", "--beam", "20", "--users",
               str(args.rank_users), "--device", run.device.type, "--dtype", args.dtype]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            last = (r.stderr.strip() or r.stdout.strip() or "no output").splitlines()[-1]
            die(f"06_eval.py on {run.rank_dir} failed: {last}")
        m = load_json(os.path.join(run.rank_dir, "eval_valid.json"), "rerun 05_sft.py")["model"]
        res = [round(m["recall@10"], 5), round(m["ndcg@10"], 5)]
        state["rank_seconds"] += time.time() - t
    if dist.is_initialized():
        dist.broadcast_object_list(res, src=0)
    return res


def sft_step(args, run, rows, step, perms, model, train_model, opt, sched):
    """One optimizer step over grad_accum micro-batches (this rank's slice of each), the summed
    loss divided by the target tokens of the whole step. Returns (mean loss, gradient norm)."""
    offsets = [(step * args.grad_accum + micro) * args.batch_size + run.rank * run.per_rank
               for micro in range(args.grad_accum)]        # this rank's slice of each micro-batch
    batches = [collate([rows.encode(rows.examples[i]) for i in
                        stream_batch(len(rows.examples), o, run.per_rank, args.seed, perms)],
                       rows.pad_id) for o in offsets]
    n = torch.tensor([float(sum(int((b[3] != IGNORE).sum()) for b in batches))], device=run.device)
    tot = torch.zeros(1, dtype=torch.float64, device=run.device)      # summed loss of this step
    if dist.is_initialized():
        dist.all_reduce(n)                                # target tokens of the step, all processes
    for micro, batch in enumerate(batches):
        ids, mask, pos, labels = (x.to(run.device) for x in batch)
        with grad_sync(train_model, last=micro == args.grad_accum - 1):
            with run.ctx:
                loss, _ = train_model(ids, mask, pos, labels)
            (loss * run.world / n[0]).backward()   # DDP averages over processes: sum / all targets
        tot += loss.detach().double()
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    if dist.is_initialized():
        dist.all_reduce(tot)
    return (tot[0] / n[0]).item(), gnorm


def write_sft_json(args, run, rows, state, total):
    """Rank 0: 05_sft.json beside the best model; the resume state is no longer needed."""
    summary = {"loss_curve": state["loss_curve"], "val_curve": state["val_curve"],
               "rank_curve": state["rank_curve"], "rank_users": args.rank_users,
               "select": args.select, "best_step": state["best_step"],
               "stopped_at": state["stopped_at"],
               "val_level_acc": state["val_level_acc"],
               "val_level_names": rows.positions, "best_val_loss": state["best_val"],
               "steps": total, "examples": len(rows.rec), "target_items": rows.targets,
               "aux_examples": len(rows.aux), "val_examples": len(rows.val),
               "world_size": run.world, "batch_size": args.batch_size,
               "grad_accum": args.grad_accum, "seconds": round(state["seconds"], 1),
               "s_per_step": round(state["seconds"] / max(1, state["step"]), 3),
               "rank_seconds": round(state["rank_seconds"], 1),
               "device": str(run.device), "autocast": run.dtype_note, "args": vars(args)}
    if not run.master:
        return
    if not os.path.isdir(run.save):
        die(f"no checkpoint was saved to {run.save} (validation loss never finite)")
    atomic_write(os.path.join(run.save, "05_sft.json"),
                 lambda t: open(t, "w").write(json.dumps(summary, indent=2)))
    if os.path.exists(run.ckpt):
        os.remove(run.ckpt)
    shutil.rmtree(run.rank_dir, ignore_errors=True)
    by = f"val NDCG@10 {-state['best_score']:.4f}" if args.select == "ndcg" else "val loss"
    run.log(f"best step {state['best_step']} ({by}) val loss {state['best_val']:.4f}  "
            f"({summary['s_per_step']:.2f} s/step, validation not counted)  saved {run.save}")


# --- Beyond the papers: several processes (torchrun + DDP) and resumable runs ---------------------
# `torchrun --nproc_per_node=4 05_sft.py --model out/ml-100k/models/centroid+gti --epochs 10
# --batch-size 256`: DistributedDataParallel, NCCL on CUDA, gloo on CPU; rank 0 logs and saves.
# --batch-size is the global micro-batch, split over the processes; each step's loss is normalized
# by the target tokens of all processes together, so the gradients equal a single-process run's up
# to float rounding. The example order is a pure function of (seed, step), so --resume continues a
# killed run from its last checkpoint with the same numbers (on CPU; on CUDA, bf16 autocast and
# non-deterministic cuBLAS/SDPA kernels make runs differ slightly).
def start_processes(device_name: str):
    """(rank, world, device): under torchrun, join its process group; else one process."""
    if int(os.environ.get("RANK", -1)) == -1:                         # not launched by torchrun
        return 0, 1, pick_device(device_name)
    use_cuda = device_name in ("auto", "cuda") and torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def wrap_ddp(loss_model, device):
    if not dist.is_initialized():
        return loss_model
    return DDP(loss_model, device_ids=[device.index] if device.type == "cuda" else None)


def grad_sync(train_model, last: bool):
    """DDP all-reduces the gradients in backward(): only on a step's last micro-batch."""
    return train_model.no_sync() if isinstance(train_model, DDP) and not last else nullcontext()


# Resume: the whole training state in <save>.resume.pt, written at each validation
RESUME_KEYS = ("model", "objective", "softmax", "template", "max_history", "aux_tasks", "aux_ratio",
               "steps", "epochs", "batch_size", "grad_accum", "lr", "warmup", "eval_every",
               "val_examples", "rank_users", "select", "patience", "dtype", "seed")   # must match


def save_resume(path, model, opt, sched, state, key: dict, device):
    """Model, optimizer, schedule, RNG and the loop's state; `key` = what --resume checks."""
    ck = {"model": model.state_dict(), "optimizer": opt.state_dict(),
          "scheduler": sched.state_dict(), "rng": torch.get_rng_state(), "state": state, **key}
    if device.type == "cuda":
        ck["cuda_rng"] = torch.cuda.get_rng_state(device)
    atomic_write(path, lambda t: torch.save(ck, t))


def load_resume(path, key: dict, model, opt, sched, device) -> dict:
    """Restore what save_resume wrote (same arguments and world size, or one line); returns the
    loop state."""
    ck = load_pt(path, "rerun without --resume")
    diff = [k for k in key["args"] if ck["args"].get(k) != key["args"][k]]
    if diff or ck["examples"] != key["examples"] or ck["world"] != key["world"]:
        die(f"--resume: {path} was written with other arguments "
            f"({', '.join(diff) or 'world size'}); use the same ones or run without --resume")
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    sched.load_state_dict(ck["scheduler"])
    torch.set_rng_state(ck["rng"])
    if device.type == "cuda" and "cuda_rng" in ck:
        torch.cuda.set_rng_state(ck["cuda_rng"], device)
    return ck["state"]


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


def pick_autocast(name: str, device: torch.device, cpu_bf16_pays: bool = True):
    """The one dtype rule: weights, optimizer state and softmaxes stay fp32; only the matmuls may
    run in bf16 (autocast). Returns (autocast context, a note the script prints).
      float32:  no autocast.
      bfloat16: bf16 autocast on CUDA and CPU (emulated and slower without bf16 instructions);
                fp32 on MPS.
      auto:     bf16 on CUDA, and on CPUs with native bf16 (AVX512-BF16 / AMX) in the steps where it
                measured faster (cpu_bf16_pays; docs/design.md); float32 elsewhere."""
    native_cpu = device.type == "cpu" and getattr(torch.cpu, "_is_avx512_bf16_supported",
                                                  lambda: False)()
    if name == "auto":
        fast = device.type == "cuda" or (native_cpu and cpu_bf16_pays)
        name = "bfloat16" if fast else "float32"
    if name == "float32" or device.type == "mps":
        return nullcontext(), "float32"
    note = f"bf16 autocast on {device.type} (fp32 weights)"
    return torch.autocast(device.type, dtype=torch.bfloat16), note


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


def save_folder(dst: str, model, tok, files: dict):
    """A Hugging Face folder (model + tokenizer + files {name: text}) written to <dst>.tmp, then
    swapped in. Safe against a kill at any line: before the swap <dst> is whole; between the two
    renames only <dst>.old is (the next call renames it back first); stale .tmp/.old are cleared."""
    tmp, old = f"{dst}.tmp", f"{dst}.old"
    if os.path.isdir(old) and not os.path.isdir(dst):                  # killed between the renames
        os.replace(old, dst)
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    for name, text in files.items():
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
    if os.path.exists(dst):
        os.replace(dst, old)
    os.replace(tmp, dst)
    shutil.rmtree(old, ignore_errors=True)


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


def load_json(path: str, hint: str):
    return load_artifact(path, hint, lambda p: json.loads(open(p, encoding="utf-8").read()))


def load_hf(folder: str, hint: str, dtype=torch.float32):
    """(tokenizer, causal LM) from a Hugging Face folder (or hub name, offline: only if cached)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()                          # stderr stays one line on bad input
    try:
        tok = AutoTokenizer.from_pretrained(folder)
        return tok, AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    except Exception as e:
        why = "not found" if not os.path.exists(folder) else f"unreadable ({type(e).__name__})"
        die(f"{folder}: {why}; {hint}")


def items_key(ds: dict) -> str:
    """Fingerprint of dataset.pt's items (ids and texts, in order). 03 writes it into
    sid_vocab.json, so a model folder knows which dataset its SIDs index; 04-06 refuse another."""
    return hashlib.sha256(json.dumps([ds["item_ids"], ds["texts"]]).encode()).hexdigest()[:16]


# Inputs: the model folder, its SID vocabulary and the dataset it must match (also in 04, 06)
def load_sid_model(model_dir: str, out_dir: str, device):
    """A folder made by 03, 04 or 05 (HF model + tokenizer + sid_vocab.json [+ sft_config.json])
    and the dataset.pt whose items its SIDs name, checked against each other. Returns the fp32
    model on `device`, tokenizer, sid_vocab, dataset, codes (N, L+1) every item's SID as codes,
    item_tok (N, L+1) the same as token ids, and sft_config.json ({} when absent)."""
    path = os.path.join(model_dir, "sid_vocab.json")
    hint = "use a folder made by 03_expand_vocab.py (or 04/05)"
    vocab = load_json(path, hint)
    data = load_pt(os.path.join(out_dir, "dataset.pt"),
                   "run 01_embed_items.py first (or pass --out-dir)")
    fields = {"item_ids", "texts", "sequences", "train", "valid", "test", "popularity"}
    if not isinstance(data, dict) or not fields <= data.keys():
        die(f"{out_dir}/dataset.pt lacks the fields 01_embed_items.py writes; "
            "rerun it (or pass --out-dir)")
    try:
        codes = np.array(vocab["item_codes"], dtype=np.int64)                    # (N, L+1)
        item_tok = torch.tensor(vocab["item_token_ids"], dtype=torch.long)       # (N, L+1)
        names = [f"<{vocab['level_names'][l]}_{c}>" for row in codes.tolist()
                 for l, c in enumerate(row)]
    except (KeyError, TypeError, ValueError, IndexError) as e:
        die(f"{path} lacks what 03_expand_vocab.py writes ({type(e).__name__}: {e}); "
            "rebuild the folder with 03")
    if vocab.get("items_key") != items_key(data) or codes.shape != item_tok.shape:
        die(f"{path} was built for another dataset than {out_dir}/dataset.pt ({len(codes)} items "
            f"vs {len(data['item_ids'])}, or other ids/texts); rerun 03_expand_vocab.py "
            f"--out-dir {out_dir} or pass --out-dir")
    tok, model = load_hf(model_dir, hint)
    if tok.convert_ids_to_tokens(item_tok.flatten().tolist()) != names:
        die(f"{model_dir}: the tokenizer does not hold the SID tokens listed in sid_vocab.json; "
            "rebuild the folder with 03_expand_vocab.py")
    if model.get_input_embeddings().num_embeddings <= int(item_tok.max()):
        die(f"{model_dir}: embedding matrix smaller than the SID token ids; "
            "rebuild it with 03_expand_vocab.py")
    cfg_path = os.path.join(model_dir, "sft_config.json")
    sft_cfg = load_json(cfg_path, "rerun 05_sft.py") if os.path.exists(cfg_path) else {}
    return model.to(device).eval(), tok, vocab, data, codes, item_tok, sft_cfg


if __name__ == "__main__":
    main()
