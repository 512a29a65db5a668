"""A weft rank in Python, written from docs/protocol.md and proto/weft/wire.proto only.

    peer = Peer.from_env(handlers={"f": fn}, channels={64: on_message})
    peer.join()                                    # starts its server, then Join (section 7.1)
    payload, tensors = peer.call(0, "add", b"", [Tensor(DT_F32, (3,), raw)])
    peer.send(0, 64, b"note")                      # one-way (section 7.4)
    peer.shutdown()                                # the collective barrier (section 7.6)

A handler is fn(src_rank, payload, tensors) -> (payload, tensors), or raises WeftError. A
channel receiver is fn(src_rank, payload, tensors), called in the order the peer sent. Tensors
are Tensor(dtype, shape, data): data holds the little-endian elements, row-major.

Needs the module made by `protoc --python_out=DIR proto/weft/wire.proto` on sys.path (wire_pb2).
"""
import collections
import concurrent.futures
import hmac
import itertools
import math
import os
import queue
import socket
import struct
import threading
import time

import grpc
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

import wire_pb2 as pb

VERSION = 3
STREAM = "/weft.v1.Agent/Stream"
JOIN = "/weft.v1.Agent/Join"
SIZES = [4, 8, 2, 2, 1, 4, 8, 1, 1]  # section 4, by DType value
(DT_F32, DT_F64, DT_F16, DT_BF16, DT_I8, DT_I32, DT_I64, DT_U8, DT_BOOL) = range(9)
MAX_ENVELOPE = 16 << 20
SHUTDOWN_FN = "__weft.shutdown"

# Weft statuses (section 4) the peer produces or checks.
OK, INVALID_ARG, INVALID_STATE, NO_SUCH_FUNCTION, ALREADY_EXISTS = 0, -1, -3, -7, -8
UNSUPPORTED, TOO_LARGE, MISMATCH, TRANSPORT, PEER_LOST, PROTOCOL = -9, -10, -11, -20, -21, -22
VERSION_MISMATCH, RENDEZVOUS, SHUTDOWN, AUTH, REMOTE, TIMEOUT = -23, -24, -25, -26, -40, -60

# Section 8: the gRPC status ending a client stream, as a weft status.
GRPC_TO_WEFT = {
    grpc.StatusCode.DEADLINE_EXCEEDED: TIMEOUT,
    grpc.StatusCode.RESOURCE_EXHAUSTED: TOO_LARGE,
    grpc.StatusCode.UNAUTHENTICATED: AUTH,
    grpc.StatusCode.PERMISSION_DENIED: AUTH,
    grpc.StatusCode.INVALID_ARGUMENT: PROTOCOL,
    grpc.StatusCode.FAILED_PRECONDITION: PROTOCOL,
    grpc.StatusCode.UNIMPLEMENTED: UNSUPPORTED,
}

Tensor = collections.namedtuple("Tensor", "dtype shape data")


class WeftError(Exception):
    def __init__(self, status, text):
        super().__init__("%d: %s" % (status, text))
        self.status, self.text = status, text


# ------------------------------------------------------------------ framing (sections 5, 6)


def frame(env, payload=b"", tensors=()):
    """One frame: u32 LE envelope length, the envelope, the payload, each tensor's bytes."""
    env.payload_bytes = len(payload)
    for t in tensors:
        env.tensors.add(dtype=t.dtype, shape=list(t.shape), nbytes=len(t.data))
    e = env.SerializeToString()
    return b"".join([struct.pack("<I", len(e)), e, bytes(payload)] + [bytes(t.data) for t in tensors])


class Frame:
    """A received frame: its envelope, payload and tensors, or the refusal (status, reason) of
    section 6 (then the body is not read)."""

    def __init__(self, env, payload=b"", tensors=(), refusal=None):
        self.env, self.payload, self.tensors, self.refusal = env, payload, list(tensors), refusal


def _check_tensors(env):
    if len(env.tensors) > 65536:
        return "wire: %d tensors, over 65536" % len(env.tensors)
    for i, t in enumerate(env.tensors):
        if not 0 <= t.dtype <= 8:
            return "wire: tensor %d has unknown dtype %d" % (i, t.dtype)
        if len(t.shape) > 8:
            return "wire: tensor %d has %d dims, over 8" % (i, len(t.shape))
        if any(d < 0 for d in t.shape):
            return "wire: tensor %d has a negative dim" % i
        numel = math.prod(t.shape)
        if numel >= 1 << 63 or numel * SIZES[t.dtype] >= 1 << 64:
            return "wire: tensor %d is too large" % i
        if t.nbytes != numel * SIZES[t.dtype]:
            return "wire: tensor %d says %d bytes but its shape holds %d x %d" % (
                i, t.nbytes, numel, SIZES[t.dtype])
    return None


def frames(m, limit=0):
    """Every frame of one gRPC message, checked in the order of section 6. A refused frame comes
    out with .refusal set; a frame whose length cannot be trusted ends the message."""
    m = memoryview(m)
    off = 0
    while off < len(m):
        left = len(m) - off
        if left < 4:                                                          # check 1
            return
        (n,) = struct.unpack_from("<I", m, off)
        if n > MAX_ENVELOPE or n > left - 4:                                  # check 2
            return
        try:
            env = pb.Envelope.FromString(m[off + 4:off + 4 + n])              # check 3
        except Exception:
            return
        sizes = [t.nbytes for t in env.tensors]
        body = env.payload_bytes + sum(sizes)
        if body >= 1 << 64:                                                   # check 4
            return
        start, length = off + 4 + n, 4 + n + body
        refusal = None
        why = _check_tensors(env)                                             # checks 5, 6
        if why is not None:
            refusal = (PROTOCOL, why)
        elif limit and length > limit:                                        # check 7
            refusal = (TOO_LARGE, "wire: frame of %d bytes, over the limit of %d" % (length, limit))
        if body > left - 4 - n:                                               # check 8
            return             # this frame is the first of the dropped rest: no answer (as weft)
        if refusal is not None:
            yield Frame(env, refusal=refusal)
        else:
            tensors, p = [], start + env.payload_bytes
            for t, size in zip(env.tensors, sizes):
                tensors.append(Tensor(t.dtype, tuple(t.shape), bytes(m[p:p + size])))
                p += size
            yield Frame(env, bytes(m[start:start + env.payload_bytes]), tensors)
        off += length


def transcript(tp, challenge, client, server, world):
    """Section 3.2: what a connecting rank signs."""
    return b"weft connect v2" + tp + bytes(challenge) + struct.pack("<III", client, server, world)


# ------------------------------------------------------------------ the peer


class _Call:
    def __init__(self, conn, fn):
        self.conn, self.fn = conn, fn
        self.done = threading.Event()
        self.outcome = None

    def finish(self, status, text, payload=b"", tensors=()):
        if not self.done.is_set():
            self.outcome = (status, text, payload, list(tensors))
            self.done.set()


class _Conn:
    """This rank's stream to rank `to` (section 7.2, client side)."""

    def __init__(self, peer, to):
        self.peer, self.to = peer, to
        self.out = queue.Queue()
        self.early = []          # messages queued before the CHALLENGE came
        self.hello_sent = False
        self.ended = threading.Event()
        self.lost = None         # (status, why) once lost
        self.lock = threading.Lock()
        self.channel = grpc.insecure_channel(peer.world.workers[to].address,
                                             options=peer.client_options())
        self.responses = self.channel.stream_stream(STREAM)(iter(self.out.get, None))
        threading.Thread(target=self._read, daemon=True, name="weft-conn-%d" % to).start()

    def put(self, msg):
        with self.lock:
            if self.lost is not None:
                raise WeftError(self.lost[0], self.lost[1])
            if self.hello_sent:
                self.out.put(msg)
            else:
                self.early.append(msg)

    def half_close(self):
        self.out.put(None)

    def _read(self):
        status, why = PEER_LOST, "closed by the peer"
        try:
            for m in self.responses:
                self.peer.stats_message(self.to, "in", m)
                for f in frames(m, self.peer.max_message_bytes):
                    self._handle(f)
        except grpc.RpcError as e:
            status = GRPC_TO_WEFT.get(e.code(), PEER_LOST)
            why = "%s: %s" % (e.code().name, e.details())
        self._lose(status, why)
        self.ended.set()

    def _handle(self, f):
        env = f.env
        if env.kind == pb.KIND_CHALLENGE and not self.hello_sent:
            h = pb.Hello()
            h.CopyFrom(self.peer.hello)
            h.proof = self.peer.key.sign(
                transcript(b"S", env.challenge, self.peer.rank, self.to, self.peer.world_size))
            with self.lock:
                self.out.put(frame(pb.Envelope(kind=pb.KIND_HELLO, src_rank=self.peer.rank, hello=h)))
                for m in self.early:
                    self.out.put(m)
                self.early, self.hello_sent = [], True
        elif env.kind == pb.KIND_HELLO_ACK:
            if env.status != 0:
                self._lose(env.status, env.error)          # refused: rank lost (section 7.2)
        elif env.kind == pb.KIND_RESPONSE:
            call = self.peer.take_pending(env.request_id, self)
            if call is None:
                return                                     # unknown or finished id: dropped
            if f.refusal is not None:
                call.finish(f.refusal[0], f.refusal[1])
            elif env.status != 0:
                call.finish(env.status, env.error)
            else:
                call.finish(OK, "", f.payload, f.tensors)

    def _lose(self, status, why):
        with self.lock:
            if self.lost is not None:
                return
            self.lost = (status, why)
        if not self.peer.closing:
            self.peer.fail_pending(self, status, why)


class Peer:
    def __init__(self, rank, world_size, master, token=b"", name=None, handlers=None, channels=None,
                 peer_timeout_ms=2000, rendezvous_timeout_ms=60000, max_message_bytes=1 << 30,
                 handshake_timeout_ms=10000, listen_host="127.0.0.1"):
        self.rank, self.world_size, self.master = rank, world_size, master
        self.token = token
        self.name = name or "worker%d" % rank
        self.handlers = dict(handlers or {})
        self.channels = dict(channels or {})
        self.keep = max(peer_timeout_ms, 200) // 2
        self.rendezvous_timeout_ms = rendezvous_timeout_ms
        self.handshake_timeout_ms = handshake_timeout_ms
        self.max_message_bytes = max_message_bytes
        self.listen_host = listen_host
        self.key = Ed25519PrivateKey.generate()
        self.public_key = self.key.public_key().public_bytes(serialization.Encoding.Raw,
                                                             serialization.PublicFormat.Raw)
        self.world = None
        self.joined = threading.Event()
        self.lock = threading.Condition()
        self.conns = {}
        self.pending = {}
        self.ids = itertools.count(1)
        self.sent = self.received = 0   # user REQUESTs, for shutdown (section 7.6)
        self.serving = 0                # incoming user requests not answered yet
        self.proven = set()             # ranks with a proven stream to this server
        self.open_streams = 0
        self.closing = self.in_shutdown = False
        self.frames_per_message = collections.Counter()   # (rank, way, frames): messages read
        self.server = None
        self.hello = None

    @classmethod
    def from_env(cls, **kw):
        """A rank placed by its launcher (section 1): WEFT_RANK, WEFT_WORLD_SIZE, WEFT_MASTER_ADDR,
        WEFT_MASTER_PORT, WEFT_AUTH_TOKEN (or torchrun's names)."""
        env = os.environ
        get = lambda a, b, d=None: env.get(a, env.get(b, d))
        addr = get("WEFT_MASTER_ADDR", "MASTER_ADDR", "127.0.0.1")
        kw.setdefault("peer_timeout_ms", int(env.get("WEFT_PEER_TIMEOUT_MS", "2000")))
        kw.setdefault("rendezvous_timeout_ms", int(env.get("WEFT_RENDEZVOUS_TIMEOUT_MS", "60000")))
        kw.setdefault("listen_host", env.get("WEFT_LISTEN_HOST") or (
            addr if addr.startswith("127.") or addr == "localhost" else socket.gethostname()))
        return cls(int(get("WEFT_RANK", "RANK")), int(get("WEFT_WORLD_SIZE", "WORLD_SIZE")),
                   "%s:%s" % (addr, get("WEFT_MASTER_PORT", "MASTER_PORT")),
                   env.get("WEFT_AUTH_TOKEN", "").encode(), **kw)

    # ---------------------------------------------------------------- channel options (section 2)

    def _common_options(self):
        return [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1),
                ("grpc.keepalive_time_ms", self.keep), ("grpc.keepalive_timeout_ms", self.keep),
                ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
                ("grpc.enable_retries", 0)]

    def client_options(self):
        return self._common_options() + [("grpc.use_local_subchannel_pool", 1),
                                         ("grpc.initial_reconnect_backoff_ms", 100),
                                         ("grpc.max_reconnect_backoff_ms", 1000)]

    def server_options(self):
        return self._common_options() + [("grpc.http2.min_ping_interval_without_data_ms", self.keep // 2),
                                         ("grpc.http2.max_ping_strikes", 0)]

    # ---------------------------------------------------------------- rendezvous (section 7.1)

    def join(self):
        if self.rank == 0:
            raise WeftError(INVALID_ARG, "this peer joins as a rank >= 1 (rank 0 is a weft program)")
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4 + 2 * self.world_size),
                                  handlers=[grpc.method_handlers_generic_handler(
                                      "weft.v1.Agent",
                                      {"Stream": grpc.stream_stream_rpc_method_handler(self._serve)})],
                                  options=self.server_options())
        port = self.server.add_insecure_port("%s:0" % self.listen_host)
        self.server.start()
        self.hello = pb.Hello(protocol_version=VERSION, name=self.name, rank=self.rank,
                              address="%s:%d" % (self.listen_host, port), world_size=self.world_size,
                              auth_token=self.token, max_message_bytes=self.max_message_bytes,
                              identity_key=self.public_key)
        channel = grpc.insecure_channel(self.master, options=self.client_options())
        join = channel.unary_unary(JOIN, request_serializer=pb.Hello.SerializeToString,
                                   response_deserializer=pb.WorldMap.FromString)
        try:
            world = join(self.hello, timeout=(self.rendezvous_timeout_ms + 3000) / 1000,
                         wait_for_ready=True)
        except grpc.RpcError as e:
            raise WeftError(RENDEZVOUS, "join: %s: %s" % (e.code().name, e.details()))
        finally:
            channel.close()
        if world.status != 0:
            raise WeftError(world.status, world.error)
        if world.protocol_version != VERSION:
            raise WeftError(VERSION_MISMATCH, "world map of version %d" % world.protocol_version)
        if len(world.workers) != self.world_size or any(
                w.rank != i or len(w.identity_key) != 32 for i, w in enumerate(world.workers)):
            raise WeftError(PROTOCOL, "malformed world map")
        self.world = world
        self.joined.set()

    def rank_of(self, name):
        return next(w.rank for w in self.world.workers if w.name == name)

    # ---------------------------------------------------------------- calls (sections 7.3, 7.4)

    def _conn(self, to):
        with self.lock:
            c = self.conns.get(to)
            if c is None:
                c = self.conns[to] = _Conn(self, to)
            return c

    def _check_limit(self, to, msg):
        limit = self.world.workers[to].max_message_bytes
        if limit and len(msg) > limit:
            raise WeftError(TOO_LARGE, "message of %d bytes, over rank %d's limit of %d" % (len(msg), to, limit))

    def request_frame(self, fn, payload=b"", tensors=(), timeout_ms=60000):
        """(id, frame) of a REQUEST, for call_many."""
        rid = next(self.ids)
        return rid, frame(pb.Envelope(kind=pb.KIND_REQUEST, request_id=rid, function=fn,
                                      timeout_ms=timeout_ms, src_rank=self.rank), payload, tensors)

    def call_many(self, to, requests, timeout_ms=60000):
        """Sends REQUESTs [(fn, payload, tensors)] to `to` as ONE gRPC message (several frames);
        returns their outcomes [(status, text, payload, tensors)] in order."""
        conn = self._conn(to)
        calls, parts = [], []
        with self.lock:
            if self.in_shutdown and not all(fn.startswith("__weft.") for fn, _, _ in requests):
                raise WeftError(SHUTDOWN, "agent is shut down")
        for fn, payload, tensors in requests:
            rid, f = self.request_frame(fn, payload, tensors, timeout_ms)
            self._check_limit(to, f)
            call = _Call(conn, fn)
            calls.append((rid, call))
            parts.append(f)
        with self.lock:
            for rid, call in calls:
                self.pending[rid] = call
                if not call.fn.startswith("__weft."):
                    self.sent += 1
        try:
            conn.put(b"".join(parts))
        except WeftError as e:
            for rid, call in calls:
                if self.take_pending(rid, conn) is not None and not call.fn.startswith("__weft."):
                    with self.lock:
                        self.sent -= 1
                call.finish(e.status, e.text)
        deadline = time.monotonic() + timeout_ms / 1000
        out = []
        for rid, call in calls:
            if not call.done.wait(max(0, deadline - time.monotonic())):
                self.take_pending(rid, conn)
                call.finish(TIMEOUT, "call to '%s' on rank %d timed out" % (call.fn, to))
            out.append(call.outcome)
        return out

    def call(self, to, fn, payload=b"", tensors=(), timeout_ms=60000):
        """Calls `fn` on rank `to`: (payload, tensors), or raises WeftError."""
        status, text, payload, tensors = self.call_many(to, [(fn, payload, tensors)], timeout_ms)[0]
        if status != 0:
            raise WeftError(status, text)
        return payload, tensors

    def send(self, to, channel, payload=b"", tensors=()):
        """A one-way message to rank `to`'s channel (section 7.4)."""
        self.send_many(to, [(channel, payload, tensors)])

    def send_many(self, to, messages):
        """One-way messages [(channel, payload, tensors)] as ONE gRPC message."""
        msg = b"".join(frame(pb.Envelope(kind=pb.KIND_ONEWAY, channel=ch, src_rank=self.rank), p, t)
                       for ch, p, t in messages)
        self._check_limit(to, msg)
        self._conn(to).put(msg)

    def take_pending(self, rid, conn):
        with self.lock:
            call = self.pending.get(rid)
            if call is None or call.conn is not conn:
                return None
            del self.pending[rid]
            self.lock.notify_all()
            return call

    def fail_pending(self, conn, status, why):
        with self.lock:
            lost = [rid for rid, c in self.pending.items() if c.conn is conn]
            calls = [self.pending.pop(rid) for rid in lost]
            self.lock.notify_all()
        for c in calls:
            c.finish(status, "call to '%s' on rank %d failed: %s" % (c.fn, conn.to, why))

    def stats_message(self, rank, way, m):
        """Counts a message read from rank's stream: way "in" on this rank's stream to it (answers,
        acks), "out" on its stream to this rank (requests, one-way messages)."""
        with self.lock:
            self.frames_per_message[(rank, way, sum(1 for _ in frames(m)))] += 1

    # ---------------------------------------------------------------- serving (sections 7.2, 7.3)

    def _refuse(self, context, status, why):
        context.set_code(grpc.StatusCode.UNAUTHENTICATED if status == AUTH
                         else grpc.StatusCode.FAILED_PRECONDITION)
        context.set_details(why)
        return frame(pb.Envelope(kind=pb.KIND_HELLO_ACK, status=status, error=why, src_rank=self.rank))

    def _check_hello(self, fs):
        """Section 7.2's checks on the first frame: (status, why, client rank)."""
        f = fs[0]
        if f.refusal is not None:
            return f.refusal[0], f.refusal[1], -1
        if f.env.kind != pb.KIND_HELLO or not f.env.HasField("hello"):
            return PROTOCOL, "the first frame is not a Hello", -1
        h = f.env.hello
        if h.protocol_version != VERSION:
            return VERSION_MISMATCH, "rank %d speaks protocol version %d; %s speaks version %d" % (
                h.rank, h.protocol_version, self.name, VERSION), -1
        if self.token and not hmac.compare_digest(h.auth_token, self.token):
            return AUTH, "wrong auth token", -1
        if h.world_size != self.world_size:
            return MISMATCH, "world of %d, not %d" % (h.world_size, self.world_size), -1
        if not 0 <= h.rank < self.world_size:
            return INVALID_ARG, "rank %d out of range" % h.rank, -1
        if not self.joined.wait(self.handshake_timeout_ms / 1000):
            return INVALID_STATE, "%s has not joined" % self.name, -1
        return OK, "", h.rank

    def _serve(self, request_iterator, context):
        challenge = os.urandom(32)
        yield frame(pb.Envelope(kind=pb.KIND_CHALLENGE, challenge=challenge, src_rank=self.rank))
        try:
            first = next(request_iterator)   # (no handshake timeout here: a weft server has one)
        except (StopIteration, grpc.RpcError):
            return
        fs = list(frames(first, self.max_message_bytes))
        if not fs:             # nothing framed: ended without an ack (section 8)
            context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            context.set_details("the first message is not a readable Hello")
            return
        status, why, c = self._check_hello(fs)
        if status == OK:
            h = fs[0].env.hello
            try:
                Ed25519PublicKey.from_public_bytes(self.world.workers[c].identity_key).verify(
                    h.proof, transcript(b"S", challenge, c, self.rank, self.world_size))
            except (InvalidSignature, ValueError):
                status, why = AUTH, "the connection claiming rank %d did not prove it" % c
        if status == OK:
            with self.lock:
                if c in self.proven:
                    status, why = ALREADY_EXISTS, "rank %d has a proven stream open already" % c
                else:
                    self.proven.add(c)
                    self.open_streams += 1
        if status != OK:
            yield self._refuse(context, status, why)
            return
        limit = h.max_message_bytes
        try:
            yield frame(pb.Envelope(kind=pb.KIND_HELLO_ACK, src_rank=self.rank))
            rest = fs[1:]
            while True:
                answers = self._handle_frames(c, limit, rest)
                if answers:
                    yield answers      # the answers to one message leave together
                try:
                    m = next(request_iterator)
                except StopIteration:
                    return             # half-closed: end with OK
                self.stats_message(c, "out", m)
                rest = list(frames(m, self.max_message_bytes))
        except grpc.RpcError:
            return
        finally:
            with self.lock:
                self.proven.discard(c)
                self.open_streams -= 1
                self.lock.notify_all()

    def _handle_frames(self, c, limit, fs):
        answers = []
        for f in fs:
            kind = f.env.kind
            if kind == pb.KIND_REQUEST:
                answers.append(self._answer(c, limit, f))
            elif kind == pb.KIND_ONEWAY and f.refusal is None:
                receiver = self.channels.get(f.env.channel)
                if receiver is not None and not f.env.refs:
                    receiver(c, f.payload, f.tensors)
        return b"".join(answers)

    def _answer(self, c, limit, f):
        env, fn = f.env, f.env.function
        user = not fn.startswith("__weft.")
        if user:
            with self.lock:
                self.received += 1
                self.serving += 1
        try:
            status, text, payload, tensors = self._run(c, f)
            if status == OK:
                out = frame(pb.Envelope(kind=pb.KIND_RESPONSE, request_id=env.request_id,
                                        src_rank=self.rank), payload, tensors)
                if not limit or len(out) <= limit:
                    return out
                status, text = TOO_LARGE, "result of '%s' on %s is %d bytes, over the caller's limit of %d bytes" % (
                    fn, self.name, len(out), limit)
            return frame(pb.Envelope(kind=pb.KIND_RESPONSE, request_id=env.request_id, status=status,
                                     error=text, src_rank=self.rank))
        finally:
            if user:
                with self.lock:
                    self.serving -= 1
                    self.lock.notify_all()

    def _run(self, c, f):
        env, fn = f.env, f.env.function
        if f.refusal is not None:
            return f.refusal[0], "%s (on %s)" % (f.refusal[1], self.name), b"", ()
        if env.refs:
            r = env.refs[0]
            return PROTOCOL, "rpc: reference 0 from rank %d is of kind %d, which has no codec on %s" % (
                c, r.kind, self.name), b"", ()
        if env.timeout_ms <= 0:
            return TIMEOUT, "the caller's deadline passed before the call ran", b"", ()
        if fn == SHUTDOWN_FN:
            return INVALID_STATE, "%s is not rank 0" % self.name, b"", ()
        handler = self.handlers.get(fn)
        if handler is None:
            return NO_SUCH_FUNCTION, "no function '%s' on %s" % (fn, self.name), b"", ()
        try:
            payload, tensors = handler(c, f.payload, f.tensors)
            return OK, "", payload, tensors
        except WeftError as e:
            return e.status or REMOTE, "%s (in '%s' on %s)" % (e.text, fn, self.name), b"", ()
        except Exception as e:
            return REMOTE, "%r (in '%s' on %s)" % (e, fn, self.name), b"", ()

    # ---------------------------------------------------------------- probing a server's checks

    def probe_hello(self, to, timeout_s=10, **changes):
        """Opens a fresh stream to `to` and sends a Hello changed by `changes` (proof=b"..." for a
        given proof, otherwise the real one); returns (HELLO_ACK status, its error, gRPC code)."""
        out = queue.Queue()
        channel = grpc.insecure_channel(self.world.workers[to].address, options=self.client_options())
        responses = channel.stream_stream(STREAM)(iter(out.get, None), timeout=timeout_s)
        try:
            ack = None
            for m in responses:
                for f in frames(m):
                    if f.env.kind == pb.KIND_CHALLENGE:
                        h = pb.Hello()
                        h.CopyFrom(self.hello)
                        h.proof = self.key.sign(transcript(b"S", f.env.challenge, self.rank, to, self.world_size))
                        for k, v in changes.items():
                            setattr(h, k, v)
                        out.put(frame(pb.Envelope(kind=pb.KIND_HELLO, src_rank=self.rank, hello=h)))
                    elif f.env.kind == pb.KIND_HELLO_ACK:
                        ack = f.env
                        if ack.status == 0:
                            out.put(None)
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
        finally:
            out.put(None)
            channel.close()
        return (None, None, code) if ack is None else (ack.status, ack.error, code)

    # ---------------------------------------------------------------- shutdown (section 7.6)

    def _wait_passive(self, deadline):
        with self.lock:
            while any(not c.fn.startswith("__weft.") for c in self.pending.values()) or self.serving:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WeftError(TIMEOUT, "shutdown: calls still in flight at the deadline")
                self.lock.wait(min(left, 0.05))

    def shutdown(self, timeout_ms=30000):
        """The collective barrier through rank 0, then half-close and stop (section 7.6)."""
        deadline = time.monotonic() + timeout_ms / 1000
        with self.lock:
            self.in_shutdown = True
        for k in itertools.count():
            self._wait_passive(deadline)
            with self.lock:
                report = struct.pack("<QQQ", k, self.sent, self.received)
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise WeftError(TIMEOUT, "shutdown: no answer by the deadline")
            done, _ = self.call(0, SHUTDOWN_FN, report, timeout_ms=left_ms)
            if done == b"\x01":
                break
            if done != b"\x00":
                raise WeftError(PROTOCOL, "shutdown: answer %r" % done)
        self.closing = True
        with self.lock:
            conns = list(self.conns.values())
        for c in conns:
            c.half_close()
        end = time.monotonic() + 5
        for c in conns:
            c.ended.wait(max(0, end - time.monotonic()))
        with self.lock:
            while self.open_streams and time.monotonic() < end:
                self.lock.wait(end - time.monotonic())
        for c in conns:
            c.channel.close()
        self.server.stop(0).wait(5)
