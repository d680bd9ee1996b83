"""Step 4: GTI grounding - train only the new SID rows on paired text <-> SID supervision, LM frozen.

Paper step: GTI (Chen et al. 2026, "Grounded Token Initialization", method section): between vocabulary
expansion and SFT, freeze the LM and every pretrained embedding row, and train only the new token rows
with next-token NLL on paired linguistic supervision built from the item texts:

    text -> SID:  "<item text> is item" -> <a_12><b_3><c_40><d_0>
    SID -> text:  "Item <a_12><b_3><c_40><d_0> is" -> " <item text></s>"
    loss = - sum_{t in target} log p(y_t | y_<t)          (prompt positions masked with -100)
    g_W  <- g_W * m[:, None],  m_v = 1 iff token v is new  (binary row mask; weight decay 0 on the rows)

With AdamW, weight_decay = 0 and exactly-zero gradients, the moments of a masked row stay 0 and its update
is 0, so every pretrained row (and every other parameter) stays bit-identical; the script checks this.
Where the output head is untied, the same rows of the head are trained under the same mask.
Held-out grounding quality: text -> SID next-token accuracy per level on items never used for training
(teacher forcing; `acc` = argmax over the whole vocabulary, `acc_in_level` = argmax among that level's tokens;
ties count as 1/#tied, since mean init ties every new row).

Reads:  <model> (03's folder, default <out-dir>/models/centroid, with sid_vocab.json), <out-dir>/dataset.pt
Writes: <save> (default <model>+gti): model + tokenizer (save_pretrained), sid_vocab.json (copied),
        04_ground.json (accuracy before/after, loss curve, seconds)

CPU:  python 04_ground.py --model out/ml-100k/models/centroid   (ML-100K, 200 steps x 8: 3.2 min on 2 idle cores,
      bf16 autocast; `make run` passes --steps 120 to fit its 20-minute budget)
GPU:  python 04_ground.py --model out/ml-100k/models/centroid --device cuda --steps 2000 --batch-size 64
Good run: the loss falls (ML-100K centroid: 7.2 -> 3.0 over 200 steps), text->SID accuracy rises, and
  pretrained rows unchanged: True
Measured on ML-100K (centroid init, 64 held-out items, argmax within each level's tokens, levels a/b/c/d):
30 steps: 0.00/0.05/0.00/0.45 -> 0.02/0.02/0.00/1.00 (only the suffix level is learned); 200 steps (the default):
-> 0.11/0.08/0.06/1.00 against chance 0.016/0.016/0.016/0.5. More steps (GPU) ground the semantic levels further.
"""
import argparse
import ast
import dataclasses
import inspect
import json
import math
import os
import random
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")            # nothing is fetched from a hub at run time
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@dataclass
class Args:
    out_dir: str = "out/ml-100k"
    """artifacts folder with dataset.pt (item texts)"""
    model: str = ""
    """03's folder to ground (default: <out-dir>/models/centroid)"""
    save: str = ""
    """output folder (default: <model>+gti)"""
    steps: int = 200
    """optimizer steps (CPU default ~3.5 min on ML-100K)"""
    batch_size: int = 8
    """examples per step (text->SID and SID->text mixed)"""
    lr: float = 1e-2
    """peak learning rate of the new rows (AdamW; rows tolerate far more than full fine-tuning)"""
    warmup: int = 10
    """linear warmup steps, then cosine decay to 0"""
    grad_clip: float = 1.0
    """clip the gradient norm of the trained rows (0 = off)"""
    holdout_frac: float = 0.1
    """fraction of items held out from grounding to measure text->SID accuracy"""
    max_eval: int = 64
    """held-out (and seen) items scored before/after at most"""
    max_text_tokens: int = 48
    """truncate item texts to this many tokens"""
    log_every: int = 25
    """steps per log line"""
    device: str = "auto"
    """auto | cpu | cuda | mps"""
    dtype: str = "auto"
    """auto (bf16 autocast on CUDA and on CPUs with native bf16, else float32) | float32 | bfloat16; weights stay fp32"""
    seed: int = 0
    """seeds random, numpy and torch; the held-out split and the batch order"""


def die(msg: str):
    """Bad input ends the run with one clear line on stderr and exit status 1."""
    sys.exit(f"error: {msg}")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage dump
        die(f"{message} (see `python {self.prog} --help`)")


def parse_args() -> Args:
    """argparse over dataclasses.fields(Args); help = the docstring under each field."""
    src = ast.parse(inspect.getsource(Args)).body[0].body
    docs = {a.target.id: b.value.value for a, b in zip(src, src[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)}
    p = _Parser(prog=os.path.basename(sys.argv[0]), description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(Args):
        flag, h = "--" + f.name.replace("_", "-"), docs.get(f.name, "")
        if f.type in (bool, "bool"):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=h)
        else:
            t = {"int": int, "float": float, "str": str}.get(f.type, f.type) if isinstance(f.type, str) else f.type
            p.add_argument(flag, type=t, default=f.default, help=f"{h} (default: {f.default})")
    return Args(**vars(p.parse_args()))


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        die("--device cuda but CUDA is not available; use --device cpu")
    if name not in ("cpu", "cuda", "mps"):
        die(f"unknown --device {name!r}; use auto|cpu|cuda|mps")
    return torch.device(name)


def pick_autocast(name: str, device: torch.device):
    """--dtype -> (autocast context, note). Weights, optimizer and the loss's softmax stay fp32; auto = bf16
    autocast on CUDA and on CPUs with native bf16 (AVX512-BF16 / AMX: a training step of SmolLM2-135M ran
    1.7x faster there), float32 elsewhere (emulated bf16 is slower than fp32)."""
    if name not in ("auto", "float32", "bfloat16"):
        die(f"unknown --dtype {name!r}; use auto|float32|bfloat16")
    native = device.type == "cuda" or (device.type == "cpu" and getattr(torch.cpu, "_is_avx512_bf16_supported",
                                                                         lambda: False)())
    if name == "float32" or (name == "auto" and not native) or device.type == "mps":
        return nullcontext(), "float32" + (" (this CPU has no native bf16)" if name == "auto" and not native else "")
    return torch.autocast(device.type, dtype=torch.bfloat16), f"bf16 autocast on {device.type} (fp32 weights)"


def seed_everything(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def atomic_write(path: str, write):
    """write(tmp_path) then rename: an interrupted step leaves the previous artifact intact."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_pt(path: str, hint: str):
    """torch.load(weights_only=True) with a one-line error that says which step makes the file."""
    if not os.path.exists(path):
        die(f"{path} not found; {hint}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        die(f"{path} is unreadable ({type(e).__name__}); {hint}")


# ---------------------------------------------------------------------------------------------------
# The math: NLL on target tokens only, logits only where there are labels, masked row gradients
# ---------------------------------------------------------------------------------------------------
def target_logits(model, x, attn, labels):
    """Run the LM body, then the head only at labelled positions (the vocab-wide head dominates otherwise).
    Returns logits (M, V) for the M positions whose next token is a target, and those targets (M,)."""
    h = model.base_model(input_ids=x, attention_mask=attn, use_cache=False).last_hidden_state  # (B, T, D)
    y = labels[:, 1:]                                           # next-token targets            (B, T-1)
    sel = y != -100                                             # target positions              (B, T-1)
    return model.get_output_embeddings()(h[:, :-1][sel]).float(), y[sel], sel   # (M, V), (M,), (B, T-1)


def mask_row_grads(weight: torch.nn.Parameter, new_ids: torch.Tensor):
    """g_W <- g_W * m[:, None]: only the rows of the new tokens receive gradient."""
    m = torch.zeros(weight.shape[0], 1, device=weight.device, dtype=weight.dtype)
    m[new_ids] = 1.0                                            # (V, 1)
    weight.register_hook(lambda g: g * m)


# ---------------------------------------------------------------------------------------------------
# Data: paired supervision from the item texts
# ---------------------------------------------------------------------------------------------------
def build_pairs(tok, texts, item_tids, items, max_text):
    """Per item two examples (prompt ids, target ids, is_text_to_sid)."""
    is_item, item_w, is_w = (tok(s, add_special_tokens=False).input_ids for s in (" is item", "Item", " is"))
    eos = tok.eos_token_id
    out = []
    for i in items:
        text = tok(texts[i], add_special_tokens=False).input_ids[:max_text]
        text_sp = tok(" " + texts[i], add_special_tokens=False).input_ids[:max_text]
        sid = item_tids[i]
        out.append((text + is_item, sid, True))                                   # text -> SID
        out.append((item_w + sid + is_w, text_sp + ([eos] if eos is not None else []), False))  # SID -> text
    return out


def collate(batch, pad_id):
    """Right-pad to the longest example of this batch; labels -100 on prompt and padding."""
    T = max(len(p) + len(t) for p, t, _ in batch)
    x = torch.full((len(batch), T), pad_id, dtype=torch.long)
    attn = torch.zeros(len(batch), T, dtype=torch.long)
    labels = torch.full((len(batch), T), -100, dtype=torch.long)
    for b, (p, t, _) in enumerate(batch):
        n = len(p) + len(t)
        x[b, :n] = torch.tensor(p + t)
        attn[b, :n] = 1
        labels[b, len(p):n] = torch.tensor(t)
    kind = torch.tensor([k for _, _, k in batch])               # True = text -> SID            (B,)
    return x, attn, labels, kind


def tie_hits(scores, target):
    """Expected hits of argmax under random tie-breaking: (B, K) scores, (B,) target index -> (B,).
    Mean init gives every new row the same logit; a plain argmax would then 'predict' the lowest id."""
    best = scores == scores.max(-1, keepdim=True).values                 # (B, K)
    return best.gather(1, target[:, None]).squeeze(1).float() / best.sum(-1)


@torch.no_grad()
def grounding_accuracy(model, pairs, level_ids, pad_id, device, ctx, bs=32):
    """Text -> SID next-token accuracy per level (teacher forcing): argmax over the whole vocabulary
    (`acc`) and among the level's own tokens (`acc_in_level`)."""
    model.eval()
    L = len(level_ids)
    hit, hit_lvl, n = torch.zeros(L), torch.zeros(L), 0
    for s in range(0, len(pairs), bs):
        x, attn, labels, _ = collate(pairs[s:s + bs], pad_id)
        with ctx:
            logits, y, _ = target_logits(model, x.to(device), attn.to(device), labels.to(device))
        logits, y = logits.view(-1, L, logits.shape[-1]).cpu(), y.view(-1, L).cpu()   # (B, L, V), (B, L)
        for l, ids in enumerate(level_ids):
            hit[l] += tie_hits(logits[:, l], y[:, l]).sum()
            hit_lvl[l] += tie_hits(logits[:, l, ids], (ids[None, :] == y[:, l, None]).long().argmax(1)).sum()
        n += len(y)
    model.train()
    return {"items": n, "acc": [round(float(v) / max(n, 1), 4) for v in hit],
            "acc_in_level": [round(float(v) / max(n, 1), 4) for v in hit_lvl],
            "chance_in_level": [round(1 / len(ids), 4) for ids in level_ids]}


def load_inputs(args: Args):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()                    # stderr stays one line on bad input
    vpath = os.path.join(args.model, "sid_vocab.json")
    if not os.path.isdir(args.model):
        die(f"--model {args.model} not found; run 03_expand_vocab.py first (or pass --model <out-dir>/models/<init>)")
    if not os.path.exists(vpath):
        die(f"{vpath} not found; --model must be a folder written by 03_expand_vocab.py")
    try:
        vocab = json.load(open(vpath))
        item_tids, token_ids = vocab["item_token_ids"], vocab["token_ids"]
    except Exception as e:
        die(f"{vpath} is unreadable ({type(e).__name__}); rerun 03_expand_vocab.py")
    ds = load_pt(os.path.join(args.out_dir, "dataset.pt"), "run 01_embed_items.py first (or pass --out-dir)")
    if not isinstance(ds, dict) or len(ds.get("texts", [])) != len(item_tids):
        die(f"{args.out_dir}/dataset.pt has {len(ds.get('texts', [])) if isinstance(ds, dict) else '?'} item texts "
            f"but {vpath} has {len(item_tids)} items; rerun 03_expand_vocab.py on this --out-dir")
    try:
        tok = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    except Exception as e:
        die(f"--model {args.model} is unreadable ({type(e).__name__}); rerun 03_expand_vocab.py")
    return tok, model, vocab, ds["texts"], item_tids, token_ids


def main():
    args = parse_args()
    args.model = args.model or os.path.join(args.out_dir, "models", "centroid")
    args.save = args.save or args.model.rstrip("/") + "+gti"
    if args.steps < 1 or args.batch_size < 1 or not 0 <= args.holdout_frac < 1:
        die("--steps and --batch-size must be >= 1 and --holdout-frac in [0, 1)")
    seed_everything(args.seed)
    device = pick_device(args.device)
    ctx, dtype_note = pick_autocast(args.dtype, device)
    print(f"device {device}, {dtype_note}")
    t0 = time.time()
    tok, model, vocab, texts, item_tids, token_ids = load_inputs(args)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    level_ids = [torch.tensor([t for t in lvl if t >= 0]) for lvl in token_ids]     # per level (n_l,)
    new_ids = torch.cat(level_ids)                                                # (n_new,)

    # --- held-out split and the two supervision directions -------------------------------------------------
    g = torch.Generator().manual_seed(args.seed)
    perm = torch.randperm(len(texts), generator=g).tolist()
    n_hold = int(round(args.holdout_frac * len(texts)))
    held, train_items = sorted(perm[:n_hold]), sorted(perm[n_hold:])
    pairs = build_pairs(tok, texts, item_tids, train_items, args.max_text_tokens)
    t2s = lambda items: [p for p in build_pairs(tok, texts, item_tids, items, args.max_text_tokens) if p[2]]
    eval_held, eval_seen = t2s(held[:args.max_eval]), t2s(train_items[:args.max_eval])
    print(f"{len(texts)} items: {len(train_items)} for grounding ({len(pairs)} pairs), {len(held)} held out; "
          f"{len(new_ids)} trainable rows")

    # --- freeze everything but the new rows ------------------------------------------------------------------
    model.to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    trained = [emb] + ([head] if head is not emb else [])
    originals = [w.detach().clone() for w in trained]
    others = {n: p.detach().clone() for n, p in model.named_parameters() if all(p is not w for w in trained)}
    for w in trained:
        w.requires_grad_(True)
        mask_row_grads(w, new_ids.to(device))
    opt = torch.optim.AdamW(trained, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0,
                            fused=device.type in ("cuda", "cpu"))                # fused: one kernel per step
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / args.warmup if s < args.warmup else
                                              0.5 * (1 + math.cos(math.pi * (s - args.warmup) /
                                                                  max(1, args.steps - args.warmup))))

    before = {"held_out": grounding_accuracy(model, eval_held, level_ids, pad_id, device, ctx),
              "seen": grounding_accuracy(model, eval_seen, level_ids, pad_id, device, ctx)}
    print(f"before: held-out acc per level {before['held_out']['acc']}, in-level {before['held_out']['acc_in_level']}")

    # --- the loop --------------------------------------------------------------------------------------------
    order, pos, curve, t_loop = [], 0, [], time.time()
    run_loss = run_hit = run_n = 0.0
    t_int = time.time()
    for step in range(1, args.steps + 1):
        if pos + args.batch_size > len(order):                  # new epoch: reshuffle the pairs
            order, pos = torch.randperm(len(pairs), generator=g).tolist(), 0
        batch = [pairs[i] for i in order[pos:pos + args.batch_size]]
        pos += args.batch_size
        x, attn, labels, kind = (t.to(device) for t in collate(batch, pad_id))
        with ctx:
            logits, y, sel = target_logits(model, x, attn, labels)
        loss = F.cross_entropy(logits, y)                       # NLL over target tokens only
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(trained, args.grad_clip)
        opt.step()
        sched.step()
        is_t2s = kind[:, None].expand_as(sel)[sel]              # which target positions are SID tokens (M,)
        run_loss += loss.item()
        run_hit += float((logits.argmax(-1) == y)[is_t2s].sum())
        run_n += float(is_t2s.sum())
        if step % args.log_every == 0 or step == args.steps:
            k = (step - 1) % args.log_every + 1
            curve.append({"step": step, "loss": round(run_loss / k, 4), "t2s_acc": round(run_hit / max(run_n, 1), 4)})
            print(f"step {step:5d} | loss {run_loss / k:.4f} | text->SID acc {run_hit / max(run_n, 1):.3f} | "
                  f"lr {sched.get_last_lr()[0]:.2e} | {1000 * (time.time() - t_int) / k:.0f} ms/step", flush=True)
            run_loss = run_hit = run_n = 0.0
            t_int = time.time()
    train_s = time.time() - t_loop

    # --- eval: held-out grounding quality, and the frozen-rows check ----------------------------------------
    after = {"held_out": grounding_accuracy(model, eval_held, level_ids, pad_id, device, ctx),
             "seen": grounding_accuracy(model, eval_seen, level_ids, pad_id, device, ctx)}
    print(f"after:  held-out acc per level {after['held_out']['acc']}, in-level {after['held_out']['acc_in_level']}")
    keep = torch.ones(emb.shape[0], dtype=torch.bool, device=device)
    keep[new_ids] = False
    frozen_ok = all(torch.equal(w.detach()[keep], o[keep]) for w, o in zip(trained, originals)) and \
        all(torch.equal(p.detach(), others[n]) for n, p in model.named_parameters() if n in others)
    moved = float(sum((w.detach()[new_ids] - o[new_ids]).norm(dim=1).mean() for w, o in zip(trained, originals)))
    print(f"pretrained rows unchanged: {frozen_ok}; mean shift of the new rows {moved:.4f}")
    if not frozen_ok:
        die("pretrained parameters changed during grounding (this is a bug); nothing saved")

    # --- save: temp folder then swap ---------------------------------------------------------------------
    model.to("cpu")
    for w in trained:
        w.requires_grad_(False)
    tmp, old = f"{args.save}.tmp", f"{args.save}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.copy(os.path.join(args.model, "sid_vocab.json"), os.path.join(tmp, "sid_vocab.json"))
    report = {"model": args.model, "args": dataclasses.asdict(args), "items_grounded": len(train_items),
              "items_held_out": len(held), "before": before, "after": after, "loss_curve": curve,
              "pretrained_rows_unchanged": frozen_ok,
              # level-averaged scalars (held-out items) for tables: whole-vocab argmax and in-level argmax
              "held_out_acc_before": round(float(np.mean(before["held_out"]["acc"])), 4),
              "held_out_acc_after": round(float(np.mean(after["held_out"]["acc"])), 4),
              "held_out_acc_in_level_before": round(float(np.mean(before["held_out"]["acc_in_level"])), 4),
              "held_out_acc_in_level_after": round(float(np.mean(after["held_out"]["acc_in_level"])), 4), "new_row_shift": round(moved, 4),
              "train_seconds": round(train_s, 1), "seconds": round(time.time() - t0, 1)}
    with open(os.path.join(tmp, "04_ground.json"), "w") as f:
        json.dump(report, f, indent=2)
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(args.save):
        os.replace(args.save, old)
    os.replace(tmp, args.save)
    shutil.rmtree(old, ignore_errors=True)
    print(f"done in {time.time() - t0:.1f}s -> {args.save}")


if __name__ == "__main__":
    main()
