"""Ask a trained model for recommendations: a history typed as item ids or title fragments -> the top-10
items with their titles and SIDs, from 06_eval.py's constrained beam search (history excluded).

    python scripts/recommend.py --model out/ml-100k/models/centroid+gti+sft --history "Star Wars, 181, Toy Story"

Each comma-separated entry of --history is one item, oldest first (the last one is the most recent):
  - an entry equal to an item id of dataset.pt is that item (ML-100K: the MovieLens movie id, 181 = Return
    of the Jedi);
  - else a case-insensitive part of an item's title (the item text up to the fields 01_embed_items.py
    appends: ". Genres: ...", ". Category: ...", ". Brand: ..."). A title equal to the entry wins; among
    several titles that contain it, the most popular item (train-part count, then the lower index) is
    taken, and the line printed for it says how many others matched. An entry that matches nothing is a
    one-line error.
The prompt is 06's: sft_config.json's template over the last max_history items (05's prompt template
and 20 items without it), scored with its softmax; the beam search (width --beam, 06's default 20) ranks
the items not in the history, and the first --top are printed, best first, with their log-probability.
"""
import os
import re
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from common import (Parser, add_device_flags, die, load_sid_model, load_step, pad_id,  # noqa: E402
                    pick_autocast, pick_device, pos_int)

ev = load_step("06_eval")            # 06's prompt, trie, scorer and beam search
TITLE_END = re.compile(r"\. (?:Genres|Category|Brand): ")          # what 01 appends after a title


def parse_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--model", default="out/ml-100k/models/centroid+gti+sft", help="05's folder (03's, 04's)")
    p.add_argument("--out-dir", default="", help="folder with dataset.pt ('': two levels above --model)")
    p.add_argument("--history", required=True,
                   help='comma-separated item ids or title fragments, oldest first: "Star Wars, 181, Toy Story"')
    p.add_argument("--top", type=pos_int, default=10, help="items to print")
    p.add_argument("--beam", type=pos_int, default=20, help="beam width (06's default); at least --top")
    add_device_flags(p, "auto = bf16 on CUDA and native-bf16 CPUs; the head + log-softmax stay fp32")
    return p.parse_args(argv)


def title(text: str) -> str:
    return TITLE_END.split(text, maxsplit=1)[0]


def resolve(entry: str, ids: dict, titles: list, popularity: np.ndarray):
    """One history entry -> (item index, a note on how it was found). Exit with one line if nothing fits."""
    if entry in ids:
        return ids[entry], "id"
    low = entry.lower()
    exact = [i for i, t in enumerate(titles) if t.lower() == low]
    if exact:
        return exact[0], "title"
    hits = [i for i, t in enumerate(titles) if low in t.lower()]
    if not hits:
        die(f"no item has the id or a title containing {entry!r}; use an item id of dataset.pt "
            f"or part of a title (case-insensitive)")
    best = min(hits, key=lambda i: (-int(popularity[i]), i))          # most popular, then lower index
    return best, "title" if len(hits) == 1 else f"most popular of {len(hits)} titles containing {entry!r}"


def main(argv=None):
    args = parse_args(argv)
    if args.beam < args.top:
        die(f"--beam {args.beam} must be at least --top {args.top}")
    entries = [e.strip() for e in args.history.split(",") if e.strip()]
    if not entries:
        die("--history is empty; give item ids or title fragments, separated by commas")
    device = pick_device(args.device)
    ctx, _ = pick_autocast(args.dtype, device)
    out_dir = args.out_dir or os.path.dirname(os.path.dirname(os.path.abspath(args.model)))
    model, tok, vocab, data, sids, item_tok, sft_cfg = load_sid_model(args.model, out_dir, device)
    softmax = sft_cfg.get("softmax", "full")
    if softmax not in ("full", "level"):
        die(f"{args.model}/sft_config.json: softmax {softmax!r}; 06 scores full | level (retrain with 05)")
    titles = [title(t) for t in data["texts"]]
    ids = {item_id: i for i, item_id in enumerate(data["item_ids"])}
    popularity = data["popularity"].numpy()

    history = []
    for entry in entries:
        i, how = resolve(entry, ids, titles, popularity)
        history.append(i)
        print(f"history: {entry!r} -> {titles[i]} [id {data['item_ids'][i]}] ({how})")
    prompt = ev.build_prompts(tok, sft_cfg.get("template", ev.DEFAULT_TEMPLATE), item_tok, [history],
                              sft_cfg.get("max_history", 20))
    scorer = ev.LevelScorer(model, vocab["token_ids"], softmax)
    nxt = ev.build_trie(sids, [len(t) for t in vocab["token_ids"]])
    pad = pad_id(tok)
    (items, scores, _), = ev.rank_all(model, prompt, scorer, nxt, args.beam, pad, 1, [history], sids,
                                      (True,), ctx, progress=False)
    print(f"\ntop {args.top} for this history ({len(sids)} items, seen ones excluded, beam {args.beam}):")
    for rank, (i, s) in enumerate(zip(items[0, :args.top].tolist(), scores[0, :args.top].tolist()), 1):
        if i < 0:
            break                                                     # fewer unseen items than --top
        sid = "".join(tok.convert_ids_to_tokens(item_tok[i].tolist()))
        print(f"{rank:3d}. {titles[i]}  {sid}  [id {data['item_ids'][i]}]  log p {s:.3f}")


if __name__ == "__main__":
    main()
