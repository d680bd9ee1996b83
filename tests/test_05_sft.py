"""05_sft.py: no leakage of validation/test targets, a killed run resumed == uninterrupted, the kept checkpoints,
2-process gloo DDP, the loss by hand, bad input."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import load_script, REPO, assert_one_line_error, make_synthetic_out, make_tiny_model, run
from safetensors.torch import load_file
from sid_model import make_sid_model

from common import load_step

TINY = ["--steps", "6", "--eval-every", "3", "--log-every", "1", "--batch-size", "8", "--lr", "3e-3",
        "--warmup", "2", "--val-examples", "16", "--device", "cpu"]


@pytest.fixture(scope="module")
def sid_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("e5")
    out = make_synthetic_out(str(root / "out"))
    tiny = make_tiny_model(str(root / "tiny"))
    return out, tiny, make_sid_model(out, tiny, str(root / "out" / "models" / "mean"))


def held_out_setup(sid_setup):
    """Sequences whose items 58 and 59 occur only as validation / test targets."""
    from transformers import AutoTokenizer
    out, _, model_dir = sid_setup
    data = torch.load(os.path.join(out, "dataset.pt"), weights_only=True)
    vocab = json.load(open(os.path.join(model_dir, "sid_vocab.json")))
    item_tok = torch.tensor(vocab["item_token_ids"])
    seqs = [[i % 58 for i in s[:-2]] + [58, 59] for s in data["sequences"]]
    return AutoTokenizer.from_pretrained(model_dir), data, item_tok, seqs


def weights(folder):
    return load_file(os.path.join(folder, "model.safetensors"))


def same_weights(a, b):
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_prompt_rows_never_contain_valid_or_test_targets(sid_setup):
    sft = load_script("05_sft.py")
    tok, data, item_tok, seqs = held_out_setup(sid_setup)
    train, valid = [s[:-2] for s in seqs], [s[-2] for s in seqs]
    rows = sft.RowBuilder(tok, "prompt", item_tok, data["texts"], train, 20)
    rec, aux = sft.build_examples(train, "prompt", 20), sft.aux_examples(rows, len(item_tok), 400.0, seed=0)
    assert len(rec) == sum(len(s) - 1 for s in train) and len(aux) > 20
    assert {k for k, _, _ in rec} == {sft.Kind.PROMPT_ROW}
    assert {k for k, _, _ in aux} == {sft.Kind.TEXT_TO_SID, sft.Kind.SID_TO_TEXT}
    held = [item_tok[58].tolist(), item_tok[59].tolist()]
    for ex in rec:
        ids, is_target = rows.row(ex)
        assert not any(ids[j:j + 4] == h for h in held for j in range(len(ids) - 3)), ex
        target = [t for t, m in zip(ids, is_target) if m]
        assert target == item_tok[train[ex[1]][ex[2]]].tolist() + [tok.eos_token_id]
        assert len(ids) - len(target) <= 30 + 4 * 20                          # history capped at 20 items
    val = sft.RowBuilder(tok, "prompt", item_tok, data["texts"], [s + [v] for s, v in zip(train, valid)], 20)
    ids, is_target = val.row((sft.Kind.PROMPT_ROW, 0, len(train[0])))    # the validation row, as 05's main builds it
    target = [t for t, m in zip(ids, is_target) if m]
    assert target[:4] == held[0] and held[1] not in [ids[j:j + 4] for j in range(len(ids))]


def test_sequence_windows_cover_every_train_target_once(sid_setup):
    """Every-position rows: windows of <= H+1 train items, labels = the SID tokens of items 2..n of the
    window, each train target exactly once per epoch, never a validation or test item."""
    sft = load_script("05_sft.py")
    tok, data, item_tok, seqs = held_out_setup(sid_setup)
    train = [s[:-2] for s in seqs]
    H = 3
    rec = sft.build_examples(train, "sequence", H)
    rows = sft.RowBuilder(tok, "sequence", item_tok, data["texts"], train, H)
    pre = tok("User history: ", add_special_tokens=False).input_ids
    held = [item_tok[58].tolist(), item_tok[59].tolist()]
    covered = {}
    for ex in rec:
        kind, u, end = ex
        window = train[u][max(0, end - H - 1):end]
        assert kind == sft.Kind.WINDOW and 2 <= len(window) <= H + 1
        ids, is_target = rows.row(ex)
        assert ids == pre + [t for i in window for t in item_tok[i].tolist()]   # laid out like 06's prompt
        assert [t for t, m in zip(ids, is_target) if m] == [t for i in window[1:] for t in item_tok[i].tolist()]
        assert not any(ids[j:j + 4] == h for h in held for j in range(len(ids) - 3)), ex
        for pos in range(max(0, end - H - 1) + 1, end):
            covered[u, pos] = covered.get((u, pos), 0) + 1
    assert covered == {(u, p): 1 for u, s in enumerate(train) for p in range(1, len(s))}
    # collate turns the flags into next-token labels: the logit at position j predicts token j+1
    ids, mask, pos, labels = sft.collate([rows.row(rec[0]), rows.row(rec[1])], pad_id=0)
    for b, ex in enumerate(rec[:2]):
        x, t = rows.row(ex)
        T = ids.shape[1]
        assert ids[b, T - len(x):].tolist() == x and mask[b].sum() == len(x)
        want = [x[j + 1] if t[j + 1] else -100 for j in range(len(x) - 1)] + [-100]
        assert labels[b, T - len(x):].tolist() == want and (labels[b, :T - len(x)] == -100).all()
        assert pos[b, T - len(x):].tolist() == list(range(len(x)))                # positions ignore the pad


def test_validation_row_equals_06_prompt(sid_setup):
    """The token layout 05 trains and validates on is the prompt 06 ranks with, token for token, for both
    objectives and their templates."""
    sft, ev = load_script("05_sft.py"), load_script("06_eval.py")
    tok, data, item_tok, _ = held_out_setup(sid_setup)
    train, valid = data["train"], data["valid"].tolist()
    for objective, template in sft.TEMPLATES.items():
        val = sft.RowBuilder(tok, objective, item_tok, data["texts"], [s + [v] for s, v in zip(train, valid)], 5)
        prompts = ev.build_prompts(tok, template, item_tok, train, 5)                # 06 --split valid histories
        for u in range(len(train)):
            ids, is_target = val.row((sft.Kind.PROMPT_ROW, u, len(train[u])))
            n_prompt = is_target.index(1)
            assert ids[:n_prompt] == prompts[u], (objective, u)
            assert ids[n_prompt:n_prompt + 4] == item_tok[valid[u]].tolist()
    assert ev.DEFAULT_TEMPLATE == sft.TEMPLATES["prompt"]                         # folders without sft_config


@pytest.mark.parametrize("objective", ["sequence", "prompt"])
def test_aux_rows_carry_the_requested_share_of_target_tokens(sid_setup, objective):
    """--aux-tokens r: the drawn aux rows hold ~r x the recommendation rows' target tokens (counted exactly:
    every train target's SID, + eos in prompt rows); r = 0 draws none (a negative r: test_bad_input)."""
    sft = load_script("05_sft.py")
    tok, data, item_tok, _ = held_out_setup(sid_setup)
    rows = sft.RowBuilder(tok, objective, item_tok, data["texts"], data["train"], 20)
    rec = sft.build_examples(data["train"], objective, 20)
    rec_tok = sft.target_tokens(rows, rec)
    assert rec_tok == sum(len(s) - 1 for s in data["train"]) * (item_tok.shape[1] + (objective == "prompt"))
    for r in (1.0, 0.5):
        aux = sft.aux_examples(rows, len(item_tok), sft.parse_args(["--aux-tokens", str(r)]).aux_tokens * rec_tok, 0)
        assert abs(sft.target_tokens(rows, aux) / (r * rec_tok) - 1) < 0.1, (r, len(aux))
    off = sft.parse_args(["--aux-tasks", "--aux-tokens", "0"])
    assert off.aux_tasks and sft.aux_examples(rows, len(item_tok), off.aux_tokens * rec_tok, 0) == []


def test_aux_prompt_keeps_the_whole_title(sid_setup):
    sft = load_script("05_sft.py")
    tok, data, item_tok, _ = held_out_setup(sid_setup)
    texts = ["Toy Story (1995)"] + data["texts"][1:]
    rows = sft.RowBuilder(tok, "sequence", item_tok, texts, data["train"], 5)
    for kind in (sft.Kind.TEXT_TO_SID, sft.Kind.SID_TO_TEXT):
        ids, is_target = rows.row((kind, 0, 0))
        assert "Toy Story (1995)" in tok.decode(ids), tok.decode(ids)
        sid = item_tok[0].tolist()
        supervised = [t for t, m in zip(ids, is_target) if m]
        assert (supervised == sid + [tok.eos_token_id]) == (kind == sft.Kind.TEXT_TO_SID)   # the SID is the target
        assert supervised[-1] == tok.eos_token_id


def test_resume_equals_uninterrupted_and_kept_checkpoints(sid_setup, tmp_path, monkeypatch):
    """A run killed in the middle of step 6 (in-process: the 10th collate call raises, as Ctrl-C would) and
    resumed with --resume ends with the same curves and weights as an uninterrupted run; --keep-checkpoints
    keeps every validation's model, the best one equal to the saved model."""
    out, _, model_dir = sid_setup
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    args = ["--model", model_dir, *TINY, "--steps", "8"]
    run("05_sft.py", *args, "--save", a, "--keep-checkpoints")
    sft = load_step("05_sft")
    calls, collate = [0], sft.collate

    def killed_at_step_6(rows, pad_id):     # validation at 0: 2 calls; steps 1-3; validation at 3: 2; steps 4, 5
        calls[0] += 1
        if calls[0] == 10:
            raise KeyboardInterrupt
        return collate(rows, pad_id)
    monkeypatch.setattr(sft, "collate", killed_at_step_6)
    monkeypatch.setattr(sys, "argv", ["05_sft.py", *args, "--save", b])
    with pytest.raises(KeyboardInterrupt):
        sft.main()
    monkeypatch.setattr(sft, "collate", collate)
    assert calls[0] == 10 and os.path.exists(b + ".resume.pt") and not os.path.exists(os.path.join(b, "05_sft.json"))
    r = run("05_sft.py", *args, "--save", b, "--resume")
    assert "resumed from" in r.stdout and "at step 3" in r.stdout                # the last state: step 3
    ja, jb = (json.load(open(os.path.join(d, "05_sft.json"))) for d in (a, b))
    assert ja["loss_curve"] == jb["loss_curve"] and ja["val_curve"] == jb["val_curve"]
    assert len(ja["loss_curve"]) == 8 and ja["best_step"] == jb["best_step"]
    assert ja["val_level_acc"] == jb["val_level_acc"] and same_weights(a, b)
    assert not os.path.exists(b + ".resume.pt") and not os.path.exists(a + ".resume.pt")
    vocab = json.load(open(os.path.join(model_dir, "sid_vocab.json")))
    assert ja["val_level_names"] == vocab["level_names"]                # sequence: no eos target
    for (st, loss, acc), (st2, per_level) in zip(ja["val_curve"], ja["val_level_acc"]):
        assert st == st2 and len(per_level) == vocab["num_levels"] and all(0 <= x <= 1 for x in per_level)
        assert abs(np.mean(per_level) - acc) < 1e-3        # every target has L+1 tokens: mean of positions
    cfg = json.load(open(os.path.join(a, "sft_config.json")))
    assert cfg["max_history"] == 20 and cfg["template"] == "User history: {history}" and cfg["softmax"] == "level"
    assert json.load(open(os.path.join(a, "sid_vocab.json"))) == vocab
    kept = sorted(os.listdir(a + ".checkpoints"))
    assert kept == ["step_0", "step_3", "step_6", "step_8"] and not os.path.exists(b + ".checkpoints")
    assert same_weights(os.path.join(a + ".checkpoints", f"step_{ja['best_step']}"), a)
    assert not same_weights(os.path.join(a + ".checkpoints", "step_0"), os.path.join(a + ".checkpoints", "step_8"))
    assert json.load(open(os.path.join(a + ".checkpoints", "step_3", "sft_config.json"))) == cfg
    state = {"key": {"steps": 9}}                                             # a state written with --steps 9
    torch.save(state, b + ".resume.pt")
    err = assert_one_line_error(run("05_sft.py", *args, "--save", b, "--resume", check=False))
    assert "--resume" in err and "steps" in err


def test_ddp_two_processes_gloo(sid_setup, tmp_path):
    out, _, model_dir = sid_setup
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    fp32 = ["--dtype", "float32"]                  # equality up to fp32 rounding (bf16 kernels depend on shapes)
    run("05_sft.py", "--model", model_dir, "--save", one, *TINY, *fp32)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(REPO, "05_sft.py"), "--model", model_dir, "--save", two, *TINY, *fp32]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("best step") == 1                                   # rank 0 alone logs
    j1, j2 = (json.load(open(os.path.join(d, "05_sft.json"))) for d in (one, two))
    assert j2["world_size"] == 2 and len(j2["loss_curve"]) == len(j1["loss_curve"]) == 6
    l1, l2 = (np.array([v for _, v in j["loss_curve"]]) for j in (j1, j2))
    assert np.allclose(l1, l2, rtol=1e-4), (l1, l2)      # same examples, loss normalized over both ranks
    assert l2[-1] < l2[0]
    v1, v2 = (np.array([v for _, v, _ in j["val_curve"]]) for j in (j1, j2))
    assert np.allclose(v1, v2, rtol=1e-4), (v1, v2)      # every process validates all rows: the same numbers
    for (_, _, a2), (_, p2) in zip(j2["val_curve"], j2["val_level_acc"]):
        assert abs(np.mean(p2) - a2) < 1e-3
    siblings = [d for d in os.listdir(tmp_path) if d.startswith("two")]
    assert siblings == ["two"], siblings                                      # one checkpoint, no leftovers
    assert os.path.exists(os.path.join(two, "model.safetensors"))


def test_aux_tasks_and_prompt_rows_reach_06(sid_setup, tmp_path):
    out, _, model_dir = sid_setup
    dst = str(tmp_path / "aux")
    r = run("05_sft.py", "--model", model_dir, "--save", dst, *TINY, "--steps", "3", "--aux-tasks", "--objective",
            "prompt", "--softmax", "full", "--aux-tokens", "0.5", "--max-history", "5")
    j = json.load(open(os.path.join(dst, "05_sft.json")))
    assert j["rec_target_tokens"] == 176 * 5 and abs(j["aux_token_ratio"] - 0.5) < 0.05   # 176 positions x (SID, eos)
    assert f"{j['aux_examples']} auxiliary rows (aux:rec target tokens {j['aux_token_ratio']:.2f})" in r.stdout
    assert j["aux_target_tokens"] == round(j["aux_token_ratio"] * 880) and j["val_level_names"][-1] == "eos"
    run("06_eval.py", "--model", dst, "--out-dir", out, "--beam", "5", "--users", "8")
    res = json.load(open(os.path.join(dst, "eval_test.json")))
    assert res["template"] == "User history: {history}\nNext item:" and res["max_history"] == 5
    assert res["softmax"] == "full"


def test_never_reads_the_test_item(sid_setup, tmp_path):
    """A dataset.pt whose test items are replaced by the validation items gives the same curves and weights."""
    out, _, model_dir = sid_setup
    other = str(tmp_path / "other_out")
    shutil.copytree(out, other, ignore=shutil.ignore_patterns("models"))
    data = torch.load(os.path.join(out, "dataset.pt"), weights_only=True)
    data["sequences"] = [s[:-1] + [s[-2]] for s in data["sequences"]]             # test := valid
    data["test"] = data["valid"].clone()
    torch.save(data, os.path.join(other, "dataset.pt"))
    for name, o in (("a", out), ("b", other)):
        run("05_sft.py", "--model", model_dir, "--out-dir", o, "--save", str(tmp_path / name), *TINY)
    ja, jb = (json.load(open(tmp_path / d / "05_sft.json")) for d in ("a", "b"))
    assert ja["val_curve"] == jb["val_curve"] and ja["loss_curve"] == jb["loss_curve"]
    assert same_weights(str(tmp_path / "a"), str(tmp_path / "b"))


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
    for flag, value in (("--batch-size", "0"), ("--eval-every", "0"), ("--grad-accum", "0"), ("--steps", "-3"),
                        ("--objective", "chat"), ("--softmax", "sid"), ("--dtype", "fp8"), ("--epochs", "-1"),
                        ("--aux-tokens", "-0.5")):
        err = assert_one_line_error(run("05_sft.py", "--model", model_dir, "--save", str(tmp_path / "y"), *TINY,
                                        flag, value, check=False))
        assert flag.lstrip("-").split("-")[0] in err, err
    assert not os.path.exists(tmp_path / "y")


class FakeLM(torch.nn.Module):
    """Stands in for a causal LM: fixed hidden states (B, T, d) and a bias-free head over V tokens."""

    def __init__(self, h, vocab):
        super().__init__()
        self.h, self.head = h, torch.nn.Linear(h.shape[-1], vocab, bias=False)

    def base_model(self, **kw):
        return type("Out", (), {"last_hidden_state": self.h})

    def get_output_embeddings(self):
        return self.head


@pytest.mark.parametrize("softmax", ["full", "level"])
def test_sid_loss_normalizes_over_the_vocabulary_or_the_level(softmax):
    """SIDLoss by hand: a target's -log p is taken over all V tokens (full, the papers') or over the columns of
    the target's own level (level). Level a = tokens 5-7, level b = tokens 8-9; token 3 is not a SID token (an
    eos or text target): the whole vocabulary under both."""
    sft = load_script("05_sft.py")
    torch.manual_seed(0)
    lm = FakeLM(torch.randn(1, 4, 4), vocab=12)
    loss_fn = sft.SIDLoss(lm, softmax, [torch.tensor([5, 6, 7]), torch.tensor([8, 9])])
    labels = torch.tensor([[sft.IGNORE, 6, 9, 3]])                 # position 1: <a>, 2: <b>, 3: not a SID
    loss, hits = loss_fn(None, None, None, labels)
    z = lm.head(lm.h[0])                                           # (T, V)
    V = list(range(12))
    cols = {"full": [V, V, V], "level": [[5, 6, 7], [8, 9], V]}[softmax]
    want = sum(-torch.log_softmax(z[t, c], 0)[c.index(y)] for t, c, y in zip((1, 2, 3), cols, (6, 9, 3)))
    assert torch.allclose(loss, want, atol=1e-5), (loss, want)
    assert hits.tolist() == [int(z[t, c].argmax()) == c.index(y) for t, c, y in zip((1, 2, 3), cols, (6, 9, 3))]
