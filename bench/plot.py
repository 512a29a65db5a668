#!/usr/bin/env python3
"""Draws the sweeps of benchmark result files (the JSON lines run_rpc.py and run_collectives.py
write with --out) into PNG files, so that a reader sees at a glance where weft stands:

  python3 bench/plot.py --out bench/plots bench/results-rpc-DATE.jsonl bench/results-collectives-DATE.jsonl

For RPC results: rpc_latency.png (p50 round trip against payload size) and rpc_bandwidth.png
(GB/s against tensor size), one line per system. For collectives results: coll_<op>_w<world>.png
(algorithm bandwidth against message size), one line per system. weft is drawn thick.

Needs python3-matplotlib (scripts/setup.sh installs it; Debian's lives under /usr/bin/python3).
"""
import argparse
import json
import os
import sys


def size_of(label):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10), ("B", 0)):
        if label.endswith(unit) and label[:-len(unit)].isdigit():
            return int(label[:-len(unit)]) << shift
    return None


def load(paths):
    rows = []
    for p in paths:
        with open(p) as f:
            for ln in f:
                ln = ln.strip()
                if ln.startswith("{"):
                    try:
                        rows.append(json.loads(ln))
                    except ValueError:
                        pass
    return rows


def series(rows, size_key):
    """{system: [(size, value)]} of rows (weft's value, then every peer's)."""
    out = {}
    for sz, r in sorted(((size_key(r), r) for r in rows), key=lambda t: t[0]):
        if sz is None:
            continue
        if r.get("value") is not None:
            out.setdefault("weft", []).append((sz, r["value"]))
        for peer, v in (r.get("peers") or {}).items():
            if v is not None:
                out.setdefault(peer, []).append((sz, v))
    return out


def draw(plt, data, title, ylabel, path, logy):
    if not data:
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    order = ["weft"] + sorted(s for s in data if s != "weft")
    for s in order:
        pts = data.get(s)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s,
                    linewidth=2.8 if s == "weft" else 1.2, zorder=3 if s == "weft" else 2)
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print("plot: drew %s" % path, file=sys.stderr)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the PNG files")
    p.add_argument("files", nargs="+", help="result JSON lines files")
    a = p.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot: needs python3-matplotlib (try /usr/bin/python3 bench/plot.py ...)", file=sys.stderr)
        return 1
    rows = load(a.files)
    os.makedirs(a.out, exist_ok=True)

    rpc = [r for r in rows if r.get("bench") == "rpc"]
    lat = [r for r in rpc if r.get("metric", "").startswith("latency_p50_")]
    draw(plt, series(lat, lambda r: size_of(r["metric"][len("latency_p50_"):])),
         "RPC round trip between two ranks of one host (p50)", "us (log)",
         os.path.join(a.out, "rpc_latency.png"), True)
    bw = [r for r in rpc if r.get("metric", "").startswith("bandwidth_")]
    draw(plt, series(bw, lambda r: size_of(r["metric"][len("bandwidth_"):])),
         "RPC bandwidth between two ranks of one host", "GB/s",
         os.path.join(a.out, "rpc_bandwidth.png"), False)

    coll = [r for r in rows if r.get("bench") == "collectives" and r.get("metric") == "algbw"]
    for op, world in sorted({(r.get("op"), r.get("world")) for r in coll}):
        sel = [r for r in coll if r.get("op") == op and r.get("world") == world]
        draw(plt, series(sel, lambda r: r.get("bytes")),
             "%s, %d ranks of one host" % (op, world), "algorithm bandwidth (GB/s, log)",
             os.path.join(a.out, "coll_%s_w%d.png" % (op, world)), True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
