"""common.py: the CLI's one-line errors and bounds, one dtype rule, seeding, the lr schedule, the resume state,
atomic writes, guarded loaders, a crash-safe save_folder, the pad token, and the step loader."""
import json
import os
import shutil

import numpy as np
import pytest
import torch

import common


# --- the CLI -------------------------------------------------------------------------------------------------
def parser():
    p = common.Parser("Doc line.\n\nmore")
    p.add_argument("--steps", type=common.pos_int, default=3, help="optimizer steps")
    p.add_argument("--users", type=common.nonneg_int, default=0)
    p.add_argument("--lr", type=common.pos_float, default=1e-3)
    p.add_argument("--init", choices=["mean", "centroid"], default="mean")
    p.add_argument("--figures", action="store_true")
    common.add_device_flags(p)
    return p


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "argument --steps: must be >= 1 (got 0)"),
    (["--steps", "-3"], "argument --steps: must be >= 1 (got -3)"),
    (["--steps", "two"], "argument --steps: expected int, got 'two'"),
    (["--users", "-1"], "argument --users: must be >= 0 (got -1)"),
    (["--lr", "0"], "argument --lr: must be > 0 and finite (got 0)"),
    (["--lr", "inf"], "argument --lr: must be > 0 and finite (got inf)"),
    (["--init", "zeros"], "argument --init: invalid choice: 'zeros'"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--nope"], "unrecognized arguments: --nope"),
])
def test_a_bad_flag_is_one_line(argv, message):
    with pytest.raises(SystemExit) as e:
        parser().parse_args(argv)
    assert str(e.value).startswith("error: ") and message in str(e.value) and "\n" not in str(e.value)


def test_flags_parse_and_help_shows_defaults(capsys):
    a = parser().parse_args(["--steps", "5", "--users", "0", "--lr", "2e-4", "--dtype", "bfloat16"])
    assert (a.steps, a.users, a.lr, a.init, a.device, a.dtype) == (5, 0, 2e-4, "mean", "auto", "bfloat16")
    with pytest.raises(SystemExit) as e:
        parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "Doc line." in out and "more" not in out
    assert "{mean,centroid}" in out and "(default: 3)" in out and "{auto,cpu,cuda,mps}" in out


# --- device, one dtype rule, seeding -----------------------------------------------------------------------------
def test_one_dtype_rule(monkeypatch):
    pick, cpu = common.pick_autocast, torch.device("cpu")
    ctx, note = pick("float32", cpu)
    assert note == "float32" and not isinstance(ctx, torch.autocast)
    ctx, note = pick("bfloat16", cpu)
    assert isinstance(ctx, torch.autocast) and ctx.fast_dtype == torch.bfloat16 and "fp32 weights" in note
    for native in (True, False):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native, raising=False)
        assert ("bf16" in pick("auto", cpu)[1]) == native                          # 04, 05, 06 on CPU
        assert pick("auto", cpu, cpu_bf16_pays=False)[1] == "float32"              # 01: fp32 vectors on CPU


def test_a_missing_device_is_one_line(monkeypatch):
    assert common.pick_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="error: --device cuda but CUDA is not available; use --device cpu"):
        common.pick_device("cuda")


def test_seed_everything_repeats_every_generator():
    def draw():
        common.seed_everything(7)
        import random
        return random.random(), float(np.random.rand()), float(torch.rand(()))
    assert draw() == draw()


# --- files ----------------------------------------------------------------------------------------------------
def test_warmup_cosine_rises_linearly_then_falls_to_its_floor():
    f = [common.warmup_cosine(s, 4, 20, floor=0.1) for s in range(21)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0] and f[4] == 1.0                   # warmup, then the cosine's top
    assert all(a >= b for a, b in zip(f[4:], f[5:])) and f[20] == pytest.approx(0.1)
    assert common.warmup_cosine(12, 4, 20) == pytest.approx(0.5)             # half way down to floor 0
    assert common.warmup_cosine(30, 0, 20, floor=0.1) == pytest.approx(0.1)  # past the end: the floor


def test_resume_state_round_trip_and_other_arguments(tmp_path):
    path, key = str(tmp_path / "r.resume.pt"), {"lr": 1e-3, "steps": 9}
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(a.parameters())
    a(torch.ones(1, 3)).sum().backward()
    opt.step()
    common.save_resume(path, key, {"step": 4}, model=a, opt=opt)
    opt_b = torch.optim.AdamW(b.parameters())
    rest = common.load_resume(path, key, model=b, opt=opt_b)
    assert rest == {"step": 4, "key": key} and torch.equal(a.weight, b.weight)
    assert torch.equal(opt_b.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    with pytest.raises(SystemExit) as e:
        common.load_resume(path, {**key, "lr": 1e-2}, model=b)
    assert "was written with other arguments (lr)" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SystemExit) as e:
        common.load_resume(str(tmp_path / "none.pt"), key)
    assert "none.pt not found" in str(e.value)


def test_pad_id_falls_back_to_eos():
    tok = type("Tok", (), {"pad_token_id": None, "eos_token_id": 2})
    assert common.pad_id(tok) == 2
    tok.pad_token_id = 7
    assert common.pad_id(tok) == 7


def test_atomic_write_keeps_the_old_file_when_the_writer_fails(tmp_path):
    path = str(tmp_path / "a.json")
    common.write_json(path, {"x": 1})

    def killed(tmp):
        open(tmp, "w").write("half")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        common.atomic_write(path, killed)
    assert json.load(open(path)) == {"x": 1} and os.listdir(tmp_path) == ["a.json"]


def test_guarded_loaders(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x00 not an artifact {")
    for load in (common.load_pt, common.load_npy, common.load_json):
        with pytest.raises(SystemExit, match=f"error: {bad} is unreadable .*; run 02_rqvae.py first"):
            load(str(bad), "run 02_rqvae.py first")
        with pytest.raises(SystemExit, match="nope not found; run 02"):
            load(str(tmp_path / "nope"), "run 02")
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object))                # needs pickle: refused
    with pytest.raises(SystemExit, match="unreadable"):
        common.load_npy(str(tmp_path / "obj.npy"), "x")
    torch.save({"f": Fake("x")}, tmp_path / "obj.pt")                                # a pickled object: refused
    with pytest.raises(SystemExit, match="obj.pt is unreadable"):
        common.load_pt(str(tmp_path / "obj.pt"), "x")
    torch.save({"t": torch.arange(3)}, tmp_path / "ok.pt")
    assert common.load_pt(str(tmp_path / "ok.pt"), "x")["t"].tolist() == [0, 1, 2]


# --- save_folder: safe against a kill at any line ------------------------------------------------------------------
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
def test_save_folder_from_every_leftover_state(tmp_path, leftover):
    """The states a kill can leave: a half-written <dst>.tmp; <dst>.old without <dst> (between the two renames);
    <dst>.old beside the new <dst> (during the last rmtree). The next save ends with <dst> new, nothing else."""
    dst = str(tmp_path / "m")
    common.save_folder(dst, Fake("v1"), Fake("tok"), {"a.json": "1"})
    if leftover in ("tmp", "tmp_and_old_only"):
        os.makedirs(dst + ".tmp")
        open(os.path.join(dst + ".tmp", "weights"), "w").write("half")
    if leftover in ("old_only", "tmp_and_old_only"):
        os.replace(dst, dst + ".old")
    if leftover == "old_and_dst":
        shutil.copytree(dst, dst + ".old")
    common.save_folder(dst, Fake("v2"), Fake("tok"), {"a.json": "2"})
    assert folder(dst) == {"a.json": "2", "weights": "tok"}                          # tok saved last
    assert sorted(os.listdir(tmp_path)) == ["m"]


def test_save_folder_killed_while_writing_keeps_the_previous_folder(tmp_path):
    dst = str(tmp_path / "m")
    common.save_folder(dst, Fake("v1"), Fake("v1"), {"a.json": "1"})
    with pytest.raises(KeyboardInterrupt):
        common.save_folder(dst, Fake("v2", fail=True), Fake("v2"), {"a.json": "2"})
    assert folder(dst) == {"a.json": "1", "weights": "v1"}                           # the old folder is whole
    os.replace(dst, dst + ".old")                                                    # and from between the renames
    with pytest.raises(KeyboardInterrupt):
        common.save_folder(dst, Fake("v3", fail=True), Fake("v3"), {})
    assert folder(dst) == {"a.json": "1", "weights": "v1"}                           # .old was renamed back first
    common.save_folder(dst, Fake("v4"), Fake("v4"), {})
    assert folder(dst) == {"weights": "v4"} and sorted(os.listdir(tmp_path)) == ["m"]


# --- the model folder's fingerprint, the step loader -----------------------------------------------------------
def test_items_key_names_the_items_in_order():
    ds = {"item_ids": ["1", "2"], "texts": ["a", "b"]}
    assert common.items_key(ds) == common.items_key(dict(ds))
    assert common.items_key(ds) != common.items_key({"item_ids": ["2", "1"], "texts": ["b", "a"]})
    assert common.items_key(ds) != common.items_key({"item_ids": ["1", "2"], "texts": ["a", "c"]})


def test_load_step_loads_a_numbered_script_once(tmp_path, monkeypatch):
    (tmp_path / "09_toy.py").write_text("import common\nCALLS = []\ndef f():\n    return common.REPO\n")
    monkeypatch.setattr(common, "REPO", str(tmp_path))
    mod = common.load_step("09_toy")
    assert mod.f() == str(tmp_path) and common.load_step("09_toy.py") is mod
    (tmp_path / "08_broken.py").write_text("raise ValueError('boom')\n")
    for _ in range(2):                                                               # a failed load is not cached
        with pytest.raises(ValueError, match="boom"):
            common.load_step("08_broken")
