"""Test helper: turn a tiny HF model folder into a step-03-style folder (SID tokens added to tokenizer and
embeddings, sid_vocab.json as in docs/artifacts.md) for the items of a make_synthetic_out() folder."""
import json
import os

import numpy as np
import torch
from conftest import load_script


def make_sid_model(out_dir, src, dst, seed=0):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    sids = np.load(os.path.join(out_dir, "sids.npy"))                       # (N, L+1)
    sizes = [int(sids[:, l].max()) + 1 for l in range(sids.shape[1])]
    letters = "abcdefgh"[:sids.shape[1]]
    used = [sorted(set(sids[:, l].tolist())) for l in range(sids.shape[1])]
    tok = AutoTokenizer.from_pretrained(src)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(src)
    names = [f"<{letters[l]}_{k}>" for l in range(len(used)) for k in used[l]]
    tok.add_tokens(names)
    model.resize_token_embeddings(len(tok))
    token_ids = [[tok.convert_tokens_to_ids(f"<{letters[l]}_{k}>") if k in used[l] else -1
                  for k in range(sizes[l])] for l in range(len(sizes))]
    os.makedirs(dst, exist_ok=True)
    model.save_pretrained(dst)
    tok.save_pretrained(dst)
    vocab = {"num_levels": len(sizes), "level_names": list(letters), "codebook_sizes": sizes,
             "token_ids": token_ids,
             "item_token_ids": [[token_ids[l][c] for l, c in enumerate(row)] for row in sids.tolist()],
             "item_sids": ["".join(f"<{letters[l]}_{c}>" for l, c in enumerate(row)) for row in sids.tolist()],
             "item_codes": sids.tolist(), "init": "mean",
             "items_key": load_script("03_expand_vocab.py").items_key(
                 torch.load(os.path.join(out_dir, "dataset.pt"), weights_only=True))}
    with open(os.path.join(dst, "sid_vocab.json"), "w") as f:
        json.dump(vocab, f)
    return dst
