"""Step 3: add one LM token per Semantic-ID code and initialize the new embedding rows four ways.

Paper step: vocabulary expansion before grounding/SFT. `random` and `mean` are the baselines of both
papers (centroid paper: "standard" = Gaussian with the pretrained rows' statistics; GTI paper: mean
init, what Hugging Face `resize_token_embeddings(mean_resizing=True)` gives). `centroid` is
Algorithm 1 of the centroid paper (Loveland et al. 2026); `shuffled` is its ablation.

    token (l, k) = "<{letter_l}_{k}>" for every code k used at level l (0..L-1 and the suffix level)
    random:   e_{l,k} ~ N(mu, diag(sigma^2))      mu, sigma = per-dimension mean/std, existing rows
    mean:     e_{l,k} = mu
    centroid: c_{l,k} = mean of x_i over items with code k at level l    (02's centroids.pt, d dims)
              c'_{l,k} = P(c_{l,k})    P = truncate to d_model (d >= d_model), else zero-pad or a
                                      seeded orthonormal d -> d_model map (both keep all distances)
              e_{l,k} = s * (c'_{l,k} - mean_{l,k} c') + mu       (Alg. 1 mean shift; s = 1 "plain",
                        s = rms spread of the existing rows / rms spread of the c' ("matched");
                        "level", the default: each level centered on its own mean, scaled to that)
              --suffix-rows random: the collision-suffix level's rows drawn as random init's instead
    shuffled: the centroid rows permuted among the codes of each level (no semantic alignment)

Rows are written by token id (never weight[-n:]: Qwen-style checkpoints pad rows past the
tokenizer). An untied output head gets the same recipe with its own statistics; --head-init X unties
a tied head and gives the head's new rows init X. Existing rows: the tokenizer's (no padding rows).

Reads:  <out-dir>/dataset.pt (01: item count and fingerprint), sids.npy, centroids.pt, rqvae.pt
        (02; only its config: is the last level a collision suffix?), the base model
Writes: <out-dir>/models/<init>/ (model + tokenizer via save_pretrained, plus sid_vocab.json),
        <out-dir>/03_expand_vocab.json (per init: num_new_tokens, norms of new vs old rows, seconds)
CPU:  python 03_expand_vocab.py                 (all four inits)
GPU:  same command (nothing here needs a GPU); any HF causal LM: --model Qwen/Qwen3-0.6B
Good run prints the number of new tokens per level and, per init, the mean norm of new vs old rows:
  init=centroid  new rows |e| 3.3 (old 3.2)  -> out/ml-100k/models/centroid
"""
import argparse
import ast
import dataclasses
import hashlib
import inspect
import json
import os
import random
import shutil
import sys
import time
import typing
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
import torch

INITS = ("random", "mean", "centroid", "shuffled")
SHUFFLE_SEED, SUFFIX_SEED = 1, 2         # --seed offsets: the shuffle, the random suffix rows


@dataclass
class Args:
    dataset: str = "ml-100k"
    """only picks the default --out-dir (out/<dataset>)"""
    out_dir: str = ""
    """artifacts folder: reads dataset.pt, sids.npy, centroids.pt; writes models/<init>/,
    03_expand_vocab.json (default: out/<dataset>)"""
    model: str = "models/SmolLM2-135M-Instruct"
    """base causal LM: a Hugging Face folder or hub name (tied or untied head)"""
    init: Literal["random", "mean", "centroid", "shuffled", "all"] = "all"
    """the new rows' init; all = the four folders from one load of the base model"""
    centroid_map: Literal["pad", "orthogonal"] = "orthogonal"
    """centroid init when d < d_model: pad (zero-pad) or orthogonal (seeded orthonormal map)"""
    centroid_scale: Literal["plain", "matched", "level"] = "level"
    """centroid init: plain (the paper's mean shift only) | matched (also scale all rows to the
    existing rows' spread) | level (each level centered on its own mean, scaled to that spread)"""
    suffix_rows: Literal["centroid", "random"] = "centroid"
    """centroid/shuffled with a collision-suffix level (02 --collisions suffix): its rows follow
    the init (centroid) or are drawn like random init's (random); no effect without a suffix"""
    head_init: Literal["same", "random", "mean", "centroid", "shuffled"] = "same"
    """same: the head, tied or not, follows --init; else untie the output head and give its new rows
    this init"""
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    """where the statistics are computed (cpu is fast enough); auto = cuda, else mps, else cpu"""
    seed: int = 0
    """seeds random, numpy and torch (random rows, orthonormal map, shuffle)"""


# --- The paper step: four initializations of the new rows (centroid: Algorithm 1) ----------------
def new_rows(init: str, old: torch.Tensor, cents: list, args: Args, suffix: bool = False):
    """Rows for the new tokens in (level, code) order. old: (V_old, D) fp32; cents: (n_l, d) each.
    suffix: the last level is a collision suffix (its rows are random with --suffix-rows random)."""
    n = sum(len(c) for c in cents)
    mu, sigma = old.mean(0), old.std(0)                       # per-dimension statistics        (D,)
    if suffix and args.suffix_rows == "random" and init in ("centroid", "shuffled"):
        gen = torch.Generator().manual_seed(args.seed + SUFFIX_SEED)     # semantic levels as usual
        tail = mu + sigma * torch.randn(len(cents[-1]), old.shape[1], generator=gen)  # (n_sfx, D)
        return torch.cat([new_rows(init, old, cents[:-1], args), tail])
    gen = torch.Generator().manual_seed(args.seed)
    if init == "random":
        return mu + sigma * torch.randn(n, old.shape[1], generator=gen)   # e ~ N(mu, diag sigma^2)
    if init == "mean":
        return mu.expand(n, -1).clone()                                   # e = mu           (n, D)
    # centroid / shuffled: map, center on the centroids' own mean, (scale), shift to mu   (Alg. 1)
    c = map_to_width(torch.cat(cents), old.shape[1], args.centroid_map, gen)   # c' = P(c)  (n, D)
    spread = lambda x: x.pow(2).sum(1).mean().sqrt().clamp_min(1e-12)     # rms norm, centered rows
    per_level = args.centroid_scale == "level"                             # level: each level alone
    groups = c.split([len(cl) for cl in cents]) if per_level else [c]
    groups = [g - g.mean(0) for g in groups]                               # c' - mean_{l,k} c'
    if args.centroid_scale != "plain":                                     # s = rms spread old / c'
        groups = [g * (spread(old - mu) / spread(g)) for g in groups]
    rows = torch.cat(groups) + mu                                          # + mu            (n, D)
    if init == "shuffled":                                                 # permute within a level
        perm_gen, start, order = torch.Generator().manual_seed(args.seed + SHUFFLE_SEED), 0, []
        for cl in cents:
            order.append(start + torch.randperm(len(cl), generator=perm_gen))
            start += len(cl)
        rows = rows[torch.cat(order)]
    return rows


def map_to_width(c: torch.Tensor, d_model: int, how: str, gen: torch.Generator) -> torch.Tensor:
    """P: (n, d) centroids -> (n, d_model). Truncation for d >= d_model (MRL prefixes); else pad or
    orthonormal."""
    n, d = c.shape
    if d >= d_model:
        return c[:, :d_model]                                  # truncate (the paper's choice)
    if how == "pad":
        return torch.cat([c, c.new_zeros(n, d_model - d)], 1)  # zero-pad            (n, d_model)
    q, r = torch.linalg.qr(torch.randn(d_model, d, generator=gen, dtype=torch.float64))  # q (D, d)
    q = q * torch.sign(torch.diagonal(r))                      # unique (Haar) orthonormal columns
    return (c.double() @ q.T).to(c.dtype)                      # x -> Q x keeps all distances


# --- Data: the codes actually used, their centroids, the token names and sid_vocab.json ----------
def load_codes(out_dir: str):
    """02's codes and centroids, checked against 01's dataset.pt before anything is written."""
    path = os.path.join(out_dir, "sids.npy")
    sids = load_npy(path, "run 02_rqvae.py first (or pass --out-dir)")
    if sids.ndim != 2 or sids.dtype.kind not in "iu" or len(sids) == 0 or sids.min() < 0:
        die(f"{path} must be a non-negative int array [N, L+1]; rerun 02_rqvae.py")
    ds = load_pt(os.path.join(out_dir, "dataset.pt"),
                 "run 01_embed_items.py first (or pass --out-dir)")
    n_ds = len(ds.get("item_ids", [])) if isinstance(ds, dict) else "?"
    if n_ds != len(sids) or len(ds.get("texts", [])) != len(sids):
        die(f"{path} has {len(sids)} rows but {out_dir}/dataset.pt has {n_ds} items; "
            "rerun 02_rqvae.py after 01")
    cp = load_pt(os.path.join(out_dir, "centroids.pt"), "run 02_rqvae.py first")
    if not isinstance(cp, dict) or "centroids" not in cp or len(cp["centroids"]) != sids.shape[1]:
        die(f"{out_dir}/centroids.pt has no per-level `centroids` for {sids.shape[1]} levels; "
            "rerun 02_rqvae.py")
    used = [np.unique(sids[:, l]).tolist() for l in range(sids.shape[1])]   # codes used per level
    for l, u in enumerate(used):
        if u[-1] >= len(cp["centroids"][l]):
            die(f"sids.npy uses code {u[-1]} at level {l} but centroids.pt has "
                f"{len(cp['centroids'][l])}; rerun 02")
    cents = [cp["centroids"][l].float()[u] for l, u in enumerate(used)]      # per level (n_l, d)
    sizes = [int(len(cp["centroids"][l])) for l in range(sids.shape[1])]
    rq = load_pt(os.path.join(out_dir, "rqvae.pt"), "run 02_rqvae.py first")
    config = rq.get("config", {}) if isinstance(rq, dict) else {}
    suffix = config.get("collisions", "suffix") == "suffix"
    return sids.astype(np.int64), used, cents, sizes, ds, suffix


def level_letter(l: int) -> str:
    """a, b, ..., z, then aa, ab, ... (more than 26 levels is unusual but stays readable)."""
    return chr(97 + l) if l < 26 else level_letter(l // 26 - 1) + chr(97 + l % 26)


def sid_vocab(sids, used, sizes, letters, ids, ds) -> dict:
    """sid_vocab.json: token ids per level and code, each item's SID (tokens, string, codes), and
    the fingerprint of the dataset.pt these items index."""
    L1 = sids.shape[1]
    tid = {(l, k): int(i) for (l, k), i in zip([(l, k) for l in range(L1) for k in used[l]], ids)}
    return {
        "num_levels": L1, "level_names": letters, "codebook_sizes": sizes,
        "token_ids": [[tid.get((l, k), -1) for k in range(sizes[l])] for l in range(L1)],
        "item_token_ids": [[tid[(l, int(c))] for l, c in enumerate(row)] for row in sids],
        "item_sids": ["".join(f"<{letters[l]}_{int(c)}>" for l, c in enumerate(row))
                      for row in sids],
        "item_codes": sids.tolist(),            # = sids.npy: 04-06 build the trie from the folder
        "items_key": items_key(ds),             # the dataset.pt these items index (04-06 check it)
    }


# --- main: codes -> tokens -> one Hugging Face folder per init (save_folder: temp, then swapped in)
def add_sid_tokens(args: Args, names):
    """Add the SID tokens to the tokenizer; resize the embedding matrix only if it is too small.
    -> tok, model, the new rows' token ids (n,), the matrices to fill, untied?, old vocab size"""
    tok, model = load_hf(args.model, "pass a Hugging Face causal LM folder (`make setup` makes the "
                         "default)", dtype="auto")
    vocab_before = len(tok)
    if any(t in tok.get_vocab() for t in names):
        die(f"--model {args.model} already has SID tokens (e.g. {names[0]}); pass the base model, "
            "not a 03 output")
    tok.add_tokens(names)                                  # plain added tokens: "<a_1><b_2>" splits
    ids = torch.tensor(tok.convert_tokens_to_ids(names))    # token id of each new row         (n,)
    if len(tok) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tok), mean_resizing=False)  # rows overwritten by id
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    untied = head is not None and head.weight.data_ptr() != emb.weight.data_ptr()
    if args.head_init != "same" and not untied:
        untied = untie_head(args, model, emb, head)
    mats = {"embed": emb.weight} | ({"head": head.weight} if untied else {})
    return tok, model, ids, mats, untied, vocab_before


def fill_rows(args: Args, init: str, mats: dict, olds: dict, ids, cents, suffix: bool, device):
    """Write each matrix's new rows (by token id); returns their norms next to the old rows'."""
    norms = {}
    rms = lambda x: round(float((x - x.mean(0)).pow(2).sum(1).mean().sqrt()), 4)   # rms spread
    with torch.no_grad():
        for k, w in mats.items():
            how = args.head_init if k == "head" and args.head_init != "same" else init
            rows = new_rows(how, olds[k], [c.to(device) for c in cents], args, suffix)  # (n, D)
            w[ids.to(w.device)] = rows.to(w.device, w.dtype)                 # write by token id
            norms[k] = {"new_mean_norm": round(float(rows.norm(dim=1).mean()), 4),
                        "old_mean_norm": round(float(olds[k].norm(dim=1).mean()), 4),
                        "new_rms_spread": rms(rows), "old_rms_spread": rms(olds[k])}
    return norms


def main():
    args = parse_args()
    args.out_dir = args.out_dir or os.path.join("out", args.dataset)
    inits = list(INITS) if args.init == "all" else [args.init]
    seed_everything(args.seed)
    device = pick_device(args.device)
    t0 = time.time()
    sids, used, cents, sizes, ds, suffix = load_codes(args.out_dir)
    L1 = sids.shape[1]
    letters = [level_letter(l) for l in range(L1)]
    names = [f"<{letters[l]}_{k}>" for l in range(L1) for k in used[l]]
    per_level = ", ".join(f"{letters[l]}={len(u)}" for l, u in enumerate(used))
    print(f"{len(sids)} items, {L1} levels; new tokens per level: {per_level} (total {len(names)})")

    tok, model, ids, mats, untied, vocab_before = add_sid_tokens(args, names)
    rows_before = mats["embed"].shape[0]
    old_ids = torch.arange(min(vocab_before, rows_before))                    # pre-existing tokens
    olds = {k: w.detach()[old_ids].to(device, torch.float32) for k, w in mats.items()}  # (V_old, D)
    print(f"model {args.model}: vocab {vocab_before} -> {len(tok)}, matrix rows {rows_before}, "
          f"d_model {mats['embed'].shape[1]}, head {'untied' if untied else 'tied'}; "
          f"centroid d = {cents[0].shape[1]}")
    vocab = sid_vocab(sids, used, sizes, letters, ids, ds)

    summary_path = os.path.join(args.out_dir, "03_expand_vocab.json")
    summary = load_summary(summary_path)              # keep the other inits' rows when writing one
    os.makedirs(os.path.join(args.out_dir, "models"), exist_ok=True)
    for init in inits:
        t1 = time.time()
        norms = fill_rows(args, init, mats, olds, ids, cents, suffix, device)
        dst = os.path.join(args.out_dir, "models", init)
        save_folder(dst, model, tok, {"sid_vocab.json": json.dumps(vocab | {"init": init})})
        summary[init] = {"init": init, "num_new_tokens": len(names), "model": args.model,
                         "vocab_before": vocab_before, "vocab_after": len(tok), "tied": not untied,
                         "centroid_map": args.centroid_map, "centroid_scale": args.centroid_scale,
                         "suffix_rows": args.suffix_rows if suffix else "none",
                         "head_init": init if args.head_init == "same" else args.head_init,
                         "norms": norms, "seconds": round(time.time() - t1, 2)}
        e = norms["embed"]
        print(f"init={init:9s} new rows |e| {e['new_mean_norm']:.3f} "
              f"(old {e['old_mean_norm']:.3f}), spread {e['new_rms_spread']:.3f} "
              f"(old {e['old_rms_spread']:.3f})  -> {dst}")
    atomic_write(summary_path, lambda t: open(t, "w").write(json.dumps(summary, indent=2)))
    print(f"done in {time.time() - t0:.1f}s; summary -> {summary_path}")


# --- Beyond the papers: an untied head for --head-init; the summary of earlier runs -------------
def untie_head(args: Args, model, emb, head) -> bool:
    """The head gets its own copy of the rows; the config says untied (saved, reloaded untied)."""
    if head is None:
        die(f"--head-init {args.head_init}: --model {args.model} has no output head to untie")
    head.weight = torch.nn.Parameter(emb.weight.detach().clone())
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False
    return True


def load_summary(path: str) -> dict:
    """03_expand_vocab.json of an earlier run (another --init); {} if there is none or it is bad."""
    if os.path.exists(path):
        try:
            return json.load(open(path))
        except Exception:
            return {}
    return {}


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


def load_npy(path: str, hint: str) -> np.ndarray:
    return load_artifact(path, hint, lambda p: np.load(p, allow_pickle=False))


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
