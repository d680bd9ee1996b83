"""The plumbing the seven numbered scripts share: helpers byte-identical wherever they appear, Args types as the
CLI's checks (choices, bounds), one dtype rule, guarded loaders for every artifact kind, crash-safe
save_folder, steps that check their inputs against each other before writing, defaults that chain."""
import ast
import json
import os
import shutil
import sys
import typing

import numpy as np
import pytest
import torch
from conftest import REPO, assert_one_line_error, load_script, make_synthetic_out, make_tiny_model, run
from sid_model import make_sid_model

SCRIPTS = ["01_embed_items.py", "02_rqvae.py", "03_expand_vocab.py", "04_ground.py", "05_sft.py", "06_eval.py",
           "07_diagnose.py"]
MAIN_GUARD = '\nif __name__ == "__main__":\n    main()\n'
STEP_OWN = {"Args", "main"}                                  # every script has its own


def source(script):
    return open(os.path.join(REPO, script)).read()


def top_level(script):
    """{name: source text} of the script's top-level functions and classes."""
    src = source(script)
    return {n.name: ast.get_source_segment(src, n) for n in ast.parse(src).body
            if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


@pytest.fixture(scope="module")
def mods():
    out = {s: load_script(s) for s in SCRIPTS}
    for mod in out.values():
        sys.modules[mod.__name__] = mod                          # parse_args reads Args' source via its module
    return out


# --- shared helpers: byte-identical wherever they appear, each script carries only what it calls ----------
def test_a_helper_in_several_scripts_is_byte_identical():
    texts = {}
    for s in SCRIPTS + ["baselines/sasrec.py"]:
        for name, text in top_level(s).items():
            if name not in STEP_OWN:
                texts.setdefault(name, {})[s] = text
    shared = {name: by for name, by in texts.items() if len(by) > 1}
    assert {"die", "parse_args", "pick_device", "seed_everything", "load_sid_model"} <= shared.keys()
    for name, by in shared.items():
        assert len(set(by.values())) == 1, (name, sorted(by))


def test_each_script_carries_only_the_helpers_it_calls_and_imports_no_other():
    for s in SCRIPTS + ["baselines/sasrec.py"]:
        tree = ast.parse(source(s))
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        for name in top_level(s).keys() - STEP_OWN:
            assert name in names, (s, name)                                       # called somewhere
        assert source(s).endswith(MAIN_GUARD), s
        imports = "".join(l for l in source(s).splitlines() if "import" in l)
        for other in SCRIPTS if s in SCRIPTS else []:          # (the baseline reuses 06's metric code)
            assert other[:-3] not in imports, (s, other)                          # self-contained steps


# --- Args types are the CLI's checks ------------------------------------------------------------------------
def parse(mod, *argv, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["x.py", *argv])
    return mod.parse_args()


def test_help_lists_every_choice(mods, monkeypatch, capsys):
    for s, mod in mods.items():
        with pytest.raises(SystemExit) as e:
            parse(mod, "--help", monkeypatch=monkeypatch)
        assert e.value.code == 0
        out = capsys.readouterr().out
        literals = {f: t for f, t in typing.get_type_hints(mod.Args).items() if typing.get_origin(t) is typing.Literal}
        assert "device" in literals, s
        for f, t in literals.items():
            assert "{" + ",".join(typing.get_args(t)) + "}" in out, (s, f)
        assert "unknown --" not in source(s), s                                     # no hand-written checks left


def test_every_bound_rejects_a_value_below_it(mods, monkeypatch):
    """Count flags at 0 or negative (--batch-size 0, --eval-every 0, --grad-accum 0, --steps -3, ...): one line
    naming the flag, never a traceback or a run that trains nothing."""
    checked = 0
    for s, mod in mods.items():
        for f, t in typing.get_type_hints(mod.Args, include_extras=True).items():
            if typing.get_origin(t) is not typing.Annotated:
                continue
            bad = {">= 1": "0", ">= 0": "-1", "> 0": "0"}[typing.get_args(t)[1]]
            flag = "--" + f.replace("_", "-")
            with pytest.raises(SystemExit, match=f"argument {flag}: must be"):
                parse(mod, flag, bad, monkeypatch=monkeypatch)
            checked += 1
    assert checked >= 30
    with pytest.raises(SystemExit, match="argument --steps: must be >= 1 \\(got -3\\)"):
        parse(mods["05_sft.py"], "--steps", "-3", monkeypatch=monkeypatch)


def test_wrong_choice_is_one_line():
    err = assert_one_line_error(run("03_expand_vocab.py", "--init", "zeros", check=False))
    assert "invalid choice: 'zeros'" in err and "'centroid'" in err


# --- one dtype rule ----------------------------------------------------------------------------------------
def test_one_dtype_rule(mods, monkeypatch):
    pick = mods["05_sft.py"].pick_autocast
    cpu = torch.device("cpu")
    ctx, note = pick("float32", cpu)
    assert note == "float32" and not isinstance(ctx, torch.autocast)
    ctx, note = pick("bfloat16", cpu)
    assert isinstance(ctx, torch.autocast) and ctx.fast_dtype == torch.bfloat16 and "fp32 weights" in note
    for native in (True, False):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native, raising=False)
        assert ("bf16" in pick("auto", cpu)[1]) == native                          # 04, 05, 06 on CPU
        assert pick("auto", cpu, cpu_bf16_pays=False)[1] == "float32"              # 01: fp32 vectors on CPU
    for s in ("01_embed_items.py", "04_ground.py", "05_sft.py", "06_eval.py"):
        assert typing.get_args(typing.get_type_hints(mods[s].Args)["dtype"]) == ("auto", "float32", "bfloat16")


# --- guarded loaders: one line that names the file and the step that makes it ------------------------------
def test_guarded_loaders(mods, tmp_path):
    m = mods["07_diagnose.py"]
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x00 not an artifact {")
    for load in (m.load_pt, m.load_npy, m.load_json):
        with pytest.raises(SystemExit, match=f"error: {bad} .*run 02_rqvae.py first"):
            load(str(bad), "run 02_rqvae.py first")
        with pytest.raises(SystemExit, match="nope not found; run 02"):
            load(str(tmp_path / "nope"), "run 02")
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object))                # needs pickle: refused
    with pytest.raises(SystemExit, match="unreadable"):
        m.load_npy(str(tmp_path / "obj.npy"), "x")


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
    ev = load_script("06_eval.py")
    o = str(os.path.join(os.path.dirname(out), "no_sids"))
    copy_out(out, o)
    os.remove(os.path.join(o, "sids.npy"))
    _, _, _, _, codes, item_tok, _ = ev.load_sid_model(model_dir, o, torch.device("cpu"))
    assert np.array_equal(codes, np.load(os.path.join(out, "sids.npy"))) and item_tok.shape == codes.shape


# --- a step checks the artifacts it reads against each other before writing anything -----------------------
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


# --- data that cannot be right: empty item texts ------------------------------------------------------------
def test_empty_item_text_is_counted_and_replaced(tmp_path, capsys):
    E = load_script("01_embed_items.py")
    (tmp_path / "interactions.csv").write_text("user,item,timestamp\n" + "".join(
        f"u{u},i{(u + k) % 5},{k}\n" for u in range(4) for k in range(4)))
    (tmp_path / "items.csv").write_text('item,text\ni0,A film\ni1,   \ni2,""\ni3,Another\n')   # i4: no row
    ds = E.load_dataset(E.Args(dataset="generic", data_dir=str(tmp_path)))
    assert "warning: 3 items have no text" in capsys.readouterr().out
    texts = dict(zip(ds["item_ids"], ds["texts"]))
    assert texts == {"i0": "A film", "i1": "i1", "i2": "i2", "i3": "Another", "i4": "i4"}


# --- save_folder: safe against a kill at any line -------------------------------------------------------
class Fake:
    """Stands in for a model / tokenizer: save_pretrained writes one file (or fails, like a kill)."""

    def __init__(self, text, fail=False):
        self.text, self.fail = text, fail

    def save_pretrained(self, path):
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "weights"), "w") as f:
            f.write(self.text)
        if self.fail:
            raise KeyboardInterrupt                                                  # killed while writing


def folder(path):
    return {f: open(os.path.join(path, f)).read() for f in sorted(os.listdir(path))} if os.path.isdir(path) else None


@pytest.mark.parametrize("leftover", ["none", "tmp", "old_only", "old_and_dst", "tmp_and_old_only"])
def test_save_folder_from_every_leftover_state(mods, tmp_path, leftover):
    """The states a kill can leave: a half-written <dst>.tmp; <dst>.old without <dst> (between the two renames);
    <dst>.old beside the new <dst> (during the last rmtree). The next save ends with <dst> new, nothing else."""
    save = mods["05_sft.py"].save_folder
    dst = str(tmp_path / "m")
    save(dst, Fake("v1"), Fake("tok"), {"a.json": "1"})
    if leftover in ("tmp", "tmp_and_old_only"):
        os.makedirs(dst + ".tmp")
        open(os.path.join(dst + ".tmp", "weights"), "w").write("half")
    if leftover in ("old_only", "tmp_and_old_only"):
        os.replace(dst, dst + ".old")
    if leftover == "old_and_dst":
        shutil.copytree(dst, dst + ".old")
    save(dst, Fake("v2"), Fake("tok"), {"a.json": "2"})
    assert folder(dst) == {"a.json": "2", "weights": "tok"}                          # tok saved last
    assert sorted(os.listdir(tmp_path)) == ["m"]


def test_save_folder_killed_while_writing_keeps_the_previous_folder(mods, tmp_path):
    save = mods["03_expand_vocab.py"].save_folder
    dst = str(tmp_path / "m")
    save(dst, Fake("v1"), Fake("v1"), {"a.json": "1"})
    with pytest.raises(KeyboardInterrupt):
        save(dst, Fake("v2", fail=True), Fake("v2"), {"a.json": "2"})
    assert folder(dst) == {"a.json": "1", "weights": "v1"}                           # the old folder is whole
    os.replace(dst, dst + ".old")                                                    # and from between the renames
    with pytest.raises(KeyboardInterrupt):
        save(dst, Fake("v3", fail=True), Fake("v3"), {})
    assert folder(dst) == {"a.json": "1", "weights": "v1"}                           # .old was renamed back first
    save(dst, Fake("v4"), Fake("v4"), {})
    assert folder(dst) == {"weights": "v4"} and sorted(os.listdir(tmp_path)) == ["m"]


# --- defaults follow the pipeline -------------------------------------------------------------------------
def test_bare_scripts_chain_their_defaults(mods):
    """With no flags, each step reads the previous step's output: out/<dataset> for 01/02/03/07 (and 04's
    --out-dir), 04 grounds models/centroid into centroid+gti, 05 fine-tunes that into +sft, 06 evaluates it."""
    A = {s: mods[s].Args() for s in SCRIPTS}
    ds = A["01_embed_items.py"].dataset
    for s in ("02_rqvae.py", "03_expand_vocab.py", "04_ground.py", "07_diagnose.py"):
        assert A[s].dataset == ds and A[s].out_dir == "", s                         # default out/<dataset>
    grounded = os.path.join("out", ds, "models", "centroid") + "+gti"              # 04's default --save
    assert A["05_sft.py"].model == grounded
    assert A["06_eval.py"].model == grounded + "+sft"                                # 05's default --save
    assert A["03_expand_vocab.py"].init == "all"                                     # writes models/centroid


def test_validation_users_are_user_ids(mods):
    """05's validation subset: positions in the list of users with a train part map back to their ids."""
    sft = mods["05_sft.py"]
    train = [[1, 2], [], [3], [], [4, 5, 6], [7]]
    assert sft.validation_users(train, 0, seed=0) == [0, 2, 4, 5]
    for seed in range(5):
        sub = sft.validation_users(train, 2, seed)
        assert len(sub) == 2 and set(sub) <= {0, 2, 4, 5} and sub == sorted(sub)
        assert sub == sft.validation_users(train, 2, seed)                           # fixed by the seed


def test_load_sid_model_is_one_text_in_04_05_06():
    def text(script):
        s = source(script)
        i = s.index("def load_sid_model(")
        return s[i:s.index("\n\n\n", i)]
    assert text("04_ground.py") == text("05_sft.py") == text("06_eval.py")
    assert "sids.npy" not in text("06_eval.py")


def test_dataset_without_its_fields_is_one_line(setup, tmp_path):
    out, _, model_dir = setup
    o = copy_out(out, tmp_path / "o")
    torch.save({"item_ids": ["0"]}, os.path.join(o, "dataset.pt"))                   # a dict, but not 01's
    for script in ("04_ground.py", "05_sft.py", "06_eval.py"):
        err = assert_one_line_error(run(script, "--out-dir", o, "--model", model_dir, check=False))
        assert "dataset.pt lacks the fields 01_embed_items.py writes" in err, (script, err)
