"""What every step shares and that is not the lesson: one-line CLI errors, device and dtype, seeding, several
processes, the lr schedule and the resume state, atomic writes, guarded loaders, the model folder (model +
tokenizer + sid_vocab.json), and load_step, with which scripts/, bench/ and tests use a numbered step's
functions. A numbered script imports this module and never imports or runs another numbered script."""
import argparse
import hashlib
import importlib.util
import json
import math
import os
import random
import shutil
import sys
from contextlib import nullcontext

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")            # nothing is fetched from a hub at run time
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
REPO = os.path.dirname(os.path.abspath(__file__))


def die(msg: str):
    """Bad input ends the run with one clear line on stderr and exit status 1."""
    sys.exit(f"error: {msg}")


# --- the CLI: plain argparse, a bad flag is one line ---------------------------------------------
class Parser(argparse.ArgumentParser):
    """argparse with one-line errors and every flag's default in --help."""

    def __init__(self, doc: str):
        super().__init__(prog=os.path.basename(sys.argv[0]), description=doc.split("\n\n")[0],
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    def error(self, message):  # one line instead of argparse's usage dump
        die(f"{message} (see `python {self.prog} --help`)")


def _bounded(kind, ok, what):
    def check(s):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {s!r}")
        if not ok(v):
            raise argparse.ArgumentTypeError(f"must be {what} (got {s})")
        return v
    check.__name__ = kind.__name__
    return check


pos_int = _bounded(int, lambda v: v >= 1, ">= 1")         # type= for counts that must be >= 1
nonneg_int = _bounded(int, lambda v: v >= 0, ">= 0")      # type= for counts where 0 means off/all
pos_float = _bounded(float, lambda v: 0 < v < math.inf, "> 0 and finite")
nonneg_float = _bounded(float, lambda v: 0 <= v < math.inf, ">= 0 and finite")


def add_device_flags(p: Parser, dtype_help: str = "auto = bf16 on CUDA, fp32 on CPU"):
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                   help="auto = cuda, else mps, else cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help=f"bf16 autocast of the matmuls (weights stay fp32); {dtype_help}")


# --- device, dtype, seed, several processes; the lr schedule, the resume state -------------------
def pick_device(name: str) -> torch.device:
    """--device auto -> cuda, else mps, else cpu; a device that is not there is one line."""
    if name == "auto":
        mps = torch.backends.mps.is_available()
        name = "cuda" if torch.cuda.is_available() else "mps" if mps else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        die("--device cuda but CUDA is not available; use --device cpu")
    if name == "mps" and not torch.backends.mps.is_available():
        die("--device mps but MPS is not available; use --device cpu")
    return torch.device(name)


def pick_autocast(name: str, device: torch.device, cpu_bf16_pays: bool = True):
    """The one dtype rule: weights, optimizer state and softmaxes stay fp32; only the matmuls may run in
    bf16 (autocast; fp32 on MPS). auto = bf16 on CUDA, and on CPUs with native bf16 (AVX512-BF16 / AMX) in
    the steps where it measured faster (cpu_bf16_pays; docs/design.md). Returns (context, note to print)."""
    native_cpu = device.type == "cpu" and getattr(torch.cpu, "_is_avx512_bf16_supported",
                                                  lambda: False)()
    if name == "auto":
        fast = device.type == "cuda" or (native_cpu and cpu_bf16_pays)
        name = "bfloat16" if fast else "float32"
    if name == "float32" or device.type == "mps":
        return nullcontext(), "float32"
    note = f"bf16 autocast on {device.type} (fp32 weights)"
    return torch.autocast(device.type, dtype=torch.bfloat16), note


def seed_everything(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def init_distributed(device_flag: str):
    """torchrun: join the group (NCCL on CUDA, else gloo) -> (True, rank, world, device); else (False, 0, 1, device)"""
    if int(os.environ.get("RANK", -1)) == -1:
        return False, 0, 1, pick_device(device_flag)
    import torch.distributed as dist
    cuda = device_flag in ("auto", "cuda") and torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    return True, dist.get_rank(), dist.get_world_size(), device


def warmup_cosine(step: int, warmup: int, total: int, floor: float = 0.0) -> float:
    """The lr multiplier at `step`: linear warmup to 1 over `warmup` steps, then cosine down to `floor` at `total`."""
    cos = 1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup)))   # 2 -> 0
    return (step + 1) / warmup if step < warmup else floor + (1 - floor) * 0.5 * cos


def save_resume(path: str, key: dict, extra: dict, **parts):
    """Write (atomically) the state --resume continues from: each of `parts`' state dict, `extra`, this run's `key`."""
    ck = {**{name: part.state_dict() for name, part in parts.items()}, **extra, "key": key}
    atomic_write(path, lambda t: torch.save(ck, t))


def load_resume(path: str, key: dict, **parts):
    """The state a killed run left at `path`, checked against this run's `key` (the arguments that must not
    change); each of `parts` (model=..., optimizer=...) gets its saved state dict. -> the rest of the state."""
    ck = load_pt(path, "a run writes it as it goes and removes it when it ends; run without --resume")
    if diff := [k for k in key if ck.get("key", {}).get(k) != key[k]]:
        die(f"--resume: {path} was written with other arguments ({', '.join(diff)}); use them or run without --resume")
    for name, part in parts.items():
        part.load_state_dict(ck.pop(name))
    return ck


# --- files: atomic writes, guarded loads ---------------------------------------------------------
def atomic_write(path: str, write):
    """write(tmp_path) then rename: an interrupted step leaves the previous artifact intact. For numpy:
    atomic_write(p, lambda t: np.save(open(t, "wb"), arr)) (np.save would add .npy to a str path)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(path: str, obj):
    atomic_write(path, lambda t: open(t, "w").write(json.dumps(obj, indent=2)))


def load_artifact(path: str, hint: str, read):
    """read(path), or one line naming the file and `hint` (which step makes it) if it fails."""
    if not os.path.isfile(path):
        die(f"{path} not found; {hint}")
    try:
        return read(path)
    except Exception as e:
        die(f"{path} is unreadable ({type(e).__name__}); {hint}")


def load_pt(path: str, hint: str):           # tensors, lists, dicts; never pickled objects
    return load_artifact(path, hint, lambda p: torch.load(p, map_location="cpu", weights_only=True))


def load_npy(path: str, hint: str) -> np.ndarray:
    return load_artifact(path, hint, lambda p: np.load(p, allow_pickle=False))


def load_json(path: str, hint: str):
    return load_artifact(path, hint, lambda p: json.loads(open(p, encoding="utf-8").read()))


# --- the model folder: Hugging Face model + tokenizer + sid_vocab.json ----------------------------
def load_hf(folder: str, hint: str, dtype=torch.float32):
    """(tokenizer, causal LM) from a Hugging Face folder (or hub name, offline: only if cached)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()                          # stderr stays one line on bad input
    try:
        tok = AutoTokenizer.from_pretrained(folder)
        return tok, AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    except Exception as e:
        why = "not found" if not os.path.exists(folder) else f"unreadable ({type(e).__name__})"
        die(f"{folder}: {why}; {hint}")


def pad_id(tok) -> int:
    """The token that pads a batch: the tokenizer's pad token, else its EOS (masked out either way)."""
    return tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)


def save_folder(dst: str, model, tok, files: dict):
    """A Hugging Face folder (model + tokenizer + files {name: text}) written to <dst>.tmp, then swapped
    in. A kill at any line leaves <dst> whole, or only <dst>.old (renamed back by the next call)."""
    tmp, old = f"{dst}.tmp", f"{dst}.old"
    if os.path.isdir(old) and not os.path.isdir(dst):                  # killed between the renames
        os.replace(old, dst)
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    for name, text in files.items():
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
    if os.path.exists(dst):
        os.replace(dst, old)
    os.replace(tmp, dst)
    shutil.rmtree(old, ignore_errors=True)


def items_key(ds: dict) -> str:
    """Fingerprint of dataset.pt's items (ids and texts, in order). 03 writes it into
    sid_vocab.json, so a model folder knows which dataset its SIDs index; 04-06 refuse another."""
    return hashlib.sha256(json.dumps([ds["item_ids"], ds["texts"]]).encode()).hexdigest()[:16]


def load_sid_model(model_dir: str, out_dir: str, device):
    """A 03/04/05 folder and the dataset.pt whose items its SIDs name, checked against each other ->
    (fp32 model on device, tokenizer, sid_vocab, dataset, codes (N, L+1) every item's SID,
    item_tok (N, L+1) the same as token ids, sft_config.json or {})."""
    path = os.path.join(model_dir, "sid_vocab.json")
    hint = "use a folder made by 03_expand_vocab.py (or 04/05)"
    vocab = load_json(path, hint)
    data = load_pt(os.path.join(out_dir, "dataset.pt"),
                   "run 01_embed_items.py first (or pass --out-dir)")
    fields = {"item_ids", "texts", "sequences", "train", "valid", "test", "popularity"}
    if not isinstance(data, dict) or not fields <= data.keys():
        die(f"{out_dir}/dataset.pt lacks the fields 01_embed_items.py writes; "
            "rerun it (or pass --out-dir)")
    try:
        codes = np.array(vocab["item_codes"], dtype=np.int64)                    # (N, L+1)
        item_tok = torch.tensor(vocab["item_token_ids"], dtype=torch.long)       # (N, L+1)
        names = [f"<{vocab['level_names'][l]}_{c}>" for row in codes.tolist()
                 for l, c in enumerate(row)]
    except (KeyError, TypeError, ValueError, IndexError) as e:
        die(f"{path} lacks what 03_expand_vocab.py writes ({type(e).__name__}: {e}); "
            "rebuild the folder with 03")
    if vocab.get("items_key") != items_key(data) or codes.shape != item_tok.shape:
        die(f"{path} was built for another dataset than {out_dir}/dataset.pt ({len(codes)} items "
            f"vs {len(data['item_ids'])}, or other ids/texts); rerun 03_expand_vocab.py "
            f"--out-dir {out_dir} or pass --out-dir")
    tok, model = load_hf(model_dir, hint)
    if tok.convert_ids_to_tokens(item_tok.flatten().tolist()) != names:
        die(f"{model_dir}: the tokenizer does not hold the SID tokens listed in sid_vocab.json; "
            "rebuild the folder with 03_expand_vocab.py")
    if model.get_input_embeddings().num_embeddings <= int(item_tok.max()):
        die(f"{model_dir}: embedding matrix smaller than the SID token ids; "
            "rebuild it with 03_expand_vocab.py")
    cfg_path = os.path.join(model_dir, "sft_config.json")
    sft_cfg = load_json(cfg_path, "rerun 05_sft.py") if os.path.exists(cfg_path) else {}
    return model.to(device).eval(), tok, vocab, data, codes, item_tok, sft_cfg


# --- for scripts/, bench/ and tests: a numbered step's functions, loaded by path ----------------------
def load_step(name: str):
    """load_step("06_eval") -> the module 06_eval.py, executed once per process (a name that starts
    with a digit cannot be imported with `import`)."""
    key = "step_" + name.removesuffix(".py")
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, os.path.join(REPO, name.removesuffix(".py") + ".py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[key]
            raise
    return sys.modules[key]
