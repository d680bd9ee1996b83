"""Step 4: GTI grounding (only the new SID rows train) or CPT (every parameter), text <-> SID pairs.

GTI (Chen et al. 2026, method section), between steps 03 and 05: freeze the LM and every pretrained
row; train the new token rows (and an untied head's same rows) on next-token NLL over item texts:
    text -> SID:  "<item text> is item" -> <a_12><b_3><c_40><d_0>
    SID -> text:  "Item <a_12><b_3><c_40><d_0> is" -> " <item text></s>"
    loss = - mean_{t in target} log p(y_t | y_<t)         (prompt positions masked with -100)
    g_W  <- g_W * m[:, None],  m_v = 1 iff token v is new   (row mask; AdamW, weight decay 0)
--train all is continued pretraining (CPT, the centroid paper's alignment stage): the same pairs and loss, every
parameter trained (lr 1e-4, warmup then constant, so the folder saved after epoch E is the same whatever --epochs
is). One CPT epoch on ML-100K = 378 steps of 8 pairs: 613 s measured on 2 CPU cores (bf16).
--epochs E scores the held-out items (--max-eval of them) after every epoch: `holdout_curve`, the in-level
text -> SID accuracy per level; --plateau P (--train rows) stops once no level rose above its best so far (the
start counts) for P epochs, else at E, and saves the model at the stop. The GTI paper grounds 8,000 steps x 128
pairs (new rows), then unfreezes all for 8,000 x 128 on the same pairs, then SFT; in proportion (D = epochs_done
in mean+gti/04_ground.json; the same --seed: the same pairs):
GTI+: python 04_ground.py --model out/ml-100k/models/mean --epochs 30 --plateau 2        (-> mean+gti)
      python 04_ground.py --model out/ml-100k/models/mean+gti --train all --epochs D  (-> mean+gti+cptD)
Reads:  <model> (03's folder, default <out-dir>/models/centroid), <out-dir>/dataset.pt
Writes: <save> (default <model>+gti; --train all: <model>+cpt<E>): model, tokenizer, sid_vocab.json, 04_ground.json
        (--epochs: + holdout_curve [[epoch, step, [acc per level]]], stopped_epoch (null: ran to E), epochs_done,
        steps_done); --epochs E also <save>.resume.pt after every epoch e < E (--resume continues from it; the
        finished run removes it), --train all also <model>+cpt<e>
CPU:  python 04_ground.py --model out/ml-100k/models/centroid
GPU:  python 04_ground.py --device cuda --steps 2000 --batch-size 64       (the same default model)
CPT:  python 04_ground.py --model out/ml-100k/models/random --train all --epochs 4  (+cpt1..+cpt4)
Good run: the loss falls, held-out in-level accuracy beats chance, `pretrained rows unchanged: True`
"""
import argparse
import json
import os
import time

import numpy as np
import torch

from common import (Parser, add_device_flags, die, load_resume, load_sid_model, nonneg_float, nonneg_int,
                    pad_id, pick_autocast, pick_device, pos_int, save_folder, save_resume, seed_everything,
                    warmup_cosine)


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(__doc__)
    p.add_argument("--dataset", default="ml-100k", help="only picks the default --out-dir")
    p.add_argument("--out-dir", default="", help="folder with dataset.pt (default: out/<dataset>)")
    p.add_argument("--model", default="", help="03's folder (default: <out-dir>/models/centroid)")
    p.add_argument("--save", default="", help="output folder (default: <model>+gti; all: +cpt<E>)")
    p.add_argument("--train", default="rows", choices=["rows", "all"],
                   help="rows: GTI, only the new rows (masked gradients) | all: CPT, all weights")
    p.add_argument("--steps", type=pos_int, default=200, help="optimizer steps (unless --epochs)")
    p.add_argument("--epochs", type=nonneg_int, default=0,
                   help="passes over the pairs (0: use --steps); --train all saves every epoch")
    p.add_argument("--plateau", type=nonneg_int, default=0,
                   help="--train rows --epochs E: stop once no level's held-out acc rose for P epochs (0: off)")
    p.add_argument("--batch-size", type=pos_int, default=8, help="pairs per step, both directions")
    p.add_argument("--lr", type=nonneg_float, default=0.0,
                   help="peak learning rate (AdamW; 0: 1e-2 for --train rows, 1e-4 for all)")
    p.add_argument("--warmup", type=nonneg_int, default=10,
                   help="linear warmup steps, then cosine decay to 0 (--train all: constant)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="gradient norm clip (0 = off)")
    p.add_argument("--holdout-frac", type=float, default=0.1,
                   help="fraction of items held out from grounding to measure text->SID accuracy")
    p.add_argument("--max-eval", type=nonneg_int, default=64, help="items scored before/after (max)")
    p.add_argument("--max-text-tokens", type=pos_int, default=48, help="truncate item texts")
    p.add_argument("--log-every", type=pos_int, default=25, help="steps per log line")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=False,
                   help="--epochs: continue from <save>.resume.pt (written after every epoch)")
    add_device_flags(p, "auto: bf16 on CUDA and on CPUs with native bf16")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds random, numpy and torch; the held-out split and the batch order")
    return p.parse_args(argv)


# --- The paper step: 1. pairs, 2. the loss at the target tokens, 3. the masked row update --------
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
    labels = torch.full((B, T), -100, dtype=torch.long)                 # x, attn, labels: (B, T)
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


def grounding_loss(logits, y):
    """loss = - mean over the M target tokens of log p(y_t | y_<t), both directions in one mean."""
    return torch.nn.functional.cross_entropy(logits, y, reduction="none").mean()   # (M,) -> ()


def mask_row_grads(weight: torch.nn.Parameter, new_ids: torch.Tensor):
    """3. Masked update: g_W <- g_W * m[:, None]; AdamW(weight_decay=0) then never moves a row."""
    m = torch.zeros(weight.shape[0], 1, device=weight.device, dtype=weight.dtype)
    m[new_ids] = 1.0                                            # (V, 1)
    weight.register_hook(lambda g: g * m)


def freeze_all_but_new_rows(model, new_ids: torch.Tensor):
    """Only the embedding (and an untied head's same rows) train, under the row mask. Returns them
    and a check: () -> every pretrained row and every other parameter bit-identical?"""
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
    return trained, lambda: (
        all(torch.equal(w.detach()[keep], o[keep]) for w, o in zip(trained, originals)) and
        all(torch.equal(model.get_parameter(n).detach(), o) for n, o in others.items()))


def plateaued(accs, patience: int) -> bool:
    """The plateau rule on per-level accuracies (the start, then one row per epoch): True when none of
    the last `patience` rows beats, at any level, that level's best before them."""
    a = np.array(accs)                                                 # (1 + epochs, L)
    return 0 < patience < len(a) and not (a[-patience:] > a[:-patience].max(0)).any()


# --- Eval: held-out text -> SID accuracy ---------------------------------------------------
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


# --- main: data, the loop, eval, save ----------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    args.out_dir = args.out_dir or os.path.join("out", args.dataset)
    args.model = args.model or os.path.join(args.out_dir, "models", "centroid")
    rows = args.train == "rows"
    args.lr = args.lr or (1e-2 if rows else 1e-4)
    args.save = args.save or args.model.rstrip("/") + ("+gti" if rows else f"+cpt{args.epochs}")
    if not 0 <= args.holdout_frac < 1:
        die(f"--holdout-frac {args.holdout_frac}: must be in [0, 1)")
    seed_everything(args.seed)
    device = pick_device(args.device)
    ctx, dtype_note = pick_autocast(args.dtype, device)
    print(f"device {device}, {dtype_note}")
    t0 = time.time()
    model, tok, vocab, data, _, item_tok, _ = load_sid_model(args.model, args.out_dir, "cpu")
    texts, item_tids = data["texts"], item_tok.tolist()
    pad = pad_id(tok)
    level_ids = [torch.tensor([t for t in lvl if t >= 0]) for lvl in vocab["token_ids"]]  # (n_l,)
    new_ids = torch.cat(level_ids).to(device)                                       # (n_new,)
    g = torch.Generator().manual_seed(args.seed)               # 1. pairs: split, then batch order
    perm = torch.randperm(len(texts), generator=g).tolist()
    n_hold = int(round(args.holdout_frac * len(texts)))
    held, train_items = sorted(perm[:n_hold]), sorted(perm[n_hold:])
    pairs_of = lambda items: build_pairs(tok, texts, item_tids, items, args.max_text_tokens)
    pairs, scored = pairs_of(train_items), {"held_out": held, "seen": train_items}
    scored = {k: [p for p in pairs_of(its[:args.max_eval]) if p[2]] for k, its in scored.items()}
    if args.plateau and not (rows and args.epochs and scored["held_out"]):
        die(f"--plateau {args.plateau}: needs --train rows, --epochs E and held-out items (--holdout-frac, --max-eval)")
    per_epoch = len(pairs) // args.batch_size                   # steps per pass over the pairs
    if per_epoch < 1:
        die(f"--batch-size {args.batch_size} exceeds the {len(pairs)} grounding pairs")
    args.steps = args.epochs * per_epoch if args.epochs else args.steps
    print(f"{len(texts)} items: {len(train_items)} for grounding ({len(pairs)} pairs), {len(held)} held out; "
          f"train {args.train}: {args.steps} steps ({args.steps / per_epoch:.2f} epochs)")

    acc = {}
    def accuracy(when):                                         # 4. held-out (and seen) items
        acc[when] = {k: grounding_accuracy(model, p, level_ids, pad, device, ctx) for k, p in scored.items()}
        print(f"{when + ':':<7} held-out acc per level {acc[when]['held_out']['acc']}, "
              f"in-level {acc[when]['held_out']['acc_in_level']}")
    if rows:                                                    # GTI: the new rows, masked
        trained, unchanged = freeze_all_but_new_rows(model.to(device), new_ids)
    else:                                                       # CPT: every parameter
        trained, unchanged = list(model.to(device).requires_grad_(True).parameters()), lambda: None
    ws = list(dict.fromkeys((model.get_input_embeddings().weight, model.get_output_embeddings().weight)))  # untied: 2
    start = [w.detach()[new_ids].clone() for w in ws]           # the new rows before training
    files = {"sid_vocab.json": json.dumps(vocab)}
    ckpt, key = f"{args.save}.resume.pt", {k: v for k, v in vars(args).items()
                                             if k not in ("resume", "device", "log_every", "plateau")}
    # The loop: pairs -> logits at the targets -> loss -> masked row update (AdamW). CPT's lr is
    # constant after the warmup, so a long run's +cpt1, +cpt2 are the ends of short runs.
    opt = torch.optim.AdamW(trained, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0,
                            fused=device.type in ("cuda", "cpu"))      # fused: one kernel per step
    sched = torch.optim.lr_scheduler.LambdaLR(      # linear warmup, then cosine to 0 (GTI) | 1 (CPT)
        opt, lambda s: warmup_cosine(s, args.warmup, args.steps) if rows or s < args.warmup else 1.0)
    order, pos, curve, first, run, state = [], 0, [], 1, (0.0, 0.0, 0.0), {}
    if args.resume:                              # saved at an epoch's end: the next step reshuffles
        state = load_resume(ckpt, key, model=model, opt=opt, sched=sched)
        g.set_state(state["g"])
        torch.set_rng_state(state["rng"])
        first, curve, run, acc["before"] = state["step"] + 1, state["curve"], state["run"], state["acc_before"]
        print(f"resumed from {ckpt} after step {state['step']}")
    else:
        accuracy("before")
    (run_loss, run_hit, run_n), t_int = run, time.time()
    t_loop = t_int - state.get("s", 0.0)                       # seconds of the loop, all parts
    hcurve, stop, step = state.get("hcurve", []), False, first - 1    # held-out acc after each epoch
    model.train()                                               # a resumed run skipped "before"
    for step in range(first, args.steps + 1):
        if pos + args.batch_size > len(order):                  # new epoch: reshuffle the pairs
            order, pos = torch.randperm(len(pairs), generator=g).tolist(), 0
        batch = [pairs[i] for i in order[pos:pos + args.batch_size]]
        pos += args.batch_size
        x, attn, labels, kind = (t.to(device) for t in collate_right(batch, pad))
        with ctx:
            logits, y, sel = target_logits(model, x, attn, labels)   # (M, V), (M,)
        is_t2s = kind[:, None].expand_as(sel)[sel]              # targets that are SID tokens (M,)
        loss = grounding_loss(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()                                         # the hooks mask the row grads
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(trained, args.grad_clip)
        opt.step()
        sched.step()
        run_loss += loss.item()
        run_hit += float((logits.argmax(-1) == y)[is_t2s].sum())
        run_n += float(is_t2s.sum())
        if end := args.epochs and step % per_epoch == 0:        # an epoch's end: score the held-out items
            e, ho = step // per_epoch, grounding_accuracy(model, scored["held_out"], level_ids, pad, device, ctx)
            hcurve.append([e, step, ho["acc_in_level"]])
            stop = step < args.steps and plateaued([acc["before"]["held_out"]["acc_in_level"]]
                                                   + [c[2] for c in hcurve], args.plateau)
            print(f"epoch {e}: held-out in-level {ho['acc_in_level']}{'; plateau: stop' if stop else ''}", flush=True)
        if step % args.log_every == 0 or step == args.steps or stop:
            k, hit = (step - 1) % args.log_every + 1, run_hit / max(run_n, 1)
            curve.append({"step": step, "loss": round(run_loss / k, 4), "t2s_acc": round(hit, 4)})
            ms = 1000 * (time.time() - t_int) / k
            print(f"step {step:5d} | loss {run_loss / k:.4f} | text->SID acc {hit:.3f} | "
                  f"lr {sched.get_last_lr()[0]:.2e} | {ms:.0f} ms/step", flush=True)
            (run_loss, run_hit, run_n), t_int = (0.0, 0.0, 0.0), time.time()
        if end and step < args.steps and not stop:             # an epoch's end: the resume state
            info = {"train": "all", "epoch": e, "step": step, "holdout_curve": hcurve, "args": vars(args)}
            dst = f"{args.model.rstrip('/')}+cpt{e}"
            if not rows:                                        # CPT: a folder after every epoch
                save_folder(dst, model, tok, {**files, "04_ground.json": json.dumps(info, indent=2)})
            save_resume(ckpt, key, {"step": step, "g": g.get_state(), "curve": curve, "s": time.time() - t_loop,
                                    "run": (run_loss, run_hit, run_n), "rng": torch.get_rng_state(),
                                    "acc_before": acc["before"], "hcurve": hcurve}, model=model, opt=opt, sched=sched)
            print(f"epoch {e}: " + (f"wrote {ckpt}" if rows else f"saved {dst} and {ckpt}"), flush=True)
        if stop:
            break
    train_s = time.time() - t_loop

    accuracy("after")
    frozen_ok = unchanged()
    moved = float(sum((w.detach()[new_ids] - s).norm(dim=1).mean() for w, s in zip(ws, start)))
    print(f"pretrained rows unchanged: {frozen_ok}; mean shift of the new rows {moved:.4f}")
    if rows and not frozen_ok:
        die("pretrained parameters changed during grounding (this is a bug); nothing saved")

    # 5. save: the folder (with the same sid_vocab.json and this report), swapped in by save_folder
    model.to("cpu")
    report = {"model": args.model, "args": vars(args), "items_grounded": len(train_items), "items_held_out": len(held),
              **acc, "loss_curve": curve, "pretrained_rows_unchanged": frozen_ok,
              **{f"held_out_{k}_{when}": round(float(np.mean(a["held_out"][k])), 4)  # the tables' figures
                 for k in ("acc", "acc_in_level") for when, a in acc.items()},
              **({"holdout_curve": hcurve, "stopped_epoch": hcurve[-1][0] if stop else None,
                  "epochs_done": step // per_epoch, "steps_done": step} if args.epochs else {}),
              "new_row_shift": round(moved, 4), "train_seconds": round(train_s, 1),
              "seconds": round(time.time() - t0, 1)}
    save_folder(args.save, model, tok, {**files, "04_ground.json": json.dumps(report, indent=2)})
    if os.path.exists(ckpt):                                    # the finished run needs no resume
        os.remove(ckpt)
    print(f"done in {time.time() - t0:.1f}s -> {args.save}")


if __name__ == "__main__":
    main()
