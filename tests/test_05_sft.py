"""05_sft.py: no leakage of validation/test targets, resume == uninterrupted, 2-process gloo DDP, bad input."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import load_script, REPO, assert_one_line_error, make_synthetic_out, make_tiny_model, run
from sid_model import make_sid_model

TINY = ["--steps", "6", "--eval-every", "3", "--log-every", "1", "--batch-size", "8", "--lr", "3e-3",
        "--warmup", "2", "--val-examples", "16", "--device", "cpu"]


@pytest.fixture(scope="module")
def sid_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("e5")
    out = make_synthetic_out(str(root / "out"))
    tiny = make_tiny_model(str(root / "tiny"))
    return out, tiny, make_sid_model(out, tiny, str(root / "out" / "models" / "mean"))


def test_examples_never_contain_valid_or_test_targets(sid_setup, tmp_path):
    from transformers import AutoTokenizer
    sft = load_script("05_sft.py")
    out, _, model_dir = sid_setup
    data = torch.load(os.path.join(out, "dataset.pt"), weights_only=True)
    vocab = json.load(open(os.path.join(model_dir, "sid_vocab.json")))
    item_tok = torch.tensor(vocab["item_token_ids"])
    # held-out items 58 and 59 occur only as validation / test targets
    seqs = [[i % 58 for i in s[:-2]] + [58, 59] for s in data["sequences"]]
    train, valid = [s[:-2] for s in seqs], [s[-2] for s in seqs]
    tok = AutoTokenizer.from_pretrained(model_dir)
    rec, aux = sft.build_examples(train, len(item_tok), 0.5, seed=0)
    assert len(rec) == sum(len(s) - 1 for s in train) and len(aux) == round(0.5 * len(rec))
    enc = sft.Encoder(tok, "History: {history}\nNext:", item_tok, data["texts"], train, valid, 20)
    held = [item_tok[58].tolist(), item_tok[59].tolist()]
    for ex in rec:
        prompt, target = enc(ex)
        ids = prompt + target
        assert not any(ids[j:j + 4] == h for h in held for j in range(len(ids) - 3)), ex
        assert target == item_tok[train[ex[1]][ex[2]]].tolist() + [tok.eos_token_id]
        assert len(prompt) <= 30 + 4 * 20                                    # history capped at 20 items
    prompt, target = enc((3, 0, 0))                                          # the validation example
    assert target[:4] == held[0] and held[1] not in [prompt[j:j + 4] for j in range(len(prompt))]


def test_collate_keeps_targets_at_the_end():
    sft = load_script("05_sft.py")
    ids, mask, pos, labels = sft.collate([([5, 6, 7], [8, 9]), ([5], [8, 9, 10])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 8, 9], [0, 5, 8, 9, 10]]
    assert pos.tolist() == [[0, 1, 2, 3, 4], [0, 0, 1, 2, 3]]
    # 4 kept logits (positions 1..4): each label is the token after its position, -100 elsewhere
    assert labels.tolist() == [[-100, 8, 9, -100], [8, 9, 10, -100]]


def test_resume_equals_uninterrupted(sid_setup, tmp_path):
    out, _, model_dir = sid_setup
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    run("05_sft.py", "--model", model_dir, "--save", a, *TINY, "--steps", "8", "--no-resumable")
    assert not os.path.exists(a + ".resume.pt")                                 # --no-resumable: no state file
    r = run("05_sft.py", "--model", model_dir, "--save", b, *TINY, "--steps", "8", "--stop-at", "5")
    assert "stopped after step 5" in r.stdout and os.path.exists(b + ".resume.pt")
    assert not os.path.exists(os.path.join(b, "05_sft.json"))
    r = run("05_sft.py", "--model", model_dir, "--save", b, *TINY, "--steps", "8", "--resume")
    assert "resumed from" in r.stdout and "at step 3" in r.stdout                # last checkpoint: step 3
    ja, jb = (json.load(open(os.path.join(d, "05_sft.json"))) for d in (a, b))
    assert ja["loss_curve"] == jb["loss_curve"] and ja["val_curve"] == jb["val_curve"]
    assert len(ja["loss_curve"]) == 8 and ja["best_step"] == jb["best_step"]
    assert ja["val_level_acc"] == jb["val_level_acc"]
    vocab = json.load(open(os.path.join(model_dir, "sid_vocab.json")))
    assert ja["val_level_names"] == vocab["level_names"] + ["eos"]
    for (st, loss, acc), (st2, per_level) in zip(ja["val_curve"], ja["val_level_acc"]):
        assert st == st2 and len(per_level) == vocab["num_levels"] + 1 and all(0 <= x <= 1 for x in per_level)
        assert abs(np.mean(per_level) - acc) < 1e-3        # every target has L+2 tokens: mean of positions
    from safetensors.torch import load_file
    wa, wb = (load_file(os.path.join(d, "model.safetensors")) for d in (a, b))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not os.path.exists(b + ".resume.pt")
    cfg = json.load(open(os.path.join(a, "sft_config.json")))
    assert cfg["max_history"] == 20 and "{history}" in cfg["template"]
    assert json.load(open(os.path.join(a, "sid_vocab.json"))) == json.load(open(os.path.join(model_dir, "sid_vocab.json")))


def test_ddp_two_processes_gloo(sid_setup, tmp_path):
    out, _, model_dir = sid_setup
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    run("05_sft.py", "--model", model_dir, "--save", one, *TINY)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(REPO, "05_sft.py"), "--model", model_dir, "--save", two, *TINY]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("best step") == 1                                   # rank 0 alone logs
    j1, j2 = (json.load(open(os.path.join(d, "05_sft.json"))) for d in (one, two))
    assert j2["world_size"] == 2 and len(j2["loss_curve"]) == len(j1["loss_curve"]) == 6
    l1, l2 = (np.array([v for _, v in j["loss_curve"]]) for j in (j1, j2))
    assert np.allclose(l1, l2, rtol=1e-3), (l1, l2)                          # same examples per step
    assert l2[-1] < l2[0]
    for (_, _, a1), (_, p1), (_, _, a2), (_, p2) in zip(j1["val_curve"], j1["val_level_acc"],
                                                         j2["val_curve"], j2["val_level_acc"]):
        assert abs(np.mean(p1) - a1) < 1e-3 and abs(np.mean(p2) - a2) < 1e-3     # summed over both ranks
    siblings = [d for d in os.listdir(tmp_path) if d.startswith("two")]
    assert siblings == ["two"], siblings                                      # one checkpoint, no leftovers
    assert os.path.exists(os.path.join(two, "model.safetensors"))


def test_aux_tasks_and_custom_template_reach_06(sid_setup, tmp_path):
    out, _, model_dir = sid_setup
    dst = str(tmp_path / "aux")
    r = run("05_sft.py", "--model", model_dir, "--save", dst, *TINY, "--steps", "3", "--aux-tasks",
            "--aux-ratio", "0.5", "--template", "Seen: {history}. Then:", "--max-history", "5")
    assert "88 auxiliary" in r.stdout                                         # 0.5 x 176 positions
    run("06_eval.py", "--model", dst, "--out-dir", out, "--beam", "5", "--users", "8")
    res = json.load(open(os.path.join(dst, "eval_test.json")))
    assert res["template"] == "Seen: {history}. Then:" and res["max_history"] == 5


def test_bad_input(sid_setup, tmp_path):
    out, tiny, model_dir = sid_setup
    err = assert_one_line_error(run("05_sft.py", "--model", tiny, "--out-dir", out, *TINY, check=False))
    assert "sid_vocab.json" in err and "03_expand_vocab.py" in err
    other = make_synthetic_out(str(tmp_path / "other"), num_items=50)
    err = assert_one_line_error(run("05_sft.py", "--model", model_dir, "--out-dir", other, *TINY, check=False))
    assert "another dataset" in err
    err = assert_one_line_error(run("05_sft.py", "--model", model_dir, "--save", str(tmp_path / "x"), *TINY,
                                    "--resume", check=False))
    assert "resume" in err
