"""requirements.txt lists what the code imports (plus pytest, and gguf + accelerate, which transformers needs to
read the GGUF backbone), and nothing else."""
import ast
import os
import re
import subprocess
import sys

from conftest import REPO

STDLIB = set(sys.stdlib_module_names)
THROUGH_TRANSFORMERS = {"gguf", "accelerate"}   # transformers needs both for `gguf_file=` (convert_backbone.py)


def imported_packages():
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True).stdout.split()
    names = set()
    for f in files:
        for node in ast.walk(ast.parse(open(os.path.join(REPO, f)).read())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module.split(".")[0])
    local = {os.path.basename(f)[:-3] for f in files}                  # this repository's own modules
    return names - STDLIB - local


def required():
    lines = open(os.path.join(REPO, "requirements.txt")).read().splitlines()
    return {re.split(r"[<>=!~ ]", l.strip())[0] for l in lines if l.strip() and not l.startswith("#")}


def test_every_import_is_declared_and_every_requirement_is_used():
    imports, reqs = imported_packages(), required()
    assert imports - reqs == set(), "imported but not in requirements.txt"
    unused = reqs - imports - THROUGH_TRANSFORMERS - {"pytest"}
    assert unused == set(), "in requirements.txt but imported nowhere"
    assert "gguf_file=" in open(os.path.join(REPO, "scripts", "convert_backbone.py")).read()
