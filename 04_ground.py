"""Step 4: GTI grounding (only the new SID rows train) or CPT (every parameter), text <-> SID pairs.

GTI (Chen et al. 2026, method section), between steps 03 and 05: freeze the LM and every pretrained
row; train the new token rows (and an untied head's same rows) on next-token NLL over item texts:
    text -> SID:  "<item text> is item" -> <a_12><b_3><c_40><d_0>
    SID -> text:  "Item <a_12><b_3><c_40><d_0> is" -> " <item text></s>"
    loss = - mean_{t in target} log p(y_t | y_<t)         (prompt positions masked with -100)
    g_W  <- g_W * m[:, None],  m_v = 1 iff token v is new   (row mask; AdamW, weight decay 0)
--train all is continued pretraining (CPT, the centroid paper's alignment stage): the same pairs
and loss, every parameter trained (lr 1e-4, warmup then constant, so the folder saved after epoch E
is the same whatever --epochs is), counted in --epochs over the pairs.
One CPT epoch on ML-100K = 378 steps of 8 pairs: 613 s measured on 2 CPU cores (bf16).
Reads:  <model> (03's folder, default <out-dir>/models/centroid), <out-dir>/dataset.pt
Writes: <save> (default <model>+gti; --train all: <model>+cpt<E> at each of --save-epochs): model,
        tokenizer, sid_vocab.json, 04_ground.json; --train all: <save>.resume.pt at each of
        --save-epochs (--resume continues from it; the finished run removes it)
CPU:  python 04_ground.py --model out/ml-100k/models/centroid
GPU:  python 04_ground.py --device cuda --steps 2000 --batch-size 64       (the same default model)
CPT:  python 04_ground.py --model out/ml-100k/models/random --train all --epochs 4 --save-epochs 1,2
Good run: the loss falls, held-out in-level accuracy beats chance, `pretrained rows unchanged: True`
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
import sys
import time
import typing
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
import torch


@dataclass
class Args:
    dataset: str = "ml-100k"
    """only picks the default --out-dir (out/<dataset>)"""
    out_dir: str = ""
    """artifacts folder with dataset.pt (item texts; default: out/<dataset>)"""
    model: str = ""
    """03's folder to ground (default: <out-dir>/models/centroid)"""
    save: str = ""
    """output folder (default: <model>+gti)"""
    train: Literal["rows", "all"] = "rows"
    """rows: GTI, only the new rows (masked gradients) | all: CPT, every parameter"""
    steps: Annotated[int, ">= 1"] = 200
    """optimizer steps (ignored when --epochs > 0)"""
    epochs: Annotated[int, ">= 0"] = 0
    """passes over the grounding pairs (sets the steps; 0: use --steps)"""
    save_epochs: str = ""
    """--train all: also save <model>+cpt<E> after each of these epochs (e.g. 1,2,4)"""
    batch_size: Annotated[int, ">= 1"] = 8
    """examples per step (text->SID and SID->text mixed)"""
    lr: Annotated[float, ">= 0"] = 0.0
    """peak learning rate (AdamW; 0: 1e-2 for --train rows, 1e-4 for all)"""
    warmup: Annotated[int, ">= 0"] = 10
    """linear warmup steps, then cosine decay to 0 (--train all: constant after the warmup)"""
    loss_average: Literal["tokens", "directions"] = "tokens"
    """tokens (one mean over all target tokens) | directions (mean NLL per direction, averaged)"""
    grad_clip: float = 1.0
    """clip the gradient norm of the trained rows (0 = off)"""
    holdout_frac: float = 0.1
    """fraction of items held out from grounding to measure text->SID accuracy"""
    max_eval: Annotated[int, ">= 0"] = 64
    """held-out (and seen) items scored before/after at most"""
    max_text_tokens: Annotated[int, ">= 1"] = 48
    """truncate item texts to this many tokens"""
    log_every: Annotated[int, ">= 1"] = 25
    """steps per log line"""
    resume: bool = False
    """--train all: continue from <save>.resume.pt, written at each --save-epochs epoch"""
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    """auto = cuda, else mps, else cpu"""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """bf16 autocast or not; weights, optimizer, loss stay fp32 (auto: bf16 on CUDA, native CPUs)"""
    seed: int = 0
    """seeds random, numpy and torch; the held-out split and the batch order"""


def build_pairs(tok, texts, item_tids, items, max_text):
    """1. Pairs: per item two examples (prompt ids, target ids, is_text_to_sid)."""
    ids = lambda s: tok(s, add_special_tokens=False).input_ids
    is_item, item_w, is_w = ids(" is item"), ids("Item"), ids(" is")
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    return [ex for i in items for ex in (
        (ids(texts[i])[:max_text] + is_item, item_tids[i], True),                     # text -> SID
        (item_w + item_tids[i] + is_w, ids(" " + texts[i])[:max_text] + eos, False))]  # SID -> text


def collate_right(batch, pad_id):
    """Right-pad to the longest example of this batch; labels -100 on prompt and padding."""
    B, T = len(batch), max(len(p) + len(t) for p, t, _ in batch)
    x, attn = torch.full((B, T), pad_id, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
    labels = torch.full((B, T), -100, dtype=torch.long)
    for b, (p, t, _) in enumerate(batch):
        n = len(p) + len(t)
        x[b, :n], attn[b, :n], labels[b, len(p):n] = torch.tensor(p + t), 1, torch.tensor(t)
    return x, attn, labels, torch.tensor([k for _, _, k in batch])   # kind: True = text -> SID (B,)


def target_logits(model, x, attn, labels):
    """2. Loss: the LM body, then the head only at labelled positions (the vocab-wide head costs
    most): logits (M, V) where the next token is a target, those targets (M,), mask (B, T-1)."""
    h = model.base_model(input_ids=x, attention_mask=attn, use_cache=False).last_hidden_state
    y = labels[:, 1:]                                           # next-token targets  h: (B, T, D)
    sel = y != -100                                             # target positions      (B, T-1)
    return model.get_output_embeddings()(h[:, :-1][sel]).float(), y[sel], sel


def grounding_loss(logits, y, is_t2s, average: str):
    """NLL over the M target tokens: "tokens" one mean; "directions" the text->SID mean and the
    SID->text mean, averaged (an absent direction drops out): 4 SID tokens weigh like a title."""
    nll = torch.nn.functional.cross_entropy(logits, y, reduction="none")                    # (M,)
    if average == "tokens":
        return nll.mean()
    parts = [nll[m].mean() for m in (is_t2s, ~is_t2s) if m.any()]
    return sum(parts) / len(parts)


def mask_row_grads(weight: torch.nn.Parameter, new_ids: torch.Tensor):
    """3. Masked update: g_W <- g_W * m[:, None]; AdamW(weight_decay=0) then never moves a row."""
    m = torch.zeros(weight.shape[0], 1, device=weight.device, dtype=weight.dtype)
    m[new_ids] = 1.0                                            # (V, 1)
    weight.register_hook(lambda g: g * m)


def freeze_all_but_new_rows(model, new_ids: torch.Tensor):
    """Only the embedding (and an untied head's same rows) train, under the row mask. Returns them
    and a check: every pretrained row and parameter bit-identical? (and the new rows' mean shift)"""
    model.requires_grad_(False)
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    trained = [emb] + ([head] if head is not emb else [])
    originals = [w.detach().clone() for w in trained]
    others = {n: p.detach().clone() for n, p in model.named_parameters()
              if all(p is not w for w in trained)}
    for w in trained:
        w.requires_grad_(True)
        mask_row_grads(w, new_ids)
    keep = torch.ones(emb.shape[0], dtype=torch.bool, device=emb.device)
    keep[new_ids] = False                                       # the pretrained rows
    shift = new_row_shift(model, new_ids)
    def unchanged():
        ok = all(torch.equal(w.detach()[keep], o[keep]) for w, o in zip(trained, originals)) and \
            all(torch.equal(model.get_parameter(n).detach(), o) for n, o in others.items())
        return ok, shift()[1]
    return trained, unchanged


def new_row_shift(model, new_ids: torch.Tensor):
    """CPT's counterpart of the check above: () -> (None, the new rows' mean L2 shift since now)."""
    ws = list(dict.fromkeys((model.get_input_embeddings().weight,     # untied head: both
                             model.get_output_embeddings().weight)))
    start = [w.detach()[new_ids].clone() for w in ws]
    return lambda: (None, float(sum((w.detach()[new_ids] - s).norm(dim=1).mean()
                                    for w, s in zip(ws, start))))


def ground_rows(model, pairs, trained, g, pad_id, device, ctx, args: Args, at_step=None,
                state=None):
    """The loop: pairs -> logits at the targets -> loss -> masked row update, AdamW with linear
    warmup then cosine decay to 0 (CPT: constant); at_step(step, snapshot) after each step, where
    snapshot() is the loop's state, which `state` restores (--resume). Returns the loss curve (a
    point per log line) and its seconds. An epoch = len(pairs) // batch_size steps, then a
    reshuffle."""
    opt = torch.optim.AdamW(trained, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0,
                            fused=device.type in ("cuda", "cpu"))      # fused: one kernel per step
    w, decay = args.warmup, max(1, args.steps - args.warmup)

    def lr_factor(s):  # warmup, then cosine to 0 (GTI) or constant (CPT: epoch E's weights do
        if s < w:      # not depend on --epochs: a long run's +cpt1, +cpt2 are short runs' ends)
            return (s + 1) / w
        return 1.0 if args.train == "all" else 0.5 * (1 + math.cos(math.pi * (s - w) / decay))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    order, pos, curve, t_loop, first, run = [], 0, [], time.time(), 1, (0.0, 0.0, 0.0)
    if state:                                    # saved at an epoch's end: the next step reshuffles
        opt.load_state_dict(state.pop("opt"))                  # copied in: drop the file's copy
        sched.load_state_dict(state["sched"])
        g.set_state(state["g"])
        first, curve, run = state["step"] + 1, state["curve"], state["run"]
        t_loop -= state["s"]
    (run_loss, run_hit, run_n), t_int = run, time.time()
    for step in range(first, args.steps + 1):
        if pos + args.batch_size > len(order):                  # new epoch: reshuffle the pairs
            order, pos = torch.randperm(len(pairs), generator=g).tolist(), 0
        batch = [pairs[i] for i in order[pos:pos + args.batch_size]]
        pos += args.batch_size
        x, attn, labels, kind = (t.to(device) for t in collate_right(batch, pad_id))
        with ctx:
            logits, y, sel = target_logits(model, x, attn, labels)
        is_t2s = kind[:, None].expand_as(sel)[sel]              # targets that are SID tokens (M,)
        loss = grounding_loss(logits, y, is_t2s, args.loss_average)
        opt.zero_grad(set_to_none=True)
        loss.backward()                                         # the hooks mask the row grads
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(trained, args.grad_clip)
        opt.step()
        sched.step()
        run_loss += loss.item()
        run_hit += float((logits.argmax(-1) == y)[is_t2s].sum())
        run_n += float(is_t2s.sum())
        if step % args.log_every == 0 or step == args.steps:
            k, acc = (step - 1) % args.log_every + 1, run_hit / max(run_n, 1)
            curve.append({"step": step, "loss": round(run_loss / k, 4), "t2s_acc": round(acc, 4)})
            print(f"step {step:5d} | loss {run_loss / k:.4f} | text->SID acc {acc:.3f} | lr "
                  f"{sched.get_last_lr()[0]:.2e} | {1000 * (time.time() - t_int) / k:.0f} ms/step",
                  flush=True)
            (run_loss, run_hit, run_n), t_int = (0.0, 0.0, 0.0), time.time()
        if at_step:
            at_step(step, lambda: {"step": step, "opt": opt.state_dict(),
                                   "sched": sched.state_dict(), "g": g.get_state(), "curve": curve,
                                   "s": time.time() - t_loop, "run": (run_loss, run_hit, run_n)})
    return curve, time.time() - t_loop


def tie_hits(scores, target):
    """4. Held-out accuracy: expected argmax hits, ties broken at random: (B, K), (B,) -> (B,)."""
    best = scores == scores.max(-1, keepdim=True).values                 # (B, K)
    return best.gather(1, target[:, None]).squeeze(1).float() / best.sum(-1)


@torch.no_grad()
def grounding_accuracy(model, pairs, level_ids, pad_id, device, ctx, bs=32):
    """Text -> SID next-token accuracy per level (teacher forcing): argmax over the whole vocabulary
    (`acc`) and among the level's tokens (`acc_in_level`); a tie counts 1/#tied (mean init ties)."""
    model.eval()
    L = len(level_ids)
    hit, hit_lvl, n = torch.zeros(L), torch.zeros(L), 0
    for s in range(0, len(pairs), bs):
        x, attn, labels, _ = collate_right(pairs[s:s + bs], pad_id)
        with ctx:
            logits, y, _ = target_logits(model, x.to(device), attn.to(device), labels.to(device))
        logits, y = logits.view(-1, L, logits.shape[-1]).cpu(), y.view(-1, L).cpu()  # (B, L, V)
        for l, ids in enumerate(level_ids):
            hit[l] += tie_hits(logits[:, l], y[:, l]).sum()
            in_level = (ids[None, :] == y[:, l, None]).long().argmax(1)   # target's index in ids
            hit_lvl[l] += tie_hits(logits[:, l, ids], in_level).sum()
        n += len(y)
    model.train()
    return {"items": n, "acc": [round(float(v) / max(n, 1), 4) for v in hit],
            "acc_in_level": [round(float(v) / max(n, 1), 4) for v in hit_lvl],
            "chance_in_level": [round(1 / len(ids), 4) for ids in level_ids]}


def parse_save_epochs(args):
    """--save-epochs "1,2,4" -> {1, 2, 4}: whole epochs in 1 .. --epochs, only with --train all."""
    try:
        eps = {int(e) for e in args.save_epochs.split(",") if e.strip()}
    except ValueError:
        eps = {0}
    if eps and (args.train != "all" or min(eps) < 1 or max(eps) > args.epochs):
        die(f"--save-epochs {args.save_epochs!r}: whole epochs between 1 and --epochs "
            f"({args.epochs}), with --train all")
    return eps


def main():
    args = parse_args()
    args.out_dir = args.out_dir or os.path.join("out", args.dataset)
    args.model = args.model or os.path.join(args.out_dir, "models", "centroid")
    rows = args.train == "rows"
    args.lr = args.lr or (1e-2 if rows else 1e-4)
    args.save = args.save or args.model.rstrip("/") + ("+gti" if rows else f"+cpt{args.epochs}")
    if not 0 <= args.holdout_frac < 1:
        die(f"--holdout-frac {args.holdout_frac}: must be in [0, 1)")
    if args.resume and rows:
        die("--resume: only --train all writes a resume state; rerun without --resume")
    save_epochs = parse_save_epochs(args)
    seed_everything(args.seed)
    device = pick_device(args.device)
    ctx, dtype_note = pick_autocast(args.dtype, device)
    print(f"device {device}, {dtype_note}")
    t0 = time.time()
    model, tok, vocab, data, _, item_tok, _ = load_sid_model(args.model, args.out_dir, "cpu")
    texts, item_tids = data["texts"], item_tok.tolist()
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    level_ids = [torch.tensor([t for t in lvl if t >= 0]) for lvl in vocab["token_ids"]]  # (n_l,)
    new_ids = torch.cat(level_ids)                                                  # (n_new,)
    g = torch.Generator().manual_seed(args.seed)               # 1. pairs: split, then batch order
    perm = torch.randperm(len(texts), generator=g).tolist()
    n_hold = int(round(args.holdout_frac * len(texts)))
    held, train_items = sorted(perm[:n_hold]), sorted(perm[n_hold:])
    pairs_of = lambda items: build_pairs(tok, texts, item_tids, items, args.max_text_tokens)
    pairs, scored = pairs_of(train_items), {"held_out": held, "seen": train_items}
    scored = {k: [p for p in pairs_of(its[:args.max_eval]) if p[2]] for k, its in scored.items()}
    per_epoch = len(pairs) // args.batch_size                   # steps per pass over the pairs
    if per_epoch < 1:
        die(f"--batch-size {args.batch_size} exceeds the {len(pairs)} grounding pairs")
    args.steps = args.epochs * per_epoch if args.epochs else args.steps
    print(f"{len(texts)} items: {len(train_items)} for grounding ({len(pairs)} pairs), "
          f"{len(held)} held out; train {args.train}: {args.steps} steps "
          f"({args.steps / per_epoch:.2f} epochs)")

    def accuracy(when):                                         # 4. held-out (and seen) items
        acc[when] = {k: grounding_accuracy(model, p, level_ids, pad_id, device, ctx)
                     for k, p in scored.items()}
        print(f"{when + ':':<7} held-out acc per level {acc[when]['held_out']['acc']}, "
              f"in-level {acc[when]['held_out']['acc_in_level']}")

    acc = {}                                                    # 2.-3. loss and masked update
    if rows:                                                    # GTI: the new rows, masked
        trained, unchanged = freeze_all_but_new_rows(model.to(device), new_ids.to(device))
    else:                                                       # CPT: every parameter
        trained = list(model.to(device).requires_grad_(True).parameters())
        unchanged = new_row_shift(model, new_ids.to(device))
    files = {"sid_vocab.json": json.dumps(vocab)}
    ckpt, key = f"{args.save}.resume.pt", {k: v for k, v in dataclasses.asdict(args).items()
                                             if k not in ("resume", "device", "log_every")}
    state = resume(ckpt, key, model) if args.resume else None

    def at_step(step, snapshot):                                # CPT: folders at chosen epochs
        e = step // per_epoch
        if step % per_epoch == 0 and e in save_epochs and e != args.epochs:
            info = {"train": "all", "epoch": e, "step": step, "args": dataclasses.asdict(args)}
            dst = f"{args.model.rstrip('/')}+cpt{e}"
            save_folder(dst, model, tok, {**files, "04_ground.json": json.dumps(info, indent=2)})
            ck = {**snapshot(), "model": model.state_dict(), "rng": torch.get_rng_state(),
                  "acc_before": acc["before"], "key": key}
            atomic_write(ckpt, lambda t: torch.save(ck, t))    # --resume continues from here
            print(f"epoch {e}: saved {dst} and {ckpt}", flush=True)

    if state:
        acc["before"] = state["acc_before"]
        print(f"resumed from {ckpt} after step {state['step']}")
    else:
        accuracy("before")
    curve, train_s = ground_rows(model, pairs, trained, g, pad_id, device, ctx, args, at_step,
                                 state)
    accuracy("after")
    frozen_ok, moved = unchanged()
    print(f"pretrained rows unchanged: {frozen_ok}; mean shift of the new rows {moved:.4f}")
    if rows and not frozen_ok:
        die("pretrained parameters changed during grounding (this is a bug); nothing saved")

    # 5. save: the folder (with the same sid_vocab.json and this report), swapped in by save_folder
    model.to("cpu")
    report = {"model": args.model, "args": dataclasses.asdict(args),
              "items_grounded": len(train_items), "items_held_out": len(held), **acc,
              "loss_curve": curve, "pretrained_rows_unchanged": frozen_ok,
              **{f"held_out_{key}_{when}": round(float(np.mean(a["held_out"][key])), 4)  # tables
                 for key in ("acc", "acc_in_level") for when, a in acc.items()},
              "new_row_shift": round(moved, 4), "train_seconds": round(train_s, 1),
              "seconds": round(time.time() - t0, 1)}
    save_folder(args.save, model, tok, {**files, "04_ground.json": json.dumps(report, indent=2)})
    if os.path.exists(ckpt):                                    # the finished run needs no resume
        os.remove(ckpt)
    print(f"done in {time.time() - t0:.1f}s -> {args.save}")


def resume(ckpt, key: dict, model):
    """--resume (CPT): the model and RNG from <save>.resume.pt (same arguments, or one line);
    returns the loop's state for ground_rows."""
    ck = load_pt(ckpt, "it is written at each --save-epochs epoch of --train all; run without "
                       "--resume")
    diff = [k for k in key if ck["key"].get(k) != key[k]]
    if diff:
        die(f"--resume: {ckpt} was written with other arguments ({', '.join(diff)}); use the "
            "same ones or run without --resume")
    model.load_state_dict(ck.pop("model"))                  # copied in: drop the file's copy
    torch.set_rng_state(ck["rng"])
    return ck


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
