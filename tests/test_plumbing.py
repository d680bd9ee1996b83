"""The plumbing of the seven numbered scripts: each imports common.py and no other step, carries no copy of a
common helper, parses plain argparse (every bound and choice a one-line error), fits its line budget, chains its
defaults to the previous step's output, and turns a broken artifact into one line that names the file."""
import argparse
import ast
import json
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import REPO, assert_one_line_error, load_script, make_synthetic_out, make_tiny_model, run
from sid_model import make_sid_model

import common

SCRIPTS = ["01_embed_items.py", "02_rqvae.py", "03_expand_vocab.py", "04_ground.py", "05_sft.py", "06_eval.py",
           "07_diagnose.py"]
MAIN_GUARD = '\nif __name__ == "__main__":\n    main()\n'
BOUNDED = {common.pos_int: "0", common.nonneg_int: "-1", common.pos_float: "0", common.nonneg_float: "-1"}


def source(script):
    return open(os.path.join(REPO, script)).read()


@pytest.fixture(scope="module")
def mods():
    return {s: load_script(s) for s in SCRIPTS}


def parser_of(mod, monkeypatch):
    """The argparse parser a step builds (captured when its parse_args([]) runs)."""
    seen = {}
    parse = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        seen["p"] = self
        return parse(self, args, namespace)
    monkeypatch.setattr(common.Parser, "parse_args", capture)
    mod.parse_args([])
    monkeypatch.undo()
    return seen["p"]


# --- the form: one shared module, self-contained steps, budgets ------------------------------------------------
def test_each_step_imports_common_and_no_other_step_and_copies_no_helper():
    shared = {n.name for n in ast.parse(source("common.py")).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    for s in SCRIPTS + ["baselines/sasrec.py"]:
        tree = ast.parse(source(s))
        mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "common" in mods, s
        assert not mods & {"inspect", "subprocess"} and "ast.parse" not in source(s), s   # no CLI from its own source
        own = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert own & shared == set(), (s, own & shared)                            # no pasted copy of a helper
        assert source(s).endswith(MAIN_GUARD), s
        if s in SCRIPTS:                                                           # a step never loads another
            assert "load_step(" not in source(s) and "spec_from_file_location" not in source(s), s


def test_line_budgets():
    """A step a student reads in one sitting: ~300 lines, none over 350 (nanoGPT's train.py: 336); the seven
    and common.py together 2,320 lines after the minimal core, 2,365 with the plateau rule and the aux token mix
    (the aim was ~2,100; docs/log.md, 2026-12-04), 2,400 since 04's and 05's twin resume, schedule and DDP code
    moved into common.py (docs/log.md, 2026-12-07)."""
    lines = {s: len(source(s).splitlines()) for s in SCRIPTS + ["common.py"]}
    assert all(n <= 350 for s, n in lines.items() if s in SCRIPTS) and lines["common.py"] <= 280, lines
    assert sum(lines.values()) <= 2400, lines


# --- plain argparse: choices, bounds, one line --------------------------------------------------------------------
def test_help_lists_the_device_choices(mods, capsys):
    for s, mod in mods.items():
        with pytest.raises(SystemExit) as e:
            mod.parse_args(["--help"])
        assert e.value.code == 0, s
        assert "{auto,cpu,cuda,mps}" in capsys.readouterr().out, s


def test_every_bound_rejects_a_value_below_it(mods, monkeypatch):
    """Count flags at 0 or negative (--batch-size 0, --eval-every 0, --steps -3, ...): one line naming the flag,
    never a traceback or a run that trains nothing."""
    checked = 0
    for s, mod in mods.items():
        for action in parser_of(mod, monkeypatch)._actions:
            if action.type in BOUNDED:
                with pytest.raises(SystemExit, match=f"argument {action.option_strings[0]}: must be"):
                    mod.parse_args([action.option_strings[0], BOUNDED[action.type]])
                checked += 1
    assert checked >= 25
    with pytest.raises(SystemExit, match="argument --steps: must be >= 1 \\(got -3\\)"):
        mods["05_sft.py"].parse_args(["--steps", "-3"])


def test_dtype_flag_where_a_step_runs_the_model(mods, monkeypatch):
    for s in ("01_embed_items.py", "04_ground.py", "05_sft.py", "06_eval.py"):
        dtype = {a.dest: a for a in parser_of(mods[s], monkeypatch)._actions}["dtype"]
        assert dtype.choices == ["auto", "float32", "bfloat16"] and dtype.default == "auto", s


def test_wrong_choice_is_one_line():
    err = assert_one_line_error(run("03_expand_vocab.py", "--init", "zeros", check=False))
    assert "invalid choice: 'zeros'" in err and "'centroid'" in err


def test_bare_scripts_chain_their_defaults(mods):
    """With no flags, each step reads the previous step's output: out/<dataset> for 01/02/03/07 (and 04's
    --out-dir), 04 grounds models/centroid into centroid+gti, 05 fine-tunes that into +sft, 06 evaluates it."""
    A = {s: mods[s].parse_args([]) for s in SCRIPTS}
    ds = A["01_embed_items.py"].dataset
    for s in ("02_rqvae.py", "03_expand_vocab.py", "04_ground.py", "07_diagnose.py"):
        assert A[s].dataset == ds and A[s].out_dir == "", s                         # default out/<dataset>
    grounded = os.path.join("out", ds, "models", "centroid") + "+gti"              # 04's default --save
    assert A["05_sft.py"].model == grounded
    assert A["06_eval.py"].model == grounded + "+sft"                                # 05's default --save
    assert A["03_expand_vocab.py"].init == "all"                                     # writes models/centroid


# --- guarded loading across the steps ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("plumb")
    out = make_synthetic_out(str(root / "out"))
    tiny = make_tiny_model(str(root / "tiny"))
    return out, tiny, make_sid_model(out, tiny, str(root / "out" / "models" / "mean"))


def copy_out(src, dst):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("models"))
    return str(dst)


def test_broken_npy_is_one_line_in_every_reader(setup, tmp_path):
    out, tiny, _ = setup
    for name, runs in (("sids.npy", [("03_expand_vocab.py", "--model", tiny), ("07_diagnose.py",)]),
                       ("item_emb.npy", [("02_rqvae.py", "--steps", "2"), ("07_diagnose.py",)])):
        o = copy_out(out, tmp_path / name)
        with open(os.path.join(o, name), "wb") as f:
            f.write(b"not a numpy file")
        for script, *flags in runs:
            err = assert_one_line_error(run(script, "--out-dir", o, *flags, check=False))
            assert f"{name} is unreadable" in err, (script, err)


def test_broken_sid_vocab_is_one_line_in_every_reader(setup, tmp_path):
    out, _, model_dir = setup
    bad = str(tmp_path / "bad")
    shutil.copytree(model_dir, bad)
    with open(os.path.join(bad, "sid_vocab.json"), "w") as f:
        f.write('{"num_levels": 4, "token_ids": [')                                   # cut short
    for script in ("04_ground.py", "05_sft.py", "06_eval.py", "07_diagnose.py"):
        flags = ["--models", bad] if script == "07_diagnose.py" else ["--model", bad]
        err = assert_one_line_error(run(script, "--out-dir", out, *flags, check=False))
        assert "sid_vocab.json is unreadable (JSONDecodeError)" in err and "03_expand_vocab.py" in err, (script, err)
    shutil.copy(os.path.join(model_dir, "sid_vocab.json"), bad)
    with open(os.path.join(bad, "model.safetensors"), "wb") as f:
        f.write(b"truncated")                                                      # weights cut short
    err = assert_one_line_error(run("07_diagnose.py", "--out-dir", out, "--models", bad, check=False))
    assert "model.safetensors is unreadable" in err, err
    err = assert_one_line_error(run("06_eval.py", "--out-dir", out, "--model", bad, check=False))
    assert f"{bad}: unreadable" in err, err
    vocab = json.load(open(os.path.join(model_dir, "sid_vocab.json")))
    del vocab["item_codes"]                                                        # a folder without item codes
    json.dump(vocab, open(os.path.join(bad, "sid_vocab.json"), "w"))
    err = assert_one_line_error(run("06_eval.py", "--out-dir", out, "--model", bad, check=False))
    assert "item_codes" in err and "03" in err


def test_model_folder_carries_its_codes(setup):
    """04-06 read every item's SID from sid_vocab.json (item_codes = sids.npy), not from <out-dir>/sids.npy."""
    out, _, model_dir = setup
    o = str(os.path.join(os.path.dirname(out), "no_sids"))
    copy_out(out, o)
    os.remove(os.path.join(o, "sids.npy"))
    _, _, _, _, codes, item_tok, _ = common.load_sid_model(model_dir, o, torch.device("cpu"))
    assert np.array_equal(codes, np.load(os.path.join(out, "sids.npy"))) and item_tok.shape == codes.shape


def test_03_refuses_sids_that_do_not_match_the_dataset(tmp_path, tiny_model):
    out = make_synthetic_out(str(tmp_path / "out"))
    run("03_expand_vocab.py", "--out-dir", out, "--model", tiny_model, "--init", "mean")
    folder = os.path.join(out, "models", "mean")
    before = {f: os.stat(os.path.join(folder, f)).st_mtime_ns for f in os.listdir(folder)}
    summary = open(os.path.join(out, "03_expand_vocab.json")).read()
    sids = np.load(os.path.join(out, "sids.npy"))
    np.save(os.path.join(out, "sids.npy"), sids[:-10])                              # 10 rows short
    err = assert_one_line_error(run("03_expand_vocab.py", "--out-dir", out, "--model", tiny_model, "--init", "mean",
                                    check=False))
    assert "sids.npy has 50 rows" in err and "dataset.pt has 60 items" in err
    assert {f: os.stat(os.path.join(folder, f)).st_mtime_ns for f in os.listdir(folder)} == before
    assert open(os.path.join(out, "03_expand_vocab.json")).read() == summary
    assert sorted(os.listdir(os.path.join(out, "models"))) == ["mean"]


def test_dataset_without_its_fields_is_one_line(setup, tmp_path):
    out, _, model_dir = setup
    o = copy_out(out, tmp_path / "o")
    torch.save({"item_ids": ["0"]}, os.path.join(o, "dataset.pt"))                   # a dict, but not 01's
    for script in ("04_ground.py", "05_sft.py", "06_eval.py"):
        err = assert_one_line_error(run(script, "--out-dir", o, "--model", model_dir, check=False))
        assert "dataset.pt lacks the fields 01_embed_items.py writes" in err, (script, err)
