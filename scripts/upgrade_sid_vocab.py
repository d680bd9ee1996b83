"""One-off migration: give model folders made before issue 10 the two sid_vocab.json fields 04-06 now read.

03_expand_vocab.py writes `item_codes` (every item's SID as codes, = sids.npy) and `items_key` (a fingerprint
of dataset.pt's item ids and texts) into sid_vocab.json, so a model folder describes itself and 04-06 no
longer read sids.npy. Folders written before that (03, 04, 05 outputs) stop with "sid_vocab.json lacks what
03_expand_vocab.py writes (KeyError: 'item_codes')". Instead of rebuilding them (03 -> 04 -> 05), this adds
the two fields from the out-dir they were built from, after checking that their SIDs are that sids.npy's.
The result is byte-identical to what the current 03 writes.

usage:  python scripts/upgrade_sid_vocab.py out/ml-100k          (every <out-dir>/models/*/sid_vocab.json)
"""
import hashlib
import json
import os
import sys

import numpy as np
import torch


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/upgrade_sid_vocab.py <out-dir>")
    out = sys.argv[1]
    sids = np.load(os.path.join(out, "sids.npy"), allow_pickle=False)
    ds = torch.load(os.path.join(out, "dataset.pt"), map_location="cpu", weights_only=True)
    key = hashlib.sha256(json.dumps([ds["item_ids"], ds["texts"]]).encode()).hexdigest()[:16]   # = items_key()
    order = ["num_levels", "level_names", "codebook_sizes", "token_ids", "item_token_ids", "item_sids"]
    for name in sorted(os.listdir(os.path.join(out, "models"))):
        path = os.path.join(out, "models", name, "sid_vocab.json")
        if not os.path.exists(path):
            continue
        v = json.load(open(path))
        if "item_codes" in v:
            print(f"up to date   {path}")
            continue
        expect = ["".join(f"<{v['level_names'][l]}_{c}>" for l, c in enumerate(row)) for row in sids.tolist()]
        if v["item_sids"] != expect:
            print(f"SKIPPED      {path}: its SIDs are not {out}/sids.npy's; rebuild it with 03_expand_vocab.py")
            continue
        v = {k: v[k] for k in order} | {"item_codes": sids.tolist(), "items_key": key} | \
            {k: x for k, x in v.items() if k not in order}                          # 03's key order
        with open(path + ".tmp", "w") as f:
            f.write(json.dumps(v))
        os.replace(path + ".tmp", path)
        print(f"upgraded     {path}")


if __name__ == "__main__":
    main()
