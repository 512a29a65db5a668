#!/usr/bin/env python3
"""The hybrid-parallel training benchmark (weft's main job): weft's examples/hybrid_train (the CTR
model of examples/ctr_train, its 26 embedding tables sharded on 2 parameter-server ranks with
server-side Adagrad and row-sparse pushes, the dense MLP replicated on 2 trainers under weft's DDP
reducer) in its three consistency modes against its torch twin bench/torch_hybrid_train.py
(torch's "Combining DDP with Distributed RPC Framework" pattern: RemoteModule EmbeddingBags on 2
parameter servers, DDP over gloo on 2 trainers, distributed autograd, DistributedOptimizer), in
one run on this host, world 4, one thread per rank.

Data: one synthetic Criteo-format TSV file (bench/gen_ctr_data.py: label, 13 integer and 26
hexadecimal categorical features; Zipf-distributed ids, labels from a planted logistic model),
--samples rows (200000; --quick 50000) from --seed, written once to --workdir (default /tmp) as
ctr-SAMPLES-sSEED.tsv, or reused when that file's sidecar (.json) says it was made with the same
arguments (--regen makes it anew); --data FILE uses an existing Criteo TSV file instead. Both
systems read the same file (--data), hold out its last n // 10 samples and train with the same
options: --epochs (2), --batch (1024, global), --rows (1000000 rows per table), --seed (1), and
ctr_train's default model and optimizer settings (dim 16, MLP 64,32, Adam lr 0.002, Adagrad lr
0.05).

Systems, each run in every round, back to back, the order rotating between rounds (so that
drift of the shared machine hits them alike); medians over --repeat rounds (default 3; --quick 1):

  weft_sync     weftrun -n 4 --servers 2 BUILDDIR/examples/hybrid_train --data FILE --json
                --mode sync [common options]
  weft_async    ... --mode async
  weft_bounded  ... --mode bounded --staleness S (--staleness, default 2)
  torch         PY bench/torch_hybrid_train.py --data FILE --json [common options]

Common options: --epochs, --batch, --rows, --seed, --target-auc T and --eval-every N (held-out
AUC measured every N steps, default 20, and after each epoch, the training clock stopped; the
target defaults to 0.78, --quick 0.76: about 0.04 below the planted model's ceiling, which torch
reaches within the 2 epochs). hybrid_train gets an option only if its --help mentions it (the
runner says on stderr which it leaves out); without --target-auc it reports no time to target.

Each program prints one JSON line: weft's first trainer (rank 2 under weftrun --servers 2; its
"[rank 2] " prefix is stripped, other ranks' lines ignored), the torch twin's trainer0 (no
prefix). Each is echoed to stderr with its system, round and the runner's wall_s (the program's
whole run, start to exit, measured here; it replaces the program's own). Fields used:
samples_per_s, time_to_target_s, peak_rss_mb (max over the 4 ranks of ru_maxrss, MiB), auc,
logloss, wall_s.

Result lines (stdout; appended to --out, default bench/results-hybrid-DATE.jsonl; --quick: not
saved unless --out), each {"bench":"hybrid",...,"date":..}:
  row "data":  the data set: samples, seed, click rate, the planted model's held-out AUC
               ("ceiling_auc") and logloss, the target AUC.
  row "vs_torch": per (metric, system) the median, its unit and runs, and for the weft systems
               "vs": {"torch": weft / torch}; on weft_sync's lines "target" and "meets_target":
                 samples_per_s      weft_sync / torch >= 3
                 time_to_target_s   weft_sync / torch <= 0.5 (met as well when weft reaches the
                                    target and torch does not; not met when weft does not)
                 peak_rss_mb        weft_sync / torch <= 1 (the max over ranks of each)
               (a weft line without the metric's field gives "meets_target": null and a "note")
               auc, logloss and wall_s are reported without targets.
  row "modes": per metric, the three weft modes side by side: "values": {"sync":..,"async":..,
               "bounded":..} (medians) and "vs_sync" (each mode / sync).
peak_rss_mb lines also carry "per_rank" (ranks 0..3, medians) when the program reports
"peak_rss_mb_ranks" (the torch twin does; its servers hold dense tables of --rows rows and, per
trainer, Adagrad accumulators of the same size).
A system whose program is missing, not built (hybrid_train's placeholder says "not built yet")
or without torch is left out with a message on stderr; a run that fails or prints no result line
counts as a failure (exit status 1).

  run_hybrid.py [--builddir build] [--repeat 3] [--quick] [--samples 200000] [--epochs 2]
                [--batch 1024] [--rows 1000000] [--seed 1] [--staleness 2] [--target-auc X]
                [--eval-every 20] [--workdir /tmp] [--data FILE] [--regen] [--out FILE]
                [--skip-torch] [--torch-python PY] [--timeout 900]

Python 3 standard library only (the torch twin runs under --torch-python, default this python
if it has torch, else /usr/bin/python3).
"""
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time

from benchlib import emit_results, find_torch_python, jline, median_of, run_proc, train_bench_args
from gen_ctr_data import generate, same_args

HERE = os.path.dirname(os.path.abspath(__file__))
PROG = "run_hybrid"
SERVERS = 2
WORLD = 4
MODES = ("sync", "async", "bounded")
PREFIX = re.compile(r"^\[rank (\d+)\] ")
METRICS = (("samples_per_s", "samples/s"), ("time_to_target_s", "s"), ("peak_rss_mb", "MiB"),
           ("auc", "fraction"), ("logloss", "nats"), ("wall_s", "s"))
LOWER_BETTER = {"time_to_target_s", "peak_rss_mb", "logloss", "wall_s"}


def parse_args():
    p = train_bench_args(__doc__, "1 round, 50000 samples, target AUC 0.76, not saved", None,
                         "rounds (default 3, --quick 1); medians are reported")
    p.add_argument("--samples", type=int, default=None, help="rows of the generated file (default 200000)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=1024, help="global batch (both trainers)")
    p.add_argument("--rows", type=int, default=1000000, help="rows per embedding table")
    p.add_argument("--seed", type=int, default=1, help="data, initialisation and shuffling seed")
    p.add_argument("--staleness", type=int, default=2, help="bounded mode's staleness")
    p.add_argument("--target-auc", type=float, default=None, help="default 0.78 (--quick 0.76)")
    p.add_argument("--eval-every", type=int, default=20, help="steps between AUC measurements (0: epoch ends)")
    p.add_argument("--workdir", default="/tmp", help="where the generated file goes")
    p.add_argument("--data", help="an existing Criteo TSV file instead of the generated one")
    p.add_argument("--regen", action="store_true", help="generate the file even if it exists")
    p.add_argument("--out", help="results file (default bench/results-hybrid-DATE.jsonl)")
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--torch-python")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    a = p.parse_args()
    if a.repeat is None:
        a.repeat = 1 if a.quick else 3
    if a.samples is None:
        a.samples = 50000 if a.quick else 200000
    if a.target_auc is None:
        a.target_auc = 0.76 if a.quick else 0.78
    if a.repeat < 1 or a.samples < 20 or a.epochs < 1 or a.batch < 2 or a.rows < 2 or a.eval_every < 0:
        p.error("--repeat, --epochs >= 1, --samples >= 20, --batch, --rows >= 2, --eval-every >= 0")
    return a


# ------------------------------------------------------------------ data


def data_file(a):
    """The Criteo TSV both systems read, and what is known of it (the sidecar, or just the path)."""
    if a.data:
        meta = {"file": a.data}
        try:
            with open(a.data + ".json") as f:
                meta = json.load(f)
        except (OSError, ValueError):
            pass
        return a.data, meta
    os.makedirs(a.workdir, exist_ok=True)
    path = os.path.join(a.workdir, "ctr-%d-s%d.tsv" % (a.samples, a.seed))
    gen_args = dict(samples=a.samples, seed=a.seed, values=10000, zipf=1.2, cat_scale=0.2, missing=0.05, ctr=0.25)
    if not a.regen and os.path.exists(path):
        try:
            with open(path + ".json") as f:
                meta = json.load(f)
            if same_args(meta, **gen_args) and os.path.getsize(path) == meta.get("bytes"):
                print("%s: reusing %s" % (PROG, path), file=sys.stderr)
                return path, meta
        except (OSError, ValueError):
            pass
    print("%s: generating %s (%d samples)" % (PROG, path, a.samples), file=sys.stderr, flush=True)
    meta = generate(path, **gen_args)
    print(jline(meta), file=sys.stderr, flush=True)
    return path, meta


# ------------------------------------------------------------------ programs


def weft_options(hybrid):
    """hybrid_train's --help text, or None (with a message) when it cannot run or is the
    placeholder."""
    if not os.access(hybrid, os.X_OK):
        print("%s: %s not found (build it: ninja -C BUILDDIR); weft rows skipped" % (PROG, hybrid), file=sys.stderr)
        return None
    try:
        r = subprocess.run([hybrid, "--help"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        print("%s: %s --help: %s; weft rows skipped" % (PROG, hybrid, e), file=sys.stderr)
        return None
    if "not built yet" in r.stdout or r.returncode != 0:
        print("%s: %s is not built yet (--help: exit %d: %s); weft rows skipped"
              % (PROG, hybrid, r.returncode, r.stdout.strip()[:200]), file=sys.stderr)
        return None
    return r.stdout


def common_options(a, path):
    return [("--data", path), ("--epochs", str(a.epochs)), ("--batch", str(a.batch)), ("--rows", str(a.rows)),
            ("--seed", str(a.seed)), ("--target-auc", repr(a.target_auc)), ("--eval-every", str(a.eval_every))]


def weft_argv(a, weftrun, hybrid, help_text, path, mode):
    argv = [weftrun, "-n", str(WORLD), "--servers", str(SERVERS), hybrid, "--json", "--mode", mode]
    if mode == "bounded":
        argv += ["--staleness", str(a.staleness)]
    for opt, val in common_options(a, path):
        if re.search(r"(^|\s)%s\b" % re.escape(opt), help_text):
            argv += [opt, val]
    return argv


def left_out(help_text, a, path):
    return [opt for opt, _ in common_options(a, path) if not re.search(r"(^|\s)%s\b" % re.escape(opt), help_text)]


def result_line(out, rank):
    """The first JSON result line (an object with "system") of rank `rank` (weftrun's "[rank R] "
    prefix), or of unprefixed output when rank is None."""
    for ln in (out or "").splitlines():
        m = PREFIX.match(ln)
        if m:
            if rank is None or int(m.group(1)) != rank:
                continue
            ln = ln[m.end():]
        elif rank is not None:
            continue
        ln = ln.strip()
        if ln.startswith("{"):
            try:
                d = json.loads(ln)
            except ValueError:
                continue
            if isinstance(d, dict) and "system" in d:
                return d
    return None


def rounds(systems, repeat, timeout, env):
    """train_rounds (benchlib) with the result taken from a given rank: systems is a list of
    (system, argv, rank); each round runs them back to back, the order rotating between rounds.
    Returns ({("hybrid", system): [result dicts]}, failures)."""
    got = {}
    failures = 0
    for rnd in range(repeat):
        k = rnd % len(systems)
        for system, argv, rank in systems[k:] + systems[:k]:
            out, err_text, err, wall = run_proc(argv, timeout, env=env)
            d = result_line(out, rank)
            if err is not None or d is None:
                failures += 1
                print("%s: %s: %s" % (PROG, system, err or "no result line"), file=sys.stderr)
                if err_text and err is None:
                    print("\n".join(err_text.strip().splitlines()[-5:]), file=sys.stderr)
                continue
            d["program_wall_s"] = d.get("wall_s")
            d.update({"as": system, "round": rnd, "wall_s": round(wall, 2)})
            print(jline(d), file=sys.stderr, flush=True)
            got.setdefault(("hybrid", system), []).append(d)
    return got, failures


# ------------------------------------------------------------------ results


def per_rank(got, system):
    """The per-rank medians of peak_rss_mb_ranks (ranks 0..3: the servers, then the trainers),
    when the program reports them; else None."""
    lists = [d["peak_rss_mb_ranks"] for d in got.get(("hybrid", system), [])
             if isinstance(d.get("peak_rss_mb_ranks"), list) and len(d["peak_rss_mb_ranks"]) == WORLD]
    if not lists:
        return None
    return [round(statistics.median(x[r] for x in lists), 1) for r in range(WORLD)]


def main():
    t_start = time.monotonic()
    a = parse_args()
    torch_python = None if a.skip_torch else find_torch_python(a)
    if torch_python is None:
        print("%s: no python with torch (or --skip-torch): torch rows skipped" % PROG, file=sys.stderr)
    weftrun = os.path.join(a.builddir, "tools", "weftrun")
    hybrid = os.path.join(a.builddir, "examples", "hybrid_train")
    twin = os.path.join(HERE, "torch_hybrid_train.py")
    help_text = weft_options(hybrid)
    if help_text is not None and not os.access(weftrun, os.X_OK):
        print("%s: %s not found; weft rows skipped" % (PROG, weftrun), file=sys.stderr)
        help_text = None
    if help_text is None and torch_python is None:
        print("%s: nothing to run" % PROG, file=sys.stderr)
        return 1
    path, meta = data_file(a)

    systems = []
    if help_text is not None:
        missing = left_out(help_text, a, path)
        if missing:
            print("%s: hybrid_train --help does not mention %s: left out of its command line"
                  % (PROG, ", ".join(missing)), file=sys.stderr)
        for mode in MODES:
            systems.append(("weft_" + mode, weft_argv(a, weftrun, hybrid, help_text, path, mode), SERVERS))
    if torch_python is not None:
        argv = [torch_python, twin, "--json", "--timeout", repr(a.timeout)]
        for opt, val in common_options(a, path):
            argv += [opt, val]
        systems.append(("torch", argv, None))
    for system, argv, _ in systems:
        print("%s: %s: %s" % (PROG, system, " ".join(argv)), file=sys.stderr)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    got, failures = rounds(systems, a.repeat, a.timeout, env)

    def med(system, metric):
        return median_of(got, "hybrid", system, metric)

    def runs(system):
        return len(got.get(("hybrid", system), []))

    date = datetime.date.today().isoformat()
    config = {"samples": meta.get("samples"), "epochs": a.epochs, "batch": a.batch, "rows": a.rows,
              "seed": a.seed, "target_auc": a.target_auc, "eval_every": a.eval_every, "staleness": a.staleness}
    results = [dict({"bench": "hybrid", "row": "data", "metric": "ceiling_auc",
                     "value": meta.get("ceiling_auc"), "unit": "fraction",
                     "ceiling_logloss": meta.get("ceiling_logloss"), "click_rate": meta.get("click_rate"),
                     "file": path}, **config, date=date)]
    targets = {"samples_per_s": ("weft_sync / torch >= 3", lambda r: r >= 3),
               "time_to_target_s": ("weft_sync / torch <= 0.5", lambda r: r <= 0.5),
               "peak_rss_mb": ("weft_sync / torch <= 1", lambda r: r <= 1)}
    for metric, unit in METRICS:
        peer = med("torch", metric)
        for system, _, _ in systems:
            v = med(system, metric)
            n = runs(system)
            if n == 0:
                continue
            r = {"bench": "hybrid", "row": "vs_torch", "metric": metric, "system": system,
                 "value": None if v is None else round(v, 5), "unit": unit, "runs": n}
            ratio = None
            if system != "torch" and runs("torch"):
                ratio = round(v / peer, 3) if v is not None and peer else None
                r["vs"] = {"torch": ratio}
            if system == "weft_sync" and metric in targets and runs("torch"):
                text, ok = targets[metric]
                r["target"] = text
                if not any(metric in d for d in got.get(("hybrid", system), [])):
                    r["meets_target"] = None
                    r["note"] = "hybrid_train reports no %s" % metric
                elif metric == "time_to_target_s" and v is not None and peer is None:
                    r["meets_target"] = True  # weft reached the AUC, torch did not
                else:
                    r["meets_target"] = None if ratio is None else bool(ok(ratio))
                    if v is None and metric == "time_to_target_s":
                        r["meets_target"] = False  # weft did not reach the AUC
            if metric == "peak_rss_mb":
                per = per_rank(got, system)
                if per:
                    r["per_rank"] = per
            r.update(config)
            r["date"] = date
            results.append(r)
    if any(runs("weft_" + m) for m in MODES):
        for metric, unit in METRICS:
            vals = {m: med("weft_" + m, metric) for m in MODES}
            sync = vals["sync"]
            results.append(dict({"bench": "hybrid", "row": "modes", "metric": metric, "unit": unit,
                                 "values": {m: (None if v is None else round(v, 5)) for m, v in vals.items()},
                                 "vs_sync": {m: (round(v / sync, 3) if v is not None and sync else None)
                                             for m, v in vals.items()},
                                 "runs": {m: runs("weft_" + m) for m in MODES}}, **config, date=date))
    out = a.out if a.out else (None if a.quick else os.path.join(HERE, "results-hybrid-%s.jsonl" % date))
    emit_results(results, out, "a")
    print("%s: %d rounds of %d systems in %.0f s%s" % (PROG, a.repeat, len(systems), time.monotonic() - t_start,
                                                       ", %d failed runs" % failures if failures else ""),
          file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
