#!/usr/bin/env python3
"""Multi-host tests in network namespaces (docs/testing.md): two simulated hosts, each a network
namespace and a PID namespace of its own, joined by a link, with one `weftrun --nnodes 2` per host
running tests/netns/netns_rank.c (2 ranks per host).

    netns_test.py CASE        (environment: WEFTRUN, NETNS_RANK, NETNS_WIRE: the built programs)

Cases:
  cross_host       a veth pair; the job (RPC, a direct connection, all_reduce) gives its exact
                   result with no cross-memory read across the hosts, and its bytes crossed the
                   veth pair (the interfaces' counters)
  delay_loss       the same job over a link with 20 ms of delay and 2 % loss each way (TCP's
                   handshakes included): the same exact result, and the link did drop packets
  syn_loss         the same job over a link with 20 ms of delay that drops the first SYN sent to
                   each address and port (TCP sends it again 1 s later): the same exact result.
                   gRPC's connections have TCP_USER_TIMEOUT = peer_timeout / 2 (1 s by default),
                   so one lost SYN fails a connect; the agent tries a peer stream's connect again
                   until its handshake deadline (it took the first failure for a lost peer before)
  partition        a silent partition (every packet dropped) in the middle of a job: every rank
                   gets WEFT_ERR_PEER_LOST for a call and an all_reduce across it, well before
                   their deadlines, its own host's ranks still answer, and nothing hangs
  partition_down   the same partition, by setting one end of the veth pair down

The impaired link is tests/netns/wire.c, a user-space cable between two TUN devices (delay, a
seeded loss, the cut): it runs on any kernel with TUN, and can spare the handshakes.
NETNS_LINK=netem uses tc's netem on a veth pair instead, where the kernel has sch_netem (it drops
SYNs as well). Exits 77 (meson: skipped) saying why when namespaces, veth pairs or the link cannot
be made here (not root, no CAP_NET_ADMIN, no iproute2), 0 when the case passed, 1 when it
failed. Every wait has a deadline, and the namespaces, links and
processes go on every exit.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

SKIP = 77
TOKEN = '0123456789abcdef0123456789abcdef'
HOSTS = ('10.77.0.1', '10.77.0.2')
NPROC = 2          # ranks per host
NODE_TIMEOUT = 45  # each weftrun's --timeout, seconds: a case stays within 60 s
ECHO_BYTES = 512 << 10
WORLD_FLOATS = 256 << 10
DELAY_MS, LOSS_PCT = 20, 2
PEER_TIMEOUT_MS = 1000  # the partition cases'; the call and all_reduce wait up to 30 s


def log(*a):
    print(*a, flush=True)


def skip(why):
    log(f'SKIP: {why}')
    sys.exit(SKIP)


class Failed(Exception):
    pass


def expect(cond, what):
    if not cond:
        raise Failed(what)


def which(name):
    path = os.environ.get('PATH', '') + ':/usr/sbin:/sbin:/usr/bin:/bin'
    return shutil.which(name, path=path)


def run(argv, deadline=20, check=True):
    """Runs a set-up command; its output, or Failed (check) / None."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=deadline)
    except subprocess.TimeoutExpired:
        raise Failed(f'{" ".join(argv)}: still running after {deadline} s')
    if r.returncode != 0:
        if check:
            raise Failed(f'{" ".join(argv)}: exit {r.returncode}: {r.stderr.strip()}')
        return None
    return r.stdout


def expected_checksum():
    """FNV-1a 64 of the world all_reduce's result (netns_rank.c: rank r holds (r + 1) * (i % 7 +
    1), so the sum is 10 * (i % 7 + 1) with 4 ranks)."""
    import struct
    world = 2 * NPROC
    ranks_sum = world * (world + 1) // 2
    period = b''.join(struct.pack('<f', float(ranks_sum * (i % 7 + 1))) for i in range(7))
    data = (period * (WORLD_FLOATS // 7 + 1))[:WORLD_FLOATS * 4]
    h = 14695981039346656037
    for b in data:
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return f'{h:016x}'


class Hosts:
    """Two hosts (network namespaces) joined by a link: 'veth', 'netem' (a veth pair with netem on
    both ends) or 'wire' (TUN devices and netns_wire). Everything it made goes in close()."""

    def __init__(self, tag, link, impair=None, wire_mode=None):
        self.ip, self.tc, self.unshare = which('ip'), which('tc'), which('unshare')
        self.tag = f'wn{os.getpid()}{tag}'
        self.ns = (self.tag + 'a', self.tag + 'b')
        self.ifs = (self.tag + 'a', self.tag + 'b')
        self.link = link
        self.made = []
        self.procs = []   # Popen of what runs in the namespaces, killed in close()
        self.wire = None
        self.wire_out = None
        self.dir = tempfile.mkdtemp(prefix='weft-netns-')
        try:
            self._make(impair, wire_mode)
        except BaseException:
            self.close()
            raise

    def _make(self, impair, wire_mode):
        for ns in self.ns:
            err = subprocess.run([self.ip, 'netns', 'add', ns], capture_output=True, text=True)
            if err.returncode != 0:
                skip(f'cannot create a network namespace (ip netns add: {err.stderr.strip()}); '
                     'these tests need root with CAP_NET_ADMIN and CAP_SYS_ADMIN')
            self.made.append(ns)
        a, b = self.ifs
        if self.link == 'wire':
            self.wire_out = open(os.path.join(self.dir, 'wire.out'), 'w+')
            delay, loss = impair if impair is not None else (0, 0)
            self.wire = subprocess.Popen(
                [os.environ['NETNS_WIRE'], f'/run/netns/{self.ns[0]}', a,
                 f'/run/netns/{self.ns[1]}', b, str(delay), str(loss), '7']
                + ([wire_mode] if wire_mode else []),
                stdout=self.wire_out, stderr=subprocess.PIPE, text=True)
            until = time.monotonic() + 10
            while 'ready' not in self._wire_text():
                code = self.wire.poll()
                if code is not None:
                    why = self.wire.stderr.read().strip()
                    if code == SKIP:
                        skip(f'no TUN device for tests/netns/wire.c ({why})')
                    raise Failed(f'netns_wire exited {code}: {why}')
                expect(time.monotonic() < until, 'netns_wire did not start within 10 s')
                time.sleep(0.01)
        else:
            err = subprocess.run([self.ip, 'link', 'add', a, 'netns', self.ns[0], 'type', 'veth',
                                  'peer', 'name', b, 'netns', self.ns[1]],
                                 capture_output=True, text=True)
            if err.returncode != 0:
                skip(f'cannot create a veth pair (ip link add: {err.stderr.strip()})')
        for k in (0, 1):
            run([self.ip, '-n', self.ns[k], 'addr', 'add', f'{HOSTS[k]}/24', 'dev', self.ifs[k]])
            run([self.ip, '-n', self.ns[k], 'link', 'set', 'lo', 'up'])
            run([self.ip, '-n', self.ns[k], 'link', 'set', self.ifs[k], 'up'])
        if self.link == 'netem':
            delay, loss = impair
            for k in (0, 1):
                self.tc_netem(k, 'add', f'delay {delay}ms loss {loss}%')

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _wire_text(self):
        self.wire_out.seek(0)
        return self.wire_out.read()

    def tc_netem(self, k, verb, params):
        run([self.tc, '-n', self.ns[k], 'qdisc', verb, 'dev', self.ifs[k], 'root', 'netem']
            + params.split())

    def counters(self, k):
        """(rx bytes, tx bytes) of host k's interface."""
        out = json.loads(run([self.ip, '-n', self.ns[k], '-s', '-j', 'link', 'show', 'dev',
                              self.ifs[k]]))
        s = out[0]['stats64']
        return s['rx']['bytes'], s['tx']['bytes']

    def dropped(self):
        """Packets the impaired link dropped: netem's counters, or the wire's (then it ends)."""
        if self.link == 'netem':
            n = 0
            for k in (0, 1):
                out = json.loads(run([self.tc, '-n', self.ns[k], '-s', '-j', 'qdisc', 'show',
                                      'dev', self.ifs[k]]))
                n += sum(q.get('drops', 0) for q in out if q.get('kind') == 'netem')
            return n, 'netem'
        self.wire.send_signal(signal.SIGTERM)
        self.wire.wait(10)
        text = self._wire_text()
        n = sum(int(line.split()[-1]) for line in text.splitlines() if ' dropped ' in line)
        return n, text.strip().replace('\n', '; ')

    def cut(self, how):
        if how == 'down':
            run([self.ip, '-n', self.ns[1], 'link', 'set', self.ifs[1], 'down'])
        elif self.link == 'netem':
            for k in (0, 1):
                self.tc_netem(k, 'change', 'loss 100%')
        else:
            # The signal is handled by the wire's own loop: the cut holds once it says so.
            self.wire.send_signal(signal.SIGUSR1)
            until = time.monotonic() + 10
            while 'cut' not in self._wire_text().splitlines():
                expect(time.monotonic() < until, 'netns_wire did not cut the link within 10 s')
                time.sleep(0.01)

    def start_node(self, k, args, env_extra):
        env = {n: v for n, v in os.environ.items()
               if not n.startswith(('SLURM_', 'OMPI_', 'PMI_', 'WEFT_')) and n not in
               ('MASTER_ADDR', 'MASTER_PORT', 'RANK', 'WORLD_SIZE', 'LOCAL_RANK',
                'LOCAL_WORLD_SIZE')}
        env['WEFT_AUTH_TOKEN'] = TOKEN
        env.update(env_extra)
        out = open(os.path.join(self.dir, f'node{k}.out'), 'w+')
        err = open(os.path.join(self.dir, f'node{k}.err'), 'w+')
        # Each host's weftrun is process 1 of a PID namespace of its own (--kill-child: its ranks
        # go with it), as on two machines: host_id() in collectives/cma.c differs.
        p = subprocess.Popen(
            [self.ip, 'netns', 'exec', self.ns[k], self.unshare, '--pid', '--fork',
             '--kill-child', '--mount-proc', os.environ['WEFTRUN'], '--timeout', str(NODE_TIMEOUT),
             '--nnodes', '2', '--node-rank', str(k), '-n', str(NPROC), '--master-addr', HOSTS[0],
             '--master-port', '29500', os.environ['NETNS_RANK']] + args,
            stdout=out, stderr=err, env=env, start_new_session=True)
        p.out, p.err = out, err
        self.procs.append(p)
        return p

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        if self.wire is not None and self.wire.poll() is None:
            self.wire.kill()
            self.wire.wait()
        for ns in self.made:
            # Whatever still runs in the namespace (nothing, normally).
            pids = run([self.ip, 'netns', 'pids', ns], check=False) or ''
            for pid in pids.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run([self.ip, 'netns', 'del', ns], capture_output=True)
        self.made = []
        shutil.rmtree(self.dir, ignore_errors=True)


def finish(nodes, deadline):
    """Waits for both weftruns (until @p deadline, monotonic); their (status, stdout, stderr)."""
    res = []
    for p in nodes:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in nodes:
        code = p.poll()
        p.out.seek(0)
        p.err.seek(0)
        res.append((code, p.out.read(), p.err.read()))
    for k, (code, out, err) in enumerate(res):
        expect(code is not None, f'host {k}: weftrun still running at the deadline\n'
               f'stdout:\n{out}\nstderr:\n{err}')
    return res


def expect_ran(res, want):
    """Both weftruns exited 0 and every rank printed a line starting with @p want % rank."""
    for k, (code, out, err) in enumerate(res):
        expect(code == 0, f'host {k}: weftrun exited {code}\nstdout:\n{out}\nstderr:\n{err}')
        for r in range(k * NPROC, (k + 1) * NPROC):
            prefix = f'[rank {r}] ' + want % r
            expect(any(line.startswith(prefix) for line in out.splitlines()),
                   f'host {k}: no line "{prefix}"\nstdout:\n{out}\nstderr:\n{err}')


def rank_lines(res, word):
    return [line for _, out, _ in res for line in out.splitlines() if word in line]


def impaired_link():
    """The link kind for the impaired cases: the wire, or netem when NETNS_LINK says so."""
    if os.environ.get('NETNS_LINK', '') != 'netem':
        return 'wire'
    if which('tc') is None:
        skip('NETNS_LINK=netem, but tc (iproute2) is not installed')
    with Hosts('q', 'veth') as h:
        r = subprocess.run([h.tc, '-n', h.ns[0], 'qdisc', 'add', 'dev', h.ifs[0], 'root', 'netem',
                            'delay', '1ms'], capture_output=True, text=True)
        if r.returncode != 0:
            skip(f'NETNS_LINK=netem, but this kernel has no netem (tc qdisc add ... netem: '
                 f'{r.stderr.strip()})')
    return 'netem'


def job(h, what):
    t0 = time.monotonic()
    nodes = [h.start_node(k, ['job', *HOSTS], {}) for k in (1, 0)]
    res = finish(nodes[::-1], t0 + NODE_TIMEOUT + 10)
    expect_ran(res, 'NETNS OK rank %d checksum ')
    want = expected_checksum()
    for line in rank_lines(res, 'NETNS OK'):
        expect(line.endswith(f'checksum {want}'), f'{line}: want checksum {want}')
    for line in rank_lines(res, 'all_reduce of') + rank_lines(res, 'direct connection'):
        log(line)
    log(f'{what}: the job took {time.monotonic() - t0:.1f} s, checksum {want} on every rank')


def case_cross_host():
    with Hosts('c', 'veth') as h:
        before = [h.counters(k) for k in (0, 1)]
        job(h, 'veth')
        after = [h.counters(k) for k in (0, 1)]
        # Each host sends its 2 echo requests and the answers to the other host's 2: at least
        # 4 * ECHO_BYTES each way, and the ring's share of the all_reduce.
        least = 4 * ECHO_BYTES
        for k in (0, 1):
            rx, tx = after[k][0] - before[k][0], after[k][1] - before[k][1]
            log(f'host {k}: {h.ifs[k]} received {rx} bytes, sent {tx}')
            expect(rx >= least and tx >= least,
                   f'host {k}: only {rx} bytes received and {tx} sent on {h.ifs[k]}, want '
                   f'{least} at least each way: the job did not cross the veth pair')


def case_delay_loss():
    link = impaired_link()
    with Hosts('l', link, (DELAY_MS, LOSS_PCT)) as h:
        job(h, f'{DELAY_MS} ms and {LOSS_PCT} % loss each way ({link})')
        n, detail = h.dropped()
        log(f'dropped {n} packets: {detail}')
        expect(n > 0, f'the link dropped no packet ({detail}): the loss was not applied')


def case_syn_loss():
    with Hosts('s', 'wire', (DELAY_MS, 0), 'first-syn') as h:
        job(h, f'{DELAY_MS} ms each way, the first SYN to each address and port lost')
        n, detail = h.dropped()
        log(f'dropped {n} packets: {detail}')
        expect(n > 0, f'the link dropped no SYN ({detail})')


def case_partition(how):
    link = 'veth' if how == 'down' else impaired_link()
    # netem or the wire pass everything until cut() makes them drop every packet.
    with Hosts('p' if how == 'drop' else 'd', link, (0, 0) if link != 'veth' else None) as h:
        t0 = time.monotonic()
        env = {'WEFT_PEER_TIMEOUT_MS': str(PEER_TIMEOUT_MS)}
        nodes = [h.start_node(k, ['partition', *HOSTS, h.dir], env) for k in (1, 0)]
        ready = [os.path.join(h.dir, f'ready.{r}') for r in range(2 * NPROC)]
        until = t0 + 30
        while not all(os.path.exists(p) for p in ready):
            if any(p.poll() is not None for p in nodes) or time.monotonic() > until:
                res = finish(nodes[::-1], time.monotonic() + 1)
                raise Failed('the ranks did not all get ready:\n' + '\n'.join(
                    f'host {k}: exit {c}\nstdout:\n{o}\nstderr:\n{e}'
                    for k, (c, o, e) in enumerate(res)))
            time.sleep(0.01)
        h.cut(how)
        open(os.path.join(h.dir, 'cut'), 'w').close()
        what = 'one veth end down' if how == 'down' else f'{link}, every packet dropped'
        log(f'cut the link ({what})')
        res = finish(nodes[::-1], t0 + NODE_TIMEOUT + 10)
        expect_ran(res, 'PARTITION OK rank %d')
        for line in rank_lines(res, 'PEER_LOST after') + rank_lines(res, 'shutdown:'):
            log(line)


CASES = {
    'cross_host': case_cross_host,
    'delay_loss': case_delay_loss,
    'syn_loss': case_syn_loss,
    'partition': lambda: case_partition('drop'),
    'partition_down': lambda: case_partition('down'),
}


def main():
    if len(sys.argv) != 2 or sys.argv[1] not in CASES:
        print(f'usage: netns_test.py {"|".join(CASES)}', file=sys.stderr)
        return 2
    if not sys.platform.startswith('linux'):
        skip('network namespaces are Linux only')
    for prog in ('ip', 'unshare'):
        if which(prog) is None:
            skip(f'{prog} is not installed (iproute2, util-linux)')
    if os.geteuid() != 0:
        skip('not root: making network namespaces and links needs root (CAP_NET_ADMIN, '
             'CAP_SYS_ADMIN)')
    # meson's timeout sends SIGTERM: the finally blocks still take everything down.
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    signal.signal(signal.SIGINT, lambda *a: sys.exit(130))
    try:
        CASES[sys.argv[1]]()
    except Failed as e:
        log(f'FAIL: {e}')
        return 1
    log('OK')
    return 0


if __name__ == '__main__':
    sys.exit(main())
