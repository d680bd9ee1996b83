"""The reproduction study: every SID-token init variant through 03 -> (04) -> 05 -> 06, diagnosed by 07.

Question (issue 5): do the papers' effects show up at this scale? Mean init collapses the new rows (GTI),
random init organizes them by popularity (centroid paper, Thm 3.1), centroid init keeps the semantic
geometry, grounding keeps block structure - and do these differences change convergence and Recall?

Per dataset, per variant, per seed (runs/study/<dataset>/<variant>/seed<s>/, 01/02 artifacts linked in):
    03_expand_vocab.py -> 07 (after init) -> [04_ground.py -> 07 (after grounding)] -> 05_sft.py (same budget
    for every variant) -> 07 (after SFT) -> 06_eval.py
then per stage one 07 run over all variants of seed 0 (side-by-side heatmaps, spectra, popularity), and
aggregates (mean +- std over seeds) into results/<dataset>.md and results/<dataset>_*.png: Recall/NDCG with
the most-popular baseline, validation-loss curves, steps to a validation-loss threshold, geometry metrics.
Model weights are deleted once a run is diagnosed and evaluated (a slim copy of seed 0's embedding rows is
kept for the figures); --keep-models keeps them. A finished step is skipped when rerun (resume after a kill).

CPU:  python scripts/study.py                       (ML-100K, 3 seeds, small budgets; see --help)
GPU:  python scripts/study.py --gpu                 (ML-100K and Amazon Beauty, full budgets, bf16)
Tiny: python scripts/study.py --seeds 1 --sft-steps 4 --ground-steps 4 --eval-users 16 --variants random,mean+gti
Good run: one line per step with its time, then the tables; results/<dataset>.md starts with the command.
"""
import argparse
import ast
import dataclasses
import inspect
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKBONE = "models/SmolLM2-135M-Instruct"


@dataclass
class Args:
    datasets: str = ""
    """comma-separated datasets (default: ml-100k; --gpu: ml-100k,amazon-beauty)"""
    data_dir: str = ""
    """Amazon Beauty folder for 01 (default: 01's own, ../shared/data/amazon-beauty)"""
    variants: str = "random,mean,mean+aux,centroid,centroid-matched,shuffled,mean+gti,centroid+gti"
    """which variants to run (names in VARIANTS below; `why` = the centroid-vs-random investigation)"""
    seeds: int = 3
    """seeds per variant (0, 1, ...): 03's random rows / map / shuffle, 04's and 05's order"""
    sft_steps: int = 0
    """05 optimizer steps, the same for every variant (0: mode default, CPU 20; GPU uses --sft-epochs)"""
    sft_epochs: float = 0.0
    """05 epochs over all examples instead of steps (0: mode default, GPU 3)"""
    sft_batch_size: int = 0
    """05 examples per step (0: mode default, CPU 16, GPU 64)"""
    sft_lr: float = 0.0
    """05 peak learning rate (0: 05's default)"""
    eval_every: int = 0
    """05 validation interval in steps (0: mode default, CPU 10, GPU 200)"""
    val_examples: int = 0
    """05 validation examples (0: mode default, CPU 64, GPU all users)"""
    ground_steps: int = 0
    """04 optimizer steps for the +gti variants (0: mode default, CPU 60, GPU 2000)"""
    ground_batch_size: int = 0
    """04 examples per step (0: mode default, CPU 16, GPU 64)"""
    eval_users: int = -1
    """06 evaluates the first N users on test (-1: mode default, CPU 100, GPU all; 0: all)"""
    beam: int = 20
    """06 beam width (= list length; Recall@20 needs 20)"""
    centroid_scale: str = "plain"
    """--centroid-scale for the shuffled and centroid+gti variants (centroid / centroid-matched fix their own)"""
    centroid_map: str = ""
    """--centroid-map passed to 03 for centroid variants (default: 03's own)"""
    loss_threshold: float = 0.0
    """validation loss for 'steps to threshold' (0: auto = the worst variant's mean best validation loss)"""
    device: str = ""
    """device for 03-06 (default: cpu; --gpu: cuda)"""
    gpu: bool = False
    """GPU mode: both datasets, full budgets, bf16 (05/06 pick bf16 autocast on CUDA)"""
    out_root: str = "out"
    """01/02 artifacts live in <out-root>/<dataset> (made there when missing)"""
    encoder: str = "minilm"
    """01's --encoder when 01 has to run (lm: d = d_model centroids; use another --out-root and --tag)"""
    tag: str = ""
    """suffix of the result files: results/<dataset><tag>.md"""
    work_dir: str = "runs/study"
    """where the per-run folders go (git-ignored)"""
    results_dir: str = "results"
    """where the markdown tables and figures go"""
    keep_models: bool = False
    """keep every model folder's weights (fp32 SmolLM2 folders are ~0.5 GB each)"""
    until: str = "eval"
    """last stage of each run: init (03 + 07 only: geometry at init, seconds) | ground | sft | eval"""
    dry_run: bool = False
    """print the commands without running anything"""
    report_only: bool = False
    """run nothing; aggregate whatever runs exist under --work-dir into the tables and figures"""


# CPU budget. Measured here (2 shared cores, load ~4 from other jobs, 00:35 UTC): one `random` run at 30 SFT
# steps took 517 s = 03 22 s + 07 18 s + 05 443 s (6.1 s/step training, the rest 4 validations of 64
# examples with a best-model save and a resume checkpoint each) + 06 32 s (100 users). Hence 20 steps with
# validation at 0/10/20: ~3-4 min per run on an idle machine, ~6 min under that load; 24 runs (+ 2 x 3
# groundings of 60 steps, ~3 min each) land at ~90 min idle, longer when the cores are shared. Geometry needs
# far less (--until init).
CPU = {"datasets": "ml-100k", "sft_steps": 20, "sft_epochs": 0.0, "sft_batch_size": 16, "eval_every": 10,
       "val_examples": 64, "ground_steps": 60, "ground_batch_size": 16, "eval_users": 100, "device": "cpu"}
GPU = {"datasets": "ml-100k,amazon-beauty", "sft_steps": 0, "sft_epochs": 3.0, "sft_batch_size": 64,
       "eval_every": 200, "val_examples": 0, "ground_steps": 2000, "ground_batch_size": 64, "eval_users": 0,
       "device": "cuda"}

# The committed ML-100K study (results/) was measured with 05's former objective and settings, before the
# every-position objective and CPU bf16 became the defaults; the study keeps them until it is rerun at the new
# budget, so that `make study` reproduces the committed tables.
FORMER_05 = ["--objective", "prompt", "--softmax", "full", "--lr", "2e-4", "--warmup", "10", "--dtype", "float32"]

# variant -> how it is made: 03's init (+ flags), whether 04 grounds it, 05's extra flags
VARIANTS = {
    "random":           {"init": "random"},
    "mean":             {"init": "mean"},
    "mean+aux":         {"init": "mean", "sft": ["--aux-tasks"]},                      # GTI paper's LC-Rec
    "centroid":         {"init": "centroid", "expand": ["--centroid-scale", "plain"]},  # Alg. 1 as published
    "centroid-matched": {"init": "centroid", "expand": ["--centroid-scale", "matched"]},
    "shuffled":         {"init": "shuffled", "expand": ["--centroid-scale", "{centroid_scale}"]},
    "mean+gti":         {"init": "mean", "ground": True},
    "centroid+gti":     {"init": "centroid", "expand": ["--centroid-scale", "{centroid_scale}"], "ground": True},
    # why does centroid init lose to random here? (`make study-why`): the map, per-level scale, the tied head
    "centroid-pad":     {"init": "centroid", "expand": ["--centroid-scale", "matched", "--centroid-map", "pad"]},
    "centroid-level":   {"init": "centroid", "expand": ["--centroid-scale", "level"]},
    "untied-random":    {"init": "random", "expand": ["--head-init", "random"]},       # untying alone
    "untied-centroid":  {"init": "centroid", "expand": ["--centroid-scale", "matched", "--head-init", "centroid"]},
    "centroid-in+random-head": {"init": "centroid", "expand": ["--centroid-scale", "matched", "--head-init", "random"]},
    "random-in+centroid-head": {"init": "random", "expand": ["--centroid-scale", "matched", "--head-init", "centroid"]},
}
WHY = "random,centroid-matched,centroid-pad,centroid-level,untied-random,untied-centroid,centroid-in+random-head," \
      "random-in+centroid-head"
STAGES = ("init", "ground", "sft")
GEOMETRY = [("effective_rank", "erank"), ("top1_var_share", "top1"), ("mean_cos", "mean cos"),
            ("rsa_centroids", "RSA cent"), ("rsa_codebook", "RSA book"), ("pop_spearman_abs", "pop rho (abs)"),
            ("pop_probe_r2", "pop R2")]
METRICS = [("recall@5", "R@5"), ("recall@10", "R@10"), ("recall@20", "R@20"), ("ndcg@10", "N@10")]
# TIGER (Rajput et al., NeurIPS 2023), Table 2, Amazon Beauty, as published (different training budget/model)
TIGER_BEAUTY = {"recall@5": 0.0454, "ndcg@5": 0.0321, "recall@10": 0.0648, "ndcg@10": 0.0384}


def die(msg: str):
    sys.exit(f"error: {msg}")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        die(f"{message} (see `python {self.prog} --help`)")


def parse_args() -> Args:
    """argparse over dataclasses.fields(Args); help = the docstring under each field."""
    src = ast.parse(inspect.getsource(Args)).body[0].body
    docs = {a.target.id: b.value.value for a, b in zip(src, src[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)}
    p = _Parser(prog=os.path.basename(sys.argv[0]), description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(Args):
        flag, h = "--" + f.name.replace("_", "-"), docs.get(f.name, "")
        if f.type in (bool, "bool"):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=h)
        else:
            t = {"int": int, "float": float, "str": str}.get(f.type, f.type) if isinstance(f.type, str) else f.type
            p.add_argument(flag, type=t, default=f.default, help=f"{h} (default: {f.default})")
    a = Args(**vars(p.parse_args()))
    given = {k for k in CPU if getattr(a, k) != getattr(Args, k)}      # budgets set on the command line
    for k, v in (GPU if a.gpu else CPU).items():                       # the others get the mode's default
        if k not in given:
            setattr(a, k, v)
    if "sft_steps" in given and "sft_epochs" not in given:
        a.sft_epochs = 0.0                                             # explicit steps beat the GPU epochs
    return a


# ---------------------------------------------------------------------------------------------------
# Running the numbered scripts
# ---------------------------------------------------------------------------------------------------
_FLAGS = {}


def check_flags(script, cmd):
    """Every --flag we pass must exist in the script's --help (catches drift between this driver and a step)."""
    if script not in _FLAGS:
        h = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True, text=True).stdout
        _FLAGS[script] = set(re.findall(r"--[a-z][a-z0-9-]*", h))
    bad = [c for c in cmd if c.startswith("--") and c not in _FLAGS[script]]
    if bad:
        die(f"{script} has no {', '.join(bad)}; update scripts/study.py to its current flags")


def step(a: Args, script, args, log, done=None):
    """Run `python script args` (unless `done` exists), output to `log`; one line with the time."""
    args = [str(x) for x in args]
    check_flags(script, args)
    line = f"python {script} {' '.join(args)}"
    if done is True or (isinstance(done, str) and os.path.exists(done)):
        print(f"  skip (done)  {line}")
        return 0.0
    if a.dry_run:
        print(f"  {line}")
        return 0.0
    t = time.time()
    os.makedirs(os.path.dirname(log), exist_ok=True)
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, script, *args], cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                           env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    dt = time.time() - t
    if r.returncode != 0:
        tail = open(log).read().strip().splitlines()[-1:] or ["(no output)"]
        die(f"{script} failed after {dt:.0f}s ({tail[0]}); full log: {log}")
    print(f"  {dt:6.1f}s  {line}")
    tj = os.path.join(os.path.dirname(log), "timings.json")           # seconds per step, kept across resumes
    times = load_json(tj) or {}
    times[os.path.basename(log)[:-4]] = round(dt, 1)
    with open(tj, "w") as f:
        json.dump(times, f, indent=1)
    return dt


def link_base(base, run):
    """A run folder sees 01/02's artifacts (symlinks) and gets its own models/."""
    os.makedirs(run, exist_ok=True)
    for f in ("dataset.pt", "item_emb.npy", "sids.npy", "centroids.pt", "rqvae.pt", "01_embed_items.json",
              "02_rqvae.json"):
        src, dst = os.path.abspath(os.path.join(base, f)), os.path.join(run, f)
        if os.path.exists(src) and not os.path.lexists(dst):
            os.symlink(src, dst)


def slim_copy(model, dst):
    """Keep only sid_vocab.json and the input-embedding tensor (what 07 reads) of a model folder."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    if os.path.exists(os.path.join(dst, "model.safetensors")):
        return
    for fn in sorted(os.listdir(model)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(model, fn), framework="pt") as f:
                key = next((k for k in f.keys() if "embed_tokens" in k), None)
                if key:
                    os.makedirs(dst, exist_ok=True)
                    shutil.copy(os.path.join(model, "sid_vocab.json"), dst)
                    save_file({key: f.get_tensor(key).float().contiguous()}, os.path.join(dst, "model.safetensors"))
                    return


def drop_weights(run):
    """Delete weights and resume checkpoints of a finished run; keep every JSON."""
    for root, _, files in os.walk(os.path.join(run, "models")):
        for fn in files:
            if fn.endswith((".safetensors", ".bin", ".pt")):
                os.remove(os.path.join(root, fn))


def run_one(a: Args, ds, base, variant, seed):
    """One variant, one seed: 03 -> 07 -> (04 -> 07) -> 05 -> 07 -> 06. Returns {stage: model folder}."""
    v, run = VARIANTS[variant], os.path.join(a.work_dir, ds, variant, f"seed{seed}")
    link_base(base, run)
    logs, dev = os.path.join(run, "logs"), ["--device", a.device]
    expand = [x.format(centroid_scale=a.centroid_scale) for x in v.get("expand", [])]
    if a.until not in ("init", "ground", "sft", "eval"):
        die(f"unknown --until {a.until!r}; use init|ground|sft|eval")
    if a.centroid_map and v["init"] in ("centroid", "shuffled") and "--centroid-map" not in expand:
        expand += ["--centroid-map", a.centroid_map]
    m = os.path.join(run, "models", v["init"])
    stages = {"init": m}
    final = os.path.join(run, "models", v["init"] + ("+gti" if v.get("ground") else "") + "+sft")
    done_all = os.path.join(final, "eval_test_keep.json")
    marker = {"init": os.path.join(run, "diag_init.json"), "ground": os.path.join(run, "diag_ground.json"),
              "sft": os.path.join(run, "diag_sft.json"), "eval": done_all}[a.until]
    if a.until == "ground" and not v.get("ground"):
        marker = os.path.join(run, "diag_init.json")
    if os.path.exists(marker):                                         # finished up to --until before
        print(f"  skip (done)  {variant} seed {seed} up to {a.until}")
        return finish(a, run, seed, stages)
    # a step is done when its weights exist (a run dropped after an earlier --until is rebuilt, same seed)
    weights = lambda f: os.path.isdir(f) and any(x.endswith(".safetensors") for x in os.listdir(f))
    step(a, "03_expand_vocab.py", ["--out-dir", run, "--model", BACKBONE, "--init", v["init"], *expand,
                                   "--seed", seed, *dev], f"{logs}/03.log", weights(m))
    diag = lambda model, stage: step(a, "07_diagnose.py", ["--out-dir", run, "--models", model, "--names", variant,
                                                           "--save", os.path.join(run, f"diag_{stage}.json"),
                                                           "--no-figures"], f"{logs}/07_{stage}.log",
                                     os.path.join(run, f"diag_{stage}.json"))
    diag(m, "init")
    if a.until == "init":
        return finish(a, run, seed, stages)
    if v.get("ground"):
        g = m + "+gti"
        step(a, "04_ground.py", ["--out-dir", run, "--model", m, "--save", g, "--steps", a.ground_steps,
                                 "--batch-size", a.ground_batch_size, "--seed", seed, "--dtype", "float32", *dev],
             f"{logs}/04.log", weights(g) and os.path.exists(os.path.join(g, "04_ground.json")))
        diag(g, "ground")
        m = stages["ground"] = g
    if a.until == "ground":
        return finish(a, run, seed, stages)
    budget = ["--epochs", a.sft_epochs] if a.sft_epochs else ["--steps", a.sft_steps]
    step(a, "05_sft.py", ["--model", m, "--save", final, "--out-dir", run, *budget, "--batch-size", a.sft_batch_size,
                          "--eval-every", a.eval_every, "--val-examples", a.val_examples, "--no-resumable", *FORMER_05,
                          *(["--lr", a.sft_lr] if a.sft_lr else []), *v.get("sft", []), "--seed", seed, *dev],
         f"{logs}/05.log", weights(final) and os.path.exists(os.path.join(final, "05_sft.json")))
    stages["sft"] = final
    diag(final, "sft")
    if a.until == "eval":
        step(a, "06_eval.py", ["--model", final, "--out-dir", run, "--split", "test", "--beam", a.beam,
                               "--users", a.eval_users, "--protocol", "kept", "--dtype", "float32", "--seed", seed,
                               *dev], f"{logs}/06.log", done_all)
    return finish(a, run, seed, stages)


def finish(a: Args, run, seed, stages):
    """Keep seed 0's embedding rows (slim) for the side-by-side figures, then drop the weights."""
    if seed == 0 and not a.dry_run:
        for st, path in stages.items():
            slim_copy(path, os.path.join(run, "slim", st))
    if not a.keep_models and not a.dry_run:
        drop_weights(run)
    return stages


# ---------------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------------
def load_json(path):
    return json.load(open(path)) if os.path.exists(path) else None


def ms(xs, fmt="{:.3f}"):
    """'mean +- std' over seeds ('-' when nothing; std over >= 2 values)."""
    xs = [x for x in xs if x is not None and np.isfinite(x)]
    if not xs:
        return "-"
    return fmt.format(np.mean(xs)) + (" +- " + fmt.format(np.std(xs, ddof=1)) if len(xs) > 1 else "")


def collect(a: Args, ds, variants):
    """Per variant: per seed the diagnostics of each stage, the SFT summary and the test metrics."""
    out = {}
    for v in variants:
        runs = []
        for s in range(a.seeds):
            run = os.path.join(a.work_dir, ds, v, f"seed{s}")
            final = os.path.join(run, "models", VARIANTS[v]["init"] + ("+gti" if VARIANTS[v].get("ground") else "") + "+sft")
            diag = {st: load_json(os.path.join(run, f"diag_{st}.json")) for st in STAGES}
            runs.append({"diag": {st: d["models"][v] for st, d in diag.items() if d},
                         "reference": next((d["reference"] for d in diag.values() if d), None),
                         "sft": load_json(os.path.join(final, "05_sft.json")),
                         "eval": load_json(os.path.join(final, "eval_test_keep.json")),
                         "ground": load_json(os.path.join(run, "models", VARIANTS[v]["init"] + "+gti", "04_ground.json")),
                         "seconds": sum((load_json(os.path.join(run, "logs", "timings.json")) or {}).values())})
        out[v] = runs
    return out


def steps_to(curve, thr):
    """First validation step whose loss <= thr (None if never)."""
    return next((st for st, loss, *_ in curve if loss <= thr), None)


def per_position(sft):
    """Last validation accuracy at each target position (a/b/c/.../eos), mean over the seeds that logged it."""
    accs = [s["val_level_acc"][-1][1] for s in sft if s.get("val_level_acc")]
    if not accs:
        return "-"
    names = next((s["val_level_names"] for s in sft if s.get("val_level_names")), range(len(accs[0])))
    return " ".join(f"{n} {x:.2f}" for n, x in zip(names, np.mean(accs, 0)))


def report(a: Args, ds, res, figs, cmd):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    variants = list(res)
    best = {v: [r["sft"]["best_val_loss"] for r in res[v] if r["sft"]] for v in variants}
    thr = a.loss_threshold or max((np.mean(b) for b in best.values() if b), default=float("nan"))
    seconds = sum(r["seconds"] for v in variants for r in res[v])
    lines = [f"# Study: {ds}", "", f"Command: `{cmd}`  ", f"Machine: {platform.node()} {platform.machine()}, "
             f"{os.cpu_count()} CPUs, device {a.device}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
             f"compute {seconds / 60:.1f} min (sum of the runs' step times, 01/02 excluded)  ", f"Budgets: seeds {a.seeds}, SFT "
             + (f"{a.sft_epochs} epochs" if a.sft_epochs else f"{a.sft_steps} steps") + f" x batch {a.sft_batch_size}"
             f" (val every {a.eval_every}, {a.val_examples or 'all'} val examples), grounding {a.ground_steps} steps"
             f" x batch {a.ground_batch_size}, test users {a.eval_users or 'all'}, beam {a.beam}", ""]
    # --- recommendation
    lines += ["## Test metrics (mean +- std over seeds)", "",
              "| variant | " + " | ".join(n for _, n in METRICS) + " | cold R@10 (n) | best val loss | step of best"
              f" | steps to val loss {thr:.3f} | last val token acc | per position | s/run |",
              "|---" * (len(METRICS) + 8) + "|"]
    pop = None
    for v in variants:
        ev = [r["eval"] for r in res[v] if r["eval"]]
        pop = pop or (ev[0] if ev else None)
        sft = [r["sft"] for r in res[v] if r["sft"]]
        reach = [steps_to(s["val_curve"], thr) for s in sft]
        lines.append(f"| {v} | " + " | ".join(ms([e["model"].get(k) for e in ev]) for k, _ in METRICS)
                     + f" | {ms([e['cold_model'].get('recall@10') for e in ev])} ({ev[0]['cold_users'] if ev else '-'})"
                     + f" | {ms(best[v])} | {ms([s['best_step'] for s in sft], '{:.0f}')}"
                     + f" | {ms(reach, '{:.0f}')} ({sum(x is not None for x in reach)}/{len(sft)} reached)"
                     + f" | {ms([s['val_curve'][-1][2] for s in sft if len(s['val_curve'][-1]) > 2])}"
                     + f" | {per_position(sft)}"
                     + f" | {ms([r['seconds'] for r in res[v] if r['seconds']], '{:.0f}')} |")
    if pop:
        lines.append("| most popular | " + " | ".join(f"{pop['most_popular'].get(k, float('nan')):.3f}" for k, _ in METRICS)
                     + f" | {pop['cold_most_popular'].get('recall@10', float('nan')):.3f} | | | | | | |")
    if ds == "amazon-beauty":
        lines.append("| TIGER (published) | " + " | ".join(f"{TIGER_BEAUTY[k]:.4f}" if k in TIGER_BEAUTY else "-"
                                                             for k, _ in METRICS) + " | | | | | | | |")
    # --- geometry
    ref = next((r["reference"] for v in variants for r in res[v] if r["reference"]), None)
    lines += ["", "## Geometry of the SID rows (all levels; mean +- std over seeds)", "",
              "| variant | stage | " + " | ".join(n for _, n in GEOMETRY) + " | purity@10 | vocab/SID spread |",
              "|---" * (len(GEOMETRY) + 4) + "|"]
    for v in variants:
        for st in STAGES:
            ds_ = [r["diag"][st] for r in res[v] if st in r["diag"]]
            if ds_:
                lines.append(f"| {v} | {st} | " + " | ".join(ms([d["levels"]["all"][k] for d in ds_], "{:.2f}")
                                                               for k, _ in GEOMETRY)
                             + f" | {ms([d['purity'] for d in ds_])} | {ms([d['spread_ratio_vocab_over_sid'] for d in ds_], '{:.2f}')} |")
    if ref:
        lines += ["", f"Purity@{ref['k']} references: raw item embeddings {ref['purity_item_emb']:.3f}, random Gaussian "
                  f"SID rows {ref['purity_random_sid_rows']:.3f} (what the SID assignment alone gives), chance "
                  f"{ref['purity_chance']:.3f}."]
    for v in variants:                                                 # 04's held-out text -> SID accuracy
        g = [r["ground"] for r in res[v] if r["ground"]]
        if g:
            lines += ["", f"Grounding {v}: held-out text->SID next-token accuracy (mean over levels) "
                      f"{ms([x.get('held_out_acc_before') for x in g])} -> {ms([x.get('held_out_acc_after') for x in g])}, "
                      f"within the level's tokens {ms([x.get('held_out_acc_in_level_before') for x in g])} -> "
                      f"{ms([x.get('held_out_acc_in_level_after') for x in g])}."]
    # --- validation-loss curves
    fig, ax = plt.subplots(figsize=(6, 4))
    for v in variants:
        curves = [np.array([c[:2] for c in r["sft"]["val_curve"]]) for r in res[v] if r["sft"]]
        if curves:
            n = min(len(c) for c in curves)
            y = np.stack([c[:n, 1] for c in curves])
            ax.plot(curves[0][:n, 0], y.mean(0), label=v)
            ax.fill_between(curves[0][:n, 0], y.mean(0) - y.std(0), y.mean(0) + y.std(0), alpha=0.2)
    if np.isfinite(thr):
        ax.axhline(thr, color="k", lw=0.5, ls="--")
    ax.set(xlabel="SFT step", ylabel="validation loss", title=f"{ds}: validation loss (mean +- std over seeds)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(a.results_dir, f"{ds}{a.tag}_val_loss.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    figs = [path] + figs
    lines += ["", "## Figures", ""] + [f"![{os.path.basename(f)}]({os.path.basename(f)})" for f in figs]
    md = os.path.join(a.results_dir, f"{ds}{a.tag}.md")
    with open(md + ".tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(md + ".tmp", md)
    print("\n".join(lines[:40]))
    print(f"wrote {md}")


# ---------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------
def run_all(a: Args, ds, base, variants):
    """01 and 02 once per dataset (skipped when their files exist), then every variant x seed."""
    t0, dev = time.time(), ["--device", a.device]
    data_dir = ["--data-dir", a.data_dir] if a.data_dir and ds != "ml-100k" else []
    step(a, "01_embed_items.py", ["--dataset", ds, "--out-dir", base, *data_dir, "--encoder", a.encoder, *dev],
         f"{a.work_dir}/{ds}/logs/01.log", os.path.join(base, "dataset.pt"))
    step(a, "02_rqvae.py", ["--out-dir", base, *dev], f"{a.work_dir}/{ds}/logs/02.log", os.path.join(base, "rqvae.pt"))
    for seed in range(a.seeds):                                        # seed-major: seed 0 of all variants first
        for v in variants:
            t = time.time()
            print(f"--- {ds} {v} seed {seed}")
            run_one(a, ds, base, v, seed)
            print(f"    {v} seed {seed}: {time.time() - t:.0f}s (study so far {(time.time() - t0) / 60:.1f} min)")


def main():
    a = parse_args()
    os.chdir(REPO)
    variants = (WHY if a.variants == "why" else a.variants).split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        die(f"unknown variant(s) {bad}; choose from {','.join(VARIANTS)}")
    if not os.path.exists(os.path.join(BACKBONE, "config.json")):
        die(f"{BACKBONE} not found; run `make setup` first")
    cmd = "python scripts/study.py " + " ".join(sys.argv[1:])
    os.makedirs(a.results_dir, exist_ok=True)
    for ds in a.datasets.split(","):
        t0 = time.time()
        base = os.path.join(a.out_root, ds)
        print(f"=== {ds}: variants {variants}, seeds {a.seeds}, device {a.device}")
        if not a.report_only:
            run_all(a, ds, base, variants)
        if a.dry_run:
            continue
        figs = []
        for st in STAGES:                                              # side by side: seed 0 of every variant
            have = [(v, os.path.join(a.work_dir, ds, v, "seed0", "slim", st)) for v in variants]
            have = [(v, p) for v, p in have if os.path.exists(os.path.join(p, "model.safetensors"))]
            if have:
                save = os.path.join(a.results_dir, f"{ds}{a.tag}_{st}.json")
                step(a, "07_diagnose.py", ["--out-dir", base, "--models", ",".join(p for _, p in have),
                                           "--names", ",".join(v for v, _ in have), "--save", save],
                     f"{a.work_dir}/{ds}/logs/07_{st}_all.log")
                figs += [f"{os.path.splitext(save)[0]}_{k}.png" for k in ("cosine", "spectra", "popularity")]
        report(a, ds, collect(a, ds, variants), figs, cmd)


if __name__ == "__main__":
    main()
