"""scripts/recommend.py: a typed history (ids and title fragments) -> 06's top-10 with titles and SIDs; the
resolution rule; an unknown item is one line."""
import json
import os
import re

import numpy as np
import pytest
import torch
from conftest import assert_one_line_error, load_script, make_synthetic_out, make_tiny_model, run
from sid_model import make_sid_model

LINE = re.compile(r"^\s*(\d+)\. (.+)  ((?:<[a-z]_\d+>)+)  \[id (\S+)\]  log p (-?[\d.]+)$")


@pytest.fixture(scope="module")
def rec_setup(tmp_path_factory):
    """A SID model whose SID rows are spread (distinct scores, no near-ties) and an sft_config.json with its
    own template, history length and the level softmax, as 05 writes it."""
    from transformers import AutoModelForCausalLM
    root = tmp_path_factory.mktemp("rec")
    out = make_synthetic_out(str(root / "out"))
    model_dir = make_sid_model(out, make_tiny_model(str(root / "tiny")), str(root / "out" / "models" / "m"))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    vocab = json.load(open(os.path.join(model_dir, "sid_vocab.json")))
    sid = [t for lvl in vocab["token_ids"] for t in lvl if t >= 0]
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[sid] = torch.randn(len(sid), emb.shape[1], generator=torch.Generator().manual_seed(0))
    model.save_pretrained(model_dir)
    json.dump({"template": "Seen: {history}\nNext:", "softmax": "level", "max_history": 6},
              open(os.path.join(model_dir, "sft_config.json"), "w"))
    return out, model_dir, vocab


def test_known_history_prints_ten_ranked_lines_as_06_ranks_them(rec_setup):
    """User 5's history typed as ids and one title fragment: 10 lines, ranks 1..10, each item's own SID, no
    history item, scores best first, and the same list 06_eval.py ranks for user 5 (history excluded)."""
    out, model_dir, vocab = rec_setup
    data = torch.load(os.path.join(out, "dataset.pt"), weights_only=True)
    hist = data["sequences"][5][:-1]
    typed = [data["item_ids"][i] for i in hist]
    typed[0] = data["texts"][hist[0]].upper()                         # a title, any case: exact match
    r = run("scripts/recommend.py", "--model", model_dir, "--history", ", ".join(typed), "--device", "cpu",
            "--dtype", "float32")
    rows = [LINE.match(l) for l in r.stdout.splitlines() if LINE.match(l)]
    assert len(rows) == 10, r.stdout
    assert [int(m.group(1)) for m in rows] == list(range(1, 11))
    items = [data["item_ids"].index(m.group(4)) for m in rows]
    assert all(m.group(3) == vocab["item_sids"][i] for m, i in zip(rows, items))
    assert all(m.group(2) == data["texts"][i] for m, i in zip(rows, items))
    assert not set(items) & set(hist) and len(set(items)) == 10
    scores = [float(m.group(5)) for m in rows]
    assert scores == sorted(scores, reverse=True)
    assert r.stdout.count("history: ") == len(hist)
    run("06_eval.py", "--model", model_dir, "--users", "8", "--protocol", "excluded", "--device", "cpu",
        "--dtype", "float32")
    assert items == np.load(os.path.join(model_dir, "eval_test_topk.npy"))[5, :10].tolist()


def test_unknown_or_empty_history_is_one_line(rec_setup):
    _, model_dir, _ = rec_setup
    err = assert_one_line_error(run("scripts/recommend.py", "--model", model_dir, "--history", "3, no such movie",
                                    check=False))
    assert "'no such movie'" in err
    err = assert_one_line_error(run("scripts/recommend.py", "--model", model_dir, "--history", " , ", check=False))
    assert "empty" in err
    assert_one_line_error(run("scripts/recommend.py", "--model", model_dir, check=False))          # no --history


def test_resolution_rule():
    """An id is that item; else a title equal to the entry (any case); else the most popular title containing
    it, ties by the lower index; titles end where 01's appended fields start."""
    rec = load_script("scripts/recommend.py")
    titles = ["Star Wars (1977)", "Star Trek (1979)", "Star Kid (1997)", "Wars of the Stars", "181"]
    ids = {"50": 0, "222": 1, "1": 2, "7": 3, "9": 4}
    pop = np.array([5, 9, 9, 1, 0])
    assert rec.resolve("50", ids, titles, pop) == (0, "id")
    assert rec.resolve("star wars (1977)", ids, titles, pop) == (0, "title")
    item, how = rec.resolve("star", ids, titles, pop)                    # items 1 and 2 tie on 9: index 1
    assert item == 1 and "4 titles" in how
    assert rec.resolve("wars of", ids, titles, pop) == (3, "title")
    assert rec.resolve("181", ids, titles, pop) == (4, "title")           # not an id: its title
    assert rec.title("Toy Story (1995). Genres: Animation, Comedy") == "Toy Story (1995)"
    assert rec.title("Lip balm. Category: Beauty > Lips. Brand: X") == "Lip balm"
