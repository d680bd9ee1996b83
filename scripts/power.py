"""What each verdict could have detected: the minimum detectable effect (MDE) of every paired claim in
results/<dataset>.md, beside the paper's effect.

For a paired difference with standard error SE, a two-sided test at level alpha detects a true effect
with probability `power` when the effect is at least
    MDE = (q_{1 - alpha/2} + q_{power}) * SE            (q: normal, or Student t with df = pairs - 1)
SE comes from the study's own 95% intervals: SE = half-width / 1.96 for the users' paired bootstrap
(943 users, the seeds pooled per user), SE = half-width / t_{0.975, k-1} for the t interval over k
seed pairs. A verdict needs both intervals above 0, so the larger of the two MDEs is only a lower
bound: the rule's own MDE is simulated (joint_power), as a range over how much of the two noises is
one (shared: the per-user run noise both intervals see; apart: they add). An "inconclusive" verdict
is then "underpowered" (the rule's MDE > the paper's effect), "no effect of the paper's size" (<= it,
and the interval covers 0) or "borderline"; what would settle it grows users AND seed pairs together.
The paper's relative effects (+6.5% ...) are turned into absolute ones with the baseline the study
measured (ours / our relative difference).

    python scripts/power.py                      # reads results/ml-100k.md, writes results/ml-100k_power.md
"""
import argparse
import math
import os
import re
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Z975, Z80 = 1.959964, 0.841621
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
T80 = {1: 1.376, 2: 1.061, 3: 0.978, 4: 0.941, 5: 0.920, 6: 0.906, 7: 0.896, 8: 0.889, 9: 0.883}
DRAWS = 20000          # simulated studies per power (its standard error ~0.003 at 80%)
NUM = r"([+-]?\d+(?:\.\d+)?)"
INTERVAL = NUM + r" \[" + NUM + ", " + NUM + r"\]"


def t_quantile(q: float, df: int) -> float:
    """Student t quantile (q = 0.975 or 0.80): the table up to df 9, then the Cornish-Fisher term."""
    table, z = (T975, Z975) if q == 0.975 else (T80, Z80)
    return table[df] if df in table else z + (z ** 3 + z) / (4 * df)


def mde(se: float, df: int = 0) -> float:
    """Minimum detectable effect at 80% power, 5% two-sided; df = 0: normal quantiles."""
    return (t_quantile(0.975, df) + t_quantile(0.80, df)) * se if df else (Z975 + Z80) * se


def se_of(lo: float, hi: float, df: int = 0) -> float:
    """Standard error behind a 95% interval [lo, hi] (normal, or t with df)."""
    return (hi - lo) / 2 / (t_quantile(0.975, df) if df else Z975)


def pairs_needed(se_k: float, k: int, effect: float, most: int = 1000) -> int:
    """Seed pairs whose t-interval MDE reaches `effect`, at the per-pair spread seen with k pairs."""
    sd = se_k * math.sqrt(k)
    for n in range(2, most):
        if mde(sd / math.sqrt(n), n - 1) <= effect:
            return n
    return most


def joint_power(effect: float, se_u: float, se_s: float, k: int, shared: bool, draws: int = DRAWS, seed: int = 0):
    """Power of the verdict rule (the users' 95% interval AND the t interval over k seed pairs above 0) in simulated
    studies. Both intervals are centred on one estimate, the mean of the pairs' differences d_s = effect + c + e_s:
    e_s ~ N(0, k se_s^2) is the runs' noise (the t interval's width comes from the d_s), c the users' noise, one draw
    for every pair (the bootstrap's half-width: Z975 se_u). shared=False: c ~ N(0, se_u^2), the two add (per-user run
    noise, which both intervals see, counted twice: pessimistic); shared=True: c ~ N(0, max(0, se_u^2 - se_s^2)),
    the runs' noise is inside the users' (optimistic). -> (power of the users' interval, the seeds', both)."""
    g = np.random.default_rng(seed)
    c2 = se_u ** 2 - (min(se_u, se_s) ** 2 if shared else 0.0)
    est = effect + g.standard_normal(draws) * math.sqrt(c2 + se_s ** 2)
    se_hat = se_s * np.sqrt(g.chisquare(k - 1, draws) / (k - 1))           # the t interval's own SE estimate
    users, seeds = est > Z975 * se_u, est > t_quantile(0.975, k - 1) * se_hat
    return float(users.mean()), float(seeds.mean()), float((users & seeds).mean())


def joint_mde(se_u: float, se_s: float, k: int, shared: bool) -> float:
    """The smallest effect the verdict rule detects in 80% of simulated studies (bisection; the same simulated
    studies at every effect, so the power rises with it)."""
    lo, hi = 0.0, 10 * (se_u + se_s) * t_quantile(0.975, k - 1)
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if joint_power(mid, se_u, se_s, k, shared)[2] >= 0.8 else (mid, hi)
    return hi


def together(effect: float, se_u: float, se_s: float, k: int, users: int, shared: bool, most: int = 10000):
    """Users and seed pairs, grown by one factor n / k, at which the verdict rule detects `effect` in 80% of simulated
    studies: -> (users, n), or None past `most` pairs."""
    power = lambda n: joint_power(effect, se_u * math.sqrt(k / n), se_s * math.sqrt(k / n), n, shared)[2]  # noqa: E731
    if power(most) < 0.8:
        return None
    lo, hi = 1, most
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if power(mid) >= 0.8 else (mid, hi)
    return math.ceil(users * hi / k), hi


def parse_claims(text: str):
    """The rows of the '## The papers' claims' table: (claim, paper, ours, verdict)."""
    body = text.split("## The papers' claims", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in body.splitlines()
            if line.startswith("| ") and not line.startswith("| claim") and "---" not in line]
    return [r[:4] for r in rows if len(r) >= 4]


def split_comparisons(claim, paper, ours, verdict):
    """A CPT row holds two paired comparisons ("a - b: <interval ...>; a - c: <interval ...>"): one
    row each, its verdict read from its own interval(s); any other row is returned as it is."""
    parts = re.findall(r"(\S+ - \S+): (.*?)(?=; \S+ - \S+: |$)", ours)
    if not parts:
        return [(claim, paper, ours, verdict)]
    out = []
    for name, text in parts:
        ivs = [(float(lo), float(hi)) for lo, hi in re.findall(r"\[" + NUM + ", " + NUM + r"\]", text)]
        sides = {"above 0" if lo > 0 else "below 0" if hi < 0 else "covers 0" for lo, hi in ivs}
        v = sides.pop() if sides in ({"above 0"}, {"below 0"}) else "inconclusive"
        out.append((f"{claim}: {name}", paper, text, v))
    return out


def analyse(claim, paper, ours, verdict, users: int):
    """One claim -> a dict, or None when the claim has no paired number (geometry, not tested)."""
    rel = re.search(r"([+-]?\d+(?:\.\d+)?)%", paper)
    m_users = re.match(INTERVAL + r" \(([+-]?\d+(?:\.\d+)?)%\)", ours)
    m_seeds = re.search(r"per seed pair " + INTERVAL + r" \(t 95%, (\d+) pairs", ours)
    m_steps = re.match(INTERVAL + r" steps fewer \(.*? of random's (\d+)\).*over (\d+) seed pairs", ours)
    effect_rel = abs(float(rel.group(1))) / 100 if rel else None     # None: the paper gives no size
    m_users = m_users or re.match(INTERVAL + r"()", ours)               # no relative: baseline 0
    if m_steps:                                        # steps to a validation loss: seeds only
        d, lo, hi, base, k = (float(x) for x in m_steps.groups())
        effect_rel = effect_rel or float("nan")
        effect, se_s, k = effect_rel * base, se_of(lo, hi, int(k) - 1), int(k)
        return {"claim": claim, "ours": d, "effect": effect, "unit": "steps", "mde_users": None,
                "mde_seeds": mde(se_s, k - 1), "k": k, "se_s": se_s, "verdict": verdict}
    if not m_users:
        return None
    d, lo, hi = (float(x) for x in m_users.groups()[:3])
    ours_rel = float(m_users.group(4)) if m_users.group(4) else 0.0
    base = abs(d / (ours_rel / 100)) if ours_rel else 0.0
    effect = None if effect_rel is None else effect_rel * base
    out = {"claim": claim, "ours": d, "effect": effect, "unit": "", "verdict": verdict, "se_u": se_of(lo, hi),
           "mde_users": mde(se_of(lo, hi)), "mde_seeds": None, "k": 0}
    if m_seeds:
        s_lo, s_hi, k = float(m_seeds.group(2)), float(m_seeds.group(3)), int(m_seeds.group(4))
        out.update(k=k, se_s=se_of(s_lo, s_hi, k - 1), mde_seeds=mde(se_of(s_lo, s_hi, k - 1), k - 1))
    return out


def rule_mde(r):
    """The verdict rule's MDE, (shared, apart) as in joint_power where both intervals exist, else the one's."""
    if r["mde_users"] is not None and r["mde_seeds"] is not None:
        return tuple(joint_mde(r["se_u"], r["se_s"], r["k"], shared) for shared in (True, False))
    one = r["mde_users"] if r["mde_seeds"] is None else r["mde_seeds"]
    return one, one


def report(rows, users: int, beauty_users: int):
    lines = ["| claim | paper's effect | ours | MDE, users | MDE, seed pairs | MDE, the verdict's rule | verdict "
             "| what it means | to reach MDE = effect | Beauty's users: MDE |", "|---" * 10 + "|"]
    span = lambda a, b: a if a == b else f"{a}-{b}"  # noqa: E731
    for r in rows:
        e, f = r["effect"], (lambda v: "-" if v is None else f"{v:.4f}" if not r["unit"] else f"{v:.0f}")
        lo, hi = rule_mde(r)
        rule, sized = span(f(lo), f(hi)), e is not None and e > 0
        if r["verdict"] != "inconclusive":
            meaning = r["verdict"]
        elif e is None:
            meaning = f"the paper gives no size; MDE {rule}"
        elif not sized:
            meaning = "our baseline is 0, so the paper's relative effect has no size here"
        elif lo > e:
            meaning = f"underpowered (MDE {rule} > {f(e)})"
        elif hi <= e:
            meaning = f"no effect of the paper's size (MDE {rule} <= {f(e)}, interval covers 0)"
        else:
            meaning = f"borderline (MDE {rule} around {f(e)})"
        need = "-"                                                    # what would have settled it
        if sized and r["verdict"] == "inconclusive" and r["mde_users"] is not None and r["mde_seeds"] is not None:
            t = [together(e, r["se_u"], r["se_s"], r["k"], users, shared) for shared in (True, False)]
            need = "over 10,000 seed pairs" if None in t else \
                f"{span(f'{t[0][0]:,}', f'{t[1][0]:,}')} users and {span(t[0][1], t[1][1])} seed pairs together"
        elif sized and r["verdict"] == "inconclusive":
            need = f"{pairs_needed(r['se_s'], r['k'], e)} seed pairs" if r["mde_users"] is None else \
                f"{math.ceil(users * (r['mde_users'] / e) ** 2):,} users (one seed pair: the users' interval only)"
        beauty = "-" if r["mde_users"] is None else f(r["mde_users"] * math.sqrt(users / beauty_users))
        ours = f"{r['ours']:+.0f}" if r["unit"] else f"{r['ours']:+.4f}"
        lines.append(f"| {r['claim']} | {f(e)} | {ours} | {f(r['mde_users'])} | {f(r['mde_seeds'])} ({r['k']} pairs) "
                     f"| {rule} | {r['verdict']} | {meaning} | {need} | {beauty} |")
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="ml-100k")
    p.add_argument("--users", type=int, default=943, help="users behind the bootstrap intervals")
    p.add_argument("--beauty-users", type=int, default=22363, help="Amazon Beauty 5-core's users")
    p.add_argument("--results-dir", default="results", help="study.py's --results-dir")
    a = p.parse_args()
    src = os.path.join(REPO, a.results_dir, f"{a.dataset}.md")
    if not os.path.exists(src):
        sys.exit(f"error: {src} not found; run `make study-report` first")
    rows = [r for r in (analyse(*c, a.users) for row in parse_claims(open(src).read())
                        for c in split_comparisons(*row)) if r]
    if not rows:
        sys.exit(f"error: {src} has no paired claim with the paper's effect; is it study.py's report?")
    text = [f"# What each verdict could have detected ({a.dataset})", "",
            f"Written by `python scripts/power.py --dataset {a.dataset}"
            f"{'' if a.results_dir == 'results' else ' --results-dir ' + a.results_dir}` from the intervals in "
            f"[{a.dataset}.md]({a.dataset}.md). MDE = minimum detectable effect at 80% power, 5% two-sided: "
            "(q_0.975 + q_0.80) x SE, SE read back from each 95% interval (users: normal; seed pairs: t "
            "with pairs - 1 df). The verdict needs both intervals above 0, so the larger of the two MDEs "
            "is only a lower bound: the rule's MDE is simulated (20,000 studies sharing one estimate, the "
            "users' noise common to every seed pair), from the runs' noise inside the users' (the per-user "
            "run noise both intervals see) to the two adding up. To reach MDE = effect: users and seed "
            "pairs grown together by one factor (the same per-user and per-pair variance); more of one "
            "alone leaves the other interval too wide. The paper's relative effect is made absolute with our "
            "baseline. Beauty's users: the users' MDE at 22,363 users, the same per-user variance assumed "
            "(a rough guide: Beauty's hit rates, and so its variance, are lower).", "",
            *report(rows, a.users, a.beauty_users), ""]
    dst = os.path.join(REPO, a.results_dir, f"{a.dataset}_power.md")
    tmp = dst + ".tmp"
    open(tmp, "w").write("\n".join(text))
    os.replace(tmp, dst)
    print("\n".join(text))


if __name__ == "__main__":
    main()
