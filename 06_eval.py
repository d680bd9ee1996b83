"""Step 6: batched trie-constrained beam search over the SIDs that exist; Recall@K / NDCG@K, cold items.

Paper step: the evaluation protocol shared by both papers (TIGER, Rajput et al. 2023, sec. 3.2; LC-Rec;
GTI, Chen et al. 2026, sec. 5; centroid init, Loveland et al. 2026, sec. 5): leave-one-out, full ranking
over all items by beam search restricted to valid SIDs (a prefix trie), Recall@K (= HR@K, one target)
and NDCG@K.

    score(item) = sum_l log p(c_l | prompt, c_<l)        log-probs over the full vocabulary
    beam step:  keep the B best (prefix, code) pairs with trie[prefix, code] valid; invalid -> -inf
    Recall@K = 1[rank <= K]        NDCG@K = 1[rank <= K] / log2(rank + 1)       (rank is 1-based)

The search prefills each prompt once, copies its KV cache to the B beams (cache.batch_repeat_interleave),
then runs one forward per later SID level over users x beams, reordering the cache to the surviving
beams (cache.reorder_cache). `generate(num_beams=B)` instead runs every prompt B times (bench/beam_search.py
measures both). Duplicates are impossible: each beam is a distinct trie node and each child is distinct.

Prompt: the template in <model>/sft_config.json (written by 05; the same default as 05 when absent) over
the last --max-history items. Test split: history = sequence[:-1] (train part + validation item), target
= last item; --split valid: history = train part, target = validation item. History items are NOT
excluded from the ranking, for the model and the most-popular baseline alike (keep it simple, identical).
Cold targets: items seen <= --cold-max times in the train parts.

Reads:  <model>/ (HF folder + sid_vocab.json [+ sft_config.json]), <out-dir>/dataset.pt, sids.npy.
        Default --out-dir: the folder two levels above --model (<out-dir>/models/<name>).
Writes: <model>/eval_<split>.json (metrics, cold metrics + count, most-popular baseline, seconds),
        <model>/eval_<split>_topk.npy (int64 [U, beam], item indices best first; -1 = no more valid SIDs).

CPU:  python 06_eval.py --model out/ml-100k/models/centroid+sft                (943 users, beam 20)
GPU:  python 06_eval.py --model out/ml-100k/models/centroid+sft --device cuda --batch-size 128
Good run prints a markdown table: model vs most-popular, all users and cold targets.
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

from tqdm import tqdm  # noqa: E402


@dataclass
class Args:
    model: str = "out/ml-100k/models/centroid+sft"
    """model folder (05_sft.py output; any 03/04 folder works too)"""
    out_dir: str = ""
    """artifacts folder with dataset.pt and sids.npy (default: two levels above --model)"""
    split: str = "test"
    """test | valid"""
    beam: int = 20
    """beam width = length of each user's ranked list"""
    batch_size: int = 16
    """users per batch (each becomes batch_size x beam rows after the prefill)"""
    max_history: int = 0
    """history items in the prompt (0: sft_config.json's value, else 20)"""
    cold_max: int = 10
    """a test target is cold when it occurs <= this many times in the train parts"""
    users: int = 0
    """evaluate only the first N users (0: all)"""
    device: str = "auto"
    """auto | cpu | cuda | mps"""
    dtype: str = "auto"
    """auto (bfloat16 on CUDA, float32 elsewhere) | float32 | bfloat16"""
    seed: int = 0
    """seeds random, numpy and torch"""


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
# Inputs: the model folder, its SID vocabulary, and the dataset it must match
# ---------------------------------------------------------------------------------------------------
DEFAULT_TEMPLATE = "User history: {history}\nNext item:"   # identical to 05_sft.py's default


def load_sid_model(model_dir: str, out_dir: str, device, dtype):
    """Load model + tokenizer + sid_vocab.json and check they match <out-dir>'s dataset.pt / sids.npy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    vocab_path = os.path.join(model_dir, "sid_vocab.json")
    if not os.path.isdir(model_dir):
        die(f"{model_dir} not found; run 03_expand_vocab.py (and 05_sft.py) first")
    if not os.path.exists(vocab_path):
        die(f"{vocab_path} not found: {model_dir} has no SID tokens; use a folder made by 03_expand_vocab.py, "
            "04_ground.py or 05_sft.py")
    vocab = json.load(open(vocab_path))
    data = load_pt(os.path.join(out_dir, "dataset.pt"), "run 01_embed_items.py first (or pass --out-dir)")
    sids_path = os.path.join(out_dir, "sids.npy")
    if not os.path.exists(sids_path):
        die(f"{sids_path} not found; run 02_rqvae.py first (or pass --out-dir)")
    sids = np.load(sids_path)
    n = len(data["item_ids"])
    letters = vocab["level_names"]
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
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    if model.get_input_embeddings().num_embeddings <= int(item_tok.max()):
        die(f"{model_dir}: embedding matrix smaller than the SID token ids; rebuild it with 03_expand_vocab.py")
    cfg_path = os.path.join(model_dir, "sft_config.json")
    sft_cfg = json.load(open(cfg_path)) if os.path.exists(cfg_path) else {}
    return model, tok, vocab, data, sids, item_tok, sft_cfg


def encode_prompt(pre_ids, post_ids, item_tok, history):
    """Token ids of the template with the history's SID tokens inserted as ids (never re-tokenized)."""
    return pre_ids + [t for i in history for t in item_tok[i].tolist()] + post_ids


def build_prompts(tok, template, item_tok, histories, max_history):
    if template.count("{history}") != 1:
        die(f"prompt template {template!r} must contain {{history}} exactly once")
    pre, post = template.split("{history}")
    pre_ids = tok(pre, add_special_tokens=False).input_ids
    post_ids = tok(post, add_special_tokens=False).input_ids
    return [encode_prompt(pre_ids, post_ids, item_tok, h[-max_history:]) for h in histories]


# ---------------------------------------------------------------------------------------------------
# The prefix trie as tensors: nxt[l][node, code] = child node at level l+1 (item index at the last level)
# ---------------------------------------------------------------------------------------------------
def build_trie(codes: np.ndarray, sizes):
    """codes: (N, L+1) unique rows. Returns nxt: list of LongTensors (nodes_l, K_l), -1 = no such child."""
    n, levels = codes.shape
    node, n_nodes, nxt = np.zeros(n, np.int64), 1, []
    for l in range(levels):
        table = np.full((n_nodes, sizes[l]), -1, np.int64)
        if l < levels - 1:
            keys = node * sizes[l] + codes[:, l]                       # (N,) prefix id of length l+1
            uniq, child = np.unique(keys, return_inverse=True)
            table[uniq // sizes[l], uniq % sizes[l]] = np.arange(len(uniq))
            node, n_nodes = child.reshape(-1), len(uniq)
        else:
            table[node, codes[:, l]] = np.arange(n)                     # leaves are the items themselves
        nxt.append(torch.from_numpy(table))
    return nxt


# ---------------------------------------------------------------------------------------------------
# Batched constrained beam search: one prefill per prompt, one forward per later level over users x beams
# ---------------------------------------------------------------------------------------------------
def left_pad(prompts, pad_id, device):
    P = max(map(len, prompts))
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p)
        mask[b, P - len(p):] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def beam_search(model, prompts, level_tok, nxt, beam: int, pad_id: int):
    """prompts: list of B token-id lists; level_tok[l]: (K_l,) token id of code k (any id where unused);
    nxt: build_trie's tables. Returns items (B, beam) best first (-1: fewer valid SIDs) and their scores."""
    dev = model.device
    ids, mask = left_pad(prompts, pad_id, dev)                               # (B, P)
    B = ids.shape[0]
    pos = (mask.cumsum(1) - 1).clamp(min=0)                                  # positions ignore the left pad
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
    cache, logp = out.cache, out.logits[:, -1].float().log_softmax(-1)   # (B, V)
    first = mask.sum(1, keepdim=True)                                        # (B, 1) position of SID token 0
    scores = torch.zeros(B, 1, device=dev)                                   # (B, nb) summed log-probs
    nodes = torch.zeros(B, 1, dtype=torch.long, device=dev)                  # (B, nb) trie node per beam
    for l, (tok_l, nxt_l) in enumerate(zip(level_tok, nxt)):
        K, nb = len(tok_l), nodes.shape[1]
        lp = logp[:, tok_l.to(dev)].view(B, nb, K)                           # (B, nb, K) log p(code | prefix)
        child = nxt_l.to(dev)[nodes.clamp(min=0)]                            # (B, nb, K)
        child = child.masked_fill(nodes[..., None] < 0, -1)
        cand = (scores[..., None] + lp).masked_fill(child < 0, -math.inf).view(B, nb * K)
        if nb * K < beam:                                                    # fewer candidates than beams
            cand = torch.cat([cand, cand.new_full((B, beam - nb * K), -math.inf)], 1)
        scores, idx = cand.topk(beam, dim=1)                                 # (B, beam) sorted best first
        idx = idx.clamp(max=nb * K - 1)
        nodes = child.view(B, nb * K).gather(1, idx).masked_fill(scores == -math.inf, -1)
        if l == len(level_tok) - 1:
            break
        if l == 0:
            cache.batch_repeat_interleave(beam)                              # (B, ...) -> (B*beam, ...)
            mask = mask.repeat_interleave(beam, 0)
            first = first.repeat_interleave(beam, 0)
        else:                                                                # beam b continues parent idx // K
            parent = torch.arange(B, device=dev)[:, None] * nb + idx // K    # (B, beam) rows of the cache
            cache.reorder_cache(parent.view(-1))
        token = tok_l.to(dev)[idx % K].view(B * beam, 1)                     # (B*beam, 1) chosen SID token
        mask = torch.cat([mask, mask.new_ones(B * beam, 1)], 1)
        out = model(input_ids=token, attention_mask=mask, position_ids=first + l, cache=cache,
                    use_cache=True)
        logp = out.logits[:, -1].float().log_softmax(-1)                     # (B*beam, V)
    return nodes, scores


def rank_all(model, prompts, level_tok, nxt, beam, pad_id, batch_size, progress=True):
    """Beam search over all prompts in batches of similar length; returns (U, beam) items and scores."""
    order = sorted(range(len(prompts)), key=lambda u: len(prompts[u]))
    items = torch.full((len(prompts), beam), -1, dtype=torch.long)
    scores = torch.full((len(prompts), beam), -math.inf)
    for s in tqdm(range(0, len(order), batch_size), desc="beam search", leave=False, disable=not progress):
        us = order[s:s + batch_size]
        it, sc = beam_search(model, [prompts[u] for u in us], level_tok, nxt, beam, pad_id)
        items[us], scores[us] = it.cpu(), sc.cpu()
    return items, scores


# ---------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------
def rank_metrics(topk: np.ndarray, targets: np.ndarray, ks=(1, 5, 10, 20), ndcg_ks=(5, 10, 20)) -> dict:
    """topk: (U, K) item indices best first; targets: (U,). Recall@k, NDCG@k averaged over users."""
    hit = topk == targets[:, None]                                           # (U, K)
    rank = np.where(hit.any(1), hit.argmax(1), np.iinfo(np.int64).max)      # 0-based rank, max = absent
    out = {f"recall@{k}": float(np.mean(rank < k)) if len(rank) else 0.0 for k in ks if k <= topk.shape[1]}
    for k in ndcg_ks:
        if k <= topk.shape[1]:
            gain = np.where(rank < k, 1.0 / np.log2(np.minimum(rank, k) + 2.0), 0.0)
            out[f"ndcg@{k}"] = float(np.mean(gain)) if len(rank) else 0.0
    return out


def markdown_table(rows):
    keys = list(rows[0][1].keys())
    lines = ["| | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(f"{m[k]:.4f}" for k in keys) + " |" for name, m in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------
def pick_dtype(name: str, device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in ("float32", "bfloat16"):
        die(f"unknown --dtype {name!r}; use auto|float32|bfloat16")
    return getattr(torch, name)


def main():
    args = parse_args()
    seed_everything(args.seed)
    if args.split not in ("test", "valid"):
        die(f"unknown --split {args.split!r}; use test|valid")
    if args.beam < 1 or args.batch_size < 1:
        die("--beam and --batch-size must be >= 1")
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    out_dir = args.out_dir or os.path.dirname(os.path.dirname(os.path.abspath(args.model)))
    print(f"device {device}  dtype {str(dtype).replace('torch.', '')}  model {args.model}  split {args.split}")
    t0 = time.time()
    model, tok, vocab, data, sids, item_tok, sft_cfg = load_sid_model(args.model, out_dir, device, dtype)
    template = sft_cfg.get("template", DEFAULT_TEMPLATE)
    max_history = args.max_history or sft_cfg.get("max_history", 20)

    seqs = data["sequences"][:args.users or None]
    cut = 1 if args.split == "test" else 2                                   # test history includes valid
    histories = [s[:-cut] for s in seqs]
    targets = data[args.split][:len(seqs)].numpy()
    prompts = build_prompts(tok, template, item_tok, histories, max_history)
    level_tok = [torch.tensor(t).clamp(min=0) for t in vocab["token_ids"]]   # unused codes never in the trie
    nxt = build_trie(sids, [len(t) for t in level_tok])
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    print(f"users {len(prompts)}  items {len(sids)}  levels {len(level_tok)}  beam {args.beam}  "
          f"prompt tokens mean {np.mean([len(p) for p in prompts]):.0f}")

    t1 = time.time()
    items, scores = rank_all(model, prompts, level_tok, nxt, args.beam, pad_id, args.batch_size)
    search_s = time.time() - t1
    topk = items.numpy()
    pop = data["popularity"].numpy()
    pop_topk = np.broadcast_to(np.argsort(-pop, kind="stable")[:args.beam], topk.shape)
    cold = pop[targets] <= args.cold_max
    res = {
        "split": args.split, "users": len(prompts), "beam": args.beam, "max_history": max_history,
        "template": template, "model": rank_metrics(topk, targets), "most_popular": rank_metrics(pop_topk, targets),
        "cold_max": args.cold_max, "cold_users": int(cold.sum()),
        "cold_model": rank_metrics(topk[cold], targets[cold]),
        "cold_most_popular": rank_metrics(pop_topk[cold], targets[cold]),
        "search_seconds": round(search_s, 2), "seconds": round(time.time() - t0, 2),
    }
    atomic_write(os.path.join(args.model, f"eval_{args.split}.json"),
                 lambda t: open(t, "w").write(json.dumps(res, indent=2)))
    atomic_write(os.path.join(args.model, f"eval_{args.split}_topk.npy"), lambda t: np.save(open(t, "wb"), topk))
    print(f"beam search {search_s:.1f}s for {len(prompts)} users ({1000 * search_s / len(prompts):.0f} ms/user)")
    print(markdown_table([(f"model (all, n={len(prompts)})", res["model"]),
                          ("most popular (all)", res["most_popular"]),
                          (f"model (cold <= {args.cold_max}, n={res['cold_users']})", res["cold_model"]),
                          ("most popular (cold)", res["cold_most_popular"])]))
    print(f"wrote {os.path.join(args.model, f'eval_{args.split}.json')}")


if __name__ == "__main__":
    main()
