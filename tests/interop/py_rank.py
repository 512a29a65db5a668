"""Rank 1 of tests/interop's world of three: the Python peer (weft_peer.py) among two weft C ranks
(interop_rank.c, ranks 0 and 2). Placed by the WEFT_* variables like any rank; exits 0 when every
check held, 1 otherwise."""
import os
import struct
import sys
import threading
import time

import grpc

import weft_peer as wp
from weft_peer import Tensor

C_RANKS = (0, 2)
CHANNEL = 64      # the C program's module
NOTES = 200       # one-way messages each side sends the other
CALL_MS = 20000
WAIT_S = 30

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("[rank 1] FAIL %s" % what, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ what the C ranks call

served = {}          # (rank, fn) -> times
notes = {r: [] for r in C_RANKS}
cv = threading.Condition()


def count(src, fn):
    with cv:
        served[(src, fn)] = served.get((src, fn), 0) + 1
        cv.notify_all()


def py_double(src, payload, tensors):
    count(src, "py.double")
    (t,) = tensors
    if t.dtype != wp.DT_F64:
        raise wp.WeftError(-5, "py.double takes f64")
    n = len(t.data) // 8
    doubled = [x * 2 for x in struct.unpack("<%dd" % n, t.data)]
    return payload, [Tensor(t.dtype, t.shape, struct.pack("<%dd" % n, *doubled))]


def py_echo(src, payload, tensors):
    count(src, "py.echo")
    return payload, tensors


def py_fail(src, payload, tensors):
    count(src, "py.fail")
    raise wp.WeftError(-4, "py.fail refused: " + payload.decode())


def on_note(src, payload, tensors):
    with cv:
        notes.setdefault(src, []).append((payload, tensors))
        cv.notify_all()


def wait_for(cond, what):
    end = time.monotonic() + WAIT_S
    with cv:
        while not cond():
            left = end - time.monotonic()
            if left <= 0:
                check(False, "timed out waiting for " + what)
                return
            cv.wait(left)


# ------------------------------------------------------------------ values and expected results


def f32_add(a, b):
    """IEEE binary32 addition: the double sum rounded once to binary32 (exact for +)."""
    s = a + b
    try:
        return struct.pack("<f", s)
    except OverflowError:
        return struct.pack("<f", s * float("inf"))


def f32(*xs):
    return Tensor(wp.DT_F32, (len(xs),), struct.pack("<%df" % len(xs), *xs))


def wrap(x, bits):
    return (x + (1 << (bits - 1))) % (1 << bits) - (1 << (bits - 1))


def check_add(peer, r):
    tiny, big = 1.401298464324817e-45, 3.4028234663852886e38
    xs = [1.0, 0.1, -0.0, tiny, big, float("inf"), 1e-30, -2.5, 16777216.0]
    ys = [2.0, 0.2, -0.0, tiny, big, 1.0, 1e30, 2.5, 1.0]
    xs32 = struct.unpack("<9f", struct.pack("<9f", *xs))
    ys32 = struct.unpack("<9f", struct.pack("<9f", *ys))
    want = b"".join(f32_add(a, b) for a, b in zip(xs32, ys32))
    payload, tensors = peer.call(r, "add", b"f32", [f32(*xs), f32(*ys)], CALL_MS)
    check(payload == b"f32" and len(tensors) == 1 and tensors[0].dtype == wp.DT_F32
          and tensors[0].shape == (9,) and tensors[0].data == want,
          "add f32 on rank %d: %r, want %r" % (r, tensors, want))

    d = [0.1, 1e308, -1e-320, 3.0]
    e = [0.2, 1e308, 1e-320, 1.0 / 3.0]
    _, tensors = peer.call(r, "add", b"", [Tensor(wp.DT_F64, (2, 2), struct.pack("<4d", *d)),
                                            Tensor(wp.DT_F64, (2, 2), struct.pack("<4d", *e))])
    want = struct.pack("<4d", *[a + b for a, b in zip(d, e)])
    check(tensors[0].shape == (2, 2) and tensors[0].data == want, "add f64 on rank %d" % r)

    i = [2**63 - 1, -2**63, 5, -7]
    j = [1, -1, 2**40, 7]
    _, tensors = peer.call(r, "add", b"", [Tensor(wp.DT_I64, (4,), struct.pack("<4q", *i)),
                                            Tensor(wp.DT_I64, (4,), struct.pack("<4q", *j))])
    want = struct.pack("<4q", *[wrap(a + b, 64) for a, b in zip(i, j)])
    check(tensors[0].data == want, "add i64 on rank %d (wrapping)" % r)


def check_echo(peer, r):
    nan_bits = Tensor(wp.DT_F32, (3,), bytes.fromhex("0100c07f ffffffff 0000807f".replace(" ", "")))
    tensors = [nan_bits, Tensor(wp.DT_F16, (2, 2), bytes.fromhex("007e01fc0080ff7b")),
               Tensor(wp.DT_BF16, (1, 3), bytes.fromhex("c07f8000807f")),
               Tensor(wp.DT_BOOL, (4,), b"\x00\x01\x01\x00"), Tensor(wp.DT_I8, (0, 5), b""),
               Tensor(wp.DT_U8, (), b"\xfe"), Tensor(wp.DT_I32, (2,), struct.pack("<2i", -1, 2**31 - 1)),
               Tensor(wp.DT_F64, (1, 1, 1, 1, 1, 1, 1, 1), struct.pack("<d", -0.0))]
    payload = os.urandom(777)
    got_payload, got = peer.call(r, "echo", payload, tensors, CALL_MS)
    check(got_payload == payload, "echo payload on rank %d" % r)
    check([tuple(t) for t in got] == [tuple(t) for t in tensors], "echo tensors on rank %d" % r)


def check_errors(peer, r):
    try:
        peer.call(r, "fail", b"why not", [], CALL_MS)
        check(False, "fail on rank %d succeeded" % r)
    except wp.WeftError as e:
        check(e.status == -4, "fail on rank %d: status %d, want -4" % (r, e.status))
        want = "fail was asked to fail: why not (in 'fail' on worker%d)" % r
        check(e.text == want, "fail on rank %d: text %r, want %r (section 7.3)" % (r, e.text, want))
    try:
        peer.call(r, "no_such_function", b"", [], CALL_MS)
        check(False, "no_such_function on rank %d succeeded" % r)
    except wp.WeftError as e:
        check(e.status == -7, "no_such_function on rank %d: status %d (%s), want -7" % (r, e.status, e.text))


def add_batch(peer, r, big):
    """16 add REQUESTs to rank r in one gRPC message (request 7 with two 3 MiB tensors when `big`);
    checks every answer and returns {frames: messages} of the messages that brought them."""
    before = dict(peer.frames_per_message)
    reqs = []
    for k in range(16):
        n = (3 << 20) // 4 if big and k == 7 else k + 1
        x = struct.pack("<%di" % n, *range(n))
        y = struct.pack("<%di" % n, *([k] * n))
        reqs.append(("add", b"%d" % k, [Tensor(wp.DT_I32, (n,), x), Tensor(wp.DT_I32, (n,), y)]))
    outs = peer.call_many(r, reqs, CALL_MS)
    for k, (st, text, payload, tensors) in enumerate(outs):
        n = len(reqs[k][2][0].data) // 4
        want = struct.pack("<%di" % n, *[i + k for i in range(n)])
        check(st == 0 and payload == b"%d" % k and tensors[0].data == want,
              "batched add %d on rank %d: %d %s" % (k, r, st, text))
    return {key[2]: v - before.get(key, 0) for key, v in peer.frames_per_message.items()
            if key[:2] == (r, "in") and v > before.get(key, 0)}


def check_batch(peer, r):
    """The answers to the requests of one message leave together as one message (section 5)."""
    got = add_batch(peer, r, big=False)
    check(got == {16: 1}, "rank %d answered 16 requests of one message in messages %r" % (r, got))
    got = add_batch(peer, r, big=True)
    print("[rank 1] 16 answers from rank %d, one of 3 MiB, came as messages {frames: count} %r"
          % (r, got), flush=True)
    check(sum(f * n for f, n in got.items()) == 16 and max(got) > 1,
          "rank %d answered 16 requests, one large, in messages %r" % (r, got))


def check_refusals(peer, r):
    st, text, code = peer.probe_hello(r, proof=bytes(64))
    check(st == -26 and code == grpc.StatusCode.UNAUTHENTICATED,
          "wrong proof to rank %d: %s %r %s, want -26 UNAUTHENTICATED" % (r, st, text, code))
    st, text, code = peer.probe_hello(r, protocol_version=1)
    check(st == -23 and code == grpc.StatusCode.FAILED_PRECONDITION,
          "version 1 to rank %d: %s %r %s, want -23 FAILED_PRECONDITION" % (r, st, text, code))
    st, text, code = peer.probe_hello(r)   # a second proven stream for rank 1 (section 3.3)
    check(st == -8, "second stream to rank %d: %s %r %s, want -8" % (r, st, text, code))
    print("[rank 1] refusals from rank %d as the page says" % r, flush=True)


def send_notes(peer, r):
    """NOTES one-way messages: the first half one per gRPC message, the rest all in one."""
    msgs = [(CHANNEL, b"note %d" % i, [Tensor(wp.DT_I64, (2,), struct.pack("<2q", i, 1))])
            for i in range(NOTES)]
    for m in msgs[:NOTES // 2]:
        peer.send(r, *m)
    peer.send_many(r, msgs[NOTES // 2:])


def check_notes():
    for r in C_RANKS:
        got = notes[r]
        want = [(b"note %d from %d" % (i, r), [Tensor(wp.DT_I64, (2,), struct.pack("<2q", i, r))])
                for i in range(NOTES)]
        check(got == want, "notes from rank %d: %d, in order: %s" % (r, len(got), got == want))


def main():
    peer = wp.Peer.from_env(name="py1", channels={CHANNEL: on_note},
                            handlers={"py.double": py_double, "py.echo": py_echo, "py.fail": py_fail})
    peer.join()
    print("[rank 1] joined a world of %d: %s" % (
        peer.world_size, ", ".join(w.name for w in peer.world.workers)), flush=True)
    for r in C_RANKS:
        check_add(peer, r)
        check_echo(peer, r)
        check_errors(peer, r)
        check_batch(peer, r)
        send_notes(peer, r)
        check_refusals(peer, r)
    wait_for(lambda: all(len(notes[r]) >= NOTES for r in C_RANKS), "the C ranks' notes")
    check_notes()
    wait_for(lambda: all(served.get((r, f), 0) >= 1 for r in C_RANKS
                         for f in ("py.double", "py.echo", "py.fail")), "the C ranks' calls")
    merged = {k: v for k, v in peer.frames_per_message.items() if k[1] == "out" and k[2] > 1}
    print("[rank 1] merged messages from the C ranks' streams {(rank, way, frames): count} %r "
          "(timing decides how many)" % merged, flush=True)
    peer.shutdown(30000)
    print("[rank 1] shutdown done: sent %d, received %d" % (peer.sent, peer.received), flush=True)
    print("[rank 1] %s" % ("all checks passed" if not failures else "FAILED"), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
