/* Every WEFT_* environment variable, once: X(id, name, type, default, min, max, choices, aliases,
 * module, doc). Included by core/internal.h (the ids) and core/config.c (the table); not
 * installed. `weftrun --print-config` prints this table with the values in effect.
 *   type: INT (decimal, in min..max), BOOL (0/1, true/false, yes/no, on/off), STR, CHOICE (one of
 *         choices, '|'-separated), SECRET (a string never printed).
 *   default: the text used when the variable and its aliases are unset ("" for none).
 *   aliases: other names read when the WEFT_ one is unset, in order ('|'-separated; "" none). */
#ifndef WEFT_CORE_CONFIG_VARS_H
#define WEFT_CORE_CONFIG_VARS_H


#define WEFT__CONFIG_VARS(X)                                                                       \
    /* core */                                                                                     \
    X(LOG, "WEFT_LOG", CHOICE, "warn", 0, 0, "debug|info|warn|warning|error|off|none", "", "core",      \
      "log threshold: lines below it are not printed")                                             \
    X(SPIN_US, "WEFT_SPIN_US", INT, "200", 0, 100000, "", "", "core",                              \
      "microseconds a waiting thread polls a future before it sleeps")                            \
    X(TENSOR_CACHE_MB, "WEFT_TENSOR_CACHE_MB", INT, "1024", 0, 1073741824, "", "", "core",         \
      "MiB of large tensor buffers kept for reuse (received messages land in them)")              \
    X(REDUCE_SIMD, "WEFT_REDUCE_SIMD", BOOL, "1", 0, 0, "", "", "core",                            \
      "use the CPU's vector kernels (F16C, AVX2) for f16/bf16 reductions")                         \
    /* rpc: the agent (weft_agent_opts_t fields override these) */                                 \
    X(RANK, "WEFT_RANK", INT, "-1", -1, 1048575, "", "RANK|SLURM_PROCID|OMPI_COMM_WORLD_RANK|PMI_RANK", \
      "rpc", "this process's rank in the world")                                                  \
    X(WORLD_SIZE, "WEFT_WORLD_SIZE", INT, "-1", -1, 1048576, "",                                   \
      "WORLD_SIZE|SLURM_NTASKS|OMPI_COMM_WORLD_SIZE|PMI_SIZE", "rpc", "number of ranks")          \
    X(MASTER_ADDR, "WEFT_MASTER_ADDR", STR, "127.0.0.1", 0, 0, "", "MASTER_ADDR", "rpc",           \
      "host of rank 0, where every rank joins")                                                    \
    X(MASTER_PORT, "WEFT_MASTER_PORT", INT, "-1", -1, 65535, "", "MASTER_PORT", "rpc",             \
      "port of rank 0's server (rank 0 may use 0: any free port)")                                 \
    X(NAME, "WEFT_NAME", STR, "", 0, 0, "", "", "rpc", "this worker's name (default worker<rank>)") \
    X(LISTEN_HOST, "WEFT_LISTEN_HOST", STR, "", 0, 0, "", "", "rpc",                               \
      "host or address other ranks reach this one at (default: see docs/weftrun.md)")              \
    X(SOCKET_IFNAME, "WEFT_SOCKET_IFNAME", STR, "", 0, 0, "", "", "rpc",                           \
      "network interface whose IPv4 address this rank listens on and advertises")                  \
    X(AUTH_TOKEN, "WEFT_AUTH_TOKEN", SECRET, "", 0, 0, "", "", "rpc",                              \
      "the job's shared secret, checked when a rank joins and connects")                           \
    X(TLS_CA, "WEFT_TLS_CA", STR, "", 0, 0, "", "", "rpc",                                         \
      "PEM file of the job's CA: TLS with client certificates on every connection (docs/security.md)") \
    X(TLS_CERT, "WEFT_TLS_CERT", STR, "", 0, 0, "", "", "rpc",                                     \
      "PEM file of this rank's certificate (chain), bound to its rank (docs/security.md)")          \
    X(TLS_KEY, "WEFT_TLS_KEY", STR, "", 0, 0, "", "", "rpc",                                       \
      "PEM file of this rank's private key")                                                       \
    X(RENDEZVOUS_TIMEOUT_MS, "WEFT_RENDEZVOUS_TIMEOUT_MS", INT, "60000", 1, INT64_MAX, "", "",  \
      "rpc", "how long the ranks wait for each other at join")                                    \
    X(RPC_TIMEOUT_MS, "WEFT_RPC_TIMEOUT_MS", INT, "60000", 1, INT64_MAX, "", "", "rpc",        \
      "deadline of a call (and of other remote operations) given a timeout of 0")                  \
    X(PEER_TIMEOUT_MS, "WEFT_PEER_TIMEOUT_MS", INT, "2000", 200, INT64_MAX, "", "", "rpc",     \
      "a peer silent this long is declared lost")                                                  \
    X(HANDLER_THREADS, "WEFT_HANDLER_THREADS", INT, "1", 1, 32, "", "", "rpc",                     \
      "threads serving the transport and handlers (one more starts when one blocks)")             \
    X(MAX_MESSAGE_BYTES, "WEFT_MAX_MESSAGE_BYTES", INT, "4294967295", 1024, 4294967295, "", "",     \
      "rpc", "largest message this rank accepts")                                                  \
    X(HANDSHAKE_TIMEOUT_MS, "WEFT_HANDSHAKE_TIMEOUT_MS", INT, "10000", 100, INT64_MAX, "", "",      \
      "rpc", "a connection that has not proved its rank by then is closed")                        \
    X(DIRECT, "WEFT_DIRECT", BOOL, "1", 0, 0, "", "", "rpc",                                       \
      "large frames take direct TCP connections between ranks (0: everything on gRPC)")           \
    X(DIRECT_FAULT_SILENT_MS, "WEFT_DIRECT_FAULT_SILENT_MS", INT, "0", 0, INT64_MAX, "", "",       \
      "rpc", "tests: the direct listener waits this long before its challenge (a silent port)")   \
    X(SHUTDOWN_FAULT_GAP_MS, "WEFT_SHUTDOWN_FAULT_GAP_MS", INT, "0", 0, 10000, "", "", "rpc",      \
      "tests: rank 0 waits this long after it answers its own last shutdown report")              \
    X(SHUTDOWN_FAULT_DELAY_MS, "WEFT_SHUTDOWN_FAULT_DELAY_MS", INT, "0", 0, 10000, "", "", "rpc",  \
      "tests: a rank waits this long before each of its shutdown reports")                         \
    X(SEAL_EPOCH_BYTES, "WEFT_SEAL_EPOCH_BYTES", INT, "17179869184", 4096, 17179869184, "", "",    \
      "rpc", "tests: bytes sealed under one key on a TLS direct connection (every rank alike)")    \
    X(SHM, "WEFT_SHM", BOOL, "1", 0, 0, "", "", "rpc",                                             \
      "ranks of one host exchange every frame through shared-memory rings (0: off, on any rank)")  \
    X(SHM_RING_KB, "WEFT_SHM_RING_KB", INT, "4096", 64, 262144, "", "", "rpc",                     \
      "KiB of each shared-memory ring (one per ordered pair of ranks on a host; a power of two)")   \
    X(SHM_SPIN_US, "WEFT_SHM_SPIN_US", INT, "1000", 0, 100000, "", "", "rpc",                        \
      "microseconds a shared-memory reader or writer polls its ring before it sleeps")             \
    X(SHM_SLEEP_MS, "WEFT_SHM_SLEEP_MS", INT, "50", 1, 600000, "", "", "rpc",                        \
      "tests: how long a sleeping ring side waits for a wake before it looks again")              \
    X(SHM_HOST_TAG, "WEFT_SHM_HOST_TAG", STR, "", 0, 0, "", "", "rpc",                             \
      "tests: ranks with different tags act as if on different hosts (no shared memory)")          \
    /* rref */                                                                                     \
    X(DIST_CONTEXT_TTL_MS, "WEFT_DIST_CONTEXT_TTL_MS", INT, "600000", 100, INT64_MAX, "", "",       \
      "dist_autograd",                                                                             \
      "a context other workers' calls brought here is dropped after this long unused (its "        \
      "creator's release or loss drops it first)")                                                 \
    X(RREF_EAGER_BYTES, "WEFT_RREF_EAGER_BYTES", INT, "65536", 0, INT64_MAX, "", "", "rref",    \
      "values up to this size come back with remote()'s answer (0: always fetched)")               \
    X(RREF_FAULT_DELAY_US, "WEFT_RREF_FAULT_DELAY_US", INT, "0", 0, INT64_MAX, "", "", "rref",  \
      "tests: delay each reference control message by up to this many microseconds")              \
    X(RREF_FAULT_DUP, "WEFT_RREF_FAULT_DUP", BOOL, "0", 0, 0, "", "", "rref",                      \
      "tests: send each reference control message twice")                                         \
    /* collectives */                                                                              \
    X(COLL_TIMEOUT_MS, "WEFT_COLL_TIMEOUT_MS", INT, "60000", 1, INT64_MAX, "", "",              \
      "collectives", "a group's default deadline for each operation")                              \
    X(COLL_ALGO, "WEFT_COLL_ALGO", CHOICE, "auto", 0, 0, "auto|direct|ring|cma|oneshot", "", "collectives", \
      "all_reduce algorithm of new groups (set it alike on every rank)")                          \
    X(COLL_CMA, "WEFT_COLL_CMA", BOOL, "1", 0, 0, "", "", "collectives",                           \
      "allow collectives (all_reduce, broadcast, all_gather, reduce_scatter, all_to_all) by "        \
      "cross-memory reads between ranks of one host (0 on any rank: never)")  \
    /* cuda (the cuda feature) */                                                                  \
    X(CUDA_CHUNKS, "WEFT_CUDA_CHUNKS", INT, "8", 1, 64, "", "", "cuda",                            \
      "chunks a device tensor of 1 MiB or more is cut into when a collective stages it through "   \
      "pinned host memory (set it alike on every rank)")                                           \
    X(CUDA_IPC, "WEFT_CUDA_IPC", BOOL, "1", 0, 0, "", "", "cuda",                                  \
      "ranks of one host exchange device memory by CUDA IPC in all_reduce and broadcast "          \
      "(set it alike on every rank)")                                                              \
    X(CUDA_IPC_MIN_KB, "WEFT_CUDA_IPC_MIN_KB", INT, "256", 0, 1048576, "", "", "cuda",             \
      "smallest tensor (KiB) whose all_reduce or broadcast considers CUDA IPC")                   \
    /* ps */                                                                                       \
    X(PS_SERVERS, "WEFT_PS_SERVERS", STR, "1", 0, 0, "", "", "ps",                                 \
      "parameter server ranks: a count N (ranks 0..N-1) or a list \"0,3\"")                       \
    X(PS_WORKERS, "WEFT_PS_WORKERS", STR, "", 0, 0, "", "", "ps",                                  \
      "parameter server worker ranks as a list (empty: every non-server rank, or all)")           \
    X(PS_FAULT_DUP, "WEFT_PS_FAULT_DUP", BOOL, "0", 0, 0, "", "", "ps",                            \
      "tests: send each push twice (the same sequence number)")                                   \
    X(PS_FAULT_DELAY_US, "WEFT_PS_FAULT_DELAY_US", INT, "0", 0, INT64_MAX, "", "", "ps",           \
      "tests: delay each push by up to this many microseconds (reorders them)")                   \
    X(PS_FAULT_COMMIT_EXIT, "WEFT_PS_FAULT_COMMIT_EXIT", INT, "-1", -1, INT64_MAX, "", "", "ps",   \
      "test hook: worker 0 exits (8) in the save of this checkpoint, before its MANIFEST")         \
    X(PS_FAULT_SAVE_EXIT, "WEFT_PS_FAULT_SAVE_EXIT", INT, "-1", -1, INT64_MAX, "", "", "ps",       \
      "tests: a server exits at once (as if killed) in its N-th save, writing its last table")     \
    /* examples */                                                                                 \
    X(DATA_DIR, "WEFT_DATA_DIR", STR, "/usr/share/datasets/fashion-mnist", 0, 0, "", "",            \
      "examples", "where the examples read Fashion-MNIST")

#endif
