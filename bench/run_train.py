#!/usr/bin/env python3
"""weft's data-parallel training benchmark against torch DistributedDataParallel (gloo).

Trains the same model on the same data with the same batch size and optimizer in both
systems, in one run: an MLP 784-HIDDEN-10 (ReLU) on Fashion-MNIST, pixels/255 normalised
with mean 0.2860 and std 0.3530, SGD(lr, momentum) without schedule, BATCH samples per
rank per step, each epoch's shard that of DistributedSampler(shuffle=True, drop_last=False),
test accuracy on the 10000 test images every --eval-every steps and after every epoch,
the training clock stopped during evaluation, stopping at the first evaluation that
reaches --target (--stop-at-target) or after --epochs epochs. One thread per rank.

  weft       BUILDDIR/tools/weftrun -n WORLD BUILDDIR/examples/dp_train --json ...
  torch_ddp  bench/torch_ddp_train.py WORLD ... under a python that has torch

For each repeat, for each world size, the two systems run in turn (the order alternating
between repeats, so that drift of a shared machine hits both alike); repeat r uses seed
SEED+r in both, so the medians average over training trajectories as well as timings.
Each program prints one JSON line (weftrun's "[rank 0] " prefix is stripped):

  {"system":"weft"|"torch_ddp","world":2,"batch":64,"lr":..,"momentum":..,"hidden":256,
   "epochs_run":..,"steps":..,"samples_per_s":..,"time_to_target_s":..|null,"target":0.85,
   "final_acc":..,"peak_rss_mb_max":..,"peak_rss_mb_sum":..}

which goes to stderr with "round", "seed" and the runner's "wall_s" added. Then one JSON
object per (world, metric) on stdout, value = weft's median over the repeats:

  {"bench":"train","world":2,"metric":"time_to_target_s","value":3.1,"unit":"s",
   "vs":{"torch_ddp":0.8},"ratio":"weft/peer","better":"lower","peers":{"torch_ddp":3.9},
   "runs":{"weft":3,"torch_ddp":3},"reached":{"weft":3,"torch_ddp":3},"settings":{..},
   "machine":{..},"date":".."}

metrics: time_to_target_s (median over the runs that reached the target), samples_per_s,
peak_rss_mb_max, peak_rss_mb_sum (MiB, ru_maxrss of the ranks), final_acc. Every ratio is
weft/torch: < 1 is better for time and memory, > 1 for samples_per_s. A markdown table of
the same follows on stdout. The raw lines and the summary lines are appended to
bench/results-train-DATE.jsonl (--out FILE instead; --no-save or --quick: not saved).

Parameter-server rows (--only ps runs them alone, --only dp the rows above alone): the same
model, data, batch per worker, lr, momentum, epochs and seeds trained through a parameter server,
PS_SERVERS server ranks holding the parameters (SGD with momentum on the servers, applied to the
mean of the workers' gradients once per step: sync) and PS_WORKERS workers, each step pull ->
forward/backward -> push:

  weft      BUILDDIR/tools/weftrun -n S+W --servers S /usr/bin/time -f .. BUILDDIR/examples/ps_train
            --json --mode sync ...
  torch_ps  bench/torch_ps_train.py --servers S --workers W ... (torch.distributed.rpc, the
            batch-updating parameter server of pytorch/examples; --ps-fetch picks its calls)

ps_train evaluates every --eval-every steps and after every epoch, the training clock stopped,
and runs all --epochs (no --stop-at-target); torch_ps_train.py does the same. ps_train's JSON
line has no time to target and no memory, so the runner takes them from its output: its
"step N: test accuracy X%, training T s" lines give the training seconds of each mid-epoch
evaluation; at the end of epoch E they are the samples trained so far (E x workers x
ceil(N / workers), N from its first line) over the cumulative samples/s of its "epoch E: ..."
line; time_to_target_s is that of the first evaluation whose test accuracy is >= --target;
peak_rss_mb_* is the ru_maxrss of each rank
(/usr/bin/time's %M around every rank; without /usr/bin/time they are null). torch_ps_train.py
reports both itself (getrusage of every rank, servers included). One JSON object per metric:

  {"bench":"train_ps","world":4,"servers":2,"workers":2,"mode":"sync","metric":"time_to_target_s",
   "value":2.1,"unit":"s","vs":{"torch_ps":1.9},"ratio":"peer/weft","better":"lower",
   "peers":{"torch_ps":4.0},"runs":{..},"reached":{..},"target":{"torch_ps":1.0},
   "meets_target":true,"settings":{..},"machine":{..},"date":".."}

Unlike the rows above, every "vs" of these rows is defined so that > 1 means weft is better
(peer/weft for time and memory, weft/peer for samples_per_s and final_acc), as in run_ps.py;
target is the issue's goal for it (time to target and the summed peak memory: weft's <= torch's,
i.e. vs >= 1) and meets_target whether the medians meet it. The metrics are those above plus
steps_to_target (steps per worker up to the evaluation that reached the target). Evaluating at
epoch ends only, time_to_target_s is the training time of 1, 2 or 3 whole epochs: a run whose
first epoch ends just under the target (about 0.85 after one epoch with these settings) needs a
second one, so the metric moves in whole epochs with the seed and the trajectory; read it with
steps_to_target and samples_per_s.
Python 3 standard library only.
"""
import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time

from benchlib import RANK_PREFIX, fmt, jline, rank0_results, run_proc, say_done, torch_python_for

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEMS = ["weft", "torch_ddp"]
METRICS = [  # (key, unit, better)
    ("time_to_target_s", "s", "lower"),
    ("samples_per_s", "samples/s", "higher"),
    ("peak_rss_mb_max", "MiB", "lower"),
    ("peak_rss_mb_sum", "MiB", "lower"),
    ("final_acc", "", "higher"),
]
PREFIX = RANK_PREFIX
PS_SYSTEMS = ["weft", "torch_ps"]
PS_METRICS = METRICS + [("steps_to_target", "steps", "lower")]  # the epoch the target fell in, per worker
PS_TARGETS = {"time_to_target_s": 1.0, "peak_rss_mb_sum": 1.0}  # vs >= 1: weft's <= torch's
TIME_BIN = "/usr/bin/time"
RSS_TAG = "weft_peak_rss_kb"
PS_HEAD = re.compile(r" on (\d+) Fashion-MNIST images, (\d+) servers, (\d+) workers")
PS_EPOCH = re.compile(r"^epoch (\d+): train loss \S+, test accuracy ([0-9.]+)%, [0-9.]+ s, ([0-9.]+) samples/s")
PS_RSS = re.compile(r"^%s (\d+)$" % RSS_TAG)
PS_STEP = re.compile(r"^step (\d+): test accuracy ([0-9.]+)%, training ([0-9.]+) s")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--builddir", default="build", help="meson build directory (default: build)")
    p.add_argument("--quick", action="store_true", help="smoke test: 1 repeat, world 2 only, not saved")
    p.add_argument("--repeat", type=int, default=None, help="rounds (default 3, --quick 1); medians are reported")
    p.add_argument("--worlds", default=None, help="comma list of world sizes (default 1,2; --quick 2)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step (default 64)")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seed", type=int, default=1, help="seed of round 0; round r uses SEED+r (default 1)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--target", type=float, default=0.85)
    p.add_argument("--no-stop-at-target", dest="stop_at_target", action="store_false",
                   help="train all epochs instead of stopping at the target")
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist", help="directory of the IDX files")
    p.add_argument("--out", help="append the JSON lines to this file (default bench/results-train-DATE.jsonl)")
    p.add_argument("--no-save", action="store_true", help="do not append to a results file")
    p.add_argument("--skip-torch", action="store_true", help="do not run torch (DDP, PS)")
    p.add_argument("--torch-python", help="python with torch (default: this one, else /usr/bin/python3)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    p.add_argument("--verbose", action="store_true", help="pass the programs' stderr through")
    p.add_argument("--only", choices=["dp", "ps"], help="run only the data-parallel (dp) or parameter-server (ps) rows")
    p.add_argument("--ps-servers", type=int, default=2, help="parameter-server rows: server ranks (default 2)")
    p.add_argument("--ps-workers", type=int, default=2, help="parameter-server rows: worker ranks (default 2)")
    p.add_argument("--ps-fetch", choices=["fused", "separate"], default="fused",
                   help="torch_ps_train.py --fetch: fused (default, the tutorial's update_and_fetch) or separate")
    a = p.parse_args()
    if a.repeat is None:
        a.repeat = 1 if a.quick else 3
    a.worlds = [int(w) for w in (a.worlds or ("2" if a.quick else "1,2")).split(",")]
    if a.quick and not a.out:
        a.no_save = True
    return a


def machine_info(torch_python):
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith("model name"):
                    cpu = ln.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {"nproc": os.cpu_count(), "cpu": cpu, "kernel": os.uname().release}
    if torch_python:
        try:
            r = subprocess.run([torch_python, "-c", "import torch; print(torch.__version__)"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, timeout=60)
            info["torch"] = r.stdout.strip() or None
        except (OSError, subprocess.TimeoutExpired):
            pass
    return info


def parse_output(out):
    """JSON lines of the output, weftrun's "[rank R] " prefix stripped; only rank 0's prefixed ones."""
    return rank0_results(out)


def run_cmd(cmd, timeout, verbose, env):
    """Runs one program in its own process group; returns (json lines, error text or None, wall seconds)."""
    try:
        out, _, err, wall = run_proc(cmd, timeout, verbose, env)
    except OSError as e:
        return [], str(e), 0.0
    lines = parse_output(out)
    if err is None and not lines:
        err = "no result line"
    return lines, err, wall


def common_opts(a, seed):
    o = ["--epochs", str(a.epochs), "--batch", str(a.batch), "--lr", "%g" % a.lr,
         "--momentum", "%g" % a.momentum, "--hidden", str(a.hidden), "--seed", str(seed),
         "--eval-every", str(a.eval_every), "--target", "%g" % a.target, "--data", a.data]
    if a.stop_at_target:
        o.append("--stop-at-target")
    return o


def commands(a, torch_python):
    """system -> function(world, seed) -> argv."""
    weftrun = os.path.join(a.builddir, "tools", "weftrun")
    prog = os.path.join(a.builddir, "examples", "dp_train")
    cmds = {"weft": lambda w, s: [weftrun, "-n", str(w), prog, "--json"] + common_opts(a, s)}
    if torch_python:
        cmds["torch_ddp"] = lambda w, s: ([torch_python, os.path.join(HERE, "torch_ddp_train.py"), str(w), "--json",
                                           "--timeout", "%g" % max(10.0, a.timeout - 10.0)] + common_opts(a, s))
    return cmds


def ps_commands(a, torch_python):
    """The parameter-server rows: system -> function(seed) -> argv."""
    S, W = a.ps_servers, a.ps_workers
    weftrun = os.path.join(a.builddir, "tools", "weftrun")
    prog = os.path.join(a.builddir, "examples", "ps_train")
    opts = lambda s: ["--epochs", str(a.epochs), "--batch", str(a.batch), "--lr", "%g" % a.lr,  # noqa: E731
                      "--momentum", "%g" % a.momentum, "--hidden", str(a.hidden), "--seed", str(s),
                      "--target", "%g" % a.target, "--eval-every", str(a.eval_every), "--data", a.data]
    # /usr/bin/time around every rank: its ru_maxrss (%M, KiB), printed on the rank's stderr.
    timer = [TIME_BIN, "-f", RSS_TAG + " %M"] if os.access(TIME_BIN, os.X_OK) else []
    cmds = {"weft": lambda s: ([weftrun, "-n", str(S + W), "--servers", str(S)] + timer
                               + [prog, "--json", "--mode", "sync"] + opts(s))}
    if torch_python:
        cmds["torch_ps"] = lambda s: ([torch_python, os.path.join(HERE, "torch_ps_train.py"), "--servers", str(S),
                                       "--workers", str(W), "--fetch", a.ps_fetch, "--json",
                                       "--timeout", "%g" % max(10.0, a.timeout - 10.0)] + opts(s))
    return cmds


def weft_built(a, example, rows):
    """Whether weftrun and the example are built; if not, says so and that rows are skipped."""
    needed = [os.path.join(a.builddir, "tools", "weftrun"), os.path.join(a.builddir, "examples", example)]
    if all(os.access(x, os.X_OK) for x in needed):
        return True
    print("run_train: %s missing; build it (ninja -C %s); %s skipped" % (" or ".join(needed), a.builddir, rows),
          file=sys.stderr)
    return False


def run_raw(cmd, timeout, env):
    """Like run_cmd, both streams kept: (stdout, stderr, error text or None, wall seconds)."""
    try:
        return run_proc(cmd, timeout, False, env)
    except OSError as e:
        return "", "", str(e), 0.0


def parse_weft_ps(out, err, target):
    """ps_train's JSON line (from whichever rank printed it) completed with what its other lines
    tell: time to target and the epochs' accuracies and training seconds (the lead worker's
    header and epoch lines) and the ranks' peak RSS (/usr/bin/time's lines). None if no line."""
    res = None
    head = None
    epochs = []  # (epoch, accuracy, cumulative samples/s)
    mids = []  # (step, accuracy, training seconds): --eval-every's evaluations
    rss = {}  # rank -> KiB
    for text in (out, err):
        for ln in (text or "").splitlines():
            m = PREFIX.match(ln)
            rank = int(m.group(1)) if m else None
            body = (ln[m.end():] if m else ln).strip()
            if body.startswith("{") and res is None:
                try:
                    d = json.loads(body)
                except ValueError:
                    d = None
                if isinstance(d, dict) and "system" in d:
                    res = d
                continue
            mh = PS_HEAD.search(body)
            if mh and head is None:
                head = (int(mh.group(1)), int(mh.group(3)))
                continue
            ms = PS_STEP.match(body)
            if ms:
                mids.append((int(ms.group(1)), float(ms.group(2)) / 100.0, float(ms.group(3))))
                continue
            me = PS_EPOCH.match(body)
            if me:
                epochs.append((int(me.group(1)), round(float(me.group(2)) / 100.0, 4), float(me.group(3))))
                continue
            mr = PS_RSS.match(body)
            if mr and rank is not None:
                rss[rank] = int(mr.group(1))
    if res is None:
        return None
    res["target"] = target
    res["time_to_target_s"] = None
    res["steps_to_target"] = None
    if head and epochs:
        used, nw = head
        per_epoch = nw * ((used + nw - 1) // nw)  # samples of all workers, padding included
        steps_per_epoch = res["steps"] // max(1, len(epochs))
        res["epoch_acc"] = [acc for _, acc, _ in epochs]
        res["epoch_train_s"] = [round(e * per_epoch / rate, 4) if rate > 0 else None for e, _, rate in epochs]
        # Every evaluation, in training-time order: the epoch ends and --eval-every's steps.
        evals = [(t, e * steps_per_epoch, acc) for (e, acc, _), t in zip(epochs, res["epoch_train_s"])
                 if t is not None] + [(t, st, acc) for st, acc, t in mids]
        for t, st, acc in sorted(evals):
            if acc >= target:
                res["time_to_target_s"] = t
                res["steps_to_target"] = st
                break
    n = res.get("servers", 0) + res.get("workers", 0)
    if rss and len(rss) == n:
        mb = [v / 1024.0 for v in rss.values()]
        res["peak_rss_mb_max"] = round(max(mb), 1)
        res["peak_rss_mb_sum"] = round(sum(mb), 1)
    else:
        res["peak_rss_mb_max"] = res["peak_rss_mb_sum"] = None
    res["peak_rss_ranks"] = len(rss)
    return res


def keep_last(lines, rnd, seed, wall, err, raw):
    """A run's last result line, with its round, seed and wall seconds, to stderr and raw; returns
    it unless the run failed (or printed none)."""
    for ln in lines[-1:]:
        ln["round"] = rnd
        ln["seed"] = seed
        ln["wall_s"] = round(wall, 3)
        text = jline(ln)
        print(text, file=sys.stderr, flush=True)
        raw.append(text)
        if not err:
            return ln
    return None


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main():
    a = parse_args()
    run_dp = a.only != "ps"
    run_ps = a.only != "dp"
    torch_python = torch_python_for(a, "run_train", "torch_ddp and torch_ps")
    cmds = commands(a, torch_python)
    if run_dp and not weft_built(a, "dp_train", "weft"):
        del cmds["weft"]
    systems = [s for s in SYSTEMS if s in cmds] if run_dp else []
    ps_cmds = ps_commands(a, torch_python)
    if run_ps and not weft_built(a, "ps_train", "weft's parameter-server rows"):
        del ps_cmds["weft"]
    if run_ps and not os.access(TIME_BIN, os.X_OK):
        print("run_train: no %s: weft's parameter-server peak RSS not measured" % TIME_BIN, file=sys.stderr)
    ps_systems = [s for s in PS_SYSTEMS if s in ps_cmds] if run_ps else []
    ps_world = a.ps_servers + a.ps_workers
    machine = machine_info(torch_python)
    settings = {"epochs": a.epochs, "batch": a.batch, "lr": a.lr, "momentum": a.momentum, "hidden": a.hidden,
                "seeds": [a.seed + r for r in range(a.repeat)], "eval_every": a.eval_every, "target": a.target,
                "stop_at_target": a.stop_at_target, "threads_per_rank": 1}
    ps_settings = {"epochs": a.epochs, "batch": a.batch, "lr": a.lr, "momentum": a.momentum, "hidden": a.hidden,
                   "seeds": [a.seed + r for r in range(a.repeat)], "servers": a.ps_servers,
                   "workers": a.ps_workers, "mode": "sync",
                   "eval": "every %d steps and epoch ends" % a.eval_every, "target": a.target,
                   "stop_at_target": False, "torch_fetch": a.ps_fetch, "threads_per_rank": 1}
    print("run_train: %s; %s" % (json.dumps(machine), json.dumps(settings if run_dp else ps_settings)),
          file=sys.stderr)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")

    raw = []
    values = {}  # world -> system -> [result lines]
    ps_values = {}  # system -> [result lines]
    failures = []
    t_start = time.monotonic()
    k = 0
    for rnd in range(a.repeat):
        seed = a.seed + rnd
        for world in (a.worlds if run_dp else []):
            r = k % len(systems) if systems else 0
            k += 1
            for system in systems[r:] + systems[:r]:
                cmd = cmds[system](world, seed)
                lines, err, wall = run_cmd(cmd, a.timeout, a.verbose, env)
                if err:
                    failures.append((system, world, seed, err))
                    print("run_train: %s world %d seed %d failed: %s" % (system, world, seed, err), file=sys.stderr)
                ln = keep_last(lines, rnd, seed, wall, err, raw)
                if ln:
                    values.setdefault(world, {}).setdefault(system, []).append(ln)
                print("run_train: %s world %d seed %d: %.1f s" % (system, world, seed, wall), file=sys.stderr)
        # The parameter-server rows, weft and torch in turn, the order alternating between rounds.
        r = rnd % len(ps_systems) if ps_systems else 0
        for system in ps_systems[r:] + ps_systems[:r]:
            out, errtext, err, wall = run_raw(ps_cmds[system](seed), a.timeout, env)
            if a.verbose and errtext:
                sys.stderr.write(errtext)
            if system == "weft":
                ln = parse_weft_ps(out, errtext, a.target)
                lines = [ln] if ln else []
            else:
                lines = parse_output(out)
            if not err and not lines:
                err = "no result line"
            if err:
                failures.append((system, ps_world, seed, err))
                print("run_train: ps %s seed %d failed: %s" % (system, seed, err), file=sys.stderr)
            ln = keep_last(lines, rnd, seed, wall, err, raw)
            if ln:
                ps_values.setdefault(system, []).append(ln)
            print("run_train: ps %s seed %d: %.1f s" % (system, seed, wall), file=sys.stderr)

    date = datetime.date.today().isoformat()
    summary = []
    table = []
    for world in (a.worlds if run_dp else []):
        runs = values.get(world, {})
        for key, unit, better in METRICS:
            med = {s: median([ln.get(key) for ln in runs.get(s, [])]) for s in systems}
            w = med.get("weft")
            p = med.get("torch_ddp")
            ratio = round(w / p, 3) if w is not None and p else None
            res = {"bench": "train", "world": world, "metric": key, "value": fmt(w), "unit": unit,
                   "vs": {"torch_ddp": ratio}, "ratio": "weft/peer", "better": better,
                   "peers": {"torch_ddp": fmt(p)}, "runs": {s: len(runs.get(s, [])) for s in systems}}
            if key == "time_to_target_s":
                res["reached"] = {s: sum(1 for ln in runs.get(s, []) if ln.get(key) is not None) for s in systems}
            res.update({"settings": settings, "machine": machine, "date": date})
            summary.append(jline(res))
            table.append((world, key, unit, better, w, p, ratio, res.get("reached")))
    ps_table = []
    if run_ps:
        for key, unit, better in PS_METRICS:
            med = {s: median([ln.get(key) for ln in ps_values.get(s, [])]) for s in ps_systems}
            w = med.get("weft")
            p = med.get("torch_ps")
            lower = better == "lower"
            ratio = round(p / w if lower else w / p, 3) if w and p else None
            res = {"bench": "train_ps", "world": ps_world, "servers": a.ps_servers, "workers": a.ps_workers,
                   "mode": "sync", "metric": key, "value": fmt(w), "unit": unit, "vs": {"torch_ps": ratio},
                   "ratio": "peer/weft" if lower else "weft/peer", "better": better,
                   "peers": {"torch_ps": fmt(p)}, "runs": {s: len(ps_values.get(s, [])) for s in ps_systems}}
            if key == "time_to_target_s":
                res["reached"] = {s: sum(1 for ln in ps_values.get(s, []) if ln.get(key) is not None)
                                  for s in ps_systems}
            if key in PS_TARGETS:
                res["target"] = {"torch_ps": PS_TARGETS[key]}
                res["meets_target"] = None if ratio is None else ratio >= PS_TARGETS[key]
            res.update({"settings": ps_settings, "machine": machine, "date": date})
            summary.append(jline(res))
            ps_table.append((key, better, w, p, ratio, res.get("reached"), res.get("meets_target")))
    for text in summary:
        print(text, flush=True)

    if run_dp:
        print()
        print("machine: %d x %s, torch %s; %s" % (machine["nproc"] or 0, machine["cpu"], machine.get("torch"),
                                                 ", ".join("%s=%s" % kv for kv in settings.items())))
        print()
        print("| world | metric | weft | torch DDP (gloo) | weft/torch | better |")
        print("|---|---|---|---|---|---|")
        for world, key, unit, better, w, p, ratio, reached in table:
            note = ""
            if reached:
                note = " (reached %s)" % ", ".join("%s %d/%d" % (s, reached[s], len(values.get(world, {}).get(s, [])))
                                                   for s in systems)
            print("| %d | %s%s | %s | %s | %s | %s |" % (world, key, note, fmt(w), fmt(p), ratio, better))
    if run_ps:
        print()
        print("parameter server (%d servers + %d workers, sync): machine: %d x %s, torch %s; %s"
              % (a.ps_servers, a.ps_workers, machine["nproc"] or 0, machine["cpu"], machine.get("torch"),
                 ", ".join("%s=%s" % kv for kv in ps_settings.items())))
        print()
        print("| metric | weft ps_train | torch rpc PS | weft advantage (> 1: weft better) | target | better |")
        print("|---|---|---|---|---|---|")
        for key, better, w, p, ratio, reached, meets in ps_table:
            note = ""
            if reached:
                note = " (reached %s)" % ", ".join("%s %d/%d" % (s, reached[s], len(ps_values.get(s, [])))
                                                   for s in ps_systems)
            tgt = "" if key not in PS_TARGETS else (">= %g: %s" % (PS_TARGETS[key], {True: "met", False: "not met",
                                                                                      None: "n/a"}[meets]))
            print("| %s%s | %s | %s | %s | %s | %s |" % (key, note, fmt(w), fmt(p), ratio, tgt, better))

    if not a.no_save and (raw or summary):
        path = a.out or os.path.join(HERE, "results-train-%s.jsonl" % date)
        with open(path, "a") as f:
            for text in raw + summary:
                f.write(text + "\n")
        print("run_train: appended %d lines to %s" % (len(raw) + len(summary), path), file=sys.stderr)
    say_done("run_train", a.repeat, t_start, len(failures), "round(s)")
    weft_missing = run_dp and ("weft" not in systems or any("weft" not in values.get(w, {}) for w in a.worlds))
    weft_missing = weft_missing or (run_ps and "weft" not in ps_values)
    return 1 if weft_missing or not raw else 0


if __name__ == "__main__":
    sys.exit(main())
