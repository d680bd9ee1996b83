"""Step 5: supervised fine-tuning (SFT) of the whole model on next-item prediction in SID tokens.

Paper step: the recommendation task shared by both papers (TIGER-style generative retrieval; GTI, Chen et
al. 2026, sec. 4.3 "standard SFT"; centroid init, Loveland et al. 2026, sec. 5). `--aux-tasks` mixes in
LC-Rec-style language <-> SID examples (Zheng et al. 2024; the GTI paper's LC-Rec baseline).

    example (u, i):  prompt = template(SID(s_{u,i-H}) ... SID(s_{u,i-1})),  target = SID(s_{u,i}) + EOS
                     for every position i >= 1 of the train part (s_u[:-2]); H = --max-history
    loss = - (1 / #target tokens) sum_{t in target} log p(x_t | x_<t)      (prompt positions ignored)
    lr(step) = lr * step / warmup, then cosine from lr to lr * --min-lr-frac
The validation item (s_u[-2]) is only used for the validation loss that picks the best checkpoint; the test
item (s_u[-1]) is never read. Token ids are built directly (template text ids + SID token ids from
sid_vocab.json), so tokenization can never merge or split SID tokens. Batches are left-padded, so every
target sits at the end of its row and the LM head runs only on the last (max target length + 1)
positions (`logits_to_keep`): the 49k-wide head would otherwise dominate the step.

Multi-process: `torchrun --nproc_per_node=N 05_sft.py ...` (DistributedDataParallel; NCCL on CUDA, gloo on
CPU; rank 0 logs and saves). --batch-size is the global micro-batch, split over the processes, so the
examples and the loss trajectory match a single-process run. The example order is a pure function of
(seed, step), so `--resume` continues a killed run from its last checkpoint with the same numbers (on CPU;
on CUDA, bf16 autocast and non-deterministic cuBLAS/SDPA kernels make runs differ slightly).

Reads:  --model (a 03/04 folder: HF model + tokenizer + sid_vocab.json), <out-dir>/dataset.pt, sids.npy
        (default --out-dir: the folder two levels above --model).
Writes: --save (default <model>+sft): the best model (lowest validation loss) + tokenizer + sid_vocab.json
        + sft_config.json (template, max_history; read by 06) + 05_sft.json (loss curve, val curve, validation
        accuracy per target position (SID levels, eos), best step, seconds); <save>.resume.pt while training (model, optimizer, scheduler, RNG, step; removed
        when the run finishes).

CPU (demonstration budget, ~10 min for SmolLM2-135M at ~3.2 s/step; still below most-popular on ML-100K):
      python 05_sft.py --model out/ml-100k/models/centroid
GPU (epochs over all ~97k ML-100K examples, bf16 autocast, larger batch):
      python 05_sft.py --model out/ml-100k/models/centroid --device cuda --epochs 3 --batch-size 64 \
          --lr 3e-4 --warmup 200 --eval-every 500 --val-examples 943
      torchrun --nproc_per_node=4 05_sft.py --model out/ml-100k/models/centroid --epochs 3 --batch-size 256
Good run prints one line per --log-every steps, e.g. "step 50/150 | loss 2.91 | lr 1.9e-04 | ...", the
validation loss every --eval-every steps, and "best step ... val loss ..." at the end.
"""
# ---------------------------------------------------------------------------------------------------
# Shared boilerplate: COPY this block into each numbered script (no imports between numbered scripts;
# duplication is accepted, cleanrl-style). Keep names identical across scripts.
# ---------------------------------------------------------------------------------------------------
import argparse
import ast
import dataclasses
import inspect
import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")            # nothing is fetched from a hub at run time
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import math  # noqa: E402  (step-specific imports)
from contextlib import nullcontext  # noqa: E402

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


@dataclass
class Args:
    model: str = "out/ml-100k/models/centroid"
    """input model folder (03_expand_vocab.py or 04_ground.py output)"""
    save: str = ""
    """output folder (default: <model>+sft)"""
    out_dir: str = ""
    """artifacts folder with dataset.pt and sids.npy (default: two levels above --model)"""
    max_history: int = 20
    """history items in each prompt"""
    template: str = "User history: {history}\nNext item:"
    """prompt template; {history} = the history's SID tokens (saved to sft_config.json for 06)"""
    aux_tasks: bool = False
    """mix in LC-Rec-style item text -> SID and SID -> item text examples"""
    aux_ratio: float = 0.25
    """auxiliary examples per recommendation example (with --aux-tasks)"""
    steps: int = 150
    """optimizer steps (CPU demonstration default); ignored when --epochs > 0"""
    epochs: float = 0.0
    """passes over all examples (sets the number of steps; the GPU setting)"""
    batch_size: int = 16
    """examples per micro-step, over all processes together"""
    grad_accum: int = 1
    """micro-steps per optimizer step"""
    lr: float = 2e-4
    """peak learning rate (AdamW)"""
    min_lr_frac: float = 0.1
    """cosine schedule ends at lr * min_lr_frac"""
    warmup: int = 10
    """linear warmup steps"""
    weight_decay: float = 0.01
    """AdamW weight decay"""
    clip: float = 1.0
    """gradient-norm clipping (0: off)"""
    eval_every: int = 50
    """validation loss, best-model save and resume checkpoint every N steps"""
    val_examples: int = 256
    """validation examples (one per user, a fixed random subset; 0: all users)"""
    log_every: int = 10
    """one log line every N steps"""
    resume: bool = False
    """continue from <save>.resume.pt (same arguments)"""
    resumable: bool = True
    """write <save>.resume.pt (model + optimizer state, ~3x the model) at each validation; --no-resumable skips it (short runs)"""
    stop_at: int = 0
    """stop abruptly after this step, as if killed (to test --resume); 0: off"""
    device: str = "auto"
    """auto | cpu | cuda | mps"""
    dtype: str = "auto"
    """auto (bfloat16 autocast on CUDA, float32 elsewhere) | float32 | bfloat16 (CUDA only)"""
    seed: int = 0
    """seeds random, numpy, torch and the example order"""


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
# torch.save:  atomic_write(p, lambda t: torch.save(obj, t))
# numpy:       atomic_write(p, lambda t: np.save(open(t, "wb"), arr))   (np.save adds .npy to str paths!)
# json:        atomic_write(p, lambda t: open(t, "w").write(json.dumps(d, indent=2)))
# HF folder:   save_pretrained into f"{dst}.tmp", then swap: rename old dst away, rename tmp -> dst, rmtree old.


def load_pt(path: str, hint: str):
    """torch.load(weights_only=True) with a one-line error that says which step makes the file."""
    if not os.path.exists(path):
        die(f"{path} not found; {hint}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        die(f"{path} is unreadable ({type(e).__name__}); {hint}")


# ---------------------------------------------------------------------------------------------------
# Inputs: the model folder, its SID vocabulary, and the dataset it must match (same checks as 06_eval.py)
# ---------------------------------------------------------------------------------------------------
def load_sid_model(model_dir: str, out_dir: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    vocab_path = os.path.join(model_dir, "sid_vocab.json")
    if not os.path.isdir(model_dir):
        die(f"{model_dir} not found; run 03_expand_vocab.py (or 04_ground.py) first")
    if not os.path.exists(vocab_path):
        die(f"{vocab_path} not found: {model_dir} has no SID tokens; use a folder made by 03_expand_vocab.py "
            "or 04_ground.py")
    vocab = json.load(open(vocab_path))
    data = load_pt(os.path.join(out_dir, "dataset.pt"), "run 01_embed_items.py first (or pass --out-dir)")
    sids_path = os.path.join(out_dir, "sids.npy")
    if not os.path.exists(sids_path):
        die(f"{sids_path} not found; run 02_rqvae.py first (or pass --out-dir)")
    sids = np.load(sids_path)
    n, letters = len(data["item_ids"]), vocab["level_names"]
    if len(vocab["item_sids"]) != n or sids.shape != (n, vocab["num_levels"]):
        die(f"{vocab_path} describes {len(vocab['item_sids'])} items x {vocab['num_levels']} levels but "
            f"{out_dir} has {n} items, sids.npy {tuple(sids.shape)}; the model was built for another "
            f"dataset: rerun 03_expand_vocab.py --out-dir {out_dir}")
    expect = ["".join(f"<{letters[l]}_{c}>" for l, c in enumerate(row)) for row in sids.tolist()]
    bad = [i for i in range(n) if expect[i] != vocab["item_sids"][i]]
    if bad:
        die(f"{vocab_path}: item {bad[0]} has SID {vocab['item_sids'][bad[0]]} but {sids_path} says "
            f"{expect[bad[0]]} ({len(bad)} items differ); rerun 03_expand_vocab.py after 02_rqvae.py")
    tok = AutoTokenizer.from_pretrained(model_dir)
    item_tok = torch.tensor(vocab["item_token_ids"], dtype=torch.long)               # (N, L+1)
    names = tok.convert_ids_to_tokens(item_tok.flatten().tolist())
    if names != [t for s in expect for t in s.replace("><", ">\n<").split("\n")]:
        die(f"{model_dir}: the tokenizer does not hold the SID tokens listed in sid_vocab.json; "
            "rebuild the folder with 03_expand_vocab.py")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if model.get_input_embeddings().num_embeddings <= int(item_tok.max()):
        die(f"{model_dir}: embedding matrix smaller than the SID token ids; rebuild it with 03_expand_vocab.py")
    return model, tok, vocab, data, item_tok


# ---------------------------------------------------------------------------------------------------
# Examples: (kind, a, b) triples, turned into token ids only when batched (97k ML-100K examples stay small)
#   kind 0: recommendation, user a, target position b of the train part (history = the H items before b)
#   kind 1: item text -> SID of item a        kind 2: SID of item a -> item text     (LC-Rec auxiliary)
#   kind 3: validation, user a: history = the whole train part, target = the validation item
# ---------------------------------------------------------------------------------------------------
AUX_TEMPLATES = {1: "Item: {text}\nSemantic ID:", 2: "Semantic ID: {sid}\nItem:"}


def build_examples(train, num_items: int, aux_ratio: float, seed: int):
    """train: the train parts only (s_u[:-2]); the validation / test items are not even passed in."""
    rec = [(0, u, i) for u, s in enumerate(train) for i in range(1, len(s))]
    aux = []
    if aux_ratio > 0:
        g = torch.Generator().manual_seed(seed)
        n_aux = round(aux_ratio * len(rec))
        pick = torch.randint(0, 2 * num_items, (n_aux,), generator=g).tolist()   # text->SID or SID->text
        aux = [(1 + p % 2, p // 2, 0) for p in pick]
    return rec, aux


class Encoder:
    """Turns an example triple into (prompt ids, target ids); SID tokens are inserted as ids."""

    def __init__(self, tok, template, item_tok, texts, data_seqs, valid, max_history):
        if template.count("{history}") != 1:
            die(f"--template {template!r} must contain {{history}} exactly once")
        enc = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731
        self.pre, self.post = map(enc, template.split("{history}"))
        self.aux = {k: [enc(x) for x in t.split("{text}" if k == 1 else "{sid}")] for k, t in AUX_TEMPLATES.items()}
        self.enc, self.item_tok, self.texts = enc, item_tok.tolist(), texts
        self.train, self.valid, self.H = data_seqs, valid, max_history
        self.eos = tok.eos_token_id

    def sid(self, items):
        return [t for i in items for t in self.item_tok[i]]

    def __call__(self, ex):
        kind, a, b = ex
        if kind == 0:                                       # history s[b-H:b] -> s[b]
            s = self.train[a]
            return self.pre + self.sid(s[max(0, b - self.H):b]) + self.post, self.sid([s[b]]) + [self.eos]
        if kind == 3:                                       # history s[-H:] -> validation item
            return self.pre + self.sid(self.train[a][-self.H:]) + self.post, self.sid([self.valid[a]]) + [self.eos]
        text = self.enc(" " + self.texts[a])[:32]
        pre, post = self.aux[kind]
        if kind == 1:
            return pre + text[1:] + post, self.sid([a]) + [self.eos]
        return pre + self.sid([a]) + post, text + [self.eos]


def collate(pairs, pad_id: int):
    """Left-pad prompt+target rows. Returns ids, mask, positions (B, T), labels (B, m), m = logits to keep."""
    T = max(len(p) + len(t) for p, t in pairs)
    m = max(len(t) for _, t in pairs) + 1                   # logits at T-m .. T-1 (the last one is unused)
    ids = torch.full((len(pairs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(pairs), T, dtype=torch.long)
    labels = torch.full((len(pairs), m), -100, dtype=torch.long)
    for b, (p, t) in enumerate(pairs):
        ids[b, T - len(p) - len(t):] = torch.tensor(p + t)
        mask[b, T - len(p) - len(t):] = 1
        labels[b, m - 1 - len(t):m - 1] = torch.tensor(t)   # the logit at position j predicts token j+1
    pos = (mask.cumsum(1) - 1).clamp(min=0)                 # positions ignore the left pad
    return ids, mask, pos, labels


def batch_loss(model, batch, device, ctx):
    """Summed CE over target tokens, their count, and hits (B, m): argmax == label at each target position.
    The LM head runs on the last m positions only."""
    ids, mask, pos, labels = (x.to(device) for x in batch)
    with ctx:
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False,
                       logits_to_keep=labels.shape[1]).logits                  # (B, m, V)
    logits = logits.float()
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    hits = (logits.argmax(-1) == labels) & (labels != -100)                     # (B, m)
    return loss, (labels != -100).sum(), hits


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


# ---------------------------------------------------------------------------------------------------
# Saving: the unwrapped model as an HF folder (atomic swap), the resumable training state
# ---------------------------------------------------------------------------------------------------
def save_folder(dst, model, tok, extra: dict):
    tmp, old = f"{dst}.tmp", f"{dst}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    for name, obj in extra.items():
        with open(os.path.join(tmp, name), "w") as f:
            json.dump(obj, f, indent=2)
    if os.path.exists(dst):
        os.replace(dst, old)
    os.replace(tmp, dst)
    shutil.rmtree(old, ignore_errors=True)


def lr_lambda(args, total):
    def f(step):                                            # multiplier of args.lr at optimizer step `step`
        if step < args.warmup:
            return (step + 1) / args.warmup
        p = (step - args.warmup) / max(1, total - args.warmup)
        return args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, p)))
    return f


# ---------------------------------------------------------------------------------------------------
# Main: setup (DDP or not) -> data -> loop (accumulate, clip, step, log, validate, checkpoint) -> save
# ---------------------------------------------------------------------------------------------------
def main():
    args = parse_args()
    ddp = int(os.environ.get("RANK", -1)) != -1                       # launched by torchrun?
    if ddp:
        use_cuda = args.device in ("auto", "cuda") and torch.cuda.is_available()
        dist.init_process_group("nccl" if use_cuda else "gloo")
        rank, world, local = dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device(f"cuda:{local}" if use_cuda else "cpu")
        if use_cuda:
            torch.cuda.set_device(device)
    else:
        rank, world, device = 0, 1, pick_device(args.device)
    master = rank == 0
    log = print if master else (lambda *a, **k: None)
    if args.batch_size % world:
        die(f"--batch-size {args.batch_size} must be divisible by the {world} processes")
    if args.dtype not in ("auto", "float32", "bfloat16") or (args.dtype == "bfloat16" and device.type != "cuda"):
        die(f"--dtype {args.dtype}: use auto|float32, or bfloat16 on CUDA")
    bf16 = device.type == "cuda" and args.dtype in ("auto", "bfloat16")
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else nullcontext()
    save = args.save or args.model.rstrip("/") + "+sft"
    ckpt_path = f"{save}.resume.pt"
    out_dir = args.out_dir or os.path.dirname(os.path.dirname(os.path.abspath(args.model)))
    if args.resume and not os.path.exists(ckpt_path):
        die(f"--resume: {ckpt_path} not found (a finished run removes it); run without --resume")
    seed_everything(args.seed)
    log(f"device {device}  world {world}  autocast {'bfloat16' if bf16 else 'off (float32)'}  model {args.model}")

    # --- data ---
    model, tok, vocab, data, item_tok = load_sid_model(args.model, out_dir)
    train, valid = data["train"], data["valid"].tolist()
    rec, aux = build_examples(train, len(item_tok), args.aux_ratio if args.aux_tasks else 0.0, args.seed)
    examples = rec + aux
    if not rec:
        die(f"{out_dir}/dataset.pt has no training positions (train parts shorter than 2 items)")
    encode = Encoder(tok, args.template, item_tok, data["texts"], train, valid, args.max_history)
    users = [u for u in range(len(train)) if len(train[u]) > 0]
    if args.val_examples and args.val_examples < len(users):
        g = torch.Generator().manual_seed(args.seed)
        users = sorted(torch.randperm(len(users), generator=g)[:args.val_examples].tolist())
    val = [(3, u, 0) for u in users]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    per_step = args.batch_size * args.grad_accum
    total = math.ceil(args.epochs * len(examples) / per_step) if args.epochs > 0 else args.steps
    log(f"examples {len(rec)} recommendation + {len(aux)} auxiliary, val {len(val)}  "
        f"steps {total} x {per_step} examples ({total * per_step / len(examples):.2f} epochs)")

    # --- model, optimizer, schedule, resume ---
    model.to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args, total))
    state = {"step": 0, "best_val": float("inf"), "best_step": -1, "loss_curve": [], "val_curve": [],
             "val_level_acc": [], "seconds": 0.0}
    keep = ("model", "template", "max_history", "aux_tasks", "aux_ratio", "steps", "epochs", "batch_size",
            "grad_accum", "lr", "min_lr_frac", "warmup", "weight_decay", "clip", "eval_every", "val_examples", "seed")
    if args.resume:
        ck = load_pt(ckpt_path, "rerun without --resume")
        diff = [k for k in keep if ck["args"].get(k) != getattr(args, k)]
        if diff or ck["examples"] != len(examples) or ck["world"] != world:
            die(f"--resume: {ckpt_path} was written with other arguments ({', '.join(diff) or 'world size'}); "
                "use the same ones or run without --resume")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        torch.set_rng_state(ck["rng"])
        if device.type == "cuda" and "cuda_rng" in ck:
            torch.cuda.set_rng_state(ck["cuda_rng"], device)
        state = ck["state"]
        log(f"resumed from {ckpt_path} at step {state['step']}")
    raw = model
    if ddp:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    sft_config = {"template": args.template, "max_history": args.max_history, "item_separator": "",
                  "target": "SID tokens + eos", "aux_tasks": args.aux_tasks, "aux_templates": AUX_TEMPLATES}

    positions = vocab["level_names"] + ["eos"]                          # the target tokens of every val example

    def evaluate():
        """Validation loss, next-token accuracy over the target tokens and per target position (SID levels, eos),
        summed over all processes. Every validation target is one item's SID + eos: K = L+2 tokens."""
        model.eval()
        K = len(positions)
        tot = torch.zeros(3 + K, dtype=torch.float64, device=device)
        mine = val[rank::world]
        with torch.no_grad():
            for s in range(0, len(mine), args.batch_size // world):
                loss, n, hits = batch_loss(model, collate([encode(e) for e in mine[s:s + args.batch_size // world]],
                                                          pad_id), device, ctx)
                per_pos = hits[:, -1 - K:-1].sum(0)                     # labels are right-aligned      (K,)
                tot += torch.cat([torch.stack([loss.double(), n.double(), hits.sum().double()]), per_pos.double()])
        if ddp:
            dist.all_reduce(tot)
        model.train()
        return (tot[0] / tot[1]).item(), (tot[2] / tot[1]).item(), (tot[3:] / (tot[1] / K)).tolist()

    def checkpoint(step):
        """Validate; save the best model (HF folder) and the resumable state. Rank 0 writes."""
        vloss, vacc, vpos = evaluate()
        state["val_curve"].append([step, round(vloss, 5), round(vacc, 5)])
        state.setdefault("val_level_acc", []).append([step, [round(x, 4) for x in vpos]])
        better = vloss < state["best_val"]
        if better:
            state["best_val"], state["best_step"] = vloss, step
            if master:
                save_folder(save, raw, tok, {"sid_vocab.json": vocab, "sft_config.json": sft_config})
        log(f"step {step}/{total} | val loss {vloss:.4f} | val token acc {vacc:.3f} ("
            + " ".join(f"{n} {x:.2f}" for n, x in zip(positions, vpos)) + ")"
            + (" | best, saved" if better else ""))
        if master and args.resumable and 0 < step < total:              # the last step needs no resume state
            ck = {"model": raw.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                  "rng": torch.get_rng_state(), "state": state, "examples": len(examples), "world": world,
                  "args": {k: getattr(args, k) for k in keep}}
            if device.type == "cuda":
                ck["cuda_rng"] = torch.cuda.get_rng_state(device)
            atomic_write(ckpt_path, lambda t: torch.save(ck, t))
        if ddp:
            dist.barrier()

    # --- loop ---
    if state["step"] == 0:
        checkpoint(0)                                                   # the initial model's val loss
    model.train()
    perms, local = {}, args.batch_size // world
    t_start, t_log, steps_here = time.time(), time.time(), 0
    for step in range(state["step"], total):
        tot = torch.zeros(2, dtype=torch.float64, device=device)
        for micro in range(args.grad_accum):
            offset = (step * args.grad_accum + micro) * args.batch_size + rank * local
            batch = collate([encode(examples[i]) for i in stream_batch(len(examples), offset, local, args.seed, perms)],
                            pad_id)
            sync = not ddp or micro == args.grad_accum - 1
            with (nullcontext() if sync else model.no_sync()):
                loss, n, _ = batch_loss(model, batch, device, ctx)
                (loss / n / args.grad_accum).backward()                 # mean over this micro-batch's targets
            tot += torch.stack([loss.detach().double(), n.double()])
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip or float("inf"))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if ddp:
            dist.all_reduce(tot)
        state["loss_curve"].append([step + 1, round((tot[0] / tot[1]).item(), 5)])
        state["step"], steps_here = step + 1, steps_here + 1
        if (step + 1) % args.log_every == 0 or step + 1 == total:
            ms = 1000 * (time.time() - t_log) / ((step + 1) % args.log_every or args.log_every)
            log(f"step {step + 1}/{total} | loss {state['loss_curve'][-1][1]:.4f} | "
                f"lr {sched.get_last_lr()[0]:.2e} | gnorm {gnorm:.2f} | {ms:.0f} ms/step")
            t_log = time.time()
        if (step + 1) % args.eval_every == 0 or step + 1 == total:
            state["seconds"] += time.time() - t_start
            checkpoint(step + 1)
            t_start = time.time()
        if args.stop_at and step + 1 == args.stop_at:
            log(f"stopped after step {step + 1} (--stop-at); continue with --resume")
            if ddp:
                dist.destroy_process_group()
            return

    # --- summary ---
    summary = {"loss_curve": state["loss_curve"], "val_curve": state["val_curve"], "best_step": state["best_step"],
               "val_level_acc": state.get("val_level_acc", []), "val_level_names": positions,
               "best_val_loss": state["best_val"], "steps": total, "examples": len(rec), "aux_examples": len(aux),
               "val_examples": len(val), "world_size": world, "batch_size": args.batch_size,
               "grad_accum": args.grad_accum, "seconds": round(state["seconds"], 1),
               "s_per_step": round(state["seconds"] / max(1, total), 3), "device": str(device),
               "bf16": bf16, "args": vars(args)}
    if master:
        if not os.path.isdir(save):
            die(f"no checkpoint was saved to {save} (validation loss never finite)")
        atomic_write(os.path.join(save, "05_sft.json"), lambda t: open(t, "w").write(json.dumps(summary, indent=2)))
        if os.path.exists(ckpt_path):
            os.remove(ckpt_path)
        log(f"best step {state['best_step']} val loss {state['best_val']:.4f}  "
            f"({summary['s_per_step']:.2f} s/step incl. validation)  saved {save}")
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
