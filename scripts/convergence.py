"""Train to the peak: 05 until validation NDCG@10 has not improved for 2 evaluations (at most
--epochs, rounded down to whole --eval-every blocks), the checkpoint of highest validation NDCG@10
kept, then 06 on its test split.

How: 05 runs to the cap with --keep-checkpoints (the model of every validation in <save>.checkpoints/);
06 --split valid ranks them in step order and the patience rule is applied to that curve, so the
checkpoints after the stop are never ranked. 05's schedule depends on the cap only, so the model at each
step is the one a run stopped there would have had; the record's `seconds` is then 05's whole run.

Runs (KINDS; each one resumable piece: a killed 05 continues with --resume at the next call, a killed ranking
with the next checkpoint, <save>.ranks.json):
    ceiling            centroid + GTI (make run's chain), seed 0: how good the LLM gets on ML-100K
    random-sN          random init,   seeds --seeds: steps to peak per init (05's level softmax)
    centroid-sN        centroid init, seeds --seeds   (no grounding: the centroid paper's comparison)
    mean-full-sN       the GTI paper's baseline (mean init) under the papers' vocabulary softmax
    mean+gti-full-sN   04's light grounding (120 steps x 8 pairs) on mean init, then the same SFT
    mean+aux-full-sN   mean init + LC-Rec's auxiliary text <-> SID rows in 05 (05's default mix by tokens)
    mean+gti2-full-sN  GTI as the paper runs it, in proportion: 04 grounds the rows until held-out accuracy
                       stops rising, then unfreezes every parameter for as many passes (two-stage GTI)
03's folders and the grounded ones are built once (seed 0): a run's seed sets 05's example order and validation
users, not its init rows.

    python scripts/convergence.py --dry-run           # the plan and its CPU-time estimate
    python scripts/convergence.py --runs ceiling      # one piece (1-2.5 h on 2 CPU cores at 3 epochs)
    python scripts/convergence.py --inits mean-full,mean+gti-full --seeds 0,1 --dry-run
    python scripts/convergence.py --report-only       # table + figure from the finished runs

Needs `make run` (out/ml-100k: dataset.pt, item_emb.npy, 02's outputs, sasrec/). Every run trains on one
pinned tokenizer: 02 learns other codes on another CPU from the same item vectors, so the first run copies
make run's 02 outputs (sids.npy, centroids.pt, rqvae.pt) into results/convergence/tokenizer/, committed, and
every run on any machine rebuilds 03 (and 04 for the ceiling) from those files in out/ml-100k/convergence/base/;
SASRec's test metrics and lists, the report's reference, are pinned alike in results/convergence/sasrec/.
A seed pair made in two sessions then differs by its init and seed, not by its SIDs. Model selection reads
only the validation item (06 --split valid on 05's checkpoints); the test split is scored once per run,
on the chosen checkpoint. A finished run leaves a small record in results/convergence/ (<run>.json: 05's
curves, steps and times, the test metrics, sha256 of its SIDs; <run>_test_topk.npy: each user's ranked
test list; <run>_rows.npz: the SID rows, fp16, at every validation up to the stop: step 0 = init),
committed with its numbers: the report is built from the records, so runs made on different
machines or days add up, and out/ can be deleted once a run's record is written. A record made on other
SIDs than the pinned ones is reported with a caveat and rerun by the next call that names it. A record keeps the CPU
it was made on, and the report names a seed whose init rows (step 0 of its _rows.npz) differ from its kind's first
seed's: 03's folders rebuild bit-identical on another CPU, 04's bf16 grounding does not. On a GPU box 04-06 pick
CUDA (their --device auto) and the record's `device` says so (05's device and autocast).
Two runs can share 2 cores, each at OMP_NUM_THREADS=1 (about 1.2x the throughput of one on both).
Writes results/ml-100k_convergence.md (the table; each run - SASRec and centroid - random at the peak, paired
bootstrap over users; the efficiency claim read two ways, paired by seed; the GTI claims at the peak, each only
where its baseline beats most-popular) and results/ml-100k_convergence.png (validation NDCG@10 against epochs,
SASRec and most-popular as lines; the vocabulary-softmax runs in a second panel). The geometry claims at each run's
peak, from the _rows.npz records: python scripts/peak_geometry.py.
"""
import argparse
import json
import os
import platform
import shutil
import sys
import time

import numpy as np
import torch

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from levers import sh  # noqa: E402  (study.py's runner, each step's log in a folder)
from common import atomic_write, load_artifact, load_json, load_npy  # noqa: E402
from study import (BACKBONE, REPO, T975, beats_popular, censored_verdict, ev, fmt_iv, joint_verdict,  # noqa: E402
                   link_artifacts, paired_ivs, seed_diffs, sha, sid_rows)  # (ev = 06's metrics)
from power import mde, pairs_needed  # noqa: E402
OUT = "out/ml-100k"
TOKENIZER = "results/convergence/tokenizer"  # 02's outputs every run trains on, committed
TOKENIZER_FILES = ("sids.npy", "centroids.pt", "rqvae.pt", "02_rqvae.json")
SASREC = "results/convergence/sasrec"  # the reference's test metrics and lists (make run's SASRec), committed
BASE = f"{OUT}/convergence/base"        # 01's files + the pinned 02 files -> 03 (and 04) rebuilt here
RECORDS = "results/convergence"       # one finished run = <run>.json + <run>_test_topk.npy, committed
S_PER_STEP, S_PER_RANK = 3.0, 200.0   # this 2-core VM: 05 s/step, one 06 --split valid (943 users)
STEPS_PER_EPOCH = 660                  # ML-100K: 5,299 windows / 8 a step = 662 (05 prints the epochs)
PATIENCE = 2                           # a run stops after this many validations without a better NDCG@10


# kind: (the folder in BASE 05 starts from, 05's flags beyond the schedule). Run name: <kind>-s<seed>.
KINDS = {
    "ceiling": ("centroid+gti", []),
    "random": ("random", []),
    "centroid": ("centroid", []),
    "mean-full": ("mean", ["--softmax", "full"]),
    "mean+gti-full": ("mean+gti", ["--softmax", "full"]),
    "mean+aux-full": ("mean", ["--softmax", "full", "--aux-tasks"]),
    "mean+gti2-full": ("mean+gti2", ["--softmax", "full"]),
}
GROUND = {"centroid+gti": ("centroid", ["--steps", "120"]),    # 04's default light GTI, as make run
          "mean+gti": ("mean", ["--steps", "120"])}
GTI2_EPOCHS, GTI2_PLATEAU = 30, 2     # two-stage GTI: at most 30 passes of grounding, stop after 2 without a rise
EXAMPLES_PER_WINDOW = {"--aux-tasks": 39880 / 5299}   # 05 --aux-tasks (1:1 target tokens): rows per window, ML-100K


def runs_of(a):
    """{run name: (kind, seed)} for --inits x --seeds; the ceiling runs seed 0 only."""
    runs = {}
    for kind in a.inits.split(","):
        if kind not in KINDS:
            sys.exit(f"error: unknown kind {kind!r} in --inits; choose from {','.join(KINDS)}")
        runs.update({"ceiling": (kind, 0)} if kind == "ceiling" else
                    {f"{kind}-s{s}": (kind, int(s)) for s in a.seeds.split(",")})
    return runs


def schedule(a, flags=()):
    """(05's steps, its --eval-every): --epochs rounded down to whole validation blocks, so the last step is a
    validation step. A run with auxiliary rows validates and stops after as many recommendation windows as the
    others: both scaled by its rows per window."""
    scale = max([1.0] + [EXAMPLES_PER_WINDOW[f] for f in flags if f in EXAMPLES_PER_WINDOW])
    every = round(a.eval_every * scale)
    return max(1, int(a.epochs * STEPS_PER_EPOCH) // a.eval_every) * every, every


def record_path(name, ext=".json"):
    return f"{REPO}/{RECORDS}/{name}{ext}"


def pin(src, dst, files, hint):
    """Copy make run's `files` from src into the committed folder dst (both relative to the repository) once; the
    first file, copied last, marks a complete pin. A missing one is one line with `hint`. -> True when it copied."""
    if os.path.exists(f"{REPO}/{dst}/{files[0]}"):
        return False
    if missing := [f for f in files if not os.path.exists(f"{REPO}/{src}/{f}")]:
        sys.exit(f"error: {src}/{missing[0]} not found; {hint}")
    os.makedirs(f"{REPO}/{dst}", exist_ok=True)
    for f in files[::-1]:
        atomic_write(f"{REPO}/{dst}/{f}", lambda t, f=f: shutil.copyfile(f"{REPO}/{src}/{f}", t))
    return True


def pin_tokenizer():
    """The SIDs every run trains on: make run's 02 outputs, copied once into results/ (commit them).
    -> their sha256 prefix."""
    pinned = f"{REPO}/{TOKENIZER}"
    if pin(OUT, TOKENIZER, TOKENIZER_FILES, "run `make run` first"):
        print(f"pinned {OUT}'s 02 outputs in {TOKENIZER}/ (sids sha256 {sha(pinned + '/sids.npy')}): "
              "commit them", flush=True)
    return sha(f"{pinned}/sids.npy")


def pin_sasrec():
    """SASRec's test metrics and ranked test lists, the report's reference: make run's, copied once into
    results/convergence/sasrec/ (commit them), so the report rebuilds from results/ alone (a retrain on another CPU
    differs in the 4th digit). -> (its eval_test.json, the path of its lists)."""
    if pin(f"{OUT}/sasrec", SASREC, ("eval_test.json", "eval_test_topk_exclude.npy"),
           f"run `python baselines/sasrec.py --out-dir {OUT}`"):
        print(f"pinned {OUT}/sasrec's test files in {SASREC}/: commit them", flush=True)
    return (load_json(f"{REPO}/{SASREC}/eval_test.json", f"delete {SASREC} and rerun"),
            f"{REPO}/{SASREC}/eval_test_topk_exclude.npy")


def stage_base(pinned_sha):
    """out/ml-100k/convergence/base's inputs: 01's files linked from make run, the pinned 02 files (sha256 prefix
    pinned_sha) copied. -> True when they were (re)copied (the first call, or the pin changed)."""
    base, pinned = f"{REPO}/{BASE}", f"{REPO}/{TOKENIZER}"
    link_artifacts(f"{REPO}/{OUT}", base, ("dataset.pt", "item_emb.npy", "01_embed_items.json"))
    stale = not os.path.exists(f"{base}/sids.npy") or sha(f"{base}/sids.npy") != pinned_sha
    if stale:
        for f in TOKENIZER_FILES:
            atomic_write(f"{base}/{f}", lambda t, f=f: shutil.copyfile(f"{pinned}/{f}", t))
    return stale


def build_base(init, pinned_sha):
    """out/ml-100k/convergence/base: stage_base, and the run's input model rebuilt on the pinned SIDs (03 for
    random/centroid; + 04's 120 grounding steps for the ceiling)."""
    base = f"{REPO}/{BASE}"
    if stage_base(pinned_sha):                                  # models built on other SIDs go
        shutil.rmtree(f"{base}/models", ignore_errors=True)
    log = f"{base}/logs"
    if not os.path.exists(f"{base}/models/random/sid_vocab.json"):
        sh(["03_expand_vocab.py", "--out-dir", BASE, "--model", BACKBONE, "--init", "all"], log)
    if init in GROUND and not os.path.exists(f"{base}/models/{init}/sid_vocab.json"):
        src, flags = GROUND[init]
        sh(["04_ground.py", "--out-dir", BASE, "--model", f"{BASE}/models/{src}", "--save", f"{BASE}/models/{init}",
            *flags], log)
    if init == "mean+gti2" and not os.path.exists(f"{base}/models/{init}/sid_vocab.json"):
        rows = f"{BASE}/models/mean+gti2-rows"          # stage 1: the new rows, until held-out accuracy stalls
        if not os.path.exists(f"{REPO}/{rows}/04_ground.json"):      # a killed piece resumes at its last epoch
            resume = ["--resume"] if os.path.exists(f"{REPO}/{rows}.resume.pt") else []
            sh(["04_ground.py", "--out-dir", BASE, "--model", f"{BASE}/models/mean", "--save", rows,
                "--epochs", str(GTI2_EPOCHS), "--plateau", str(GTI2_PLATEAU), *resume], log)
        passes = load_json(f"{REPO}/{rows}/04_ground.json", f"delete {rows} and rerun")["epochs_done"]
        resume = ["--resume"] if os.path.exists(f"{base}/models/{init}.resume.pt") else []
        sh(["04_ground.py", "--out-dir", BASE, "--model", rows, "--train", "all", "--epochs", str(passes),
            "--save", f"{BASE}/models/{init}", *resume], log)           # stage 2: every parameter, as many passes
        for e in range(1, passes):                                      # 04 kept every epoch's folder
            shutil.rmtree(f"{REPO}/{rows}+cpt{e}", ignore_errors=True)


def stop_early(curve, total, patience=PATIENCE):
    """The patience rule on a validation curve [[step, Recall@10, NDCG@10], ...] in step order: the best
    checkpoint is the first of highest NDCG@10; `patience` validations after it without a better one (before
    the last step) stop the run there. -> (best step, the step the run stopped at: `total` if it ran out)."""
    best = 0
    for i, (step, _, ndcg) in enumerate(curve):
        if ndcg > curve[best][2]:
            best = i
        if i - best >= patience and step < total:
            return curve[best][0], step
    return curve[best][0], total


def rank_checkpoints(a, save, log):
    """06 --split valid (history excluded, beam 20, the first --rank-users users: the test item is not read) on
    each model 05 kept, in step order, until the patience rule stops the run. Each result goes into
    <save>.ranks.json as it comes. -> {rank_curve, best_step, stopped_at, rank_seconds}."""
    steps = sorted(int(d[5:]) for d in os.listdir(f"{REPO}/{save}.checkpoints") if d.startswith("step_"))
    total = load_json(f"{REPO}/{save}/05_sft.json", f"delete {save} and rerun")["steps"]
    path = f"{REPO}/{save}.ranks.json"
    done = load_json(path, "delete it and rerun") if os.path.exists(path) else {}   # step -> [R@10, NDCG@10, s]
    curve = []
    for step in steps:
        if str(step) not in done:
            t, ck = time.time(), f"{save}.checkpoints/step_{step}"
            sh(["06_eval.py", "--out-dir", BASE, "--model", ck, "--split", "valid", "--protocol", "excluded",
                "--beam", "20", "--users", str(a.rank_users)], log)
            m = load_json(f"{REPO}/{ck}/eval_valid.json", "rerun: 06 ranks it again")["model"]
            done[str(step)] = [round(m["recall@10"], 5), round(m["ndcg@10"], 5), time.time() - t]
            atomic_write(path, lambda p: open(p, "w").write(json.dumps(done)))
        curve.append([step, *done[str(step)][:2]])
        best, stopped = stop_early(curve, total)
        if stopped < total:
            break
    return {"rank_curve": curve, "best_step": best, "stopped_at": stopped,
            "rank_seconds": round(sum(done[str(s)][2] for s, _, _ in curve), 1)}


def write_record(name, kind, seed, run_dir, best_dir, ranked):
    """Keep what the reports need from a finished run (a few kB + one (users, 20) int32 array + the SID rows): 05's
    counts and seconds from run_dir, the test metrics and lists of the chosen checkpoint best_dir, the ranking
    (rank_checkpoints), and the SID rows of every ranked checkpoint (step 0 = the init) when they are there."""
    j = load_json(f"{run_dir}/05_sft.json", "rerun this run")
    t = load_json(f"{best_dir}/eval_test.json", "rerun this run")
    topk = load_npy(f"{best_dir}/eval_test_topk.npy", "rerun this run").astype(np.int32)
    rec = {"run": name, "kind": kind, "init": KINDS[kind][0], "flags": KINDS[kind][1], "seed": seed,
           "sids_sha256": sha(f"{REPO}/{TOKENIZER}/sids.npy"), "test": t["model"],
           "steps_per_epoch": (j["examples"] + j["aux_examples"]) / (j["batch_size"] * j["grad_accum"]),
           "best_step": ranked["best_step"], "stopped_at": ranked["stopped_at"],
           "rank_curve": ranked["rank_curve"], "seconds": j["seconds"], "rank_seconds": ranked["rank_seconds"],
           "cpu": cpu_name(), "device": f"{j['device']}, {j['autocast']}"}     # 05's: cpu or cuda, bf16 or fp32
    os.makedirs(f"{REPO}/{RECORDS}", exist_ok=True)
    cks = [f"{run_dir}.checkpoints/step_{s}" for s, _, _ in ranked["rank_curve"]]
    if all(os.path.exists(f"{c}/sid_vocab.json") for c in cks):      # ~0.2 MB a checkpoint (194 rows x 576)
        rows = [sid_rows(c) for c in cks]
        arrays = {p: np.stack([r[p] for r, _ in rows]) for p in rows[0][0]}
        atomic_write(record_path(name, "_rows.npz"), lambda p: np.savez_compressed(
            open(p, "wb"), steps=np.array([s for s, _, _ in ranked["rank_curve"]]), token_ids=rows[0][1], **arrays))
        rec["rows"] = f"{name}_rows.npz"
    atomic_write(record_path(name, "_test_topk.npy"), lambda p: np.save(open(p, "wb"), topk))
    atomic_write(record_path(name), lambda p: open(p, "w").write(json.dumps(rec, indent=1) + "\n"))


def cpu_name():
    """The CPU a record was made on (bf16 kernels differ between CPUs, so 04's grounded rows do too)."""
    try:
        return next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def init_notes(recs):
    """Every seed of a kind should start from the same init rows (03's and 04's folders are built once): a run whose
    step-0 SID rows (its _rows.npz) differ from the kind's lowest seed's is named, with how far and on which CPUs.
    03's folders rebuild bit-identical on another CPU; 04's grounding (bf16 autocast, 120 steps at lr 1e-2) does not.
    -> markdown lines."""
    first, lines = {}, []
    for name, (j, _) in sorted(recs.items(), key=lambda kv: kv[1][0]["seed"]):
        if not j.get("rows"):
            continue
        path = record_path(j["rows"], "")
        rows = load_artifact(path, f"delete {RECORDS}/{name}* and rerun", lambda p: np.load(p)["input"][0])
        k = kind_of(j)
        if k not in first:
            first[k] = (j, rows)
            continue
        j0, rows0 = first[k]
        if not np.array_equal(rows, rows0):                    # False too where the shapes differ (other SIDs)
            gap = np.abs(rows.astype(np.float32) - rows0.astype(np.float32)).max() if rows.shape == rows0.shape else np.inf
            cpus = f"{j0.get('cpu', 'CPU not recorded')} vs {j.get('cpu', 'CPU not recorded')}"
            lines.append(f"- {name} starts from other init rows than {j0['run']} (max |difference| {gap:.3f} over the "
                         f"SID rows; {cpus}): its seed pairs differ by the init build too, not only by the seed.")
    return lines


def read_record(name, n_users):
    """The run's record and its ranked test lists, or None when the run has not finished."""
    if not os.path.exists(record_path(name)):
        return None
    redo = f"delete {RECORDS}/{name}* and rerun `python scripts/convergence.py --runs {name}`"
    rec, topk = load_json(record_path(name), redo), load_npy(record_path(name, "_test_topk.npy"), redo)
    if topk.shape[0] != n_users:
        sys.exit(f"error: {RECORDS}/{name}_test_topk.npy has {topk.shape[0]} users, dataset.pt {n_users}; {redo}")
    return rec, topk.astype(np.int64)


def run_one(a, name, kind, seed):
    init, flags = KINDS[kind]
    pinned = pin_tokenizer()
    if os.path.exists(record_path(name)):
        old = load_json(record_path(name), f"delete {RECORDS}/{name}* and rerun").get("sids_sha256", "not recorded")
        if old == pinned:
            return                                       # finished here or on another machine
        print(f"{RECORDS}/{name}.json trained on other SIDs ({old}, pinned {pinned}): rerunning", flush=True)
    build_base(init, pinned)
    save = f"{OUT}/convergence/{name}"
    log = f"{REPO}/{save}.logs"
    if not os.path.exists(f"{REPO}/{save}/05_sft.json"):           # 05 to the cap, every validation kept
        resume = ["--resume"] if os.path.exists(f"{REPO}/{save}.resume.pt") else []
        sh(["05_sft.py", "--out-dir", BASE, "--model", f"{BASE}/models/{init}", "--save", save,
            "--steps", str(schedule(a, flags)[0]), "--eval-every", str(schedule(a, flags)[1]), "--keep-checkpoints",
            "--seed", str(seed), *flags, *resume], log)
    ranked = rank_checkpoints(a, save, log)
    best = f"{save}.checkpoints/step_{ranked['best_step']}"
    if not os.path.exists(f"{REPO}/{best}/eval_test.json"):
        sh(["06_eval.py", "--out-dir", BASE, "--model", best, "--protocol", "excluded"], log)
    write_record(name, kind, seed, f"{REPO}/{save}", f"{REPO}/{best}", ranked)
    for d in os.listdir(f"{REPO}/{save}.checkpoints"):              # ~0.5 GB each; the record is written
        if d != f"step_{ranked['best_step']}":
            shutil.rmtree(f"{REPO}/{save}.checkpoints/{d}")


def seed_pairs(recs):
    """(seed, random's record, centroid's record) for every seed where both runs have finished."""
    for sd in sorted({j["seed"] for j, _ in recs.values() if j["init"] == "random"}):
        r, c = [recs.get(f"{i}-s{sd}", (None,))[0] for i in ("random", "centroid")]
        if r is not None and c is not None:
            yield sd, r, c


def steps_verdict(saved, to):
    """The claim's verdict from the seed pairs' step savings [(1 - centroid's steps / random's, the censored side)], a
    run that never got there counted at its cap: study.censored_verdict ("a": centroid's, a bound against the claim)."""
    m, lo, hi, v = censored_verdict(saved)
    iv = "one seed pair, no interval" if lo is None else f"95% t interval over seed pairs [{-hi:+.0%}, {-lo:+.0%}]"
    n = sum(1 for _, side in saved if side)
    return f"{v}: centroid {-m:+.0%} steps to {to} ({iv}{f'; {n} censored at the cap' if n else ''}; paper: -27%)"


def efficiency(recs):
    """The centroid paper's efficiency claim (peak performance with 27% fewer SFT steps), paired by seed:
    1 - centroid's best step / random's. A run whose best checkpoint is its last validation has not shown
    its peak (it may still rise): its steps to the peak are >= that step (censored), and its pair is kept as a bound,
    not dropped (that would favour the slower run); a pair where both are says nothing. -> (text lines, verdict)."""
    lines, saved = [], []
    for sd, r, c in seed_pairs(recs):
        same = r.get("sids_sha256") == c.get("sids_sha256")
        open_ = [i for i, j in (("random", r), ("centroid", c)) if j["best_step"] >= j["stopped_at"]]
        side = {(): "", ("centroid",): "a", ("random",): "b"}.get(tuple(open_), "both")
        pct = c["best_step"] / r["best_step"] - 1
        lines.append(f"seed {sd}: best step random {r['best_step']}, centroid {c['best_step']}" + {
            "": f": centroid {pct:+.0%} steps",
            "a": f" (centroid best at its last validation: peak not reached): centroid >= {pct:+.0%} steps, "
                 "counted against the claim",
            "b": f" (random best at its last validation: peak not reached): centroid <= {pct:+.0%} steps",
            "both": " (both best at their last validation: peak not reached, no information)"}[side]
                     + ("" if same else " (02's SIDs differ between the two runs' machines: the pair is"
                        " confounded with the tokenizer)"))
        if side != "both":
            saved.append((-pct, side))
    if not saved:
        return lines, "inconclusive: no seed pair where either run reached its peak"
    return lines, steps_verdict(saved, "its peak vs random")


def reach(recs):
    """The same claim read as the paper words it, defined also when centroid is still rising at the cap: the
    first validation at which centroid's NDCG@10 reaches random's best, against random's best step (same seed);
    a centroid that never reaches it counts at its last validation (censored: against the claim). One validation's
    NDCG@10 has a standard error of about 0.008 over 943 users (the runs' test lists), and the step is known to
    --eval-every. -> (text lines, verdict)."""
    lines, saved = [], []
    for sd, r, c in seed_pairs(recs):
        if not r.get("rank_curve") or not c.get("rank_curve"):
            continue
        peak, hit = first_reach(c, r)
        at = f"seed {sd}: random's best {peak:.4f} at step {r['best_step']}; centroid reaches it "
        step, side = (c["stopped_at"], "a") if hit is None else (hit, "")
        saved.append((1 - step / r["best_step"], side))
        lines.append(at + (f"at no validation up to step {step}: >= " if side else f"at step {hit}: ")
                     + f"{step / r['best_step'] - 1:+.0%} steps" + (", counted against the claim" if side else ""))
    if not saved:
        return lines, "inconclusive: no seed pair with both validation curves"
    return lines, steps_verdict(saved, "random's peak")


def paired(a, b):
    """Recall@10 and NDCG@10 of a - b, user by user: 06's paired bootstrap, study.py's format."""
    return ", ".join(f"{k} {fmt_iv(ev.paired_bootstrap(a[k], b[k]))}" for k in ("recall@10", "ndcg@10"))


def kind_of(rec):
    """A record's kind (records made before kinds existed name their init)."""
    return rec.get("kind") or ("ceiling" if rec["run"] == "ceiling" else rec["init"])


# The GTI paper's claims (docs/papers.md; Vibrent, relative to the baseline), read at each run's best checkpoint
# under the vocabulary softmax: claim, paper, a, b (kinds), metric, judged (False: shown beside, no verdict).
GTI_CLAIMS = [
    ("GTI vs mean: Recall@10", "+22.03%", "mean+gti-full", "mean-full", "recall@10", True),
    ("GTI vs mean: Recall@20", "+26.02%", "mean+gti-full", "mean-full", "recall@20", True),
    ("GTI vs mean: NDCG@10", "+8.0% (.0188 -> .0203)", "mean+gti-full", "mean-full", "ndcg@10", True),
    ("GTI vs mean: Recall@5", "+1.71%", "mean+gti-full", "mean-full", "recall@5", False),
    ("GTI vs mean: NDCG@5", "-5.19%", "mean+gti-full", "mean-full", "ndcg@5", False),
    ("LC-Rec aux tasks vs mean: Recall@10", "+11.7% (.0342 -> .0382)", "mean+aux-full", "mean-full", "recall@10",
     True),
    ("GTI vs LC-Rec aux tasks: Recall@10", "+9.2% (.0382 -> .0417)", "mean+gti-full", "mean+aux-full", "recall@10",
     True),
    ("two-stage GTI vs mean: Recall@20", "+26.02% (the paper's GTI)", "mean+gti2-full", "mean-full", "recall@20",
     True),
    ("two-stage GTI vs light GTI: Recall@10", "not in the paper", "mean+gti2-full", "mean+gti-full", "recall@10",
     True),
]


def baseline_trains(b_users, pop_users):
    """study.py's baseline rule (beats_popular) on a baseline's per-user test Recall@10. -> (bool, text)."""
    ok, d = beats_popular(b_users, pop_users)
    return ok, f"{b_users.mean():.4f} (most-popular {pop_users.mean():.4f}, {fmt_iv(d)})"


SPREAD_FROM = ("mean+gti-full", "mean-full")   # the GTI pairs whose seed spread a one-pair GTI claim borrows


def borrowed_interval(per_seed, metric, d):
    """A claim with one seed pair has no seed spread of its own: borrow the spread of SPREAD_FROM's seed-pair
    differences of the same metric (k >= 2 pairs, sd s). One pair's difference d then bounds the true difference by
    d +- t(k-1, 97.5%) x s (a new draw from that spread). -> ([d, lo, hi], text), or None before k >= 2."""
    if not all(per_seed.get(k) for k in SPREAD_FROM):
        return None
    diffs = seed_diffs(*study_form(per_seed, SPREAD_FROM).values(), "all", metric)
    if len(diffs) < 2:
        return None
    s = float(np.std(diffs, ddof=1))
    h = T975.get(len(diffs) - 1, 1.96) * s
    return [d, d - h, d + h], (f"; one seed pair, with {SPREAD_FROM[0]} - {SPREAD_FROM[1]}'s seed spread "
                               f"(sd {s:.4f}, {len(diffs)} pairs)")


def study_form(per_seed, kinds):
    """{kind: {seed: per-user metrics}} -> study.py's {kind: {"users_by_seed": {seed: {"all": metrics}}}}."""
    return {k: {"users_by_seed": {s: {"all": m} for s, m in per_seed[k].items()}} for k in kinds}


def gti_claim(per_seed, pop_users, a, b, metric, judged):
    """One GTI claim from {kind: {seed: per-user metrics}}: a - b over users (the seeds both ran, averaged per user;
    paired bootstrap) and over seed pairs (t interval; one pair: borrowed_interval). A verdict only where b beats
    most-popular on those seeds (all of b's before a has run); both intervals must agree. -> (ours, b's Recall@10, verdict)."""
    if not per_seed.get(b):
        return "not run", "-", "not run yet"
    common = sorted(set(per_seed.get(a, {})) & set(per_seed[b]))    # b's training read on the seeds compared
    trained, b_text = baseline_trains(np.mean([per_seed[b][s]["recall@10"] for s in common or per_seed[b]], 0),
                                      pop_users)
    if not per_seed.get(a):                                   # the baseline's training shown before a has run
        return "not run", b_text, "not run yet"
    if not common:
        return "no common seed", b_text, "not run yet"
    pu = study_form(per_seed, (a, b))
    d, iv, sd, _, y, _ = paired_ivs(pu, a, b, "all", metric)                   # pooled over the common seeds
    rel = f" ({100 * d[0] / y.mean():+.1f}%)" if y.mean() > 0 else ""
    ours = f"{fmt_iv(d)}{rel}, seeds {','.join(map(str, common))}" + (f"; per seed pair {fmt_iv(iv)}"
                                                                       if len(sd) > 1 else "")
    if not judged:
        return ours, b_text, "shown beside"
    if not trained:
        return ours, b_text, "not testable: the baseline did not train"
    pairs, borrowed = len(sd), len(sd) < 2 and borrowed_interval(per_seed, metric, d[0])
    if borrowed:                                              # judged on another pair's spread, said so
        (iv, text), pairs = borrowed, 2
        ours += f"{text} {fmt_iv(iv)}"
    v, overruled = joint_verdict(d, iv, pairs)
    return ours, b_text, v + (" (inside the seed spread)" if overruled else "")


def first_reach(r, other):
    """(other's best validation NDCG@10, the first validation step at which run r reaches it; None: never)."""
    best = max(n for _, _, n in other["rank_curve"])
    return best, next((s for s, _, n in r["rank_curve"] if n >= best), None)


def reach_other(a, b, ra, rb):
    """The first validation step at which each of two runs (names a, b; records ra, rb) reaches the other's best
    validation NDCG@10, as a line; a run that never does says so with the last step it ranked."""
    def first(r, other):
        s = first_reach(r, other)[1]
        return f"step {s}" if s is not None else f"no validation up to step {r['stopped_at']}"
    return (f"{a} reaches {b}'s best validation NDCG@10 at {first(ra, rb)} ({b}'s best step {rb['best_step']}); "
            f"{b} reaches {a}'s at {first(rb, ra)} ({a}'s best step {ra['best_step']})")


def gti_power(per_seed, planned=2, paper=0.2203):
    """What the GTI claims' seed interval can detect before their pairs exist: the spread over seed pairs of a
    difference at the peak, estimated from centroid - random (Recall@10, the seeds' per-user means); the t interval's
    MDE with `planned` pairs, and the pairs needed for the paper's Recall@10 gain (+22.03%) on mean-full's Recall@10.
    -> a markdown line, or None before two centroid/random seed pairs and mean-full exist. Once mean+gti-full and
    mean-full share >= 3 seeds, their own spread replaces centroid - random's."""
    gti = sorted(set(per_seed.get("mean+gti-full", {})) & set(per_seed.get("mean-full", {})))
    both = sorted(set(per_seed.get("centroid", {})) & set(per_seed.get("random", {})))
    own = len(gti) >= 3                                               # the GTI pairs' own spread
    if not own and (len(both) < 2 or not per_seed.get("mean-full")):
        return None
    d = seed_diffs(*study_form(per_seed, ("mean+gti-full", "mean-full") if own else ("centroid", "random")).values(),
                   "all", "recall@10")                              # over the seeds both ran
    k, sd = len(d), float(np.std(d, ddof=1))
    effect = paper * np.mean([m["recall@10"].mean() for m in per_seed["mean-full"].values()])
    if own:
        return (f"What the seed pairs can detect: mean+gti-full - mean-full's Recall@10 over its {k} seed pairs "
                f"({', '.join(f'{x:+.4f}' for x in d)}; sd {sd:.4f}) gives the t interval an MDE (80% power) of "
                f"{mde(sd / np.sqrt(k), k - 1):.4f}; the paper's +22.03% on mean-full's Recall@10 is {effect:.4f}, "
                f"which needs {pairs_needed(sd / np.sqrt(k), k, effect)} seed pairs at this spread "
                f"(scripts/power.py's formulas).")
    return (f"What {planned} seed pairs can detect: the spread of a Recall@10 difference over seed pairs at the peak, "
            f"estimated from centroid - random ({k} pairs: sd {sd:.4f}; itself a rough estimate), gives the t "
            f"interval an MDE (80% power) of {mde(sd / np.sqrt(planned), planned - 1):.4f} with {planned} pairs; the "
            f"paper's +22.03% on mean-full's Recall@10 is {effect:.4f}, which needs "
            f"{pairs_needed(sd / np.sqrt(k), k, effect)} seed pairs (scripts/power.py's formulas).")


def gti_report(recs, per, test, histories, pop):
    """The GTI claims at the peak (markdown lines; none before any GTI run has finished)."""
    per_seed = {}
    for name, (j, _) in recs.items():
        per_seed.setdefault(kind_of(j), {})[j["seed"]] = per[name]
    if not any(k.endswith("-full") for k in per_seed):
        return []
    pop_users = ev.per_user_metrics(ev.popular_topk(pop, histories, 20, True), test)["recall@10"]
    text = ["", "## The GTI claims at the peak (vocabulary softmax)", "",
            "Each run's best checkpoint by validation NDCG@10, test split, history excluded. a - b: paired bootstrap "
            "over users (95%), the seeds both ran averaged per user; with >= 2 seed pairs also the 95% t interval "
            "over seed pairs, and both must agree (a claim with one seed pair: its difference +- t x the seed spread "
            f"of {SPREAD_FROM[0]} - {SPREAD_FROM[1]}'s pairs, once they are >= 2). A row gets a verdict only where "
            "its baseline b beats most-popular (Recall@10, paired bootstrap above 0); otherwise the test could not "
            "have come out against the claim: not testable. Recall@5 and NDCG@5 are shown beside, as the paper "
            "reports them.", "",
            "| claim | paper (Vibrent) | a - b (test) | b's Recall@10 vs most-popular | verdict |",
            "|---|---|---|---|---|"]
    for claim, paper, a, b, metric, judged in GTI_CLAIMS:
        ours, b_text, v = gti_claim(per_seed, pop_users, a, b, metric, judged)
        text.append(f"| {claim} ({a} - {b}) | {paper} | {ours} | {b_text} | {v} |")
    if line := gti_power(per_seed):
        text += ["", line, ""]
    for a, b in dict.fromkeys((c[2], c[3]) for c in GTI_CLAIMS):
        for sd in sorted(set(per_seed.get(a, {})) & set(per_seed.get(b, {}))):
            ra, rb = recs[f"{a}-s{sd}"][0], recs[f"{b}-s{sd}"][0]
            text.append(f"- seed {sd}: " + reach_other(a, b, ra, rb))
    return text


def report(a, runs):
    data = torch.load(f"{REPO}/{OUT}/dataset.pt", map_location="cpu", weights_only=True)
    valid, test = data["valid"].numpy(), data["test"].numpy()
    pop, train = data["popularity"].numpy(), data["train"]
    pop_val = ev.rank_metrics(ev.popular_topk(pop, train, 20, True), valid)["ndcg@10"]
    sas, sas_topk = pin_sasrec()
    found = sorted(f[:-5] for f in os.listdir(f"{REPO}/{RECORDS}") if f.endswith(".json"))
    names = list(dict.fromkeys([*runs, *found]))                   # the plan's order, then any other record
    recs = {n: rec for n in names if (rec := read_record(n, len(test))) is not None}
    done = {n: (kind_of(j), j["seed"]) for n, (j, _) in recs.items()}
    rows, curves, per, steps_per_epoch = [], {}, {}, float(STEPS_PER_EPOCH)
    for name, (j, topk) in recs.items():
        steps_per_epoch = j["steps_per_epoch"]
        curves[name] = [(s / steps_per_epoch, n) for s, _, n in j["rank_curve"]]
        best = max(n for _, _, n in j["rank_curve"])
        per[name] = ev.per_user_metrics(topk, test)
        rows.append(f"| {name} | {j['best_step']} ({j['best_step'] / steps_per_epoch:.2f}) | "
                    f"{best:.4f} | {per[name]['recall@10'].mean():.4f} | {per[name]['ndcg@10'].mean():.4f} | "
                    f"{j['stopped_at']} | {(j['seconds'] + j['rank_seconds']) / 60:.0f} | "
                    f"{j.get('sids_sha256', '-')[:6]} |")
    s = sas["exclude_history"]["model"]
    text = ["# Train to the peak (ml-100k)", "",
            f"Written by `python scripts/convergence.py` ({time.strftime('%Y-%m-%d', time.gmtime())}, "
            f"{os.cpu_count()} CPU cores). 05 up to {a.epochs} epochs, validation every {a.eval_every} "
            f"steps: loss on 128 users and 06's Recall/NDCG@10 on the validation item of "
            f"{a.rank_users} users (history excluded, beam 20); stop after 2 validations without a "
            "better NDCG@10; the best checkpoint by validation NDCG@10 is scored on the test split "
            "(943 users, history excluded).", "",
            "| run | best step (epochs) | val NDCG@10 | test Recall@10 | test NDCG@10 | steps run | "
            "minutes | SIDs |", "|---|---|---|---|---|---|---|---|", *rows,
            f"| SASRec (best epoch {sas['best_epoch']}) | - | {sas.get('best_val_ndcg@10', float('nan')):.4f} | "
            f"{s['recall@10']:.4f} | {s['ndcg@10']:.4f} | - | {sas['train_seconds'] / 60:.0f} | - |",
            f"| most popular | - | {pop_val:.4f} | "
            f"{sas['exclude_history']['most_popular']['recall@10']:.4f} | "
            f"{sas['exclude_history']['most_popular']['ndcg@10']:.4f} | - | - | - |", "",
            f"SIDs: the first hex digits of sha256(sids.npy) the run trained on; the runs train on the pinned "
            f"tokenizer ({TOKENIZER}/, {pin_tokenizer()[:6]}), since 02 learns other codes on another CPU. "
            "A run made before the pin ('-': not recorded) is paired only with a caveat. Minutes: wall clock "
            "of 05 and its validation rankings on the machine and load that made the run, not a speed "
            "comparison.", ""]
    if notes := init_notes(recs):
        text += ["Init rows: the runs of a kind start from one build of 03's (and 04's) folder, except:", *notes, ""]
    sas_per = ev.per_user_metrics(load_npy(sas_topk, f"delete {SASREC} and rerun"), test)   # each peak vs SASRec
    text += [f"{name} - SASRec (test, paired bootstrap 95%): {paired(per[name], sas_per)}" for name in per]
    text.append("")
    for sd in sorted({seed for n, (k, seed) in done.items() if k == "random"}):
        r, c = f"random-s{sd}", f"centroid-s{sd}"
        if r in per and c in per:
            same = recs[r][0].get("sids_sha256") == recs[c][0].get("sids_sha256")
            text.append(f"seed {sd}, centroid - random at the peak (test, paired bootstrap 95%): "
                        + paired(per[c], per[r])
                        + ("" if same else " (the two runs' SIDs differ: confounded with the tokenizer)"))
    lines, v = efficiency(recs)
    if lines:
        text += ["", "Efficiency claim (centroid reaches its peak in fewer SFT steps than random): " + v,
                 *[f"- {x}" for x in lines]]
        lines, v = reach(recs)
        text += ["", "Read as steps until centroid's validation NDCG@10 first reaches random's best (resolution "
                 f"{a.eval_every} steps; one validation's NDCG@10 has a standard error of ~0.008 over 943 users): " + v,
                 *[f"- {x}" for x in lines]]
    text += gti_report(recs, per, test, [list(h) + [v] for h, v in zip(train, valid.tolist())], pop)
    if todo := [n for n in runs if n not in recs]:
        text += ["", f"Not run yet: {', '.join(todo)} (`python scripts/convergence.py --runs {todo[0]}`, "
                 "one run per call)."]
    atomic_write(f"{REPO}/results/ml-100k_convergence.md", lambda t: open(t, "w").write("\n".join(text) + "\n"))
    print("\n".join(text))
    if curves:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        full = {n for n in curves if "--softmax" in recs[n][0].get("flags", [])}
        panels = [("05's level softmax", [n for n in curves if n not in full])] + (
            [("the vocabulary softmax (05 --softmax full)", sorted(full))] if full else [])
        fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4), sharey=True, squeeze=False)
        for ax, (title, names) in zip(axes[0], panels):
            for name in names:
                ax.plot(*zip(*curves[name]), marker="o", label=name)
            ax.axhline(sas.get("best_val_ndcg@10", np.nan), color="k", ls="--", label="SASRec")
            ax.axhline(pop_val, color="gray", ls=":", label="most popular")
            ax.axvline(220 / steps_per_epoch, color="r", alpha=0.3, label="make run's 220 steps")
            ax.set(xlabel="epochs of 05", ylabel="validation NDCG@10 (history excluded)", title=title)
            ax.legend(fontsize=8)
        atomic_write(f"{REPO}/results/ml-100k_convergence.png",
                        lambda t: fig.savefig(open(t, "wb"), format="png", dpi=120, bbox_inches="tight"))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default="", help="comma-separated run names (default: all of --inits x --seeds)")
    p.add_argument("--inits", default=",".join(KINDS), help="which kinds of run (KINDS)")
    p.add_argument("--seeds", default="0,1", help="seeds of the random and centroid runs")
    p.add_argument("--epochs", type=float, default=3.0, help="at most this many epochs of 05")
    p.add_argument("--eval-every", type=int, default=220, help="05 steps between validations")
    p.add_argument("--rank-users", type=int, default=943, help="users whose validation item 06 ranks")
    p.add_argument("--dry-run", action="store_true", help="print the plan and its CPU time; run nothing")
    p.add_argument("--report-only", action="store_true", help="run nothing; table + figure")
    a = p.parse_args()
    runs = runs_of(a)
    todo = a.runs.split(",") if a.runs else list(runs)
    if bad := [n for n in todo if n not in runs]:
        sys.exit(f"error: unknown run(s) {bad}; choose from {list(runs)}")
    if not any(os.path.exists(f"{REPO}/{d}/eval_test.json") for d in (f"{OUT}/sasrec", SASREC)):
        sys.exit(f"error: {OUT}/sasrec/eval_test.json not found; run `make run` first")
    if a.dry_run:                   # the aux runs' steps are shorter: this over-counts them
        hours = []
        for name in todo:
            steps, every = schedule(a, KINDS[runs[name][0]][1])
            hours.append((steps * S_PER_STEP + (steps / every + 1) * S_PER_RANK * a.rank_users / 943) / 3600)
            print(f"{name}: at most {steps} steps, validation every {every}: at most {hours[-1]:.1f} h")
        print(f"{len(todo)} runs: at most {sum(hours):.1f} h (+ the grounding of two-stage GTI: up to "
              f"{GTI2_EPOCHS} + {GTI2_EPOCHS} passes, ~6 + ~10 min each)")
        return
    for name in [] if a.report_only else todo:
        run_one(a, name, *runs[name])
    report(a, runs)


if __name__ == "__main__":
    main()
