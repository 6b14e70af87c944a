#!/usr/bin/env python3
"""The Python drop-in with GPU pointers against the Rust device API, from one run of
each on one machine: `gpu_pointers.py`'s document and `gpu_store --bench
--master-bin PATH`'s (its `own_master_process` rows: the same placement and the
same master process). For each object size both have, Python over Rust for
`put_from` and `get_into`: from the mean throughputs and from the median calls
(the median is what a per-call overhead shows in; a rare slow call moves the
mean). One JSON document out.

    python compare_gpu.py PYTHON.json RUST.json [--replica own_master_process]
"""

import argparse
import json
import re
import sys


def rust_rows(text, replica):
    """The `gpu_store` rows of `replica`, by object size (the document may be
    preceded or followed by log lines)."""
    rows = {}
    for m in re.findall(r'\{"replica"[^{}]*\}', text):
        r = json.loads(m)
        if r["replica"] == replica:
            rows[r["object_bytes"]] = r
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("python_json")
    ap.add_argument("rust_json")
    ap.add_argument("--replica", default="own_master_process")
    a = ap.parse_args()
    with open(a.python_json) as f:
        text = f.read()
    # The document starts on a line of its own; log lines may come before and after.
    start = re.search(r"^\{", text, re.M)
    if start is None:
        print(f"no JSON document in {a.python_json}", file=sys.stderr)
        return 1
    py, _ = json.JSONDecoder().raw_decode(text[start.start():])
    with open(a.rust_json) as f:
        rust = rust_rows(f.read(), a.replica)
    out = []
    for p in py["rows"]:
        r = rust.get(p["object_bytes"])
        if r is None:
            continue
        row = {"object_bytes": p["object_bytes"]}
        for call, py_key, rust_key in (("put_from", "put_from", "put_from_device"),
                                       ("get_into", "get_into", "get_into_device")):
            row[f"{call}_mean_ratio"] = round(p[f"{py_key}_gbps"] / r[f"{rust_key}_gbps"], 3)
            if f"{py_key}_p50_us" in p and f"{rust_key}_p50_us" in r:
                row[f"{call}_p50_ratio"] = round(r[f"{rust_key}_p50_us"] / p[f"{py_key}_p50_us"], 3)
        out.append(row)
    if not out:
        print(f"no object size in both documents (replica {a.replica})", file=sys.stderr)
        return 1
    print(json.dumps({"bench": "compare_gpu", "replica": a.replica, "python_over_rust": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
