"""04_ground.py: only the new rows move (bit-identical everything else), the loss falls, the folder reloads."""
import json
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import load_script, REPO, assert_one_line_error, run


def new_ids(folder):
    v = json.load(open(os.path.join(folder, "sid_vocab.json")))
    return torch.tensor([t for lvl in v["token_ids"] for t in lvl if t >= 0])


def params(folder):
    return dict(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).named_parameters())


def test_masked_adamw_leaves_rows_bit_identical():
    """The mechanism alone: row-mask hook + AdamW(weight_decay=0) + clipping never moves a masked row."""
    g = load_script("04_ground.py")
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 8)
    before = emb.weight.detach().clone()
    new = torch.tensor([3, 17, 42])
    g.mask_row_grads(emb.weight, new)
    opt = torch.optim.AdamW([emb.weight], lr=0.1, weight_decay=0.0)
    for _ in range(5):
        loss = emb(torch.randint(0, 50, (4, 6))).pow(2).sum() + emb.weight.sum()   # touches every row
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([emb.weight], 0.5)
        opt.step()
    keep = torch.ones(50, dtype=torch.bool)
    keep[new] = False
    assert torch.equal(emb.weight.detach()[keep], before[keep])
    assert not torch.equal(emb.weight.detach()[new], before[new])


def test_tied_scores_count_as_chance():
    """Mean init ties every new row: accuracy must be 1/#tied, not whatever argmax's tie-break picks."""
    g = load_script("04_ground.py")
    s = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 2.0, 1.0, 2.0], [3.0, 0.0, 0.0, 0.0]])
    assert g.tie_hits(s, torch.tensor([0, 1, 1])).tolist() == [0.25, 0.5, 0.0]


@pytest.mark.parametrize("tied", [True, False])
def test_only_new_rows_move_and_folder_reloads(synthetic_out, tiny_model, tiny_untied_model, tied):
    base = tiny_model if tied else tiny_untied_model
    run("03_expand_vocab.py", "--out-dir", synthetic_out, "--model", base, "--init", "centroid")
    src = os.path.join(synthetic_out, "models", "centroid")
    r = run("04_ground.py", "--out-dir", synthetic_out, "--model", src, "--steps", 4, "--batch-size", 8,
            "--log-every", 2, "--max-eval", 8)
    assert "pretrained rows unchanged: True" in r.stdout
    dst = src + "+gti"
    ids = new_ids(src)
    p0, p1 = params(src), params(dst)
    assert p0.keys() == p1.keys()
    trained = {"model.embed_tokens.weight"} | (set() if tied else {"lm_head.weight"})
    assert trained <= p0.keys()
    for name in p0:
        if name in trained:
            keep = torch.ones(len(p0[name]), dtype=torch.bool)
            keep[ids] = False
            assert torch.equal(p1[name][keep], p0[name][keep]), name        # every pretrained row
            moved = (p1[name][ids] != p0[name][ids]).any(1)
            # rows of the head (tied or not) all get softmax gradient; input-only rows move once they are seen
            assert moved.all() if (tied or name == "lm_head.weight") else moved.any(), name
        else:
            assert torch.equal(p1[name], p0[name]), name                    # every other parameter
    # the saved folder is complete: tokenizer, vocab and report, and it reloads with the trained rows
    tok = AutoTokenizer.from_pretrained(dst)
    v = json.load(open(os.path.join(dst, "sid_vocab.json")))
    assert v == json.load(open(os.path.join(src, "sid_vocab.json")))
    assert tok(v["item_sids"][0], add_special_tokens=False).input_ids == v["item_token_ids"][0]
    rep = json.load(open(os.path.join(dst, "04_ground.json")))
    w0, w1 = p0["model.embed_tokens.weight"][ids], p1["model.embed_tokens.weight"][ids]
    shift = (w1 - w0).norm(dim=1).mean().item()
    if not tied:
        shift += (p1["lm_head.weight"][ids] - p0["lm_head.weight"][ids]).norm(dim=1).mean().item()
    assert abs(rep["new_row_shift"] - shift) < 1e-3                        # the rows 04 trained are the saved ones
    assert rep["pretrained_rows_unchanged"] is True
    assert len(rep["before"]["held_out"]["acc"]) == len(rep["after"]["held_out"]["acc"]) == v["num_levels"]


def test_grounding_loss_tokens_and_the_studys_directions():
    """04: one mean over all target tokens; scripts/grounding_study.py's directions_loss: the text->SID mean (targets
    that are SID tokens) and the SID->text mean, averaged (by hand on 2 SID tokens with high NLL, 6 text tokens)."""
    g = load_script("04_ground.py")
    study = load_script("scripts/grounding_study.py")
    logits = torch.randn(8, 12, generator=torch.Generator().manual_seed(0))
    logits[:2, 10:] -= 4.0                                           # the SID targets: high NLL
    y = torch.tensor([10, 11, 0, 1, 2, 3, 4, 5])                     # tokens 10, 11 are the new (SID) tokens
    per = torch.nn.functional.cross_entropy(logits, y, reduction="none")
    assert g.grounding_loss(logits, y).item() == pytest.approx(per.mean().item())
    directions = study.directions_loss(torch.tensor([10, 11]))
    want = 0.5 * (per[:2].mean() + per[2:].mean())
    assert directions(logits, y).item() == pytest.approx(want.item())
    assert directions(logits[2:], y[2:]).item() == pytest.approx(per[2:].mean().item())   # one direction only
    assert want > per.mean()                                         # the short SID side now weighs more


def test_grounding_loss_falls(synthetic_out, tiny_model):
    run("03_expand_vocab.py", "--out-dir", synthetic_out, "--model", tiny_model, "--init", "random")
    src = os.path.join(synthetic_out, "models", "random")
    run("04_ground.py", "--out-dir", synthetic_out, "--model", src, "--steps", 30, "--batch-size", 16,
        "--lr", 1e-2, "--log-every", 5, "--max-eval", 8, "--holdout-frac", 0.0)
    curve = json.load(open(os.path.join(src + "+gti", "04_ground.json")))["loss_curve"]
    assert curve[-1]["loss"] < curve[0]["loss"] - 0.3, curve
    assert curve[-1]["t2s_acc"] > curve[0]["t2s_acc"], curve


def test_bad_input_one_line(tmp_path, synthetic_out, tiny_model):
    err = assert_one_line_error(run("04_ground.py", "--out-dir", synthetic_out,
                                    "--model", tmp_path / "missing", check=False))
    assert "missing" in err and "03_expand_vocab.py" in err
    err = assert_one_line_error(run("04_ground.py", "--out-dir", synthetic_out, "--model", tiny_model, check=False))
    assert "sid_vocab.json" in err
    run("03_expand_vocab.py", "--out-dir", synthetic_out, "--model", tiny_model, "--init", "mean")
    empty = tmp_path / "empty"
    empty.mkdir()
    err = assert_one_line_error(run("04_ground.py", "--out-dir", empty, "--model",
                                    os.path.join(synthetic_out, "models", "mean"), check=False))
    assert "dataset.pt" in err and "01_embed_items.py" in err
    err = assert_one_line_error(run("04_ground.py", "--out-dir", synthetic_out, "--model",
                                    os.path.join(synthetic_out, "models", "mean"), "--steps", 0, check=False))
    assert "--steps" in err


def test_cpt_trains_every_parameter_and_saves_every_epoch(synthetic_out, tiny_model):
    """--train all: every parameter tensor moves, the loss falls, an epoch is one pass over the pairs,
    and every epoch leaves a normal model folder (+cpt1, +cpt2, and the last epoch as --save)."""
    run("03_expand_vocab.py", "--out-dir", synthetic_out, "--model", tiny_model, "--init", "centroid")
    src = os.path.join(synthetic_out, "models", "centroid")
    r = run("04_ground.py", "--out-dir", synthetic_out, "--model", src, "--train", "all", "--epochs", 3,
            "--batch-size", 8, "--lr", 3e-3, "--warmup", 2, "--log-every", 2,
            "--max-eval", 8, "--holdout-frac", 0.0)
    rep = json.load(open(os.path.join(src + "+cpt3", "04_ground.json")))
    per_epoch = 2 * rep["items_grounded"] // 8                      # two pairs per item, 8 a step
    assert rep["args"]["steps"] == 3 * per_epoch and rep["args"]["lr"] == 3e-3
    for e in (1, 2):
        mid = json.load(open(os.path.join(src + f"+cpt{e}", "04_ground.json")))
        assert mid["epoch"] == e and mid["step"] == e * per_epoch and f"epoch {e}: saved" in r.stdout
    assert "epoch 3: saved" not in r.stdout and not os.path.exists(src + "+cpt3.resume.pt")
    before, after = params(src), params(src + "+cpt3")
    assert all(not torch.equal(before[n], after[n]) for n in before), [n for n in before if torch.equal(before[n], after[n])]
    assert not torch.equal(params(src + "+cpt1")["model.norm.weight"], after["model.norm.weight"])
    curve = rep["loss_curve"]
    assert curve[-1]["loss"] < curve[0]["loss"], curve
    assert [h[:2] for h in rep["holdout_curve"]] == [[e, e * per_epoch] for e in (1, 2, 3)]   # every epoch run
    assert rep["epochs_done"] == 3 and rep["stopped_epoch"] is None
    assert json.load(open(os.path.join(src + "+cpt1", "04_ground.json")))["holdout_curve"] == rep["holdout_curve"][:1]
    ids, w = new_ids(src), "model.embed_tokens.weight"                  # tied: one matrix
    assert abs(rep["new_row_shift"] - (after[w][ids] - before[w][ids]).norm(dim=1).mean()) < 1e-3
    assert json.load(open(os.path.join(src + "+cpt1", "sid_vocab.json"))) == json.load(open(os.path.join(src, "sid_vocab.json")))
    # the schedule is constant after the warmup, so +cpt1 of the 3-epoch run is a 1-epoch run's end
    run("04_ground.py", "--out-dir", synthetic_out, "--model", src, "--train", "all", "--epochs", 1,
        "--batch-size", 8, "--lr", 3e-3, "--warmup", 2, "--max-eval", 8, "--holdout-frac", 0.0,
        "--save", src + "+one")
    one, mid_w = params(src + "+one"), params(src + "+cpt1")
    assert all(torch.equal(one[n], mid_w[n]) for n in one)
    # GTI (--train rows) counted in epochs, and CPT counted in --steps, save no epoch folders
    for flags in (["--epochs", 2, "--save", src + "+rows"], ["--train", "all", "--steps", 2 * per_epoch, "--save", src + "+steps"]):
        r = run("04_ground.py", "--out-dir", synthetic_out, "--model", src + "+one", "--batch-size", 8, "--max-eval", 8, *flags)
        assert "saved" not in r.stdout and not os.path.exists(src + "+one+cpt1"), flags
    assert not any("resume" in f for f in os.listdir(os.path.dirname(src)))


class Killed(Exception):
    pass


@pytest.mark.parametrize("train", ["all", "rows"])
def test_killed_run_resumes_from_a_saved_epoch(synthetic_out, tiny_model, tmp_path, monkeypatch, train):
    """A run killed at epoch 2 (CPT: while saving +cpt2; GTI: while writing the epoch-2 resume state) continues
    with --resume from its epoch-1 state to the same weights, loss curve and accuracies as the run that was not
    killed (in-process, so the kill is exact); --resume with other arguments or with nothing to resume is one line."""
    run("03_expand_vocab.py", "--out-dir", synthetic_out, "--model", tiny_model, "--init", "random")
    ref, killed = (os.path.join(tmp_path, n) for n in ("ref", "killed"))
    for dst in (ref, killed):
        shutil.copytree(os.path.join(synthetic_out, "models", "random"), dst)
    flags = ["--out-dir", synthetic_out, "--train", train, "--epochs", "3",
             "--batch-size", "8", "--lr", "3e-3", "--warmup", "2", "--log-every", "3", "--max-eval", "8",
             "--device", "cpu"]                                  # 13 steps an epoch: it ends inside a log interval
    end = "+cpt3" if train == "all" else "+gti"                  # the finished run's folder

    def main(model, *extra, kill=False):
        mod = load_script("04_ground.py")
        if kill and train == "all":
            def save_folder(dst, *a):
                if dst.endswith("+cpt2"):
                    raise Killed(dst)
                real(dst, *a)
            real = mod.save_folder
            monkeypatch.setattr(mod, "save_folder", save_folder)
        if kill and train == "rows":
            writes = []

            def save_resume(path, *a, **parts):
                writes.append(path)
                if len(writes) == 2:
                    raise Killed(path)
                real(path, *a, **parts)
            real = mod.save_resume
            monkeypatch.setattr(mod, "save_resume", save_resume)
        mod.main(["--model", model, *flags, *extra])

    main(ref)
    assert not os.path.exists(ref + end + ".resume.pt")          # a finished run removes it
    with pytest.raises(Killed):
        main(killed, kill=True)
    assert not os.path.exists(killed + end) and os.path.exists(killed + end + ".resume.pt")
    assert os.path.isdir(killed + "+cpt1") == (train == "all")   # GTI writes no epoch folders
    err = assert_one_line_error(run("04_ground.py", "--model", killed, *flags, "--lr", "1e-3", "--resume", check=False))
    assert "other arguments (lr)" in err, err
    err = assert_one_line_error(run("04_ground.py", "--model", ref, *flags, "--resume", check=False))
    assert "resume.pt not found" in err, err
    main(killed, "--resume")
    assert not os.path.exists(killed + end + ".resume.pt")
    for folder in ([end] if train == "rows" else ["+cpt2", end]):
        a, b = params(ref + folder), params(killed + folder)
        assert all(torch.equal(a[n], b[n]) for n in a), [n for n in a if not torch.equal(a[n], b[n])]
    ra, rb = (json.load(open(os.path.join(m + end, "04_ground.json"))) for m in (ref, killed))
    for k in ("loss_curve", "before", "after", "new_row_shift", "held_out_acc_after", "holdout_curve"):
        assert ra[k] == rb[k], k
    assert ra["pretrained_rows_unchanged"] is True or train == "all"


def first_stop(g, accs, patience):
    """The first epoch after which 04 stops (accs: the start, then one row per epoch), None: never."""
    return next((e for e in range(1, len(accs)) if g.plateaued(accs[:e + 1], patience)), None)


def test_plateau_rule():
    """Stop once for P epochs no level beat its best so far (a tie is no rise); one level rising keeps it going."""
    g = load_script("04_ground.py")
    stalls = [[.1, .1], [.2, .1], [.3, .2], [.3, .2], [.25, .2], [.3, .2]]   # rises to epoch 2, then stalls
    assert first_stop(g, stalls, 1) == 3 and first_stop(g, stalls, 2) == 4 and first_stop(g, stalls, 3) == 5
    one_rising = [[.1, .1], [.2, .1], [.3, .2], [.3, .3], [.3, .4], [.3, .5]]   # level 2 still rising
    assert first_stop(g, one_rising, 1) is None and first_stop(g, one_rising, 2) is None
    assert first_stop(g, [[.1, .1]] * 6, 0) is None and first_stop(g, stalls, 0) is None   # P = 0: off
    assert first_stop(g, [[.1, .1]] * 3, 1) == 1                        # the start counts: no rise at epoch 1


def test_ground_epochs_stop_at_the_plateau(synthetic_out, tiny_model):
    """--train rows --epochs 3 --plateau 1: holdout_curve has one entry per epoch run, the run stops at the first
    epoch where the rule says so; an lr too small to move a weight stops it after epoch 1; misuse is one line."""
    g = load_script("04_ground.py")
    run("03_expand_vocab.py", "--out-dir", synthetic_out, "--model", tiny_model, "--init", "centroid")
    src = os.path.join(synthetic_out, "models", "centroid")
    flags = ["--out-dir", synthetic_out, "--model", src, "--epochs", 3, "--plateau", 1, "--batch-size", 8,
             "--max-eval", 8, "--log-every", 5]
    for lr, dst in ((1e-2, src + "+gti"), (1e-12, src + "+still")):
        r = run("04_ground.py", *flags, "--lr", lr, "--save", dst)
        rep = json.load(open(os.path.join(dst, "04_ground.json")))
        per_epoch, h = 2 * rep["items_grounded"] // 8, rep["holdout_curve"]
        done = rep["epochs_done"]
        assert [x[:2] for x in h] == [[e, e * per_epoch] for e in range(1, done + 1)], h
        assert rep["steps_done"] == done * per_epoch == rep["loss_curve"][-1]["step"]   # the last steps are logged
        accs = [rep["before"]["held_out"]["acc_in_level"]] + [x[2] for x in h]
        stop = first_stop(g, accs, 1)
        assert rep["stopped_epoch"] == (stop if stop is not None and stop < 3 else None), (accs, rep["stopped_epoch"])
        assert done == (rep["stopped_epoch"] or 3)
        assert ("; plateau: stop" in r.stdout) == (rep["stopped_epoch"] is not None)
    assert rep["stopped_epoch"] == 1 and h[0][2] == rep["before"]["held_out"]["acc_in_level"]   # lr 1e-12
    for extra in (["--train", "all"], ["--holdout-frac", 0.0], ["--epochs", 0]):     # CPT, nothing held out, --steps
        err = assert_one_line_error(run("04_ground.py", *flags, *extra, check=False))
        assert "--plateau 1: needs --train rows, --epochs E and held-out items" in err, err
