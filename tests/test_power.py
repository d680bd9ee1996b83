"""scripts/power.py: the MDE formula on constructed data, and the claims table it reads."""
import numpy as np
import pytest

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
    assert "underpowered (MDE 0.0218-0.0225 > 0.0044)" in line          # the rule's, above both 0.0139 and 0.0201
    assert "9,430-11,002 users and 30-35 seed pairs together" in line     # not 9,441 users or 20 pairs


def test_the_verdict_rule_is_weaker_than_either_interval():
    """Both intervals must lie above 0: where the two MDEs are equal each interval alone clears 0 in ~80% of studies,
    the rule less often than either; the rule's MDE is above both single MDEs."""
    se_s = 0.005
    effect = pw.mde(se_s, 2)                                            # the seeds' MDE over 3 pairs ...
    se_u = effect / (pw.Z975 + pw.Z80)                                  # ... is also the users' MDE
    assert abs(pw.mde(se_u) - effect) < 1e-12
    for shared in (True, False):
        users, seeds, both = pw.joint_power(effect, se_u, se_s, 3, shared)
        assert both < min(users, seeds) - 0.02 and both < 0.8, (shared, users, seeds, both)
        assert pw.joint_mde(se_u, se_s, 3, shared) > effect
    assert pw.joint_mde(se_u, se_s, 3, False) > pw.joint_mde(se_u, se_s, 3, True)    # the noises adding: wider
    users, n = pw.together(effect, se_u, se_s, 3, 943, True)
    assert n > 3 and users == np.ceil(943 * n / 3)
    assert pw.joint_power(effect, se_u * np.sqrt(3 / n), se_s * np.sqrt(3 / n), n, True)[2] >= 0.8


@pytest.mark.parametrize("shared", [True, False])
def test_joint_power_matches_studies_simulated_user_by_user(shared):
    """The model behind joint_power against whole simulated studies (users x seeds, the users' normal interval and
    the seeds' t interval on the same data): shared = per-user run noise only (both intervals see it); apart = a
    user effect common to every seed plus a shift per seed (each interval sees one)."""
    g, n_users, k, effect, studies = np.random.default_rng(1), 200, 3, 0.03, 3000
    hits = []
    for _ in range(studies):
        if shared:
            x = effect + g.normal(0, 0.5, (n_users, k))                    # per user and seed
        else:
            x = effect + g.normal(0, 0.3, (n_users, 1)) + g.normal(0, 0.02, (1, k))
        z, d = x.mean(1), x.mean(0)
        users = z.mean() - 1.96 * z.std(ddof=1) / np.sqrt(n_users) > 0
        seeds = d.mean() - 4.303 * d.std(ddof=1) / np.sqrt(k) > 0
        hits.append((users, seeds, users and seeds))
    se_u, se_s = (0.5 / np.sqrt(k * n_users), 0.5 / np.sqrt(k * n_users)) if shared else \
        (0.3 / np.sqrt(n_users), 0.02 / np.sqrt(k))
    model = pw.joint_power(effect, se_u, se_s, k, shared)
    assert np.allclose(np.mean(hits, 0), model, atol=0.03), (np.mean(hits, 0), model)


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
