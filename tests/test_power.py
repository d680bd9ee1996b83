"""scripts/power.py: the MDE formula on constructed data, and the claims table it reads."""
import numpy as np

from conftest import load_script

pw = load_script("scripts/power.py")


def test_mde_is_the_effect_detected_80_percent_of_the_time():
    """Paired differences with a known spread: SE read back from a 95% interval is the true SE, and a
    true effect equal to the MDE is detected (95% interval above 0) in ~80% of repeated studies."""
    g = np.random.default_rng(0)
    n, sd = 900, 0.3
    se_true = sd / np.sqrt(n)
    assert abs(pw.se_of(-1.96 * se_true, 1.96 * se_true) - se_true) < 1e-3 * se_true
    effect = pw.mde(se_true)
    hits = []
    for _ in range(2000):
        d = g.normal(effect, sd, n)
        se = d.std(ddof=1) / np.sqrt(n)
        hits.append(d.mean() - 1.96 * se > 0)
    assert abs(np.mean(hits) - 0.80) < 0.03, np.mean(hits)
    half = pw.mde(se_true) / 2                                   # half the MDE: far less power
    assert np.mean([g.normal(half, sd, n).mean() - 1.96 * se_true > 0 for _ in range(2000)]) < 0.4


def test_t_quantiles_and_pairs_needed():
    assert pw.t_quantile(0.975, 2) == 4.303 and abs(pw.t_quantile(0.975, 200) - 1.972) < 0.002
    assert abs(pw.t_quantile(0.80, 60) - 0.848) < 0.002
    assert pw.mde(1.0, 2) == (4.303 + 1.061)
    # 3 pairs with SE 1 (sd sqrt 3): the pairs at which the t MDE first falls to 2.0
    n = pw.pairs_needed(1.0, 3, 2.0)
    assert pw.mde(np.sqrt(3) / np.sqrt(n), n - 1) <= 2.0 < pw.mde(np.sqrt(3) / np.sqrt(n - 1), n - 2)


def test_reads_a_claim_row_into_mde_and_meaning():
    text = ("## The papers' claims\n\n| claim | paper | ours | verdict | command |\n|---|---|---|---|---|\n"
            "| centroid vs random: Recall@5 | +6.5% on average | +0.0060 [-0.0035, +0.0159] (+8.9%); 3 vs 3 "
            "seeds, 943 users; per seed pair +0.0060 [-0.0101, +0.0221] (t 95%, 3 pairs: a) | inconclusive | x |\n"
            "\n## next\n")
    (row,) = [pw.analyse(*c, 943) for c in pw.parse_claims(text)]
    assert abs(row["effect"] - 0.065 * 0.0060 / 0.089) < 1e-9
    assert abs(row["mde_users"] - (1.959964 + 0.841621) * 0.0194 / 2 / 1.959964) < 1e-6
    assert row["k"] == 3 and abs(row["mde_seeds"] - (4.303 + 1.061) * 0.0322 / 2 / 4.303) < 1e-6
    (line,) = pw.report([row], 943, 22363)[2:]
    assert "underpowered" in line


def test_a_cpt_row_is_two_comparisons():
    """The CPT claim's cell holds two paired intervals: each gets its own row, MDE and verdict."""
    ours = ("centroid+cpt1 - random+cpt2: +0.0080 [-0.0030, +0.0190] (+11.0%); 1 vs 1 seeds (1 common), 943 users; "
            "centroid+cpt1 - random+cpt8: -0.0150 [-0.0260, -0.0040] (-18.0%); 1 vs 1 seeds (1 common), 943 users")
    rows = pw.split_comparisons("centroid + 1-4 CPT ~ random + 6-10", "qualitative", ours, "not reproduced")
    assert [r[0].split(": ")[1] for r in rows] == ["centroid+cpt1 - random+cpt2", "centroid+cpt1 - random+cpt8"]
    assert [r[3] for r in rows] == ["inconclusive", "below 0"]
    a, b = (pw.analyse(*r, 943) for r in rows)
    assert a["effect"] is None and abs(a["mde_users"] - (1.959964 + 0.841621) * 0.022 / 2 / 1.959964) < 1e-6
    assert abs(b["ours"] + 0.015) < 1e-12
    assert "the paper gives no size" in pw.report([a], 943, 22363)[2]
    assert pw.split_comparisons("c", "p", "+0.0060 [-0.0035, +0.0159] (+8.9%)", "v") == \
        [("c", "p", "+0.0060 [-0.0035, +0.0159] (+8.9%)", "v")]
