"""The form the repository keeps: a README that stays true (its generated blocks equal results/), short
numbered scripts and docstrings, nothing that points outside the repository."""
import ast
import os
import re
import subprocess
import sys

from conftest import REPO

SCRIPTS = ["01_embed_items.py", "02_rqvae.py", "03_expand_vocab.py", "04_ground.py", "05_sft.py",
           "06_eval.py", "07_diagnose.py"]


def test_readme_blocks_equal_the_generated_files():
    r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "sync_readme.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    readme = open(os.path.join(REPO, "README.md")).read()
    assert readme.count("<!-- from ") >= 2 and len(readme.splitlines()) <= 250


def test_docstrings_short_and_lines_within_120_columns():
    for s in SCRIPTS:
        src = open(os.path.join(REPO, s)).read()
        assert len(ast.get_docstring(ast.parse(src)).splitlines()) <= 35, s
        assert max(map(len, src.splitlines())) <= 120, s          # the whole repository's limit


def test_nothing_points_outside_the_repository():
    bad = re.compile(r"issue \d|issue's|shared docs|METHODS\.md|git worktree")
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in {".git", ".venv", "data", "models", "out", "runs"}
                   and not d.startswith(("out-", "."))]
        for f in files:
            if f.endswith((".py", ".md", "Makefile")) and f != "test_readme.py":
                text = open(os.path.join(root, f), encoding="utf-8").read()
                assert not bad.search(text), (os.path.join(root, f), bad.search(text).group())
