"""scripts/peak_geometry.py: the geometry claims read from convergence records' SID rows. Constructed records: rows
pushed along token frequency (Thm 3.1's axis) by more than study.MOVED x their spread give "reproduced" over two
seeds; rows that did not move give "not testable at this budget"; a record on other SIDs is a one-line error."""
import json
import os
import shutil
import sys

import numpy as np
import pytest

from conftest import load_script, make_synthetic_out

pg = load_script("scripts/peak_geometry.py")


def setup(tmp_path, monkeypatch, levels=(4, 4, 4)):
    """make run's 01/02 files in out/ml-100k, its 02 files pinned in the tokenizer folder (as convergence.py pins
    them); peak_geometry stages the base folder from both."""
    for mod in (pg, sys.modules["convergence"]):
        monkeypatch.setattr(mod, "REPO", str(tmp_path))
    out = tmp_path / pg.OUT
    make_synthetic_out(str(out), num_users=60 * len(levels) * levels[0] // 12, num_items=20 * levels[0],
                       levels=levels)
    (tmp_path / pg.TOKENIZER).mkdir(parents=True)
    (out / "02_rqvae.json").write_text("{}")
    for f in ("sids.npy", "centroids.pt", "rqvae.pt", "02_rqvae.json"):
        shutil.copyfile(out / f, tmp_path / pg.TOKENIZER / f)
    data = pg.load_data()
    tok, item_tok, n = pg.row_index(data["sids"], data["centroids"])
    freq = np.concatenate([np.bincount(data["sids"][:, l], weights=data["pop"], minlength=len(t))[t >= 0]
                           for l, t in enumerate(tok)])                  # each row's token frequency, row order
    (tmp_path / pg.RECORDS).mkdir(parents=True, exist_ok=True)
    return n, freq


def record(tmp_path, name, kind, seed, E0, E1, best=20):
    np.savez_compressed(tmp_path / pg.RECORDS / f"{name}_rows.npz", steps=np.array([0, 10, best]),
                        token_ids=np.arange(len(E0)), input=np.stack([E0, (E0 + E1) / 2, E1]).astype(np.float16))
    (tmp_path / pg.RECORDS / f"{name}.json").write_text(json.dumps(
        {"run": name, "kind": kind, "seed": seed, "best_step": best, "rows": f"{name}_rows.npz"}))


def claim(md, start):
    return next(x for x in md.splitlines() if x.startswith(f"| {start}"))


def test_a_popularity_drift_is_found_and_still_rows_are_not_testable(tmp_path, monkeypatch):
    n, freq = setup(tmp_path, monkeypatch)
    g, d = np.random.default_rng(0), 16
    u = np.linalg.qr(g.standard_normal((d, 1)))[0][:, 0]                   # the axis the rows drift along
    z = (freq - freq.mean()) / freq.std()
    for seed in (0, 1):
        E0 = g.standard_normal((n, d))                                     # random init: spread ~ 4
        E1 = E0 + 3.0 * np.outer(z, u) + 0.2 * g.standard_normal((n, d))   # rms ~ 3: moved ~ 0.75 x the spread
        record(tmp_path, f"random-s{seed}", "random", seed, E0, E1)
    E0 = np.tile(g.standard_normal(d), (n, 1))                             # mean init, never moved
    record(tmp_path, "mean-full-s0", "mean-full", 0, E0, E0)
    pg.main()
    md = (tmp_path / "results" / "ml-100k_peak_geometry.md").read_text()
    row = claim(md, "random init drifts to a popularity axis")
    assert row.endswith("| reproduced |") and "over seeds 0,1" in row, row
    row = claim(md, "mean init's rows")
    assert "not testable at this budget (rms/spread 0.00 < 0.5)" in row, row
    assert claim(md, "GTI: mean init collapses").endswith("| not run yet |")
    assert "| random-s0 | 20 | 0.7" in md


def test_levels_drifting_apart_hide_the_axis_over_all_rows_not_within_a_level(tmp_path, monkeypatch):
    """Each level's rows move by its own large offset (the levels separate) plus a small push along frequency: PC1 over
    all rows is the levels' separation (all-rows rule: not reproduced), within a level it is frequency."""
    n, freq = setup(tmp_path, monkeypatch, levels=(24, 24, 24))             # a level's null needs its codes
    data = pg.load_data()
    tok, _, _ = pg.row_index(data["sids"], data["centroids"])
    level = np.concatenate([np.full(int((t >= 0).sum()), l) for l, t in enumerate(tok)])
    g, d = np.random.default_rng(2), 16
    for seed in (0, 1):
        E0 = g.standard_normal((n, d))
        u, v = np.linalg.qr(g.standard_normal((d, 2)))[0].T                 # two orthogonal unit directions
        off = 8.0 * np.array([1, -1] + [0] * (len(tok) - 2))[:, None] * u    # levels a, b move apart along u
        z = np.concatenate([(freq[level == l] - freq[level == l].mean()) / (freq[level == l].std() + 1e-9)
                            for l in range(len(tok))])
        E1 = E0 + off[level] + 2.0 * np.outer(z, v)                          # and along frequency within a level
        record(tmp_path, f"random-s{seed}", "random", seed, E0, E1)
    pg.main()
    md = (tmp_path / "results" / "ml-100k_peak_geometry.md").read_text()
    assert not claim(md, "random init drifts to a popularity axis (Thm 3.1)").endswith("| reproduced |")
    assert claim(md, "random init drifts to a popularity axis, within each code level").endswith("| reproduced |")


def test_isotropic_motion_is_not_a_popularity_axis(tmp_path, monkeypatch):
    n, _ = setup(tmp_path, monkeypatch)
    g = np.random.default_rng(1)
    for seed in (0, 1):
        E0 = g.standard_normal((n, 16))
        record(tmp_path, f"random-s{seed}", "random", seed, E0, E0 + g.standard_normal((n, 16)))  # moved ~ 1 x
    pg.main()
    row = claim((tmp_path / "results" / "ml-100k_peak_geometry.md").read_text(), "random init drifts")
    assert not row.endswith("| reproduced |") and "not testable" not in row, row
    row = claim((tmp_path / "results" / "ml-100k_peak_geometry.md").read_text(), "random init drifts to a popularity "
                "axis, within")
    assert not row.endswith("| reproduced |") and "not testable" not in row, row


def test_a_record_on_other_sids_is_one_line(tmp_path, monkeypatch):
    n, _ = setup(tmp_path, monkeypatch)
    E0 = np.zeros((n + 3, 16))
    record(tmp_path, "random-s0", "random", 0, E0, E0)
    with pytest.raises(SystemExit) as e:
        pg.main()
    err = str(e.value.code)
    assert len(err.splitlines()) == 1 and "rerun `python scripts/convergence.py --runs random-s0`" in err, err
    assert not os.path.exists(tmp_path / "results" / "ml-100k_peak_geometry.md")
