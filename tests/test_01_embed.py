"""01_embed_items.py: dataset loading (counts, chronology, split, popularity), the encoder's mean pooling,
the generic CSV format through the CLI, and bad input."""
import json
import os

import numpy as np
import pytest
import torch

from conftest import load_script, BEAUTY, ML100K, REPO, assert_one_line_error, run


E = load_script("01_embed_items.py")


def check_split(ds):
    """Leave-one-out invariants: train/valid/test are the sequence's parts, popularity counts train only."""
    for s, tr, v, te in zip(ds["sequences"], ds["train"], ds["valid"].tolist(), ds["test"].tolist()):
        assert tr == s[:-2] and v == s[-2] and te == s[-1]
    pop = torch.bincount(torch.tensor([i for tr in ds["train"] for i in tr]), minlength=len(ds["item_ids"]))
    assert torch.equal(ds["popularity"], pop)
    N = len(ds["item_ids"])
    assert len(ds["texts"]) == N == len(ds["category"]) and int(ds["category"].max()) < len(ds["category_names"])
    assert sorted({i for s in ds["sequences"] for i in s}) == list(range(N))     # re-indexed 0..N-1, all used


@pytest.mark.skipif(not os.path.exists(os.path.join(ML100K, "ml-100k.inter")), reason="run `make setup`")
def test_ml100k_counts_and_split():
    ds = E.load_dataset(E.parse_args(["--dataset", "ml-100k", "--data-dir", ML100K]))
    assert len(ds["user_ids"]) == 943 and len(ds["item_ids"]) == 1682
    assert sum(len(s) for s in ds["sequences"]) == 100_000
    check_split(ds)
    assert ds["item_ids"][0] == "1" and ds["texts"][0] == "Toy Story (1995). Genres: Animation, Children's, Comedy"
    assert ds["category_names"][int(ds["category"][0])] == "Animation"          # first genre
    # chronology: user "1"'s sequence follows the timestamps of the raw file
    events, _ = E.read_ml100k(ML100K)
    u1 = sorted([(t, n, i) for n, (u, i, t) in enumerate(events) if u == "1"])
    assert [ds["item_ids"][i] for i in ds["sequences"][ds["user_ids"].index("1")]] == [i for _, _, i in u1]


@pytest.mark.skipif(not os.path.isdir(BEAUTY), reason="data/amazon-beauty not present (README: Data)")
def test_beauty_counts_and_text():
    ds = E.load_dataset(E.parse_args(["--dataset", "amazon-beauty", "--data-dir", BEAUTY]))
    assert len(ds["user_ids"]) == 22_363 and len(ds["item_ids"]) == 12_101
    assert sum(len(s) for s in ds["sequences"]) == 198_502
    check_split(ds)
    with open(os.path.join(BEAUTY, "datamaps.json")) as f:
        id2item = json.load(f)["id2item"]
    assert ds["item_ids"][:3] == [id2item["1"], id2item["2"], id2item["3"]]       # item i = P5 id i+1 (ASIN)
    assert not any("&amp;" in t or "&quot;" in t for t in ds["texts"])           # HTML unescaped
    assert "Skin Care" in ds["category_names"] and "Beauty" not in ds["category_names"]  # categories[1]


def test_sequences_are_stable_and_chronological():
    events = [("u", "a", 5.0), ("u", "b", 1.0), ("u", "c", 5.0), ("u", "d", 1.0), ("v", "a", 0.0)]
    seqs = E.build_sequences(events)
    assert seqs["u"] == ["b", "d", "a", "c"] and seqs["v"] == ["a"]               # ties keep file order


@pytest.fixture
def generic_dir(tmp_path):
    d = tmp_path / "mydata"
    d.mkdir()
    rows = ["user,item,timestamp"] + [f"u{u},i{(u + t) % 7},{t}" for u in range(6) for t in range(5)]
    rows += ["u9,i1,0", "u9,i2,1"]                                                # too short: dropped
    (d / "interactions.csv").write_text("\n".join(rows) + "\n")
    items = ["item,text,category"] + [f'i{i},"Item {i}, a thing",{"odd" if i % 2 else "even"}' for i in range(7)]
    (d / "items.csv").write_text("\n".join(items) + "\n")
    return str(d)


def test_generic_format(generic_dir):
    ds = E.load_dataset(E.parse_args(["--dataset", "generic", "--data-dir", generic_dir]))
    assert len(ds["user_ids"]) == 6 and len(ds["item_ids"]) == 7
    assert ds["texts"][0] == "Item 0, a thing" and ds["category_names"] == ["even", "odd"]
    check_split(ds)


def test_mean_pooling_ignores_padding():
    """A text's embedding must not depend on the other (longer) texts padded into its batch."""
    tok, model = E.load_encoder(torch.device("cpu"))
    texts = ["Toy Story (1995)", "a much longer text about a movie with many more tokens than the first one"]
    both = E.embed_texts(texts, tok, model, torch.device("cpu"), batch_size=2)
    alone = E.embed_texts(texts[:1], tok, model, torch.device("cpu"), batch_size=1)
    assert both.shape == (2, 384) and both.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(both, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(both[0], alone[0], atol=1e-5)


def test_generic_cli(generic_dir, tmp_path):
    out = tmp_path / "out"
    r = run("01_embed_items.py", "--dataset", "generic", "--data-dir", generic_dir, "--out-dir", out,
            "--device", "cpu")
    emb = np.load(out / "item_emb.npy")
    assert emb.shape == (7, 384) and emb.dtype == np.float32                      # MiniLM's width
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    summary = json.loads((out / "01_embed_items.json").read_text())
    assert summary["num_users"] == 6 and summary["num_items"] == 7 and summary["num_interactions"] == 30
    assert summary["d"] == 384 and summary["encoder"] == "minilm" and "dropping 1 users" in r.stdout
    ds = torch.load(out / "dataset.pt", weights_only=True)
    assert set(ds) == {"dataset", "item_ids", "texts", "user_ids", "sequences", "train", "valid", "test",
                       "popularity", "category", "category_names"}


# --- bad input: one line, non-zero exit, previous outputs intact ---------------------------------------
@pytest.fixture
def previous_out(tmp_path):
    out = tmp_path / "prev"
    out.mkdir()
    (out / "item_emb.npy").write_bytes(b"previous")
    return out


def test_missing_data_dir(tmp_path, previous_out):
    err = assert_one_line_error(run("01_embed_items.py", "--data-dir", tmp_path / "nope", "--out-dir",
                                    previous_out, check=False))
    assert "ml-100k.inter not found" in err and "make setup" in err
    assert (previous_out / "item_emb.npy").read_bytes() == b"previous"


def test_garbled_data_file(tmp_path, previous_out):
    d = tmp_path / "ml"
    d.mkdir()
    (d / "ml-100k.inter").write_text("user_id:token\titem_id:token\trating:float\ttimestamp:float\n1\t2\tx\n")
    (d / "ml-100k.item").write_bytes(b"\xff\xfe garbage")
    err = assert_one_line_error(run("01_embed_items.py", "--data-dir", d, "--out-dir", previous_out, check=False))
    assert "ml-100k.inter line 2" in err
    (d / "ml-100k.inter").write_text("user_id:token\titem_id:token\trating:float\ttimestamp:float\n1\t2\t3\t4\n")
    err = assert_one_line_error(run("01_embed_items.py", "--data-dir", d, "--out-dir", previous_out, check=False))
    assert "ml-100k.item" in err
    assert (previous_out / "item_emb.npy").read_bytes() == b"previous"


def test_unknown_flag_and_dataset(previous_out):
    err = assert_one_line_error(run("01_embed_items.py", "--no-such-flag", "--out-dir", previous_out, check=False))
    assert "--no-such-flag" in err
    err = assert_one_line_error(run("01_embed_items.py", "--dataset", "netflix", "--out-dir", previous_out,
                                    check=False))
    assert "netflix" in err
    assert (previous_out / "item_emb.npy").read_bytes() == b"previous"
