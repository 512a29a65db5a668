#!/usr/bin/env python3
"""A synthetic click-through-rate data set in Criteo's TSV format, for bench/run_hybrid.py: the
file that weft's examples/hybrid_train and its torch twin bench/torch_hybrid_train.py both read
with --data FILE (so both train on exactly the same samples).

Format (Criteo's Kaggle train.txt, as examples/criteo.c reads it): one sample per line, 40
tab-separated fields: the label (0 or 1), 13 integer features (counts; empty with probability
--missing) and 26 categorical features written as 8 lowercase hexadecimal digits (32-bit values,
as Criteo's hashes). The learners reduce a value v to the id 1 + v mod (rows - 1) of a table of
`rows` rows and a count x to log(1 + max(x, 0)).

The samples come from a planted logistic model, criteo.c's synthetic model written into the file:
  - dense feature j (j = 0..12) is a count floor(exp(m_j + s_j z)), z ~ N(0, 1), with
    m_j = 0.5 + 2.5 j / 12 and s_j = 0.75 + 0.25 (j mod 3), empty with probability --missing
    (0.05); the model sees x_j = log(1 + count) (0 when empty);
  - categorical feature f draws a rank r in [0, V) from Zipf(s) (P(r) proportional to
    (r + 1)^-s; V = --values 10000, s = --zipf 1.2) and writes that rank's 32-bit value, drawn
    once per (feature, rank) from the seed; each (feature, rank) also has a planted weight
    w_f(r) ~ N(0, --cat-scale^2) (0.2);
  - the planted logit is b + sum_j a_j (x_j - m_j) / s_j + sum_f w_f(r_f), with a_j drawn once
    (|a_j| in [0.15, 0.45], random sign) and b set by bisection on the first 100000 samples so
    that the mean click probability is --ctr (0.25, Criteo's rate); the label is 1 with
    probability sigmoid(logit).
The weights belong to the written values, not to the learners' ids: two values of a feature that
fall on one id (about 50 of the 10000 per feature with 1M rows) share a row the learners cannot
split; the ceiling below ignores that (it is the planted model's, an upper bound).

Everything comes from --seed through Python's random.Random (Mersenne Twister, stable across
CPython versions), so the same arguments give the same file byte for byte. The file is written
to PATH.tmp, then renamed; a sidecar PATH.json holds the arguments and the planted model's
held-out ceiling (the last n // 10 samples, the learners' held-out split): its AUC (exact, ties at
their mean rank) and logloss, and the click rate.

  gen_ctr_data.py PATH [--samples 200000] [--seed 1] [--values 10000] [--zipf 1.2]
                  [--cat-scale 0.2] [--missing 0.05] [--ctr 0.25]

Prints the sidecar's JSON line on stdout. Python 3 standard library only (about 5 s per 100k
samples on this machine's cores).
"""
import argparse
import bisect
import json
import math
import os
import random
import sys
import time

N_DENSE = 13
N_SPARSE = 26
CALIB = 100000


def auc(scores, labels):
    """The exact AUC (Mann-Whitney; tied scores get their mean rank), as ctr_train's; None without
    both classes."""
    order = sorted(range(len(scores)), key=scores.__getitem__)
    n = len(order)
    rank_sum = 0.0
    pos = 0
    i = 0
    while i < n:
        j = i
        p = 0
        s = scores[order[i]]
        while j < n and scores[order[j]] == s:
            p += labels[order[j]]
            j += 1
        rank_sum += p * 0.5 * (i + 1 + j)  # ranks i+1 .. j
        pos += p
        i = j
    if pos == 0 or pos == n:
        return None
    return (rank_sum - 0.5 * pos * (pos + 1)) / (pos * (n - pos))


def bce(z, y):
    """Binary cross-entropy of logit z for label y, in the stable form."""
    return max(z, 0.0) + math.log1p(math.exp(-abs(z))) - (z if y else 0.0)


def _sigmoid(z):
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def generate(path, samples=200000, seed=1, values=10000, zipf=1.2, cat_scale=0.2, missing=0.05,
             ctr=0.25):
    """Writes the file (see the module's docstring) and its sidecar; returns the sidecar's dict."""
    if samples < 2 or values < 1:
        raise ValueError("samples must be >= 2, values >= 1")
    t0 = time.monotonic()
    rng = random.Random(seed)
    m = [0.5 + 2.5 * j / (N_DENSE - 1) for j in range(N_DENSE)]
    s = [0.75 + 0.25 * (j % 3) for j in range(N_DENSE)]
    a = []
    for _ in range(N_DENSE):
        mag = 0.15 + 0.3 * rng.random()
        a.append(mag if rng.random() >= 0.5 else -mag)
    hexes, wts = [], []
    for f in range(N_SPARSE):
        rf = random.Random(seed * 1000003 + 7919 * (f + 1))
        hexes.append(["%08x" % rf.getrandbits(32) for _ in range(values)])
        wts.append([rf.gauss(0.0, cat_scale) for _ in range(values)])
    cdf = []
    acc = 0.0
    for r in range(values):
        acc += (r + 1.0) ** -zipf
        cdf.append(acc)
    total = cdf[-1]

    rnd, gauss, exp, floor, log1p = rng.random, rng.gauss, math.exp, math.floor, math.log1p
    find = bisect.bisect_left
    dense_terms = list(zip(m, s, a))
    sparse_terms = list(zip(hexes, wts))
    lines, logits = [], []
    for _ in range(samples):
        z = 0.0
        parts = []
        for mj, sj, aj in dense_terms:
            if rnd() < missing:
                parts.append("")
                x = 0.0
            else:
                c = int(floor(exp(mj + sj * gauss(0.0, 1.0))))
                parts.append(str(c))
                x = log1p(c)
            z += aj * (x - mj) / sj
        for hx, w in sparse_terms:
            r = find(cdf, rnd() * total)  # the first rank whose cumulative weight reaches u
            if r >= values:
                r = values - 1
            parts.append(hx[r])
            z += w[r]
        lines.append("\t".join(parts))
        logits.append(z)

    calib = logits[:min(samples, CALIB)]
    lo, hi = -10.0, 10.0
    for _ in range(40):  # the bias that gives the mean rate ctr
        mid = 0.5 * (lo + hi)
        if sum(_sigmoid(z + mid) for z in calib) / len(calib) < ctr:
            lo = mid
        else:
            hi = mid
    b = 0.5 * (lo + hi)
    labels = []
    tmp = path + ".tmp"
    with open(tmp, "w") as out:
        for i in range(samples):
            z = logits[i] + b
            logits[i] = z
            y = 1 if rnd() < _sigmoid(z) else 0
            labels.append(y)
            out.write("%d\t%s\n" % (y, lines[i]))
    os.replace(tmp, path)

    n_eval = samples // 10 if samples // 10 > 0 else 1
    ev_z, ev_y = logits[samples - n_eval:], labels[samples - n_eval:]
    meta = {"file": path, "samples": samples, "seed": seed, "values": values, "zipf": zipf,
            "cat_scale": cat_scale, "missing": missing, "ctr_target": ctr,
            "click_rate": round(sum(labels) / float(samples), 5), "bias": round(b, 6),
            "eval_samples": n_eval, "ceiling_auc": auc(ev_z, ev_y),
            "ceiling_logloss": round(sum(bce(z, y) for z, y in zip(ev_z, ev_y)) / n_eval, 5),
            "bytes": os.path.getsize(path), "gen_s": round(time.monotonic() - t0, 2)}
    if meta["ceiling_auc"] is not None:
        meta["ceiling_auc"] = round(meta["ceiling_auc"], 5)
    with open(path + ".json", "w") as f:
        f.write(json.dumps(meta, separators=(",", ":")) + "\n")
    return meta


def same_args(meta, samples, seed, values, zipf, cat_scale, missing, ctr):
    """Whether a sidecar describes a file made with these arguments."""
    want = {"samples": samples, "seed": seed, "values": values, "zipf": zipf, "cat_scale": cat_scale,
            "missing": missing, "ctr_target": ctr}
    return all(meta.get(k) == v for k, v in want.items())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path")
    p.add_argument("--samples", type=int, default=200000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--values", type=int, default=10000)
    p.add_argument("--zipf", type=float, default=1.2)
    p.add_argument("--cat-scale", type=float, default=0.2)
    p.add_argument("--missing", type=float, default=0.05)
    p.add_argument("--ctr", type=float, default=0.25)
    a = p.parse_args()
    if a.samples < 2 or a.values < 1 or not 0 <= a.missing < 1 or not 0 < a.ctr < 1:
        p.error("--samples >= 2, --values >= 1, --missing in [0, 1), --ctr in (0, 1)")
    meta = generate(a.path, a.samples, a.seed, a.values, a.zipf, a.cat_scale, a.missing, a.ctr)
    print(json.dumps(meta, separators=(",", ":")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
