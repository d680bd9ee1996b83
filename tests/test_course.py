"""docs/course.md matches the code: every exercise names a function that exists in the script it names, with the
signature the text gives, and a pytest selection that collects at least one test (each was also checked by hand to
fail on a wrong body; docs/log.md)."""
import ast
import os
import re
import subprocess
import sys

from conftest import REPO

EXERCISE = re.compile(r"^\d+\. \*\*(?P<title>[^*]+)\*\* \((?P<script>0\d)[^`]*`(?P<func>[\w.]+)`", re.M)
SIGNATURE = re.compile(r"`(?:def )?(?P<name>\w+)\((?P<args>[^)]*)\)(?: -> [^`]+)?`")
SELECTION = re.compile(r"`pytest (?P<file>tests/\S+\.py) -k \"?(?P<expr>[^\"`]+)\"?`")


def course():
    return open(os.path.join(REPO, "docs", "course.md")).read()


def exercises():
    text = course()
    starts = [m.start() for m in EXERCISE.finditer(text)] + [len(text)]
    return [(m, text[a:b]) for m, a, b in zip(EXERCISE.finditer(text), starts, starts[1:])]


def functions(script):
    path = next(os.path.join(REPO, f) for f in os.listdir(REPO) if f.startswith(script) and f.endswith(".py"))
    out = {}
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = node
    return out


def test_every_exercise_names_a_function_with_its_signature_and_a_selection():
    found = exercises()
    assert len(found) >= 7
    for m, body in found:
        funcs = functions(m["script"])
        name = m["func"].split(".")[0]
        assert name in funcs, (m["title"], name)
        for sig in SIGNATURE.finditer(body):                       # a signature given in the text is the code's
            if sig["name"] in funcs and isinstance(funcs[sig["name"]], ast.FunctionDef):
                fn = funcs[sig["name"]].args
                args, required = [a.arg for a in fn.args], len(fn.args) - len(fn.defaults)
                said = [a.split("=")[0].split(":")[0].strip() for a in sig["args"].split(",") if a.strip()]
                open_end = "..." in said                                     # `f(a, b, ...)`: the rest not named
                said = [a for a in said if a != "..."]
                assert said == args[:len(said)], (m["title"], said, args)         # the code's names, in order
                assert open_end or len(said) >= required, (m["title"], said, args)  # no required one left out
        assert SELECTION.search(body), m["title"]


def test_every_selection_collects_a_test():
    for m, body in exercises():
        for sel in SELECTION.finditer(body):
            r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", sel["file"], "-k", sel["expr"]],
                               cwd=REPO, capture_output=True, text=True)
            n = re.search(r"(\d+)(?:/\d+)? tests? (?:collected|selected)", r.stdout)
            assert r.returncode == 0 and n and int(n.group(1)) >= 1, (m["title"], sel.group(0), r.stdout[-500:])
