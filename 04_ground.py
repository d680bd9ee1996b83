"""Step 4: GTI grounding - train only the new SID rows on paired text <-> SID supervision, LM frozen.

Paper step: GTI (Chen et al. 2026, "Grounded Token Initialization", method section): between vocabulary
expansion and SFT, freeze the LM and every pretrained embedding row, and train only the new token rows
with next-token NLL on paired linguistic supervision built from the item texts:

    text -> SID:  "<item text> is item" -> <a_12><b_3><c_40><d_0>
    SID -> text:  "Item <a_12><b_3><c_40><d_0> is" -> " <item text></s>"
    loss = - mean_{t in target} log p(y_t | y_<t)         (prompt positions masked with -100; --loss-average
                                                           directions: the mean of each direction, averaged)
    g_W  <- g_W * m[:, None],  m_v = 1 iff token v is new  (binary row mask; weight decay 0 on the rows)

With AdamW, weight_decay = 0 and exactly-zero gradients, the moments of a masked row stay 0 and its update
is 0, so every pretrained row (and every other parameter) stays bit-identical; the script checks this.
Where the output head is untied, the same rows of the head are trained under the same mask.
Held-out grounding quality: text -> SID next-token accuracy per level on items never used for training
(teacher forcing; `acc` = argmax over the whole vocabulary, `acc_in_level` = argmax among that level's tokens;
ties count as 1/#tied, since mean init ties every new row).

Reads:  <model> (03's folder, default <out-dir>/models/centroid, with sid_vocab.json), <out-dir>/dataset.pt
        (default --out-dir: out/<dataset>)
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
import torch.nn.functional as F


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
    steps: Annotated[int, ">= 1"] = 200
    """optimizer steps (CPU default ~3.5 min on ML-100K)"""
    batch_size: Annotated[int, ">= 1"] = 8
    """examples per step (text->SID and SID->text mixed)"""
    lr: Annotated[float, "> 0"] = 1e-2
    """peak learning rate of the new rows (AdamW; rows tolerate far more than full fine-tuning)"""
    warmup: Annotated[int, ">= 0"] = 10
    """linear warmup steps, then cosine decay to 0"""
    loss_average: Literal["tokens", "directions"] = "tokens"
    """tokens (one mean over every target token of the batch: the ~18-token text side of SID->text outweighs
    the 4 SID tokens of text->SID) | directions (mean NLL of each direction, then their average: both tasks
    weigh the same whatever their lengths)"""
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
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    """auto = cuda, else mps, else cpu"""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """bf16 autocast or not; weights, optimizer and loss stay fp32 (auto = bf16 on CUDA and on CPUs with native bf16)"""
    seed: int = 0
    """seeds random, numpy and torch; the held-out split and the batch order"""


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


def grounding_loss(logits, y, is_t2s, average: str):
    """NLL over the target tokens. "tokens": one mean over all M of them. "directions": the mean over the
    text->SID tokens and the mean over the SID->text tokens, averaged (a direction absent from the batch
    drops out), so 4 SID tokens weigh as much as an 18-token title."""
    nll = F.cross_entropy(logits, y, reduction="none")                    # (M,)
    if average == "tokens":
        return nll.mean()
    parts = [nll[m].mean() for m in (is_t2s, ~is_t2s) if m.any()]
    return sum(parts) / len(parts)


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


def collate_right(batch, pad_id):
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
        x, attn, labels, _ = collate_right(pairs[s:s + bs], pad_id)
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


def main():
    args = parse_args()
    args.out_dir = args.out_dir or os.path.join("out", args.dataset)
    args.model = args.model or os.path.join(args.out_dir, "models", "centroid")
    args.save = args.save or args.model.rstrip("/") + "+gti"
    if not 0 <= args.holdout_frac < 1:
        die(f"--holdout-frac {args.holdout_frac}: must be in [0, 1)")
    seed_everything(args.seed)
    device = pick_device(args.device)
    ctx, dtype_note = pick_autocast(args.dtype, device)
    print(f"device {device}, {dtype_note}")
    t0 = time.time()
    model, tok, vocab, data, _, item_tok, _ = load_sid_model(args.model, args.out_dir, "cpu")
    texts, item_tids, token_ids = data["texts"], item_tok.tolist(), vocab["token_ids"]
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
        x, attn, labels, kind = (t.to(device) for t in collate_right(batch, pad_id))
        with ctx:
            logits, y, sel = target_logits(model, x, attn, labels)
        is_t2s = kind[:, None].expand_as(sel)[sel]              # which target positions are SID tokens (M,)
        loss = grounding_loss(logits, y, is_t2s, args.loss_average)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(trained, args.grad_clip)
        opt.step()
        sched.step()
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

    # --- save: the folder (with the same sid_vocab.json and this report), swapped in by save_folder -------
    model.to("cpu")
    for w in trained:
        w.requires_grad_(False)
    report = {"model": args.model, "args": dataclasses.asdict(args), "items_grounded": len(train_items),
              "items_held_out": len(held), "before": before, "after": after, "loss_curve": curve,
              "pretrained_rows_unchanged": frozen_ok,
              # level-averaged scalars (held-out items) for tables: whole-vocab argmax and in-level argmax
              "held_out_acc_before": round(float(np.mean(before["held_out"]["acc"])), 4),
              "held_out_acc_after": round(float(np.mean(after["held_out"]["acc"])), 4),
              "held_out_acc_in_level_before": round(float(np.mean(before["held_out"]["acc_in_level"])), 4),
              "held_out_acc_in_level_after": round(float(np.mean(after["held_out"]["acc_in_level"])), 4),
              "new_row_shift": round(moved, 4), "train_seconds": round(train_s, 1),
              "seconds": round(time.time() - t0, 1)}
    save_folder(args.save, model, tok, {"sid_vocab.json": json.dumps(vocab),
                                        "04_ground.json": json.dumps(report, indent=2)})
    print(f"done in {time.time() - t0:.1f}s -> {args.save}")


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


if __name__ == "__main__":
    main()
