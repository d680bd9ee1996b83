"""Copy generated text into the README, so that the numbers it shows are the files' (never typed by hand).

A README block
    <!-- from results/ml-100k_make_run.md: ## Test, history excluded -->
    ... (replaced) ...
    <!-- end -->
holds that section of the file (the lines under the heading, up to the next heading of its level), or the
whole file below its title with `: *`.  `python scripts/sync_readme.py` rewrites the blocks;
`--check` only says whether they are current (tests/test_readme.py runs it).
"""
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = re.compile(r"(<!-- from (\S+): (.+?) -->\n)(.*?)(<!-- end -->)", re.S)


def section(path: str, heading: str) -> str:
    with open(os.path.join(REPO, path)) as f:
        lines = f.read().rstrip("\n").split("\n")
    if heading == "*":
        body = lines[1:]
    else:
        if heading not in lines:
            sys.exit(f"error: {path} has no line {heading!r}; rerun `make results` or fix the README block")
        level = heading.split(" ")[0] + " "
        i = lines.index(heading) + 1
        j = next((k for k in range(i, len(lines)) if lines[k].startswith(level)), len(lines))
        body = lines[i:j]
    return "\n".join(body).strip("\n") + "\n"


def synced(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + section(m.group(2), m.group(3)) + m.group(5), text)


def main():
    path = os.path.join(REPO, "README.md")
    text = open(path).read()
    new = synced(text)
    if "--check" in sys.argv[1:]:
        sys.exit(0 if new == text else "README.md blocks differ from results/: run `python scripts/sync_readme.py`")
    with open(path + ".tmp", "w") as f:
        f.write(new)
    os.replace(path + ".tmp", path)
    print(f"README.md: {len(BLOCK.findall(text))} blocks synced")


if __name__ == "__main__":
    main()
