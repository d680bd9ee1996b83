"""Shared test helpers: run a numbered script in a subprocess, build tiny synthetic artifacts that follow
docs/artifacts.md (so each step can be tested without running its predecessors), and a tiny random
Llama model that carries the real SmolLM2 tokenizer."""
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKBONE = os.path.join(REPO, "models", "SmolLM2-135M-Instruct")
ML100K = os.path.join(REPO, "data", "ml-100k")
BEAUTY = os.path.join(REPO, "data", "amazon-beauty")          # make setup links a copy found beside the repo
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, REPO)                                      # the steps, scripts/ and bench/ import common.py


def load_script(path):
    """Numbered scripts start with a digit, so tests load them by path (relative to the repo), not by name."""
    name = "script_" + os.path.basename(path)[:-3]
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(script, *args, check=True, timeout=900):
    """Run `python <script> <args>` from the repo root; return the CompletedProcess (text mode)."""
    cmd = [sys.executable, os.path.join(REPO, script), *map(str, args)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0"})
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def assert_one_line_error(r):
    """Bad input: non-zero exit, one clear line on stderr, no traceback."""
    assert r.returncode != 0, r.stdout
    err = r.stderr.strip()
    assert "Traceback" not in err, err
    assert len(err.splitlines()) == 1, err
    return err


def make_synthetic_out(out_dir, num_users=40, num_items=60, d=16, levels=(4, 4, 4), seed=0):
    """Write dataset.pt, item_emb.npy, sids.npy, centroids.pt, rqvae.pt as 01/02 would (docs/artifacts.md).

    Items get SIDs from their index (unique by construction, with a collision suffix level), user
    sequences are random walks of length 5..12. Small enough for a tiny model to fit in seconds."""
    g = np.random.default_rng(seed)
    os.makedirs(out_dir, exist_ok=True)
    emb = g.standard_normal((num_items, d)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    np.save(os.path.join(out_dir, "item_emb.npy"), emb)
    K = levels
    codes = np.stack([g.integers(0, k, num_items) for k in K], 1)
    # collision suffix: number items that share the first L codes
    suffix, seen = np.zeros(num_items, np.int64), {}
    for i, c in enumerate(map(tuple, codes)):
        suffix[i] = seen.get(c, 0)
        seen[c] = suffix[i] + 1
    sids = np.concatenate([codes, suffix[:, None]], 1).astype(np.int64)
    np.save(os.path.join(out_dir, "sids.npy"), sids)
    sizes = list(K) + [int(suffix.max()) + 1]
    cents, counts = [], []
    for l, k in enumerate(sizes):
        c = torch.zeros(k, d)
        n = torch.zeros(k, dtype=torch.long)
        for code in range(k):
            m = sids[:, l] == code
            n[code] = int(m.sum())
            if m.any():
                c[code] = torch.from_numpy(emb[m].mean(0))
        cents.append(c)
        counts.append(n)
    torch.save({"centroids": cents, "counts": counts, "codebook_sizes": sizes},
               os.path.join(out_dir, "centroids.pt"))
    torch.save({"config": {"quantizer": "rqvae", "collisions": "suffix", "levels": len(K)},
                "codebooks": [torch.randn(k, d, generator=torch.Generator().manual_seed(l)) for l, k in enumerate(K)]},
               os.path.join(out_dir, "rqvae.pt"))
    seqs = [g.integers(0, num_items, g.integers(5, 13)).tolist() for _ in range(num_users)]
    train = [s[:-2] for s in seqs]
    pop = torch.zeros(num_items, dtype=torch.long)
    for s in train:
        for i in s:
            pop[i] += 1
    cat = torch.from_numpy(sids[:, 0].copy())
    torch.save({
        "dataset": "synthetic", "item_ids": [str(i) for i in range(num_items)],
        "texts": [f"Item number {i} in group {sids[i, 0]}" for i in range(num_items)],
        "user_ids": [str(u) for u in range(num_users)], "sequences": seqs, "train": train,
        "valid": torch.tensor([s[-2] for s in seqs]), "test": torch.tensor([s[-1] for s in seqs]),
        "popularity": pop, "category": cat, "category_names": [f"g{k}" for k in range(K[0])],
    }, os.path.join(out_dir, "dataset.pt"))
    with open(os.path.join(out_dir, "01_embed_items.json"), "w") as f:
        json.dump({"num_users": num_users, "num_items": num_items, "d": d, "encoder": "synthetic"}, f)
    return out_dir


def make_tiny_model(path, tied=True, hidden=32, layers=2, seed=0):
    """A random 2-layer Llama with the real SmolLM2 tokenizer (49,152 tokens), saved as an HF folder."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    if not os.path.exists(os.path.join(BACKBONE, "tokenizer.json")):
        pytest.skip("backbone not converted; run `make setup`")
    tok = AutoTokenizer.from_pretrained(BACKBONE)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=tied,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def synthetic_out(tmp_path):
    return make_synthetic_out(str(tmp_path / "out"))


@pytest.fixture
def tiny_model(tmp_path):
    return make_tiny_model(str(tmp_path / "tiny"), tied=True)


@pytest.fixture
def tiny_untied_model(tmp_path):
    return make_tiny_model(str(tmp_path / "tiny_untied"), tied=False)


# --- the fast tier (`make test-fast`): a test is slow when it runs a script in a subprocess or builds
# artifacts with one (directly or through a fixture); every other test checks math in-process.
SLOW_FIXTURES = {"sid_setup", "all_inits", "setup", "diag_setup", "smoke", "constructed", "previous_out",
                 "generic_dir", "tiny_model", "tiny_untied_model"}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: runs a script in a subprocess (skipped by make test-fast)")


def pytest_collection_modifyitems(config, items):
    import inspect
    for item in items:
        fn = getattr(item, "function", None)
        src = inspect.getsource(fn) if fn else ""
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) or "run(" in src or "BACKBONE" in src:
            item.add_marker(pytest.mark.slow)
