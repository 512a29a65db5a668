#!/bin/sh
# Two hosts for tests/tools/test_multinode.c: network namespaces joined by a veth pair, node 0 at
# 10.99.0.1 and node 1 at 10.99.0.2, and one weftrun --nnodes 2 in each. Each node's weftrun also
# runs in a PID namespace of its own: as on two machines, the ranks of one node cannot read the
# memory of the other's (collectives' cross-memory all_reduce tells hosts apart by boot id and
# PID namespace).
#
#   multinode.sh TAG OUTDIR NPROC PROG [ARGS...]
#
# TAG makes the names unique (namespaces weft<TAG>a and weft<TAG>b, interfaces wv<TAG>a and
# wv<TAG>b; at most 12 characters). Environment:
#   IP, UNSHARE, WEFTRUN   the programs (full paths)
#   WEFT_AUTH_TOKEN        the job's token, the same on both nodes
#   NODE0_ENV, NODE1_ENV   "NAME=VALUE ..." given to that node's weftrun only (may be empty)
#   NODE_TIMEOUT           each weftrun's --timeout, in seconds
#   WEFTRUN_ARGS           more weftrun options for both nodes (may be empty)
#   PRIVATE_RUN            1: started in user and mount namespaces of its own (unshare -Urnm, not
#                          root): a tmpfs on /run first, where `ip netns` keeps its namespaces
# Writes OUTDIR/node<k>.out, node<k>.err and node<k>.status (weftrun's exit status). Exits 0 when
# both nodes ran, whatever their status; 77 when the namespaces cannot be made (why on stderr);
# 1 otherwise. The namespaces and whatever runs in them go on every exit.
set -u

if [ $# -lt 4 ]; then
    echo "usage: multinode.sh TAG OUTDIR NPROC PROG [ARGS...]" >&2
    exit 1
fi
tag=$1
out=$2
nproc=$3
shift 3
nsa=weft${tag}a
nsb=weft${tag}b
made=

cleanup() {
    for ns in $made; do
        for pid in $("$IP" netns pids "$ns" 2>/dev/null); do
            kill -KILL "$pid" 2>/dev/null
        done
        "$IP" netns del "$ns" 2>/dev/null
    done
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP

if [ "${PRIVATE_RUN:-0}" = 1 ] && ! err=$(mount -t tmpfs weft-run /run 2>&1); then
    echo "cannot mount a tmpfs on /run in a user namespace: $err" >&2
    exit 77
fi
for ns in "$nsa" "$nsb"; do
    if ! err=$("$IP" netns add "$ns" 2>&1); then
        echo "cannot create a network namespace: ip netns add: $err" >&2
        exit 77
    fi
    made="$made $ns"
done
if ! err=$("$IP" link add "wv${tag}a" netns "$nsa" type veth peer name "wv${tag}b" netns "$nsb" 2>&1); then
    echo "cannot create a veth pair: ip link add: $err" >&2
    exit 77
fi
set -e
"$IP" -n "$nsa" addr add 10.99.0.1/24 dev "wv${tag}a"
"$IP" -n "$nsb" addr add 10.99.0.2/24 dev "wv${tag}b"
for ns in "$nsa" "$nsb"; do
    # `ip netns exec` gives a fresh namespace whose loopback is down.
    "$IP" -n "$ns" link set lo up
done
"$IP" -n "$nsa" link set "wv${tag}a" up
"$IP" -n "$nsb" link set "wv${tag}b" up
set +e

# run_node K NAMESPACE ENV PROG [ARGS...]: one node's weftrun (its status to OUTDIR/nodeK.status).
run_node() {
    k=$1
    ns=$2
    nodeenv=$3
    shift 3
    # shellcheck disable=SC2086 # NODEk_ENV and WEFTRUN_ARGS are lists of words
    "$IP" netns exec "$ns" env $nodeenv "$UNSHARE" --pid --fork --kill-child "$WEFTRUN" \
        --timeout "$NODE_TIMEOUT" --nnodes 2 --node-rank "$k" -n "$nproc" \
        --master-addr 10.99.0.1 --master-port 29500 ${WEFTRUN_ARGS:-} "$@" \
        >"$out/node$k.out" 2>"$out/node$k.err"
    echo $? >"$out/node$k.status"
}

run_node 1 "$nsb" "${NODE1_ENV:-}" "$@" &
node1=$!
run_node 0 "$nsa" "${NODE0_ENV:-}" "$@" &
node0=$!
wait "$node0"
wait "$node1"
exit 0
