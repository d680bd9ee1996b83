"""The study: every SID-token init variant through 03 -> [04] -> 05 -> 06 at `make run`'s budget, >= 3 seeds,
and a claim-by-claim table against the two papers (docs/papers.md).

One run = one variant x one seed, in runs/study/<dataset>/<variant>/seed<s>/ (01/02 artifacts linked in):
    03_expand_vocab.py --init <init> [--centroid-scale <scale>] --seed s    -> 07 (geometry at init)
    [04_ground.py --steps 120 --seed s                                       -> 07]   GTI variants
    05_sft.py --eval-every 44 [--aux-tasks] --seed s     05's defaults: 220 steps x 8, lr 1e-3, level softmax
    07 (geometry after SFT);  06_eval.py --protocol excluded --cold-max 25  (beam 20, all test users)
    [bench/exact_search.py --protocol excluded --cold-max 25]   seed 0 only, with --exact
then the weights are deleted (JSONs and topk .npy stay; seed 0 keeps a slim copy of its embedding matrix per
stage for the side-by-side figures). The rqk-* variants (tokenizer axis) use a second artifacts folder,
runs/study/<dataset>/_tok_rqkmeans: 01's files linked, 02 --quantizer rqkmeans --collisions reassign. On ml-100k the
RQ-VAE runs train on the pinned tokenizer (results/convergence/tokenizer/, as scripts/convergence.py's runs; --sids):
02 learns other codes on another CPU, and records made on other SIDs could not be paired.

Report (results/<dataset>.md + figures) from whatever runs have finished, with the seed count of every row:
test Recall/NDCG (history excluded) and cold targets (seen <= 25 times in training), validation curves and steps
to a validation loss, geometry after SFT, paired differences over users (the seeds both variants ran pooled per
user, 95% bootstrap) and over seeds (95% t interval of the per-seed differences), and the papers' claims, each with
a verdict that needs both intervals to agree.

Pieces (one seed of all 11 variants ~2.2 h on 2 CPU cores; a killed piece resumes where it stopped, rerun it):
    python scripts/study.py --seeds 0        (then --seeds 1, --seeds 2; `make study SEEDS=0`)
    python scripts/study.py --report-only    (tables + figures from the finished runs)
    python scripts/study.py --seeds 0,1,2 --dry-run     (the plan and its estimated CPU time)
    python scripts/study.py --seeds 0,1,2 --variants centroid-plain,shuffled-plain   (Algorithm 1 exactly, ~1.3 h)
    python scripts/study.py --seeds 0 --variants mean-full,mean+gti-full    (the papers' vocabulary softmax, ~0.5 h)
    python scripts/study.py --seeds 0,1,2 --variants random-full,centroid-plain-full   (Algorithm 1, papers' loss, ~1.4 h)
CPT variants (<init>+cpt<E>: E epochs of 04 --train all, then 05, 07, 06 as above) start from a chain per init and seed,
runs/study/<dataset>/_cpt/<init>/seed<s>: 03, one 04 --train all run (it saves a folder after every epoch; the chain keeps
CPT_EPOCHS[init]'s; constant lr after the warmup, so epoch E's folder does not depend on the run's length), and 07 on them:
the geometry after CPT, before any SFT. They are not in the default variants (a random chain is 82-96 min, centroid ~41-48):
    python scripts/study.py --seeds 0 --results-dir results/cpt \
        --variants random,centroid,random+cpt2,random+cpt8,centroid+cpt1,centroid+cpt2      (`make study-cpt`)
    python scripts/study.py --seeds 2 --results-dir results/cpt \
        --variants random+cpt8,centroid+cpt1 --cpt-only      (the chains' geometry only; `make study-cpt-geometry`)
A piece's report covers every finished run and chain, and lists the claims that need none of its --variants only
when they have been run; so a CPT piece writes its own results/cpt/<dataset>.md, not the full study's report.
Good run: one line per step with its time; results/<dataset>.md starts with the claims table.
"""
import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections import namedtuple

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKBONE = "models/SmolLM2-135M-Instruct"
PINNED = "results/convergence/tokenizer"          # ml-100k's pinned 02 outputs (scripts/convergence.py made them)
sys.path.insert(0, REPO)
from common import atomic_write, load_json as read_json, load_step  # noqa: E402

ev = load_step("06_eval")                         # 06's per_user_metrics and paired_bootstrap

# ---------------------------------------------------------------------------------------------------
# The variants. tokenizer: rqvae = 02's default (RQ-VAE + TIGER's collision suffix), rqkmeans = the centroid
# paper's residual k-means with exactly L codes (collision-free). scale: 03's --centroid-scale; every centroid
# variant has a shuffled twin at the same scale (03 permutes its rows within each level).
# ---------------------------------------------------------------------------------------------------
Variant = namedtuple("Variant", "tokenizer init scale gti aux cpt softmax", defaults=(0, "level"))   # cpt: 04 epochs
VARIANTS = {  #                tokenizer   init        scale      gti    aux (LC-Rec tasks in 05)
    "random":       Variant("rqvae",    "random",   "",        False, False),
    "mean":         Variant("rqvae",    "mean",     "",        False, False),
    "centroid":     Variant("rqvae",    "centroid", "level",   False, False),
    "shuffled":     Variant("rqvae",    "shuffled", "level",   False, False),
    "mean+gti":     Variant("rqvae",    "mean",     "",        True,  False),
    "centroid+gti": Variant("rqvae",    "centroid", "level",   True,  False),
    "random+gti":   Variant("rqvae",    "random",   "",        True,  False),
    "mean+aux":     Variant("rqvae",    "mean",     "",        False, True),
    "rqk-random":   Variant("rqkmeans", "random",   "",        False, False),
    "rqk-centroid": Variant("rqkmeans", "centroid", "level",   False, False),
    "rqk-shuffled": Variant("rqkmeans", "shuffled", "level",   False, False),
    "random+cpt2":   Variant("rqvae",   "random",   "",        False, False, 2),   # from the CPT chains
    "random+cpt8":   Variant("rqvae",   "random",   "",        False, False, 8),
    "centroid+cpt1": Variant("rqvae",   "centroid", "level",   False, False, 1),
    "centroid+cpt2": Variant("rqvae",   "centroid", "level",   False, False, 2),
    "centroid-plain": Variant("rqvae",  "centroid", "plain",   False, False),   # Algorithm 1 exactly (03 --centroid-
    "shuffled-plain": Variant("rqvae",  "shuffled", "plain",   False, False),   # scale plain) and its shuffled twin
    "mean-full":     Variant("rqvae",   "mean",     "",        False, False, 0, "full"),   # the papers' loss
    "mean+gti-full": Variant("rqvae",   "mean",     "",        True,  False, 0, "full"),   # (05 --softmax full)
    "random-full":   Variant("rqvae",   "random",   "",        False, False, 0, "full"),   # Algorithm 1 against
    "centroid-plain-full": Variant("rqvae", "centroid", "plain",   False, False, 0, "full"),   # random, papers' loss
}
CPT_EPOCHS = {"random": (1, 2, 4, 8), "centroid": (1, 2, 4)}   # the folders a chain saves (and 07 measures)
DEFAULT_VARIANTS = [v for v, d in VARIANTS.items() if not d.cpt and d.softmax == "level" and d.scale != "plain"]
TOKENIZER_02 = {"rqvae": [], "rqkmeans": ["--quantizer", "rqkmeans", "--collisions", "reassign"]}
GROUND_STEPS, EVAL_EVERY, COLD_MAX = 120, 44, 25   # 04 as `make run`; 05 validates 6 times; 109 cold ML-100K users
# CPU seconds per step on 2 idle cores (README's pipeline table; 05 = 220 x 2.06 s + 6 validations x 20 s)
SECONDS = {"01": 8, "02": 20, "03": 10, "04": 111, "05": 220 * 2.06 + 6 * 20, "06": 180, "06x": 3.1 * 180, "07": 10,
           "04c": 613}                                # 04c: one CPT epoch (04 --train all, 378 steps)
METRICS = [("recall@5", "R@5"), ("recall@10", "R@10"), ("recall@20", "R@20"), ("ndcg@10", "N@10")]
COLD = "recall@10"                                  # the cold-target metric
GEOMETRY = [("effective_rank", "erank"), ("mean_cos", "mean cos"), ("rsa_centroids", "RSA cent"),
            ("rsa_codebook", "RSA book"), ("pop_spearman_abs", "pop abs(rho)"), ("pop_probe_r2", "pop R2")]
Step = namedtuple("Step", "name script args done")  # done: the file that exists once the step has finished


def die(msg: str):
    sys.exit(f"error: {msg}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="ml-100k", help="01's --dataset (ml-100k | amazon-beauty)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds to run: one seed is one ~2.2 h piece")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help="comma-separated names from VARIANTS (default: all but the +cpt and -full ones)")
    p.add_argument("--cpt-only", action="store_true", help="only the CPT chains of the +cpt variants (no SFT)")
    p.add_argument("--exact", action="store_true", help="also bench/exact_search.py (certified-exact top-20) for seed 0 (~9 min per variant)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and its CPU time estimate; run nothing")
    p.add_argument("--report-only", action="store_true", help="run nothing; tables and figures from finished runs")
    p.add_argument("--keep-models", action="store_true", help="keep the weights (~0.5 GB per model folder)")
    p.add_argument("--device", default="cpu", help="--device for 02-07 (cpu | cuda)")
    p.add_argument("--out-root", default="out", help="01/02 artifacts: <out-root>/<dataset> (made when missing)")
    p.add_argument("--sids", default="auto", help="a folder of 02's outputs every RQ-VAE run trains on instead of "
                   "<out-root>'s (02 learns other codes on another CPU); auto: ml-100k's pinned tokenizer "
                   f"{PINNED}/ (the one the convergence runs train on); '' = <out-root>'s 02")
    p.add_argument("--work-dir", default="runs/study", help="the run folders (git-ignored)")
    p.add_argument("--results-dir", default="results", help="the markdown report and figures")
    a = p.parse_args(argv)
    if a.sids == "auto":
        pin = os.path.join(REPO, PINNED)                                  # (any working directory)
        a.sids = pin if a.dataset == "ml-100k" and os.path.exists(os.path.join(pin, "sids.npy")) else ""
    if a.sids and not os.path.exists(os.path.join(a.sids, "sids.npy")):
        die(f"{os.path.join(a.sids, 'sids.npy')} not found; point --sids at a folder of 02's outputs, or '' to run 02")
    a.seeds = [int(s) for s in str(a.seeds).split(",") if s != ""]
    a.variants = a.variants.split(",")
    bad = [v for v in a.variants if v not in VARIANTS]
    if bad:
        die(f"unknown variant(s) {','.join(bad)}; choose from {','.join(VARIANTS)}")
    return a


# ---------------------------------------------------------------------------------------------------
# The plan: which scripts, with which flags, and the file that says each step is done
# ---------------------------------------------------------------------------------------------------
def tokenizer_dir(a, tokenizer):
    """The folder a tokenizer's runs link their 01/02 files from: <out-root>/<dataset> (or, with --sids, a folder of
    links to <out-root>'s 01 files and --sids' 02 files), or its own folder for another tokenizer."""
    if tokenizer == "rqvae":
        return os.path.join(a.work_dir, a.dataset, "_tok_pinned") if a.sids else os.path.join(a.out_root, a.dataset)
    return os.path.join(a.work_dir, a.dataset, f"_tok_{tokenizer}")


def run_dir(a, variant, seed):
    return os.path.join(a.work_dir, a.dataset, variant, f"seed{seed}")


def cpt_dir(a, init, seed):
    return os.path.join(a.work_dir, a.dataset, "_cpt", init, f"seed{seed}")


def final_model(a, variant, seed):
    v = VARIANTS[variant]
    return os.path.join(run_dir(a, variant, seed), "models",
                        v.init + ("+gti" if v.gti else "") + (f"+cpt{v.cpt}" if v.cpt else "") + "+sft")


def plan_setup(a, tokenizer):
    """tokenizer None: 01 in <out-root>/<dataset>; else the tokenizer's 02 in its folder (none for RQ-VAE with
    --sids: the pinned 02 files are linked in by stage_tokenizer)."""
    o, d, dev = os.path.join(a.out_root, a.dataset), tokenizer and tokenizer_dir(a, tokenizer), ["--device", a.device]
    if tokenizer is None:
        return [Step("01", "01_embed_items.py", ["--dataset", a.dataset, "--out-dir", o], os.path.join(o, "dataset.pt"))]
    if tokenizer == "rqvae" and a.sids:
        return []
    return [Step("02", "02_rqvae.py", ["--out-dir", d, *TOKENIZER_02[tokenizer], *dev], os.path.join(d, "02_rqvae.json"))]


def stage_tokenizer(a, tokenizer):
    """A tokenizer folder other than <out-root>/<dataset>: 01's files linked in, and for RQ-VAE --sids' 02 files."""
    o, d = os.path.join(a.out_root, a.dataset), tokenizer_dir(a, tokenizer)
    if d != o:
        link_artifacts(o, d, ("dataset.pt", "item_emb.npy", "01_embed_items.json"))
        if tokenizer == "rqvae":
            link_artifacts(a.sids, d, ("sids.npy", "centroids.pt", "rqvae.pt", "02_rqvae.json"))


def step03(run, v, seed, dev):
    scale = ["--centroid-scale", v.scale] if v.scale else []
    return Step("03", "03_expand_vocab.py", ["--out-dir", run, "--model", BACKBONE, "--init", v.init, *scale,
                                              "--seed", seed, *dev],
                os.path.join(run, "models", v.init, "sid_vocab.json"))


def step07(run, stage, model, name, dev, init=""):
    """07 on one model folder; init: the folder it trained from (07 --inits: its rows' displacement, the movement)."""
    return Step(f"07_{stage}", "07_diagnose.py", [
        "--out-dir", run, "--models", model, "--names", name, *(["--inits", init] if init else []),
        "--save", os.path.join(run, f"diag_{stage}.json"), *dev], os.path.join(run, f"diag_{stage}.json"))


def plan_cpt(a, init, seed):
    """A CPT chain (shared by the +cpt variants of its init and seed): 03, one 04 --train all run of max(CPT_EPOCHS[init])
    epochs (04 saves a folder after every epoch), and 07 on the 03 folder and on the CPT_EPOCHS[init] ones (--inits the
    03 folder: the rows' displacement since 03)."""
    run, dev, eps = cpt_dir(a, init, seed), ["--device", a.device], CPT_EPOCHS[init]
    model = os.path.join(run, "models", init)
    last = f"{model}+cpt{max(eps)}"
    steps = [step03(run, VARIANTS[init], seed, dev), step07(run, "cpt0", model, init, dev),
             Step("04c", "04_ground.py", ["--out-dir", run, "--model", model, "--train", "all", "--epochs", max(eps),
                                          "--save", last,
                                          "--seed", seed, *dev], os.path.join(last, "04_ground.json"))]
    steps += [step07(run, f"cpt{e}", f"{model}+cpt{e}", init, dev, model) for e in eps]
    return [s._replace(args=[str(x) for x in s.args]) for s in steps]


def plan(a, variant, seed):
    """The steps of one run, in order (a +cpt variant starts from its chain's folder: plan_cpt runs first)."""
    v, run, dev = VARIANTS[variant], run_dir(a, variant, seed), ["--device", a.device]
    if v.cpt:
        model, steps = os.path.join(cpt_dir(a, v.init, seed), "models", f"{v.init}+cpt{v.cpt}"), []
    else:
        model = os.path.join(run, "models", v.init)
        steps = [step03(run, v, seed, dev), step07(run, "init", model, variant, dev)]
    if v.gti:
        steps += [Step("04", "04_ground.py", ["--out-dir", run, "--model", model, "--save", model + "+gti",
                                              "--steps", GROUND_STEPS, "--seed", seed, *dev],
                       os.path.join(model + "+gti", "04_ground.json")),
                  step07(run, "ground", model + "+gti", variant, dev)]
        model += "+gti"
    final = final_model(a, variant, seed)
    steps += [Step("05", "05_sft.py", ["--model", model, "--save", final, "--out-dir", run, "--eval-every", EVAL_EVERY,
                                       *(["--aux-tasks"] if v.aux else []), "--seed", seed, *dev,
                                       *(["--softmax", v.softmax] if v.softmax != "level" else [])],
                   os.path.join(final, "05_sft.json")),
              step07(run, "sft", final, variant, dev, model),                  # model: the folder 05 started from
              Step("06", "06_eval.py", ["--model", final, "--out-dir", run, "--protocol", "excluded",
                                        "--cold-max", COLD_MAX, *dev],
                   os.path.join(final, "eval_test.json"))]
    if a.exact and seed == 0:
        steps.append(Step("06x", "bench/exact_search.py", ["--model", final, "--out-dir", run, "--protocol",
                                                           "excluded", "--cold-max", COLD_MAX, *dev],
                          os.path.join(final, "eval_test_exact.json")))
    return [s._replace(args=[str(x) for x in s.args]) for s in steps]


# ---------------------------------------------------------------------------------------------------
# Running: one subprocess per step, skipped when its `done` file exists
# ---------------------------------------------------------------------------------------------------
_HELP = {}


def script_flags(script):
    """The --flags a script's --help lists."""
    if script not in _HELP:
        h = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True, text=True).stdout
        _HELP[script] = set(re.findall(r"--[a-z][a-z0-9-]*", h))
    return _HELP[script]


def run_script(script, args, log):
    """python <script> <args> > log; one line and exit on failure. Returns seconds."""
    t = time.time()
    os.makedirs(os.path.dirname(log), exist_ok=True)
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, script, *args], cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                           env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    if r.returncode != 0:
        tail = open(log).read().strip().splitlines()[-1:] or ["(no output)"]
        die(f"{script} failed after {time.time() - t:.0f}s ({tail[0]}); full log: {log}")
    return time.time() - t


def execute(a, steps, logs):
    """Run the steps not done yet; returns the estimated seconds of those (dry run) or the measured ones."""
    total = 0.0
    for s in steps:
        bad = [x for x in s.args if x.startswith("--") and x not in script_flags(s.script)]
        if bad:
            die(f"{s.script} has no {', '.join(bad)}; update scripts/study.py to its current flags")
        save = s.args[s.args.index("--save") + 1] if "--save" in s.args else ""   # 05, and 04's CPT chains
        args = s.args + (["--resume"] if save and os.path.exists(save + ".resume.pt") else [])
        line = f"python {s.script} {' '.join(args)}"
        if os.path.exists(s.done):
            print(f"  skip (done)  {line}")
        elif a.dry_run:
            key = s.name.split("_")[0]
            est = SECONDS[key] * (int(s.args[s.args.index("--epochs") + 1]) if key == "04c" else 1)
            print(f"  ~{est:4.0f}s  {line}")
            total += est
        else:
            dt = run_script(s.script, args, os.path.join(logs, f"{s.name}.log"))
            print(f"  {dt:6.1f}s  {line}")
            total += dt
            tj = os.path.join(logs, "timings.json")                    # seconds per step, kept across resumes
            os.makedirs(logs, exist_ok=True)
            times = load_json(tj) or {}
            atomic_write(tj, lambda t: open(t, "w").write(json.dumps({**times, s.name: round(dt, 1)}, indent=1)))
    return total


def link_artifacts(src, dst, files=("dataset.pt", "item_emb.npy", "sids.npy", "centroids.pt", "rqvae.pt",
                                    "01_embed_items.json", "02_rqvae.json")):
    os.makedirs(dst, exist_ok=True)
    for f in files:
        s, d = os.path.abspath(os.path.join(src, f)), os.path.join(dst, f)
        if os.path.exists(s) and not os.path.lexists(d):
            os.symlink(s, d)


def slim_copy(model, dst):
    """sid_vocab.json + the input-embedding tensor of a model folder (all 07 reads), for the seed-0 figures."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    if os.path.exists(os.path.join(dst, "model.safetensors")) or not os.path.isdir(model):
        return
    for fn in sorted(f for f in os.listdir(model) if f.endswith(".safetensors")):
        with safe_open(os.path.join(model, fn), framework="pt") as f:
            key = next((k for k in f.keys() if "embed_tokens" in k), None)
            if key:
                os.makedirs(dst, exist_ok=True)
                shutil.copy(os.path.join(model, "sid_vocab.json"), dst)
                save_file({key: f.get_tensor(key).float().contiguous()}, os.path.join(dst, "model.safetensors"))
                return


def sha(path):
    """The first 12 hex digits of a file's sha256 ('-' when it is missing): which SIDs a run trained on."""
    return hashlib.sha256(open(path, "rb").read()).hexdigest()[:12] if os.path.exists(path) else "-"


def sid_rows(folder):
    """The SID token rows of a model folder in sid_vocab.json's order: ({"input": (n, d)} and, where the head is
    untied, {"head": (n, d)}, fp16; the token ids)."""
    import torch
    from safetensors import safe_open
    vocab = read_json(os.path.join(folder, "sid_vocab.json"), "a model folder of 03-05 has one")
    ids = [t for level in vocab["token_ids"] for t in level if t >= 0]
    rows = {}
    for fn in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        with safe_open(os.path.join(folder, fn), framework="pt") as f:
            for k in f.keys():
                part = "input" if "embed_tokens" in k else "head" if k.endswith("lm_head.weight") else None
                if part:
                    rows[part] = f.get_tensor(k)[ids].to(torch.float16).numpy()
    return rows, np.asarray(ids)


def records_dir(a):
    return os.path.join(a.results_dir, "runs", a.dataset)


def write_record(a, variant, seed):
    """A finished run's record in <results-dir>/runs/<dataset>/ (committed): <variant>-s<seed>.json (06's test json,
    05's curves, 07 per stage, the step times, sha256 of the SIDs it trained on), _test_topk.npy (each user's ranked
    list; _test_exact_topk.npy with --exact) and, while the weights exist, _rows.npz (the SID rows, fp16, at init,
    after grounding and after SFT). The report reads only records: it is rebuilt on any machine."""
    run, final, rd = run_dir(a, variant, seed), final_model(a, variant, seed), records_dir(a)
    name, sft = f"{variant}-s{seed}", load_json(os.path.join(final, "05_sft.json"))
    keep = ("val_curve", "val_level_acc", "best_val_loss", "best_step", "steps", "seconds", "examples",
            "aux_examples", "aux_token_ratio")
    rec = {"variant": variant, "seed": seed, "variant_def": VARIANTS[variant]._asdict(),
           "sids_sha256": sha(os.path.join(run, "sids.npy")), "eval": load_json(os.path.join(final, "eval_test.json")),
           "sft": {k: sft[k] for k in keep if k in sft} if sft else None,
           "diag": {st: (load_json(os.path.join(run, f"diag_{st}.json")) or {}).get("models", {}).get(variant)
                    for st in ("init", "ground", "sft")},
           "seconds": run_seconds(run, sft)}
    os.makedirs(rd, exist_ok=True)
    for src, dst in (("eval_test_topk.npy", "_test_topk.npy"), ("eval_test_exact_topk.npy", "_test_exact_topk.npy")):
        if os.path.exists(os.path.join(final, src)):
            topk = np.load(os.path.join(final, src), allow_pickle=False).astype(np.int32)
            atomic_write(os.path.join(rd, name + dst), lambda p, t=topk: np.save(open(p, "wb"), t))
    models = {s.name[3:]: s.args[s.args.index("--models") + 1] for s in plan(a, variant, seed) if s.name[:3] == "07_"}
    rows = {st: sid_rows(m) for st, m in models.items()
            if any(f.endswith(".safetensors") for f in (os.listdir(m) if os.path.isdir(m) else []))}
    if rows:                                                            # ~0.2 MB a stage (194 rows x 576, fp16)
        arrays = {f"{st}_{part}": x for st, (r, _) in rows.items() for part, x in r.items()}
        atomic_write(os.path.join(rd, name + "_rows.npz"), lambda p: np.savez_compressed(
            open(p, "wb"), token_ids=next(iter(rows.values()))[1], **arrays))
        rec["rows"] = name + "_rows.npz"
    atomic_write(os.path.join(rd, name + ".json"), lambda p: open(p, "w").write(json.dumps(rec, indent=1) + "\n"))


def run_one(a, variant, seed):
    """One run: its steps (finished ones skipped), then the slim copies (seed 0) and the weights dropped."""
    run = run_dir(a, variant, seed)
    finished = os.path.join(run, "finished.json")
    steps = plan(a, variant, seed)
    if os.path.exists(finished):
        missing = [s.name for s in steps if not os.path.exists(s.done)]
        print(f"  skip (done)  {variant} seed {seed}" + (f"; its weights are gone, so {missing} cannot run: delete "
                                                         f"{run} to redo it" if missing else ""))
        return 0.0
    if not a.dry_run:
        link_artifacts(tokenizer_dir(a, VARIANTS[variant].tokenizer), run)
    seconds = execute(a, steps, os.path.join(run, "logs"))
    if a.dry_run:
        return seconds
    write_record(a, variant, seed)                                     # before the weights go
    if seed == 0:
        for st in ("init", "ground", "sft"):
            m = next((s.args[s.args.index("--models") + 1] for s in steps if s.name == f"07_{st}"), None)
            if m:
                slim_copy(m, os.path.join(run, "slim", st))
    if not a.keep_models:                                              # weights and resume checkpoints; JSONs stay
        for root, _, files in os.walk(os.path.join(run, "models")):
            for fn in files:
                if fn.endswith((".safetensors", ".bin", ".pt")):
                    os.remove(os.path.join(root, fn))
    with open(finished, "w") as f:
        json.dump({"variant": variant, "seed": seed, "variant_def": VARIANTS[variant]._asdict()}, f)
    return seconds


def run_chain(a, init, seed):
    """One CPT chain's steps (finished ones skipped); its folders stay for the +cpt variants (~0.5 GB each)."""
    chain = cpt_dir(a, init, seed)
    if not a.dry_run:
        link_artifacts(tokenizer_dir(a, "rqvae"), chain)
    seconds = execute(a, plan_cpt(a, init, seed), os.path.join(chain, "logs"))
    if not a.dry_run:                             # 04 saved every epoch: keep the CPT_EPOCHS ones (~0.5 GB each)
        for e in set(range(1, max(CPT_EPOCHS[init]))) - set(CPT_EPOCHS[init]):
            shutil.rmtree(os.path.join(chain, "models", f"{init}+cpt{e}"), ignore_errors=True)
    return seconds


def seed0_figures(a, res_variants):
    """Per tokenizer and stage, one 07 over seed 0 of every variant (slim copies): heatmaps, spectra, popularity."""
    figs = []
    for tok in ("rqvae", "rqkmeans"):
        for st in ("init", "ground", "sft"):
            have = [(v, os.path.join(run_dir(a, v, 0), "slim", st)) for v in res_variants
                    if VARIANTS[v].tokenizer == tok]
            have = [(v, p) for v, p in have if os.path.exists(os.path.join(p, "model.safetensors"))]
            save = os.path.join(a.results_dir, f"{a.dataset}{'' if tok == 'rqvae' else '_' + tok}_{st}.json")
            if have:                      # without seed-0 folders here, the committed figures, if any, stay
                old = load_json(save) or {}
                if sorted(old.get("models", {})) != sorted(v for v, _ in have):   # redo only when the set changed
                    run_script("07_diagnose.py", ["--out-dir", tokenizer_dir(a, tok), "--models", ",".join(p for _, p in have),
                                                  "--names", ",".join(v for v, _ in have), "--save", save,
                                                  "--device", a.device],
                               os.path.join(a.work_dir, a.dataset, "logs", f"07_{tok}_{st}.log"))
                    run_script("scripts/figures.py", ["--diagnostics", save],
                               os.path.join(a.work_dir, a.dataset, "logs", f"figures_{tok}_{st}.log"))
            figs += [f"{os.path.splitext(save)[0]}_{k}.png" for k in ("cosine", "spectra", "popularity")]
    return [f for f in figs if os.path.exists(f)]


# ---------------------------------------------------------------------------------------------------
# Collect and report
# ---------------------------------------------------------------------------------------------------
def load_json(path):
    """path's JSON, or None when there is none (an unreadable one: one line naming it)."""
    return read_json(path, "delete it and rerun the run that wrote it") if os.path.exists(path) else None


def collect(a, variants):
    """Per variant, its finished seeds read from the records (records_dir): topk, 05's curve, 07 per stage, seconds,
    SIDs. A finished run folder without a record (made before records existed) gets one first."""
    out, rd = {}, records_dir(a)
    for v in variants:
        root = os.path.join(a.work_dir, a.dataset, v)
        for d in sorted(os.listdir(root)) if os.path.isdir(root) else []:
            s = int(d[4:]) if re.fullmatch(r"seed\d+", d) else None
            if s is not None and os.path.exists(os.path.join(final_model(a, v, s), "eval_test_topk.npy")) \
                    and not os.path.exists(os.path.join(rd, f"{v}-s{s}.json")):
                write_record(a, v, s)
        names = os.listdir(rd) if os.path.isdir(rd) else []
        found = [re.fullmatch(re.escape(v) + r"-s(\d+)\.json", f) for f in names]
        runs = []
        for s in sorted(int(m.group(1)) for m in found if m):
            rec, path = load_json(os.path.join(rd, f"{v}-s{s}.json")), os.path.join(rd, f"{v}-s{s}")
            if not os.path.exists(path + "_test_topk.npy"):
                continue
            exact = path + "_test_exact_topk.npy"
            runs.append({"seed": s, "eval": rec["eval"], "topk": np.load(path + "_test_topk.npy").astype(np.int64),
                         "exact_topk": np.load(exact).astype(np.int64) if os.path.exists(exact) else None,
                         "sft": rec["sft"], "diag": rec["diag"], "seconds": rec["seconds"],
                         "sids": rec.get("sids_sha256", "-")})
        out[v] = runs
    return out


def run_seconds(run, sft):
    """A run's seconds (timings.json, per step). A resumed 05's timing covers its last part only, so 05 counts at
    least its training loop and validation ranks summed over the parts (05_sft.json)."""
    t = load_json(os.path.join(run, "logs", "timings.json")) or {}
    if "05" in t and sft:
        t["05"] = max(t["05"], sft.get("seconds", 0.0) + sft.get("rank_seconds", 0.0))
    return sum(t.values())


def collect_cpt(a):
    """({init: {epoch: {seed: 07's numbers}}} of the CPT chains (epoch 0 = 03's rows), {"<dataset>/_cpt/<init>/seed<s>":
    the chain's seconds per step}), read from the chains' records (<records>/_cpt/<init>-s<seed>.json), which are
    first written from every chain folder there is (its 07 files and step times)."""
    rd = os.path.join(records_dir(a), "_cpt")
    for init, eps in CPT_EPOCHS.items():
        root = os.path.join(a.work_dir, a.dataset, "_cpt", init)
        for sd in sorted(d for d in os.listdir(root) if re.fullmatch(r"seed\d+", d)) if os.path.isdir(root) else []:
            t = load_json(os.path.join(root, sd, "logs", "timings.json")) or {}
            if "04c" in t:      # a resumed 04's timing covers its last part; its loop is summed over the parts
                g = load_json(os.path.join(root, sd, "models", f"{init}+cpt{max(eps)}", "04_ground.json")) or {}
                t["04c"] = max(t["04c"], g.get("train_seconds", 0.0))
            diags = {e: (load_json(os.path.join(root, sd, f"diag_cpt{e}.json")) or {}).get("models", {}).get(init)
                     for e in (0, *eps)}
            os.makedirs(rd, exist_ok=True)
            atomic_write(os.path.join(rd, f"{init}-s{sd[4:]}.json"), lambda p: open(p, "w").write(json.dumps(
                {"init": init, "seed": int(sd[4:]), "diags": {e: d for e, d in diags.items() if d}, "times": t},
                indent=1)))
    out, times = {}, {}
    names = [re.fullmatch(r"(.+)-s(\d+)\.json", f) for f in (os.listdir(rd) if os.path.isdir(rd) else [])]
    order = {init: i for i, init in enumerate(CPT_EPOCHS)}                 # random's chains first, as in the table
    for init, sd in sorted(((m.group(1), int(m.group(2))) for m in names if m), key=lambda x: (order[x[0]], x[1])):
        rec = load_json(os.path.join(rd, f"{init}-s{sd}.json"))
        if rec["times"]:
            times[f"{a.dataset}/_cpt/{init}/seed{sd}"] = rec["times"]
        for e, d in rec["diags"].items():
            out.setdefault(init, {}).setdefault(int(e), {})[sd] = d
    return out, dict(sorted(times.items()))


def per_user(runs, targets, cold, key="topk"):
    """{metric: (U,) mean over seeds} for all users and {metric: (U_cold,)} for cold targets (the seeds pooled), and
    the same per seed ("users_by_seed": {seed: {"all"|"cold": {metric: per-user array}}})."""
    rs = [r for r in runs if r[key] is not None]
    ms = [ev.per_user_metrics(r[key], targets[:len(r[key])]) for r in rs]
    if not ms:
        return None
    allu = {k: np.mean([m[k] for m in ms], 0) for k in ms[0]}
    users = {r["seed"]: {"all": m, "cold": {k: x[cold[:len(x)]] for k, x in m.items()}} for r, m in zip(rs, ms)}
    return {"all": allu, "cold": {k: x[cold[:len(x)]] for k, x in allu.items()}, "seeds": len(ms),
            "users_by_seed": users}


def paired_users(pa, pb, part, metric):
    """Per-user metric of a and b averaged over the seeds both ran (a 1-seed variant is paired with the same seed
    of a 3-seed one, not with the others' average); all seeds of each when they share none. Returns x, y, #common."""
    common = sorted(set(pa["users_by_seed"]) & set(pb["users_by_seed"]))
    if not common:
        return pa[part][metric], pb[part][metric], 0
    avg = lambda p: np.mean([p["users_by_seed"][s][part][metric] for s in common], 0)
    return avg(pa), avg(pb), len(common)


def seed_diffs(pa, pb, part, metric):
    """Per seed both variants ran (same seed = same SFT example order): metric(a) - metric(b), means over users."""
    ua, ub = pa["users_by_seed"], pb["users_by_seed"]
    return [float(ua[s][part][metric].mean() - ub[s][part][metric].mean()) for s in sorted(ua) if s in ub]


def mean_std(xs, fmt="{:.4f}"):
    """'mean +- std over seeds' ('-' when nothing; std over >= 2)."""
    xs = [x for x in xs if x is not None and np.isfinite(x)]
    if not xs:
        return "-"
    return fmt.format(np.mean(xs)) + (" +- " + fmt.format(np.std(xs, ddof=1)) if len(xs) > 1 else "")


def steps_to(curve, thr):
    """First SFT step at which the validation loss reaches thr, linear between validations (None: never)."""
    for i, (st, loss, *_) in enumerate(curve):
        if loss <= thr:
            if i == 0:
                return float(st)
            s0, l0 = curve[i - 1][:2]
            return s0 + (l0 - thr) / (l0 - loss) * (st - s0)
    return None


T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def t_interval(d):
    """Mean of d and its 95% t interval over seeds ([mean, None, None] below two values)."""
    d = np.asarray([x for x in d if x is not None], float)
    if len(d) < 2:
        return [float(d.mean()) if len(d) else None, None, None]
    h = T975.get(len(d) - 1, 1.96) * d.std(ddof=1) / np.sqrt(len(d))
    return [float(d.mean()), float(d.mean() - h), float(d.mean() + h)]


def verdict(lo, hi):
    """From a 95% interval of (ours - baseline) in the direction the paper claims."""
    if lo is None or hi is None:
        return "inconclusive"
    return "reproduced" if lo > 0 else "not reproduced" if hi < 0 else "inconclusive"


# Geometry claims about training need rows that moved: rms(rows - the rows training started from, 07 --inits) >= MOVED
# x the spread of those, on the seeds (seed_low). 0.5: rows pushed toward other rows (the most damaging move) by 0.25
# of the spread lose ~0.05 RSA with their init and no kNN purity, by 0.5 ~0.26 RSA and ~0.11 purity (simulated, 194
# clustered rows x 576), past the claims' thresholds (0.05-0.2): below 0.5 a geometry verdict reads the init.
MOVED = 0.5
# The CPT claim's "~": both intervals of (centroid + 1 - random + 8) inside +-6.5% of random + 8's Recall@5, the
# centroid paper's headline gain (the smallest difference it reports as one); taken from the paper, but set after the
# CPT runs had been seen (their +-0.012 intervals were known): a new CPT study must fix its margin before its runs.
EQUIV_MARGIN = 0.065


def seed_low(xs):
    """The lower end of the 95% t interval over seeds (the smallest value with one seed, or with an infinite one)."""
    return min(xs) if len(xs) < 2 or not np.all(np.isfinite(xs)) else t_interval(xs)[1]


def seed_verdict(effects, t, zero=0.0):
    """A threshold judged on the seeds, not on the mean: the 95% t interval of the per-seed effect; reproduced when its
    lower end >= t, not reproduced when its upper end <= zero, else inconclusive. -> (effect text, verdict)."""
    m, lo, hi = t_interval(effects)
    one = lo is None
    lo, hi = (m, m) if one else (lo, hi)
    v = "reproduced" if lo >= t else "not reproduced" if hi <= zero else "inconclusive"
    return f"{m:+.3f}" + ("" if one else f" [{lo:+.3f}, {hi:+.3f}]"), v + (" (provisional, 1 seed)" if one else "")


def displacement(d):
    """07's displacement numbers (all levels) of one model entry; None where 07 ran without --inits (old records)."""
    return ((d or {}).get("displacement") or {}).get("levels", {}).get("all")


def moved(d):
    """rms(dE) / spread of the init's rows: None when not measured, 0 when dE is ~0, inf when the init rows had no
    spread (mean init: all their geometry is training's)."""
    m = displacement(d)
    return None if m is None else 0.0 if not m.get("moved") else float("inf") if m.get("ratio") is None \
        else float(m["ratio"])


def gate(sides):
    """Whether a geometry claim could have failed: every side {label: {seed: 07 entry}} of rows training produced moved
    (seed_low of rms/spread >= MOVED). -> (movement text, None where testable, else the verdict)."""
    text, why = [], None
    for label, ds in sides.items():
        xs = [moved(d) for d in ds.values()]
        if not xs or None in xs:
            return f"{label}: movement not measured", "not testable: movement not measured"
        lo = seed_low(xs)
        m = np.mean(xs)                                   # inf: mean init, every row's place is training's
        text.append(f"{label} " + ("all (its init rows are one point)" if np.isinf(m) else f"{m:.2f}")
                    + (f" (low end {lo:.2f})" if len(xs) > 1 and np.isfinite(lo) else ""))
        why = why or (f"not testable at this budget (rms/spread {lo:.2f} < {MOVED})" if lo < MOVED else None)
    return "moved (rms/spread of the init's rows): " + ", ".join(text), why


def run_diags(res, v, stage):
    """{seed: 07 entry} of a variant's runs at a stage."""
    return {r["seed"]: r["diag"][stage] for r in res.get(v, []) if r["diag"].get(stage)}


def chain_diags(cpt, init, epoch):
    """({seed: 07 entry} of the chains after `epoch` CPT epochs, the epoch) ("last": the most epochs run)."""
    per = (cpt or {}).get(init, {})
    epoch = max(per, default=None) if epoch == "last" else epoch
    return per.get(epoch, {}), epoch


def convergence(res, a_, b_):
    """Steps to the worse of the two variants' mean best validation loss, paired by seed (same example order). A run
    that never gets there counts at its last validation (censored: >= the cap), not dropped. -> (the loss, {variant:
    {seed: steps or None}}, [(b's - a's steps, the censored side "a" | "b" | "", b's steps)] over the seed pairs where
    one got there)."""
    best = [np.mean([r["sft"]["best_val_loss"] for r in res.get(v, []) if r["sft"]] or [np.nan]) for v in (a_, b_)]
    thr = max(best)
    curves = {v: {r["seed"]: r["sft"]["val_curve"] for r in res.get(v, []) if r["sft"]} for v in (a_, b_)}
    steps = {v: {s: steps_to(c, thr) for s, c in curves[v].items()} for v in (a_, b_)}
    out = []
    for s in sorted(set(steps[a_]) & set(steps[b_])):
        x, y = (steps[v][s] if steps[v][s] is not None else float(curves[v][s][-1][0]) for v in (a_, b_))
        side = "a" if steps[a_][s] is None else "b" if steps[b_][s] is None else ""
        if steps[a_][s] is not None or steps[b_][s] is not None:
            out.append((y - x, side, y))
    return thr, steps, out


def censored_verdict(pairs):
    """The verdict on paired savings (> 0: the claim's side) where a run that never got there counts at its cap.
    pairs: [(saving, side, ...)]; side "a": the claim's variant never got there (the saving is at most the value: the
    pair counts against the claim), "b": the baseline never did (at least the value), "": both did. The 95% t interval
    over the values; reproduced only when its lower end > 0 and no pair is "a", not reproduced only when its upper end
    < 0 and no pair is "b" (a bound is read only in the direction it holds). -> (mean, lo, hi, verdict)."""
    m, lo, hi = t_interval([p[0] for p in pairs])
    v, sides = verdict(lo, hi), {p[1] for p in pairs}
    if (v == "reproduced" and "a" in sides) or (v == "not reproduced" and "b" in sides):
        v = "inconclusive (a censored pair bounds the saving the other way)"
    return m, lo, hi, v


def boot(x, y):
    """06's paired bootstrap of x - y over users; [None] * 3 when there are no users (e.g. no cold target)."""
    return ev.paired_bootstrap(x, y) if len(x) else [None, None, None]


def fmt_iv(d, f="{:+.4f}"):
    return "-" if d[0] is None else f.format(d[0]) + ("" if d[1] is None else f" [{f.format(d[1])}, {f.format(d[2])}]")


def pairs(variants):
    """The paired comparisons: every variant vs random of its tokenizer, then the papers' own pairs."""
    ref = {"rqvae": "random", "rqkmeans": "rqk-random"}
    out = [(v, ref[VARIANTS[v].tokenizer]) for v in variants
           if v not in ref.values() and VARIANTS[v].softmax == "level"]
    out += [("mean+gti", "mean"), ("mean+gti-full", "mean-full"), ("centroid-plain-full", "random-full"),
            ("mean+aux", "mean"), ("mean+gti", "mean+aux"), ("centroid", "shuffled"),
            ("rqk-centroid", "rqk-shuffled"), ("centroid+gti", "centroid"), ("rqk-random", "random"),
            ("rqk-centroid", "centroid"), ("centroid+cpt1", "centroid"), ("centroid+cpt1", "random+cpt2"),
            ("centroid+cpt1", "random+cpt8"), ("centroid+cpt2", "random+cpt8")]
    return [p for p in dict.fromkeys(out) if p[0] in variants and p[1] in variants]


# The papers' claims (docs/papers.md), in its order. paired: a - b over users (metric; "cold:" = cold targets only);
# steps: SFT steps to the same validation loss, b - a per seed; geometry: a 07 number after SFT (or at init),
# effect = a - b, or 1 - a / b for "ratio", per seed; cpt_geometry: the same on the CPT chains (a after what[1]
# epochs - b after what[2]; "last" = the most epochs run); axis / cpt_axis: Theorem 3.1's popularity axis, the
# |Spearman| of token frequency with PC1 of a's displacement (after SFT / after what[0] CPT epochs); geometry
# thresholds on the seeds' interval (seed_verdict), each only where the trained rows moved (gate); cpt: Recall@5 of a
# (centroid + 1 CPT epoch) above b (random + 2) and within EQUIV_MARGIN of what (random + 8). The geometry thresholds
# were fixed before the CPT runs; EQUIV_MARGIN after them (above).
CLAIMS = [  # claim, paper's number, kind, a, b, what
    ("GTI: mean init collapses the SID rows, low-rank after SFT", "qualitative (SVD spectrum, cosine)",
     "geometry", "mean", "mean+gti", ("effective_rank", "sft", "sft", "ratio", 0.5)),
    ("GTI vs mean: Recall@20", "+26.02% (Vibrent)", "paired", "mean+gti", "mean", "recall@20"),
    ("GTI vs mean: NDCG@10", "+8.0% (Vibrent .0188 -> .0203)", "paired", "mean+gti", "mean", "ndcg@10"),
    ("LC-Rec aux tasks vs mean: Recall@10", "+11.7% (Vibrent .0342 -> .0382); industrial +6.38%",
     "paired", "mean+aux", "mean", "recall@10"),
    ("GTI vs LC-Rec aux tasks: Recall@10", "+9.2% (Vibrent .0382 -> .0417); industrial +21.63% vs +6.38%",
     "paired", "mean+gti", "mean+aux", "recall@10"),
    ("GTI keeps the codebook geometry after SFT (RSA, block structure)", "qualitative (RSA, cosine blocks)",
     "geometry", "mean+gti", "mean", ("rsa_codebook", "sft", "sft", "difference", 0.1)),
    ("centroid vs random: Recall@5", "+6.5% on average (up to +16%)", "paired", "centroid", "random", "recall@5"),
    ("centroid (Algorithm 1: plain mean shift) vs random: Recall@5", "+6.5% on average (up to +16%)", "paired",
     "centroid-plain", "random", "recall@5"),
    ("centroid (Algorithm 1) vs random, the papers' vocabulary softmax: Recall@5", "+6.5% on average (up to +16%)",
     "paired", "centroid-plain-full", "random-full", "recall@5"),
    ("centroid vs random: Recall@5, RQ-KMeans SIDs (the paper's tokenizer)", "+6.5% on average (up to +16%)",
     "paired", "rqk-centroid", "rqk-random", "recall@5"),
    (f"centroid vs random: cold targets (seen <= {COLD_MAX} times), Recall@10", "+37% on average (up to +60%)",
     "paired", "centroid", "random", "cold:" + COLD),
    ("centroid vs random: SFT steps to the same validation loss", "27% fewer on average (up to 40%)",
     "steps", "centroid", "random", None),
    ("random init drifts to a popularity axis (Thm 3.1)", "qualitative (rows organize by popularity)",
     "axis", "random", "random", ("sft", 0.2)),
    ("shuffled centroids < centroid: Recall@5", "lower (ablation; no number given)",
     "paired", "centroid", "shuffled", "recall@5"),
    ("shuffled centroids < centroid: Recall@5, RQ-KMeans SIDs", "lower (ablation; no number given)",
     "paired", "rqk-centroid", "rqk-shuffled", "recall@5"),
    ("centroid init keeps item semantics after SFT (purity)", "qualitative (CPT does not recover them)",
     "geometry", "centroid", "random", ("purity", "sft", "sft", "difference", 0.05)),
    ("CPT does not recover semantics from random init (purity)", "qualitative (CPT does not recover them)",
     "cpt_geometry", "centroid", "random", ("purity", 0, "last", "difference", 0.05)),
    ("random rows organize by popularity during CPT", "qualitative (rows organize by popularity)",
     "cpt_axis", "random", "random", ("last", 0.2)),
    ("centroid + 1-4 CPT epochs ~ random + 6-10 CPT epochs: Recall@5", "qualitative (CPT epochs to the same "
     "quality)", "cpt", "centroid+cpt1", "random+cpt2", "random+cpt8"),
]


def beats_popular(b_users, pop_users):
    """The baseline rule: a baseline trained when its per-user test Recall@10 beats most-popular's (06's paired
    bootstrap over users, lower end above 0). -> (bool, [d, lo, hi])."""
    d = boot(b_users, pop_users)
    return d[1] is not None and d[1] > 0, d


def trains(pu, b_, pop_users):
    """beats_popular for variant b_ (its per-user Recall@10, mean over its seeds). -> (bool, text)."""
    if pop_users is None:
        return True, ""
    ok, d = beats_popular(pu[b_]["all"]["recall@10"], pop_users)
    mean = pu[b_]["all"]["recall@10"].mean()
    return ok, f"{b_}'s Recall@10 {mean:.4f} vs most-popular {pop_users.mean():.4f}: {fmt_iv(d)}"


def joint_verdict(d, iv, pairs):
    """Two kinds of noise: which users are tested (bootstrap d) and which training run (t interval iv over seed
    pairs). A verdict needs both intervals on the same side of 0; with one seed pair only the bootstrap exists, so a
    decided verdict says it is provisional (more pairs can only overrule it). -> (verdict, True when the seed pairs
    overruled the users)."""
    users, seeds = verdict(d[1], d[2]), verdict(iv[1], iv[2])
    if pairs < 2:
        one = "" if users == "inconclusive" else " (provisional: 1 seed pair, the seed spread not measured)"
        return users + one, False
    return (users, False) if users == seeds else ("inconclusive", True)


def equivalence(ivs, margin):
    """Two one-sided tests at +-margin on 95% intervals (2.5% each side): 'equivalent' when every interval lies inside
    (-margin, +margin), 'different' when every one lies wholly beyond it on one side, else 'inconclusive' (a wide
    interval that covers 0 is not equivalence)."""
    ivs = [iv for iv in ivs if iv[1] is not None]
    if all(-margin < lo and hi < margin for _, lo, hi in ivs):
        return "equivalent"
    sides = {"above" if lo >= margin else "below" if hi <= -margin else "" for _, lo, hi in ivs}
    return "different" if len(sides) == 1 and "" not in sides else "inconclusive"


def axis_verdict(rho, q95, t):
    """A popularity-axis threshold t on the seeds' |Spearman| values rho, each against its permutation null's q95:
    seed_verdict (not reproduced only below every null), and "reproduced" only when every seed beats its own null."""
    iv, v = seed_verdict(rho, t, zero=max(q95))
    return iv, "inconclusive (a seed within its permutation null)" if v.startswith("reproduced") and not all(
        r > q for r, q in zip(rho, q95)) else v


def seed_list(seeds):
    """'seed 0' or 'seeds 0,1,2': the seeds a figure is read over."""
    return f"seed{'s' * (len(seeds) > 1)} {','.join(map(str, seeds))}"


def geometry_row(res, cpt, kind, a_, b_, what):
    """A geometry claim: the per-seed effect over the seeds both sides have, judged on its seed interval, only where
    every trained side moved (gate). kind "geometry": runs (what: key, stage a, stage b, form, t); "cpt_geometry":
    the chains (epochs); "axis" / "cpt_axis": Theorem 3.1's axis of a's displacement (what: stage or epoch, t)."""
    chain = kind.startswith("cpt_")
    side = lambda v, st: chain_diags(cpt, v, st) if chain else (run_diags(res, v, st), st)  # noqa: E731
    label = lambda v, st: f"{v} after {st} CPT epochs" if chain else f"{v} ({st})"  # noqa: E731
    if kind.endswith("axis"):
        (ds, st), t = side(a_, what[0]), what[1]
        if not ds or (chain and not st):
            return "not run", "not run yet"
        move, why = gate({label(a_, st): ds})
        m = [displacement(d) or {} for d in ds.values()]
        rho, q95 = [x.get("pc1_freq_abs_spearman") for x in m], [x.get("perm_q95") for x in m]
        if None in rho + q95:                               # moved, but dE shifts every row alike: no PC1
            return move, why or "not testable: dE is one shift of every row (no PC1)"
        iv, v = axis_verdict(rho, q95, t)
        return (f"abs(Spearman) of token frequency with PC1 of dE ({label(a_, st)} - its init): {iv} over "
                f"{seed_list(ds)} (threshold {t}; permutation null q95 <= {max(q95):.3f}); {move}", why or v)
    key, sa, sb, form, t = what
    (da, sa), (db, sb) = side(a_, sa), side(b_, sb)
    both = sorted(set(da) & set(db))
    val = lambda d: d["purity"] if key == "purity" else d["levels"]["all"].get(key)  # noqa: E731
    xa, xb = [val(da[s]) for s in both], [val(db[s]) for s in both]
    if not both or None in xa + xb or (form == "ratio" and not all(xb)) or (chain and not max(sa, sb)):
        return "not run", "not run yet"
    iv, v = seed_verdict([1 - x / y if form == "ratio" else x - y for x, y in zip(xa, xb)], t)
    move, why = gate({label(v_, st): {s: d[s] for s in both} for v_, d, st in ((a_, da, sa), (b_, db, sb))
                      if st not in ("init", 0)})
    return (f"{key}: {label(a_, sa)} {np.mean(xa):.3f}, {label(b_, sb)} {np.mean(xb):.3f} (mean over "
            f"{seed_list(both)}); effect {'1 - a / b' if form == 'ratio' else 'a - b'} = {iv} (threshold {t}); {move}",
            why or v)


def paired_ivs(pu, a_, b_, part, metric):
    """a - b over users (the seeds both ran, pooled per user; 06's bootstrap) and over seed pairs (t interval). ->
    (users' [d, lo, hi], seeds' [m, lo, hi], the per-seed differences, x, y, #common seeds)."""
    x, y, nc = paired_users(pu[a_], pu[b_], part, metric)
    sd = seed_diffs(pu[a_], pu[b_], part, metric)
    return boot(x, y), t_interval(sd), sd, x, y, nc


def claim_row(res, pu, kind, a_, b_, what, cpt=None, pop_users=None):
    """(ours, verdict) of one claim. A paired claim gets a verdict only where its baseline b_ beats most-popular
    (trains); otherwise it could not have come out against the claim: not testable."""
    if kind == "cpt":      # reproduced: centroid + 1 above random + 2 and equivalent to random + 8 (EQUIV_MARGIN)
        (t2, v2), (t8, v8) = (claim_row(res, pu, "paired", a_, b, "recall@5", pop_users=pop_users)
                              for b in (b_, what))
        if "not run" in (t2, t8):
            return "not run", "not run yet"
        d, iv, _, _, y, _ = paired_ivs(pu, a_, what, "all", "recall@5")
        margin = EQUIV_MARGIN * float(y.mean())
        eq, v2 = equivalence([d, iv], margin), v2.split(" (")[0]
        v = next((x for x in (v2, v8) if x.startswith("not testable")), None) or (
            "reproduced" if v2 == "reproduced" and eq == "equivalent" else "not reproduced"
            if v2 == "not reproduced" or eq == "different" else f"inconclusive ({a_} vs {b_}: {v2}; vs {what}: {eq})")
        return (f"{a_} - {b_}: {t2}; {a_} - {what}: {t8}; equivalence margin +-{margin:.4f} ({EQUIV_MARGIN:.1%} of "
                f"{what}'s Recall@5): {eq}", v)
    if kind != "paired" and kind != "steps":
        return geometry_row(res, cpt, kind, a_, b_, what)
    if kind == "paired":
        part, metric = what.split(":") if ":" in what else ("all", what)
        if not (pu.get(a_) and pu.get(b_)):
            return "not run", "not run yet"
        d, iv, sd, x, y, nc = paired_ivs(pu, a_, b_, part, metric)
        base = float(y.mean()) if d[0] is not None else 0.0
        rel = f" ({100 * d[0] / base:+.1f}%)" if base > 0 else ""
        v, overruled = joint_verdict(d, iv, len(sd))
        seed_txt = (f"; per seed pair {fmt_iv(iv)} (t 95%, {len(sd)} pairs: {', '.join(f'{x:+.4f}' for x in sd)})"
                    if len(sd) >= 2 else "")
        note = " (inside the seed spread)" if overruled else ""
        sids = {r.get("sids", "-") for r in res[a_] + res[b_]}
        note += f" (the runs trained on {len(sids)} different SIDs: confounded)" if len(sids) > 1 else ""
        ok, base_txt = trains(pu, b_, pop_users)
        if not ok:
            v, note = "not testable: the baseline did not train", f" ({base_txt})"
        return (f"{fmt_iv(d)}{rel}; {pu[a_]['seeds']} vs {pu[b_]['seeds']} seeds ({nc} common), {len(x)} users"
                f"{seed_txt}", v + note)
    thr, steps, d = convergence(res, a_, b_)                              # steps: censored pairs kept as bounds
    if not d:
        if not (steps[a_] and steps[b_]):
            return "not run", "not run yet"
        reach = [f"{sum(x is not None for x in steps[v].values())}/{len(steps[v])} seeds of {v}" for v in (a_, b_)]
        return (f"no seed pair in which either reaches val loss {thr:.3f} (the worse mean best of the two) within "
                f"the budget: {', '.join(reach)} do", "inconclusive")   # both ran; no seed of either reached it
    m, lo, hi, v = censored_verdict(d)
    mb, cens = np.mean([p[2] for p in d]), [p[1] for p in d]
    return (f"{fmt_iv([m, lo, hi], '{:+.1f}')} steps fewer ({100 * m / mb:+.1f}% of {b_}'s {mb:.0f}) to val loss "
            f"{thr:.3f} (the worse mean best of the two), linear between validations every {EVAL_EVERY} steps; "
            f"95% t interval over {len(d)} seed pairs" + (f" (a run that never got there counted at its last step: "
                                                          f"{cens.count('a')} of {a_}, {cens.count('b')} of {b_})"
                                                          if any(cens) else ""), v)


def claim_cmd(cmd, kind, a_, b_, what):
    if kind.startswith("cpt_"):                                # the chains behind the +cpt variants
        return f"`{cmd} --variants random+cpt8,centroid+cpt1 --cpt-only`"
    return f"`{cmd} --variants {','.join(dict.fromkeys([a_, b_] + ([what] if kind == 'cpt' else [])))}`"


def claim_variants(kind, a_, b_, what):
    """The variants a claim needs (cpt_geometry, cpt_axis: the +cpt variants whose chains it reads)."""
    if kind.startswith("cpt_"):
        return {v for v, d in VARIANTS.items() if d.cpt and d.init in (a_, b_)}
    return {a_, b_, what} if kind == "cpt" else {a_, b_}


def claims(res, pu, cmd, cpt=None, variants=None, pop_users=None):
    """The claims table: (claim, paper's number, ours, verdict, the command that reruns that row). With
    `variants` (the piece's --variants), a claim not run yet that needs none of them is left out."""
    rows = []
    for name, paper, kind, a_, b_, what in CLAIMS:
        row = (name, paper, *claim_row(res, pu, kind, a_, b_, what, cpt, pop_users),
               claim_cmd(cmd, kind, a_, b_, what))
        if row[3] != "not run yet" or variants is None or claim_variants(kind, a_, b_, what) & set(variants):
            rows.append(row)
    return rows


def report(a, res, targets, popularity, cmd, figs=(), histories=None):
    """results/<dataset>.md from the collected runs; targets / popularity / the test histories from 01's dataset.pt
    (without histories, most-popular is each user's mean from 06's eval json: the baseline rule's reference)."""
    variants = [v for v in res if res[v]]
    cold = popularity[targets] <= COLD_MAX
    e0 = next((r["eval"] for v in variants for r in res[v] if r["eval"]), None)
    pop_users = (ev.per_user_metrics(ev.popular_topk(popularity, histories, 20, True), targets)["recall@10"]
                 if histories is not None else np.full(len(targets), e0["most_popular"]["recall@10"]) if e0 else None)
    sids = sorted({r.get("sids", "-") for v in variants for r in res[v]})
    pu = {v: per_user(res[v], targets, cold) for v in variants}
    cpt, chains = collect_cpt(a)
    md = [f"# Study: {a.dataset}", "",
          f"Command: `{cmd}` (pieces: `--seeds 0`, `--seeds 1`, `--seeds 2`; this report covers the runs finished when "
          f"it was written).  ", f"Machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, device "
          f"{a.device}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; SIDs (sha256 of the sids.npy each run "
          f"trained on): {', '.join(x[:6] for x in sids) or '-'}; compute "
          f"{sum(r['seconds'] for v in variants for r in res[v]) / 3600:.2f} h (sum of the runs' step times)"
          + (f" + {sum(sum(t.values()) for t in chains.values()) / 3600:.2f} h of CPT chains" if chains else "")
          + ".  ",
          f"Budget: 05's defaults (220 steps x 8, lr 1e-3, level softmax), validation every {EVAL_EVERY} steps; GTI "
          f"{GROUND_STEPS} grounding steps; 06 beam 20 over all {len(targets)} test users, history excluded; cold "
          f"targets = seen <= {COLD_MAX} times in training ({int(cold.sum())} users).  ",
          "Differences are paired over users: per user the metric is averaged over the seeds both variants ran, then "
          "users are resampled (2,000 bootstrap draws, 95% percentile interval). With >= 2 seeds per variant a second "
          "interval covers the training runs: the 95% t interval of the per-seed differences (seed s of a minus "
          "seed s of b, which saw the same SFT example order).", ""]
    # --- claims
    fewest = min([len(res[v]) for v in variants] + [len(ds) for per in cpt.values() for ds in per.values()])
    md += ["## The papers' claims in early training (05's 220 steps x 8 = 0.33 epoch)", "",
           "At this budget the mean-init baselines have not trained: a claim against a baseline whose Recall@10 does "
           "not beat most-popular's (paired bootstrap over users) is not testable: the baseline did not train. The "
           "GTI claims at the validation peak, under the papers' vocabulary softmax: ml-100k_convergence.md.", "",
           "Verdict: reproduced when the 95% interval of (ours - baseline) lies above 0, "
           "not reproduced when it lies below 0, inconclusive when it contains 0; with >= 2 seed pairs both intervals "
           "(users and seeds) must agree, otherwise the difference is inside the seed spread: inconclusive. Steps: a "
           "run that never reaches the loss counts at its last step, a bound read only in the direction it holds. "
           "Geometry: the 95% t interval of the per-seed effect, reproduced at lower end >= the threshold, not "
           "reproduced at upper end <= 0 (popularity axis: <= the permutation null's q95; reproduced only where every "
           "seed beats it), and only where the rows training produced moved, rms(rows - the rows it started from) >= "
           f"{MOVED} x their spread on the seeds' interval (lower end; one seed: its value): below that even rows "
           "pushed toward other rows keep their init's RSA and purity within the thresholds. CPT: centroid + 1 ~ "
           f"random + 8 only with both intervals inside +-{EQUIV_MARGIN:.1%} of random + 8's Recall@5 (the centroid "
           "paper's headline gain; two one-sided tests), not from a difference that is merely not significant."
           + (f" **Provisional: {fewest} seed(s) for some variants.** The bootstrap resamples users, not "
              "training runs; with fewer than 3 seeds a verdict can flip with the next seed." if fewest < 3 else ""), "",
           "| claim | paper | ours | verdict | command |", "|---|---|---|---|---|"]
    rows = claims(res, pu, cmd.split(" --seeds")[0] + " --seeds 0,1,2", cpt, getattr(a, "variants", None),
                  pop_users)
    md += [f"| {' | '.join(r)} |" for r in rows]
    if len(rows) < len(CLAIMS):
        md += ["", f"Left out: {len(CLAIMS) - len(rows)} claims whose variants this piece does not run."]
    # --- per variant
    thr, _, _ = convergence(res, "centroid", "random")
    md += [] if not variants else ["", "## Test metrics per variant (mean +- std over seeds: the seed spread)", "",
           "| variant | tokenizer | init | GTI | aux | seeds | " + " | ".join(n for _, n in METRICS)
           + f" | cold R@10 | best val loss | steps to val loss {thr:.3f} | h/run |", "|---" * (len(METRICS) + 10) + "|"]
    for v in variants:
        rs, d = res[v], VARIANTS[v]
        seed_means = lambda k, c=False: [float(pu[v]["users_by_seed"][r["seed"]]["cold" if c else "all"][k].mean())
                                         for r in rs]
        reach = [steps_to(r["sft"]["val_curve"], thr) for r in rs if r["sft"]]
        md.append(f"| {v} | {d.tokenizer} | {d.init}{' ' + d.scale if d.scale else ''}"
                  f"{', vocabulary softmax' if d.softmax == 'full' else ''} | {'yes' if d.gti else ''} | "
                  f"{'yes' if d.aux else ''} | {len(rs)} ({','.join(str(r['seed']) for r in rs)}) | "
                  + " | ".join(mean_std(seed_means(k)) for k, _ in METRICS) + f" | {mean_std(seed_means(COLD, True))}"
                  f" | {mean_std([r['sft']['best_val_loss'] for r in rs if r['sft']], '{:.3f}')}"
                  f" | {mean_std(reach, '{:.0f}')} ({sum(x is not None for x in reach)}/{len(reach)} reached)"
                  f" | {mean_std([r['seconds'] / 3600 for r in rs if r['seconds']], '{:.2f}')} |")
    if e0:
        md.append("| most popular | | | | | | " + " | ".join(f"{e0['most_popular'][k]:.4f}" for k, _ in METRICS)
                  + f" | {e0['cold_most_popular'][COLD]:.4f} | | | |")
    # --- paired differences
    md += [] if not pairs(variants) else ["", "## Paired differences (a - b; the seeds both ran pooled per user; 95% bootstrap over users)", "",
           "| a | b | seeds a/b | " + " | ".join(n for _, n in METRICS) + " | cold R@10 | R@10 per seed pair (t 95%) |",
           "|---" * (len(METRICS) + 5) + "|"]
    for x, y in pairs(variants):
        cells = [fmt_iv(boot(*paired_users(pu[x], pu[y], "all", k)[:2])) for k, _ in METRICS]
        cells.append(fmt_iv(boot(*paired_users(pu[x], pu[y], "cold", COLD)[:2])))
        sd = seed_diffs(pu[x], pu[y], "all", "recall@10")
        cells.append(fmt_iv(t_interval(sd)) + f" ({len(sd)} pairs)" if len(sd) >= 2 else "-")
        md.append(f"| {x} | {y} | {pu[x]['seeds']}/{pu[y]['seeds']} | " + " | ".join(cells) + " |")
    ex = {v: per_user(res[v], targets, cold, "exact_topk") for v in variants}
    ex = {v: p for v, p in ex.items() if p}
    if ex:                                                             # --exact: does the search change a comparison?
        md += ["", "## Beam vs exact top-20 (seed 0): the same differences, exact search", "",
               "| a | b | " + " | ".join(n for _, n in METRICS) + " |", "|---" * (len(METRICS) + 2) + "|"]
        md += [f"| {x} | {y} | " + " | ".join(fmt_iv(boot(*paired_users(ex[x], ex[y], "all", k)[:2]))
                                              for k, _ in METRICS) + " |" for x, y in pairs(list(ex))]
    # --- geometry
    mv = lambda ds: "inf" if float("inf") in map(moved, ds) else mean_std(list(map(moved, ds)), "{:.2f}")  # noqa: E731
    md += [] if not variants else ["", "## Geometry of the SID rows (07, all levels; mean +- std over seeds)", "",
           f"moved: rms(rows - the rows training started from) / their spread (a claim needs >= {MOVED}; inf: the "
           "init rows had no spread; -: not measured).", "",
           "| variant | stage | " + " | ".join(n for _, n in GEOMETRY) + " | purity@10 | moved |",
           "|---" * (len(GEOMETRY) + 4) + "|"]
    for v in variants:
        for st in ("init", "ground", "sft"):
            ds = [r["diag"][st] for r in res[v] if r["diag"].get(st)]
            if ds:
                md.append(f"| {v} | {st} | " + " | ".join(mean_std([d["levels"]["all"].get(k) for d in ds], "{:.2f}")
                                                          for k, _ in GEOMETRY)
                          + f" | {mean_std([d['purity'] for d in ds], '{:.3f}')} | {mv(ds)} |")
    if cpt:
        md += ["", "## Geometry after CPT, before SFT (07 on the CPT chains' folders; mean +- std over seeds)", "",
               "04 --train all: every parameter, lr 1e-4 after 10 warmup steps (constant), 8 text <-> SID pairs a "
               "step; an epoch is one pass over the pairs. Epoch 0 is 03's rows."
               + "".join(f" 04 of {c}: {t['04c'] / 60:.0f} min." for c, t in chains.items() if "04c" in t), "",
               "| init | CPT epochs | seeds | " + " | ".join(n for _, n in GEOMETRY) + " | purity@10 | moved |",
               "|---" * (len(GEOMETRY) + 5) + "|"]
        for init, per in cpt.items():
            for e, ds in sorted(per.items()):
                diags = list(ds.values())
                md.append(f"| {init} | {e} | {len(ds)} ({','.join(map(str, sorted(ds)))}) | "
                          + " | ".join(mean_std([d["levels"]["all"].get(k) for d in diags], "{:.2f}")
                                       for k, _ in GEOMETRY)
                          + f" | {mean_std([d['purity'] for d in diags], '{:.3f}')} | {mv(diags)} |")
    # --- validation curves
    figs = [validation_figure(a, res, variants, thr) if variants else None] + list(figs)
    if any(figs):
        md += ["", "## Figures", ""] + [f"![{os.path.basename(f)}]({os.path.basename(f)})" for f in figs if f]
    os.makedirs(a.results_dir, exist_ok=True)
    path = os.path.join(a.results_dir, f"{a.dataset}.md")
    atomic_write(path, lambda t: open(t, "w").write("\n".join(md) + "\n"))
    print("\n".join(md[:40]))
    print(f"wrote {path}")
    return path


def validation_figure(a, res, variants, thr):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for v in variants:
        curves = [np.array([c[:2] for c in r["sft"]["val_curve"]]) for r in res[v] if r["sft"]]
        if curves:
            n = min(len(c) for c in curves)
            y = np.stack([c[:n, 1] for c in curves])
            ax.plot(curves[0][:n, 0], y.mean(0), marker=".", label=f"{v} ({len(curves)})",
                    ls="--" if VARIANTS[v].tokenizer != "rqvae" else "-")
            ax.fill_between(curves[0][:n, 0], y.mean(0) - y.std(0), y.mean(0) + y.std(0), alpha=0.15)
    if np.isfinite(thr):
        ax.axhline(thr, color="k", lw=0.5, ls=":")
    ax.set(xlabel="SFT step", ylabel="validation loss", title=f"{a.dataset}: validation loss (mean +- std over seeds)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(a.results_dir, f"{a.dataset}_val_loss.png")
    os.makedirs(a.results_dir, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------------
# Main: setup, then seed-major over the variants, then the report
# ---------------------------------------------------------------------------------------------------
def main(argv=None):
    a = parse_args(argv)
    os.chdir(REPO)
    rd = "" if a.results_dir == "results" else f" --results-dir {a.results_dir}"
    cmd = f"python scripts/study.py --dataset {a.dataset}{rd} --seeds {','.join(map(str, a.seeds))}"
    if a.variants != DEFAULT_VARIANTS:
        cmd += f" --variants {','.join(a.variants)}" + (" --cpt-only" if a.cpt_only else "")
    if not a.report_only:
        if not os.path.exists(os.path.join(BACKBONE, "config.json")) and not a.dry_run:
            die(f"{BACKBONE} not found; run `make setup` first")
        print(f"=== {a.dataset}: {len(a.variants)} variants x seeds {a.seeds}, device {a.device}"
              + (" (dry run: estimated CPU seconds on 2 idle cores)" if a.dry_run else ""))
        total, logs = 0.0, os.path.join(a.work_dir, a.dataset, "logs")
        total += execute(a, plan_setup(a, None), logs)                 # 01, then each tokenizer's 02 (rqvae first)
        for t in sorted({VARIANTS[v].tokenizer for v in a.variants}, key=lambda t: t != "rqvae"):
            if not a.dry_run:
                stage_tokenizer(a, t)
            total += execute(a, plan_setup(a, t), logs)
        for seed in a.seeds:                                           # seed-major: one seed of everything first
            for init in dict.fromkeys(VARIANTS[v].init for v in a.variants if VARIANTS[v].cpt):
                print(f"--- CPT chain {init} seed {seed}")
                total += run_chain(a, init, seed)
            for v in [] if a.cpt_only else a.variants:
                print(f"--- {v} seed {seed}")
                total += run_one(a, v, seed)
        print(f"{'estimated' if a.dry_run else 'measured'} CPU time of this piece: {total / 3600:.2f} h")
        if a.dry_run:
            return
    ds = os.path.join(a.out_root, a.dataset, "dataset.pt")                # 01's, whichever SIDs the runs used
    if not os.path.exists(ds):
        die(f"{ds} not found; run the study (01) first")
    import torch
    data = torch.load(ds, weights_only=True)
    res = collect(a, list(VARIANTS))
    if not any(res.values()) and not collect_cpt(a)[0]:
        die(f"no finished run under {os.path.join(a.work_dir, a.dataset)}; run a piece first")
    os.makedirs(a.results_dir, exist_ok=True)
    figs = seed0_figures(a, [v for v in VARIANTS if res[v]])
    report(a, res, data["test"].numpy(), data["popularity"].numpy(), cmd, figs,
           [s[:-1] for s in data["sequences"]])                           # the test histories (valid item included)


if __name__ == "__main__":
    main()
