#!/usr/bin/env python3
"""TLS against plaintext in the same run (docs/security.md).

Each round runs every measurement with TLS (client certificates, a job CA made by the program)
and without, back to back, the order rotating between rounds, and prints one JSON object per
metric on stdout:

  {"bench":"tls","metric":"latency_p50_64B","value":72.1,"unit":"us","plain":66.0,
   "tls_over_plain":1.09,"runs":3}

value is TLS's median; tls_over_plain is TLS's figure over plaintext's (for times: > 1 means
TLS is slower; for bandwidth: < 1 means TLS is slower).

Measurements:
  latency_p50_64B, latency_p99_64B   bench_rpc pingpong of 64 bytes (BENCH_TLS=1 for TLS), with
                                     WEFT_SHM=0 (the network path, as between hosts: the
                                     shared-memory rings of one host carry no TLS)
  bandwidth_16MiB, bandwidth_64MiB   bench_rpc stream, one-way tensors, 4 calls in flight (on the
                                     direct connection, TLS through OpenSSL)
  join_w4, ready_w4, join_w8, ready_w8
                                     bench_tls ready: a world of 4 / 8 forked ranks, time from rank
                                     0's start to its join, and to every rank having called every
                                     other (all N(N-1) streams open)
Python 3 standard library only.
"""
import os
import sys
import time

from benchlib import Values, emit_results, fmt, run_rounds, runner_args, say_done

MiB = 1 << 20


def as_tls(tls):
    def mapper(ln):
        sysname = "tls" if tls or ln["system"] == "weft_tls" else "plain"
        return [(ln["metric"], sysname, ln["value"], ln.get("unit", ""))]
    return mapper


def main():
    a = runner_args(__doc__, "fewer iterations and rounds of the world start", "also write the result JSON lines to this file",
                    "(unused: no torch here)")
    b = os.path.join(a.builddir, "bench")
    rpc, ready = os.path.join(b, "bench_rpc"), os.path.join(b, "bench_tls")
    for p in (rpc, ready):
        if not os.access(p, os.X_OK):
            print("run_tls: %s missing; run meson compile -C %s" % (p, a.builddir), file=sys.stderr)
            return 1
    iters = "1000" if a.quick else "3000"
    jobs = [["pingpong", "64", iters], ["stream", "16M", "64", "4"], ["stream", "64M", "16", "4"]]
    groups = []
    for job in jobs:
        # WEFT_SHM=0: the network path, where TLS applies (ranks of one host otherwise talk
        # through the shared-memory rings, which TLS does not wrap: they never leave the host)
        groups.append([("plain", ["/usr/bin/env", "WEFT_SHM=0", "BENCH_TLS=0", rpc] + job, " ".join(job),
                        as_tls(False)),
                       ("tls", ["/usr/bin/env", "WEFT_SHM=0", "BENCH_TLS=1", rpc] + job, " ".join(job),
                        as_tls(True))])
    # bench_tls alternates plaintext and TLS itself, in one program per world size.
    for world in (4, 8):
        groups.append([("both", [ready, "ready", str(world), "2" if a.quick else "3"], "ready %d" % world,
                        as_tls(False))])
    values = Values()
    t_start = time.monotonic()
    failures = run_rounds("run_tls", a, groups, values.add)
    results = []
    for m in values.order:
        med = values.medians(m)
        t, p = med.get("tls"), med.get("plain")
        ratio = None if t is None or p is None or p == 0 else round(t / p, 3)
        results.append({"bench": "tls", "metric": m, "value": fmt(t), "unit": values.units[m], "plain": fmt(p),
                        "tls_over_plain": ratio, "runs": values.runs(m, "tls")})
    emit_results(results, a.out, "w")
    say_done("run_tls", a.repeat, t_start, failures)
    return 1 if failures or not values.order else 0


if __name__ == "__main__":
    sys.exit(main())
