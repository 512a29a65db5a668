#!/usr/bin/python3
"""Writes optim_table.h: torch 1.13's optimizer trajectories for tests/autograd/test_optim.c.

For fixed initial parameters and a fixed sequence of gradients, runs torch.optim's SGD, Adagrad,
Adam and AdamW (several configurations each, in f64 and f32) and records the parameter after
every step; likewise sparse SGD and sparse Adagrad on an embedding-like table with sparse
gradients whose indices repeat. Run with a python that has torch 1.13:

    /usr/bin/python3 tests/autograd/data/gen_optim.py > tests/autograd/data/optim_table.h
"""
import sys

import torch

ROWS, COLS, STEPS = 3, 4, 5
# Gradient scales per step: a large one then small ones, so amsgrad's maximum matters.
SCALES = [1.0, 2.0, 0.1, 0.5, 0.05]

# Sparse: a [V, D] table; NNZ rows per step with repeated indices; row 6 is never touched.
V, D, NNZ = 7, 3, 5
SPARSE_INDICES = [
    [1, 4, 1, 0, 5],
    [2, 2, 2, 3, 0],
    [5, 1, 4, 4, 1],
    [0, 0, 3, 1, 2],
    [4, 5, 5, 5, 5],
]

# (name, kind, torch class, kwargs). Missing fields take torch's defaults.
DENSE_CASES = [
    ("sgd_plain", "SGD", dict(lr=0.1)),
    ("sgd_momentum", "SGD", dict(lr=0.1, momentum=0.9)),
    ("sgd_nesterov", "SGD", dict(lr=0.05, momentum=0.9, nesterov=True)),
    ("sgd_weight_decay", "SGD", dict(lr=0.1, weight_decay=0.01)),
    ("sgd_dampening", "SGD", dict(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.001)),
    ("adagrad_default", "ADAGRAD", dict(lr=0.1)),
    ("adagrad_decay", "ADAGRAD",
     dict(lr=0.1, lr_decay=0.05, weight_decay=0.02, initial_accumulator_value=0.1, eps=1e-6)),
    ("adam_default", "ADAM", dict(lr=0.01)),
    ("adam_weight_decay", "ADAM", dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)),
    ("adam_amsgrad", "ADAM", dict(lr=0.01, amsgrad=True)),
    ("adamw_default", "ADAMW", dict(lr=0.01)),
    ("adamw_amsgrad", "ADAMW", dict(lr=0.02, betas=(0.85, 0.995), weight_decay=0.1, amsgrad=True)),
]

SPARSE_CASES = [
    ("sparse_sgd", "SGD", dict(lr=0.1)),
    ("sparse_adagrad", "ADAGRAD", dict(lr=0.1)),
    ("sparse_adagrad_decay", "ADAGRAD",
     dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.05, eps=1e-8)),
]

CLASSES = {
    "SGD": torch.optim.SGD,
    "ADAGRAD": torch.optim.Adagrad,
    "ADAM": torch.optim.Adam,
    "ADAMW": torch.optim.AdamW,
}


def rounded(t):
    """Values rounded to 6 decimals, so the table reads well; exact in the header either way."""
    return [round(float(x), 6) for x in t.flatten()]


def config(kind, kw):
    """The full hyperparameters torch used (its defaults filled in), as the C struct's fields."""
    opt = CLASSES[kind]([torch.zeros(1, requires_grad=True)], **kw)
    g = opt.param_groups[0]
    betas = g.get("betas", (0.0, 0.0))
    return dict(
        lr=g["lr"],
        momentum=g.get("momentum", 0.0),
        dampening=g.get("dampening", 0.0),
        weight_decay=g.get("weight_decay", 0.0),
        nesterov=int(g.get("nesterov", False)),
        lr_decay=g.get("lr_decay", 0.0),
        initial_accumulator_value=g.get("initial_accumulator_value", 0.0),
        eps=g.get("eps", 0.0),
        beta1=betas[0],
        beta2=betas[1],
        amsgrad=int(g.get("amsgrad", False)),
    )


def run_dense(kind, kw, init, grads, dtype):
    p = torch.tensor(init, dtype=torch.float64).reshape(ROWS, COLS).to(dtype).requires_grad_()
    opt = CLASSES[kind]([p], **kw)
    out = []
    for g in grads:
        p.grad = torch.tensor(g, dtype=torch.float64).reshape(ROWS, COLS).to(dtype)
        opt.step()
        out.append([float(x) for x in p.detach().flatten()])
    return out


def run_sparse(kind, kw, init, rows, dtype):
    p = torch.tensor(init, dtype=torch.float64).reshape(V, D).to(dtype).requires_grad_()
    opt = CLASSES[kind]([p], **kw)
    out = []
    for idx, r in zip(SPARSE_INDICES, rows):
        values = torch.tensor(r, dtype=torch.float64).reshape(NNZ, D).to(dtype)
        # uncoalesced, as weft's sparse gradients are; torch coalesces where it must
        p.grad = torch.sparse_coo_tensor(torch.tensor([idx]), values, (V, D))
        opt.step()
        out.append([float(x) for x in p.detach().flatten()])
    return out


def num(x):
    r = repr(float(x))
    assert "inf" not in r and "nan" not in r
    return r


def array(values, indent):
    """A C initialiser, four numbers a line."""
    lines = []
    for i in range(0, len(values), 4):
        lines.append(indent + ", ".join(num(v) for v in values[i:i + 4]) + ",")
    return "{\n" + "\n".join(lines) + "\n" + indent[:-4] + "}"


def steps(traj, indent):
    return "{\n" + "".join(indent + array(s, indent + "    ") + ",\n" for s in traj) + \
        indent[:-4] + "}"


def case_fields(name, kind, cfg):
    return [
        '.name = "%s"' % name,
        ".kind = OPTIM_%s" % kind,
        ".lr = %s" % num(cfg["lr"]),
        ".momentum = %s" % num(cfg["momentum"]),
        ".dampening = %s" % num(cfg["dampening"]),
        ".weight_decay = %s" % num(cfg["weight_decay"]),
        ".nesterov = %d" % cfg["nesterov"],
        ".lr_decay = %s" % num(cfg["lr_decay"]),
        ".initial_accumulator_value = %s" % num(cfg["initial_accumulator_value"]),
        ".eps = %s" % num(cfg["eps"]),
        ".beta1 = %s" % num(cfg["beta1"]),
        ".beta2 = %s" % num(cfg["beta2"]),
        ".amsgrad = %d" % cfg["amsgrad"],
    ]


def main():
    torch.manual_seed(1234)
    init = rounded(torch.randn(ROWS * COLS))
    grads = [rounded(torch.randn(ROWS * COLS) * s) for s in SCALES]
    sparse_init = rounded(torch.randn(V * D))
    sparse_rows = [rounded(torch.randn(NNZ * D) * s) for s in SCALES]

    w = sys.stdout.write
    w("/* Generated by tests/autograd/data/gen_optim.py with torch %s; do not edit.\n" %
      torch.__version__)
    w(" * Parameter values after each step of torch.optim's optimizers, in f64 and f32, for the\n"
      " * inputs below (f32 runs start from these values rounded to f32). */\n")
    w("#ifndef WEFT_TEST_OPTIM_TABLE_H\n#define WEFT_TEST_OPTIM_TABLE_H\n\n")
    w("#include <stdint.h>\n\n")
    w("#define OPTIM_ROWS  %d\n#define OPTIM_COLS  %d\n#define OPTIM_STEPS %d\n" %
      (ROWS, COLS, STEPS))
    w("#define OPTIM_NUMEL (OPTIM_ROWS * OPTIM_COLS)\n")
    w("#define SPARSE_V    %d\n#define SPARSE_D    %d\n#define SPARSE_NNZ  %d\n\n" % (V, D, NNZ))
    w("typedef enum { OPTIM_SGD, OPTIM_ADAGRAD, OPTIM_ADAM, OPTIM_ADAMW } optim_kind_t;\n\n")
    w("typedef struct {\n"
      "    const char *name;\n"
      "    optim_kind_t kind;\n"
      "    double lr, momentum, dampening, weight_decay;\n"
      "    int nesterov;\n"
      "    double lr_decay, initial_accumulator_value, eps;\n"
      "    double beta1, beta2;\n"
      "    int amsgrad;\n"
      "    double f64[OPTIM_STEPS][OPTIM_NUMEL]; /* param after each step */\n"
      "    double f32[OPTIM_STEPS][OPTIM_NUMEL];\n"
      "} optim_case_t;\n\n")
    w("typedef struct {\n"
      "    const char *name;\n"
      "    optim_kind_t kind;\n"
      "    double lr, momentum, dampening, weight_decay;\n"
      "    int nesterov;\n"
      "    double lr_decay, initial_accumulator_value, eps;\n"
      "    double beta1, beta2;\n"
      "    int amsgrad;\n"
      "    double f64[OPTIM_STEPS][SPARSE_V * SPARSE_D];\n"
      "    double f32[OPTIM_STEPS][SPARSE_V * SPARSE_D];\n"
      "} sparse_case_t;\n\n")

    w("static const double optim_init[OPTIM_NUMEL] = %s;\n\n" % array(init, "    "))
    w("static const double optim_grads[OPTIM_STEPS][OPTIM_NUMEL] = %s;\n\n" % steps(grads, "    "))
    w("static const optim_case_t optim_cases[] = {\n")
    for name, kind, kw in DENSE_CASES:
        cfg = config(kind, kw)
        f64 = run_dense(kind, kw, init, grads, torch.float64)
        f32 = run_dense(kind, kw, init, grads, torch.float32)
        w("    {\n")
        for f in case_fields(name, kind, cfg):
            w("        %s,\n" % f)
        w("        .f64 = %s,\n" % steps(f64, "            "))
        w("        .f32 = %s,\n" % steps(f32, "            "))
        w("    },\n")
    w("};\n\n")

    w("static const double sparse_init[SPARSE_V * SPARSE_D] = %s;\n\n" %
      array(sparse_init, "    "))
    w("static const int64_t sparse_indices[OPTIM_STEPS][SPARSE_NNZ] = {\n")
    for idx in SPARSE_INDICES:
        w("    {%s},\n" % ", ".join(str(i) for i in idx))
    w("};\n\n")
    w("static const double sparse_rows[OPTIM_STEPS][SPARSE_NNZ * SPARSE_D] = %s;\n\n" %
      steps(sparse_rows, "    "))
    w("static const sparse_case_t sparse_cases[] = {\n")
    for name, kind, kw in SPARSE_CASES:
        cfg = config(kind, kw)
        f64 = run_sparse(kind, kw, sparse_init, sparse_rows, torch.float64)
        f32 = run_sparse(kind, kw, sparse_init, sparse_rows, torch.float32)
        w("    {\n")
        for f in case_fields(name, kind, cfg):
            w("        %s,\n" % f)
        w("        .f64 = %s,\n" % steps(f64, "            "))
        w("        .f32 = %s,\n" % steps(f32, "            "))
        w("    },\n")
    w("};\n\n#endif\n")


if __name__ == "__main__":
    main()
