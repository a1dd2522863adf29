"""Print each implementation's top kernels from a `leantune bench e2e --out DIR` folder (its profiled pass).

    python3 benchmarks/top_kernels.py DIR [--n 8]
"""

import argparse
import glob
import json

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("folder")
parser.add_argument("--n", type=int, default=8)
args = parser.parse_args()
for path in sorted(glob.glob(f"{args.folder}/*.json")):
    top = json.load(open(path)).get("top_kernels") or []
    print(f"top kernels, {path.rsplit('/', 1)[-1]}:")
    for t in top[:args.n]:
        print(f"  {t['ms_per_step']:8.2f} ms  x{t['calls_per_step']:<6g} {t['name'][:100]}")
