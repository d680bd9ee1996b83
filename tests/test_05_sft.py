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


def held_out_setup(sid_setup):
    """Sequences whose items 58 and 59 occur only as validation / test targets."""
    from transformers import AutoTokenizer
    out, _, model_dir = sid_setup
    data = torch.load(os.path.join(out, "dataset.pt"), weights_only=True)
    vocab = json.load(open(os.path.join(model_dir, "sid_vocab.json")))
    item_tok = torch.tensor(vocab["item_token_ids"])
    seqs = [[i % 58 for i in s[:-2]] + [58, 59] for s in data["sequences"]]
    return AutoTokenizer.from_pretrained(model_dir), data, item_tok, seqs


def test_prompt_rows_never_contain_valid_or_test_targets(sid_setup):
    sft = load_script("05_sft.py")
    tok, data, item_tok, seqs = held_out_setup(sid_setup)
    train, valid = [s[:-2] for s in seqs], [s[-2] for s in seqs]
    rec, aux = sft.build_examples(train, len(item_tok), "prompt", 20, 0.5, seed=0)
    assert len(rec) == sum(len(s) - 1 for s in train) and len(aux) == round(0.5 * len(rec))
    enc = sft.Encoder(tok, "History: {history}\nNext:", "prompt", item_tok, data["texts"], train, valid, 20)
    held = [item_tok[58].tolist(), item_tok[59].tolist()]
    for ex in rec:
        ids, is_target = enc(ex)
        assert not any(ids[j:j + 4] == h for h in held for j in range(len(ids) - 3)), ex
        target = [t for t, m in zip(ids, is_target) if m]
        assert target == item_tok[train[ex[1]][ex[2]]].tolist() + [tok.eos_token_id]
        assert len(ids) - len(target) <= 30 + 4 * 20                          # history capped at 20 items
    ids, is_target = enc((3, 0, 0))                                           # the validation example
    target = [t for t, m in zip(ids, is_target) if m]
    assert target[:4] == held[0] and held[1] not in [ids[j:j + 4] for j in range(len(ids))]


def test_sequence_windows_cover_every_train_target_once(sid_setup):
    """Every-position rows: windows of <= H+1 train items, labels = the SID tokens of items 2..n of the
    window, each train target exactly once per epoch, never a validation or test item."""
    sft = load_script("05_sft.py")
    tok, data, item_tok, seqs = held_out_setup(sid_setup)
    train, valid = [s[:-2] for s in seqs], [s[-2] for s in seqs]
    H = 3
    rec, _ = sft.build_examples(train, len(item_tok), "sequence", H, 0.0, seed=0)
    enc = sft.Encoder(tok, "User history: {history}", "sequence", item_tok, data["texts"], train, valid, H)
    pre = tok("User history: ", add_special_tokens=False).input_ids
    held = [item_tok[58].tolist(), item_tok[59].tolist()]
    covered = {}
    for ex in rec:
        kind, u, end = ex
        window = train[u][max(0, end - H - 1):end]
        assert kind == 4 and 2 <= len(window) <= H + 1
        ids, is_target = enc(ex)
        assert ids == pre + [t for i in window for t in item_tok[i].tolist()]   # laid out like 06's prompt
        assert [t for t, m in zip(ids, is_target) if m] == [t for i in window[1:] for t in item_tok[i].tolist()]
        assert not any(ids[j:j + 4] == h for h in held for j in range(len(ids) - 3)), ex
        for pos in range(max(0, end - H - 1) + 1, end):
            covered[u, pos] = covered.get((u, pos), 0) + 1
    assert covered == {(u, p): 1 for u, s in enumerate(train) for p in range(1, len(s))}
    # collate turns the flags into next-token labels: the logit at position j predicts token j+1
    ids, mask, pos, labels = sft.collate([enc(rec[0]), enc(rec[1])], pad_id=0)
    for b, ex in enumerate(rec[:2]):
        x, t = enc(ex)
        T = ids.shape[1]
        assert ids[b, T - len(x):].tolist() == x and mask[b].sum() == len(x)
        want = [x[j + 1] if t[j + 1] else -100 for j in range(len(x) - 1)] + [-100]
        assert labels[b, T - len(x):].tolist() == want and (labels[b, :T - len(x)] == -100).all()
        assert pos[b, T - len(x):].tolist() == list(range(len(x)))                # positions ignore the pad


def test_validation_row_equals_06_prompt(sid_setup):
    """The token layout 05 trains and validates on is the prompt 06 ranks with, token for token, for both
    objectives and their default templates."""
    sft, ev = load_script("05_sft.py"), load_script("06_eval.py")
    tok, data, item_tok, _ = held_out_setup(sid_setup)
    train, valid = data["train"], data["valid"].tolist()
    for objective, template in sft.TEMPLATES.items():
        enc = sft.Encoder(tok, template, objective, item_tok, data["texts"], train, valid, 5)
        prompts = ev.build_prompts(tok, template, item_tok, train, 5)                # 06 --split valid histories
        for u in range(len(train)):
            ids, is_target = enc((3, u, 0))
            n_prompt = is_target.index(1)
            assert ids[:n_prompt] == prompts[u], (objective, u)
            assert ids[n_prompt:n_prompt + 4] == item_tok[valid[u]].tolist()
    assert ev.DEFAULT_TEMPLATE == sft.TEMPLATES["prompt"]                         # folders without sft_config


def test_aux_prompt_keeps_the_whole_title(sid_setup):
    sft = load_script("05_sft.py")
    tok, data, item_tok, _ = held_out_setup(sid_setup)
    texts = ["Toy Story (1995)"] + data["texts"][1:]
    enc = sft.Encoder(tok, sft.TEMPLATES["sequence"], "sequence", item_tok, texts, data["train"], [0], 5)
    for kind in (1, 2):
        ids, is_target = enc((kind, 0, 0))
        assert "Toy Story (1995)" in tok.decode(ids), tok.decode(ids)


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
    assert ja["val_level_names"] == vocab["level_names"]                # sequence: no eos target
    for (st, loss, acc), (st2, per_level) in zip(ja["val_curve"], ja["val_level_acc"]):
        assert st == st2 and len(per_level) == vocab["num_levels"] and all(0 <= x <= 1 for x in per_level)
        assert abs(np.mean(per_level) - acc) < 1e-3        # every target has L+1 tokens: mean of positions
    from safetensors.torch import load_file
    wa, wb = (load_file(os.path.join(d, "model.safetensors")) for d in (a, b))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not os.path.exists(b + ".resume.pt")
    cfg = json.load(open(os.path.join(a, "sft_config.json")))
    assert cfg["max_history"] == 20 and cfg["template"] == "User history: {history}" and cfg["softmax"] == "level"
    assert json.load(open(os.path.join(a, "sid_vocab.json"))) == json.load(open(os.path.join(model_dir, "sid_vocab.json")))


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
    for (_, _, a1), (_, p1), (_, _, a2), (_, p2) in zip(j1["val_curve"], j1["val_level_acc"],
                                                         j2["val_curve"], j2["val_level_acc"]):
        assert abs(np.mean(p1) - a1) < 1e-3 and abs(np.mean(p2) - a2) < 1e-3     # summed over both ranks
    siblings = [d for d in os.listdir(tmp_path) if d.startswith("two")]
    assert siblings == ["two"], siblings                                      # one checkpoint, no leftovers
    assert os.path.exists(os.path.join(two, "model.safetensors"))


def test_aux_tasks_and_custom_template_reach_06(sid_setup, tmp_path):
    out, _, model_dir = sid_setup
    dst = str(tmp_path / "aux")
    r = run("05_sft.py", "--model", model_dir, "--save", dst, *TINY, "--steps", "3", "--aux-tasks", "--objective",
            "prompt", "--softmax", "full", "--aux-ratio", "0.5", "--template", "Seen: {history}. Then:",
            "--max-history", "5")
    assert "88 auxiliary" in r.stdout                                         # 0.5 x 176 positions
    run("06_eval.py", "--model", dst, "--out-dir", out, "--beam", "5", "--users", "8")
    res = json.load(open(os.path.join(dst, "eval_test.json")))
    assert res["template"] == "Seen: {history}. Then:" and res["max_history"] == 5 and res["softmax"] == "full"
    err = assert_one_line_error(run("05_sft.py", "--model", model_dir, "--save", dst, *TINY, "--template",
                                    "Seen: {history}. Then:", check=False))   # sequence: must end with {history}
    assert "--template" in err


def test_select_by_validation_ndcg_never_reads_the_test_item(sid_setup, tmp_path):
    """--select ndcg: 06 ranks the validation item at each validation; the chosen checkpoint is the
    first of highest NDCG@10. A dataset.pt whose test items are replaced by the validation items
    gives the same curves and weights: were the test item read (e.g. into the excluded history),
    the validation targets would be excluded and Recall would fall."""
    import shutil
    from safetensors.torch import load_file
    out, _, model_dir = sid_setup
    other = str(tmp_path / "other_out")
    shutil.copytree(out, other, ignore=shutil.ignore_patterns("models"))
    data = torch.load(os.path.join(out, "dataset.pt"), weights_only=True)
    data["sequences"] = [s[:-1] + [s[-2]] for s in data["sequences"]]             # test := valid
    data["test"] = data["valid"].clone()
    torch.save(data, os.path.join(other, "dataset.pt"))
    runs = {}
    for name, o in (("a", out), ("b", other)):
        dst = str(tmp_path / name)
        r = run("05_sft.py", "--model", model_dir, "--out-dir", o, "--save", dst, *TINY,
                "--select", "ndcg", "--rank-users", "40")
        assert "val NDCG@10" in r.stdout and not os.path.exists(dst + ".rank")
        runs[name] = json.load(open(os.path.join(dst, "05_sft.json"))), load_file(
            os.path.join(dst, "model.safetensors"))
    (ja, wa), (jb, wb) = runs["a"], runs["b"]
    assert [s for s, _, _ in ja["rank_curve"]] == [0, 3, 6] and ja["select"] == "ndcg"
    ndcg = [n for _, _, n in ja["rank_curve"]]
    assert ja["best_step"] == ja["rank_curve"][int(np.argmax(ndcg))][0]
    assert all(0 <= r <= 1 and 0 <= n <= r for _, r, n in ja["rank_curve"])
    assert max(r for _, r, _ in ja["rank_curve"]) > 0                    # the targets are rankable
    assert ja["rank_curve"] == jb["rank_curve"] and ja["val_curve"] == jb["val_curve"]
    assert ja["best_step"] == jb["best_step"] and all(torch.equal(wa[k], wb[k]) for k in wa)
    err = assert_one_line_error(run("05_sft.py", "--model", model_dir, "--save", str(tmp_path / "c"),
                                    *TINY, "--select", "ndcg", check=False))
    assert "--rank-users" in err


def test_patience_stops_after_validations_without_improvement(sid_setup, tmp_path):
    out, _, model_dir = sid_setup
    dst = str(tmp_path / "p")                       # lr 5: the loss diverges, step 0 stays the best
    r = run("05_sft.py", "--model", model_dir, "--save", dst, *TINY, "--steps", "12", "--lr", "5",
            "--patience", "2")
    j = json.load(open(os.path.join(dst, "05_sft.json")))
    assert j["best_step"] == 0 and j["stopped_at"] == 6 and "stopping at step 6" in r.stdout
    assert len(j["loss_curve"]) == 6 and [s for s, _, _ in j["val_curve"]] == [0, 3, 6]


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
                        ("--objective", "chat"), ("--softmax", "none"), ("--dtype", "fp8")):
        err = assert_one_line_error(run("05_sft.py", "--model", model_dir, "--save", str(tmp_path / "y"), *TINY,
                                        flag, value, check=False))
        assert flag.lstrip("-").split("-")[0] in err, err
    assert not os.path.exists(tmp_path / "y")


def test_save_folder_survives_a_kill_between_renames(tmp_path):
    """A kill between save_folder's two renames leaves <dst>.old and no <dst>; the next save recovers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    sft = load_script("05_sft.py")
    tiny = make_tiny_model(str(tmp_path / "tiny"))
    model, tok = AutoModelForCausalLM.from_pretrained(tiny), AutoTokenizer.from_pretrained(tiny)
    dst = str(tmp_path / "m")
    sft.save_folder(dst, model, tok, {"a.json": json.dumps({"v": 1})})
    os.replace(dst, dst + ".old")                                              # the state after the first rename
    os.makedirs(dst + ".tmp")                                                  # and a half-written tmp
    sft.save_folder(dst, model, tok, {"a.json": json.dumps({"v": 2})})
    assert json.load(open(os.path.join(dst, "a.json"))) == {"v": 2}
    assert sorted(os.listdir(tmp_path)) == ["m", "tiny"]


class FakeLM(torch.nn.Module):
    """Stands in for a causal LM: fixed hidden states (B, T, d) and a bias-free head over V tokens."""

    def __init__(self, h, vocab):
        super().__init__()
        self.h, self.head = h, torch.nn.Linear(h.shape[-1], vocab, bias=False)

    def base_model(self, **kw):
        return type("Out", (), {"last_hidden_state": self.h})

    def get_output_embeddings(self):
        return self.head


@pytest.mark.parametrize("softmax", ["full", "sid", "level"])
def test_sid_loss_normalizes_over_the_vocabulary_the_sid_tokens_or_the_level(softmax):
    """SIDLoss by hand: a target's -log p is taken over all V tokens (full), the SID columns (sid) or
    the columns of the target's own level (level). Level a = tokens 5-7, level b = tokens 8-9."""
    sft = load_script("05_sft.py")
    torch.manual_seed(0)
    lm = FakeLM(torch.randn(1, 3, 4), vocab=12)
    loss_fn = sft.SIDLoss(lm, softmax, [torch.tensor([5, 6, 7]), torch.tensor([8, 9])])
    labels = torch.tensor([[sft.IGNORE, 6, 9]])                    # position 1: <a>, position 2: <b>
    loss, hits = loss_fn(None, None, None, labels)
    z = lm.head(lm.h[0])                                           # (T, V)
    cols = {"full": [list(range(12))] * 2, "sid": [[5, 6, 7, 8, 9]] * 2,
            "level": [[5, 6, 7], [8, 9]]}[softmax]
    want = sum(-torch.log_softmax(z[t, c], 0)[c.index(y)] for t, c, y in ((1, cols[0], 6), (2, cols[1], 9)))
    assert torch.allclose(loss, want, atol=1e-5), (loss, want)
    assert hits.tolist() == [int(z[1, cols[0]].argmax()) == cols[0].index(6),
                             int(z[2, cols[1]].argmax()) == cols[1].index(9)]
