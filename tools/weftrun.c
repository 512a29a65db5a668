/*
 * weftrun: start the ranks of a weft job.
 *
 * Standalone: forks -n N copies of a program on this node, each in its own
 * process group, gives each the WEFT_* (and torchrun-compatible) rank
 * variables, prefixes every line the ranks print with "[rank R] ", and tears
 * the job down when one rank fails, on --timeout, or on SIGINT/SIGTERM/SIGHUP.
 *
 * Under srun or mpirun (one task per rank) it sets the same variables from
 * the launcher's and exec's the program in place, so the launcher keeps
 * control of the process.
 *
 * Dependency-free on purpose: libc, and weft's core for --print-config (the configuration table);
 * it does not link the rest of libweft.
 * See docs/weftrun.md.
 */

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <weft/config.h>

#include "certs.h"
#ifdef __linux__
#include <sys/prctl.h>
#endif

#define EXIT_USAGE     2           /* bad option or configuration */
#define EXIT_NOT_EXEC  126         /* program found but not executable (shell convention) */
#define EXIT_NOT_FOUND 127         /* program not found (shell convention) */
#define EXIT_TIMEOUT   124         /* --timeout expired (like timeout(1)) */
#define LINE_CAP       (64 * 1024) /* longer lines are printed in pieces this long */
#define KILL_GRACE_S   5.0         /* SIGTERM -> SIGKILL */
#define TOKEN_BYTES    16          /* 32 hex chars */
#define TOKEN_MAX      256
#define ADDR_MAX       255
#define NPROC_MAX      1024
#define IOV_BATCH      256
#define ENV_COUNT      14 /* always set; 3 more with --tls */
#define ENV_MAX        17
#define TLS_DAYS       30
#define PREFIX_MAX     32

typedef enum {
    LAUNCHER_NONE = 0,
    LAUNCHER_SRUN,
    LAUNCHER_MPIRUN,
} launcher_kind_t;

typedef struct {
    int nproc; /* -n; 1 when not given */
    bool nproc_set;
    int nnodes;
    bool nnodes_set;
    int node_rank;
    bool node_rank_set;
    const char *master_addr; /* NULL when not given */
    int master_port;         /* 0 when not given */
    double timeout_s;        /* 0 = none */
    bool no_prefix;
    bool print_env;
    bool standalone;
    const char *servers; /* --servers: WEFT_PS_SERVERS for every rank */
    bool tls;            /* --tls: a job CA and a certificate per rank */
    const char *tls_ca;  /* --tls-ca: sign with this CA instead of a new one */
    const char *tls_ca_key;
    char **prog_argv;    /* program and its arguments, NULL-terminated */
} opts_t;

/* What srun/mpirun told this task about itself. */
typedef struct {
    launcher_kind_t kind;
    int rank;
    int world;
    int local_rank;
    int local_world;
    int node_rank;
    char master_addr[ADDR_MAX + 1]; /* derived from the scheduler; "" if unknown */
} launcher_t;

/* Where the ranks this weftrun starts sit in the job. */
typedef struct {
    int nproc;      /* ranks started by this weftrun (local world size) */
    int nnodes;     /* number of nodes (weftruns) */
    int node_rank;  /* this node's index */
    int first_rank; /* global rank of local rank 0 (exec mode: of the one rank) */
    int world;      /* global world size */
    int local_rank; /* exec mode only: the local rank of the one rank */
    char master_addr[ADDR_MAX + 1];
    char master_port[8];
    char token[TOKEN_MAX + 1];
    char tls_dir[PATH_MAX]; /* --tls: ca.pem, rank<r>.pem, rank<r>.key; "" without */
} job_t;

typedef struct {
    const char *name;
    const char *value;
} env_var_t;

typedef struct {
    char num[5][16];
    char tls[3][PATH_MAX + 32];
    env_var_t vars[ENV_MAX];
    int n;
} rank_env_t;

typedef struct {
    int fd;     /* read end of the rank's pipe; -1 once closed */
    int out_fd; /* where its lines go: 1 or 2 */
    size_t len; /* bytes of a partial line held in buf */
    char *buf;  /* LINE_CAP bytes */
} stream_t;

typedef struct {
    int rank; /* global rank */
    pid_t pid;
    bool exited; /* seen by waitid(WNOWAIT); the zombie keeps the pgid reserved */
    int how;     /* CLD_EXITED, CLD_KILLED or CLD_DUMPED */
    int code;    /* exit status or signal number */
    char prefix[PREFIX_MAX];
    size_t prefix_len;
    stream_t streams[2]; /* stdout, stderr */
} child_t;

typedef struct {
    child_t *children;
    int nchildren;
    bool prefix;
    int exit_code; /* -1 until the first failure, timeout or signal decides it */
    bool tearing_down;
    bool killed;
    double kill_deadline;
    double timeout_s;
    double timeout_deadline; /* 0 = none */
    bool out_broken[3];      /* our stdout/stderr went away: drop output */
} run_t;

/* Signals weftrun forwards to the ranks, and two it changes for itself. */
#define NSIGS_SAVED 5
static const int g_saved_sigs[NSIGS_SAVED] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE};
static struct sigaction g_orig_actions[NSIGS_SAVED]; /* restored in each rank before exec */

static volatile sig_atomic_t g_signal;
static volatile sig_atomic_t g_signal_count;
static volatile sig_atomic_t g_sigchld;

static const char *const usage_text =
    "Usage: weftrun [options] [--] prog [args...]\n"
    "\n"
    "Start the ranks of a weft job. Each rank gets WEFT_RANK, WEFT_WORLD_SIZE,\n"
    "WEFT_LOCAL_RANK, WEFT_LOCAL_WORLD_SIZE, WEFT_NODE_RANK, WEFT_MASTER_ADDR,\n"
    "WEFT_MASTER_PORT, WEFT_AUTH_TOKEN and torchrun's RANK, WORLD_SIZE, LOCAL_RANK,\n"
    "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT.\n"
    "\n"
    "Options:\n"
    "  -n, --nproc-per-node N  ranks to start on this node (default 1)\n"
    "      --nnodes M          number of nodes (default 1)\n"
    "      --node-rank K       index of this node, 0..M-1 (default 0)\n"
    "      --master-addr HOST  rendezvous host (default 127.0.0.1)\n"
    "      --master-port P     rendezvous port (default: a free port when M is 1;\n"
    "                          required when M > 1)\n"
    "      --timeout SEC       stop all ranks after SEC seconds and exit 124\n"
    "                          (0 = no limit, the default)\n"
    "      --no-prefix         do not prefix output lines with \"[rank R] \"\n"
    "      --print-env         print the variables each rank would get, and exit\n"
    "      --print-config      print every WEFT_* variable (type, default, value in\n"
    "                          effect, what it does), and exit\n"
    "      --standalone        ignore srun/mpirun variables in the environment\n"
    "      --servers N|LIST    parameter server ranks: N means ranks 0..N-1, or a\n"
    "                          list like 0,3 (sets WEFT_PS_SERVERS; docs/ps.md)\n"
    "      --tls               TLS with client certificates on every connection:\n"
    "                          make a job CA and a certificate per rank (in a\n"
    "                          private directory removed at the end) and set\n"
    "                          WEFT_TLS_CA, WEFT_TLS_CERT, WEFT_TLS_KEY\n"
    "      --tls-ca FILE       with --tls: sign with this CA certificate instead\n"
    "      --tls-ca-key FILE   and this key (the same on every node: needed when\n"
    "                          --nnodes > 1; docs/security.md)\n"
    "  -h, --help              show this help\n"
    "\n"
    "Multi-node: run one weftrun per node with the same --nnodes, --master-addr,\n"
    "--master-port and WEFT_AUTH_TOKEN (export it; 32 hex chars) and distinct\n"
    "--node-rank. Under srun or mpirun with one task per rank, weftrun takes the\n"
    "rank from the launcher and exec's prog in place (MASTER_PORT, and for mpirun\n"
    "MASTER_ADDR, must then come from the environment or the flags).\n"
    "\n"
    "Exit status: 0 when all ranks exit 0; else the first failing rank's status\n"
    "(128+signal if it was killed), 124 on --timeout, 128+signal when weftrun\n"
    "itself is interrupted, 126/127 when prog cannot be executed, 2 on usage\n"
    "errors.\n";

/* ---- small helpers ---------------------------------------------------- */

static void errorf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static void errorf(const char *fmt, ...)
{
    static const char tag[] = "weftrun: ";
    char line[1024];
    size_t len = sizeof(tag) - 1;
    va_list ap;
    int n;

    memcpy(line, tag, len);
    va_start(ap, fmt);
    n = vsnprintf(line + len, sizeof(line) - len - 1, fmt, ap);
    va_end(ap);
    if (n < 0) {
        return;
    }
    len += (size_t)n;
    if (len > sizeof(line) - 2) {
        len = sizeof(line) - 2;
    }
    line[len++] = '\n';
    /* One write, so the message cannot split around a rank's line. */
    if (write(STDERR_FILENO, line, len) < 0) {
        return;
    }
}

static double now_s(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static const char *signal_name(int sig)
{
    switch (sig) {
    case SIGHUP:
        return "SIGHUP";
    case SIGINT:
        return "SIGINT";
    case SIGQUIT:
        return "SIGQUIT";
    case SIGILL:
        return "SIGILL";
    case SIGTRAP:
        return "SIGTRAP";
    case SIGABRT:
        return "SIGABRT";
    case SIGBUS:
        return "SIGBUS";
    case SIGFPE:
        return "SIGFPE";
    case SIGKILL:
        return "SIGKILL";
    case SIGUSR1:
        return "SIGUSR1";
    case SIGSEGV:
        return "SIGSEGV";
    case SIGUSR2:
        return "SIGUSR2";
    case SIGPIPE:
        return "SIGPIPE";
    case SIGALRM:
        return "SIGALRM";
    case SIGTERM:
        return "SIGTERM";
    case SIGCHLD:
        return "SIGCHLD";
    case SIGCONT:
        return "SIGCONT";
    case SIGSTOP:
        return "SIGSTOP";
    case SIGTSTP:
        return "SIGTSTP";
    case SIGTTIN:
        return "SIGTTIN";
    case SIGTTOU:
        return "SIGTTOU";
    case SIGURG:
        return "SIGURG";
    case SIGXCPU:
        return "SIGXCPU";
    case SIGXFSZ:
        return "SIGXFSZ";
    case SIGVTALRM:
        return "SIGVTALRM";
    case SIGPROF:
        return "SIGPROF";
    case SIGWINCH:
        return "SIGWINCH";
    case SIGSYS:
        return "SIGSYS";
    default:
        return "signal";
    }
}

/* Parse a whole decimal int in [min, max]. Returns 0, or -1 if s is not one. */
static int parse_int(const char *s, int min, int max, int *out_p)
{
    char *end;
    long v;

    if (s == NULL || *s == '\0') {
        return -1;
    }
    errno = 0;
    v = strtol(s, &end, 10);
    if (errno != 0 || *end != '\0' || v < min || v > max) {
        return -1;
    }
    *out_p = (int)v;
    return 0;
}

/* Integer from the environment. Returns 1 if set and valid, 0 if unset, -1 (logged) if bad. */
static int env_int(const char *name, int min, int max, int *out_p)
{
    const char *s = getenv(name);

    if (s == NULL) {
        return 0;
    }
    if (parse_int(s, min, max, out_p) != 0) {
        errorf("%s='%s' is not an integer in [%d, %d]", name, s, min, max);
        return -1;
    }
    return 1;
}

/* The first variable of names[] that is set, or NULL. */
static const char *env_first(const char *const *names, const char **which_p)
{
    for (size_t i = 0; names[i] != NULL; i++) {
        const char *v = getenv(names[i]);
        if (v != NULL && *v != '\0') {
            if (which_p != NULL) {
                *which_p = names[i];
            }
            return v;
        }
    }
    return NULL;
}

static int copy_str(char *dst, size_t cap, const char *src, const char *what)
{
    size_t n = strlen(src);

    if (n == 0 || n >= cap) {
        errorf("%s '%s' is empty or longer than %zu characters", what, src, cap - 1);
        return -1;
    }
    memcpy(dst, src, n + 1);
    return 0;
}

/* ---- options ---------------------------------------------------------- */

enum {
    OPT_NNODES = 256,
    OPT_NODE_RANK,
    OPT_MASTER_ADDR,
    OPT_MASTER_PORT,
    OPT_TIMEOUT,
    OPT_NO_PREFIX,
    OPT_PRINT_ENV,
    OPT_PRINT_CONFIG,
    OPT_STANDALONE,
    OPT_SERVERS,
    OPT_TLS,
    OPT_TLS_CA,
    OPT_TLS_CA_KEY,
};

static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static int usage_error(const char *fmt, ...)
{
    va_list ap;

    fputs("weftrun: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputs("\nTry 'weftrun --help'.\n", stderr);
    return -1;
}

/* Returns 0 to go on, 1 when --help was printed, -1 (logged) on a usage error. */
static int parse_opts(int argc, char **argv, opts_t *opts)
{
    static const struct option longopts[] = {
        {"nproc-per-node", required_argument, NULL, 'n'},
        {"nnodes", required_argument, NULL, OPT_NNODES},
        {"node-rank", required_argument, NULL, OPT_NODE_RANK},
        {"master-addr", required_argument, NULL, OPT_MASTER_ADDR},
        {"master-port", required_argument, NULL, OPT_MASTER_PORT},
        {"timeout", required_argument, NULL, OPT_TIMEOUT},
        {"no-prefix", no_argument, NULL, OPT_NO_PREFIX},
        {"print-env", no_argument, NULL, OPT_PRINT_ENV},
        {"print-config", no_argument, NULL, OPT_PRINT_CONFIG},
        {"standalone", no_argument, NULL, OPT_STANDALONE},
        {"servers", required_argument, NULL, OPT_SERVERS},
        {"tls", no_argument, NULL, OPT_TLS},
        {"tls-ca", required_argument, NULL, OPT_TLS_CA},
        {"tls-ca-key", required_argument, NULL, OPT_TLS_CA_KEY},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    int c;

    memset(opts, 0, sizeof(*opts));
    opts->nproc = 1;
    opts->nnodes = 1;
    opterr = 0;
    /* '+': stop at the program name, so its own options pass through. */
    while ((c = getopt_long(argc, argv, "+:hn:", longopts, NULL)) != -1) {
        char *end;

        switch (c) {
        case 'h':
            fputs(usage_text, stdout);
            return 1;
        case 'n':
            if (parse_int(optarg, 1, NPROC_MAX, &opts->nproc) != 0) {
                return usage_error("-n/--nproc-per-node needs an integer in [1, %d], got '%s'",
                                   NPROC_MAX, optarg);
            }
            opts->nproc_set = true;
            break;
        case OPT_NNODES:
            if (parse_int(optarg, 1, 1 << 20, &opts->nnodes) != 0) {
                return usage_error("--nnodes needs a positive integer, got '%s'", optarg);
            }
            opts->nnodes_set = true;
            break;
        case OPT_NODE_RANK:
            if (parse_int(optarg, 0, (1 << 20) - 1, &opts->node_rank) != 0) {
                return usage_error("--node-rank needs a non-negative integer, got '%s'", optarg);
            }
            opts->node_rank_set = true;
            break;
        case OPT_MASTER_ADDR:
            if (*optarg == '\0' || strlen(optarg) > ADDR_MAX) {
                return usage_error("--master-addr needs a host name or address");
            }
            opts->master_addr = optarg;
            break;
        case OPT_MASTER_PORT:
            if (parse_int(optarg, 1, 65535, &opts->master_port) != 0) {
                return usage_error("--master-port needs a port in [1, 65535], got '%s'", optarg);
            }
            break;
        case OPT_TIMEOUT:
            errno = 0;
            opts->timeout_s = strtod(optarg, &end);
            if (errno != 0 || end == optarg || *end != '\0' || !isfinite(opts->timeout_s) ||
                opts->timeout_s < 0) {
                return usage_error("--timeout needs a number of seconds >= 0, got '%s'", optarg);
            }
            break;
        case OPT_NO_PREFIX:
            opts->no_prefix = true;
            break;
        case OPT_PRINT_ENV:
            opts->print_env = true;
            break;
        case OPT_PRINT_CONFIG:
            /* Every WEFT_* variable with its type, default and the value in effect here. */
            weft_config_print(stdout);
            return 1;
        case OPT_STANDALONE:
            opts->standalone = true;
            break;
        case OPT_SERVERS:
            /* A count N (ranks 0..N-1) or a list of ranks: the parameter server's servers. */
            if (optarg[0] == '\0' || strspn(optarg, "0123456789,") != strlen(optarg) ||
                optarg[0] == ',' || strstr(optarg, ",,") != NULL ||
                optarg[strlen(optarg) - 1] == ',' || strcmp(optarg, "0") == 0) {
                return usage_error("--servers needs a count of ranks or a list like 0,3, got "
                                   "'%s'",
                                   optarg);
            }
            opts->servers = optarg;
            break;
        case OPT_TLS:
            opts->tls = true;
            break;
        case OPT_TLS_CA:
            opts->tls_ca = optarg;
            break;
        case OPT_TLS_CA_KEY:
            opts->tls_ca_key = optarg;
            break;
        case ':':
            return usage_error("option '%s' needs an argument", argv[optind - 1]);
        default:
            /* glibc: optopt is 0 for an unknown long option, the option's
             * value for "--flag=arg" on a flag, the letter for a short one. */
            if (optopt == 0) {
                return usage_error("unknown option '%s'", argv[optind - 1]);
            }
            if (optopt >= OPT_NNODES || strncmp(argv[optind - 1], "--help=", 7) == 0) {
                return usage_error("option '%s' takes no argument", argv[optind - 1]);
            }
            return usage_error("unknown option '-%c'", optopt);
        }
    }
    if (optind >= argc) {
        return usage_error("no program given");
    }
    if (opts->node_rank >= opts->nnodes) {
        return usage_error("--node-rank %d is out of range for --nnodes %d", opts->node_rank,
                           opts->nnodes);
    }
    if ((long)opts->nnodes * opts->nproc > INT_MAX / 2) {
        return usage_error("world size %d x %d is too large", opts->nnodes, opts->nproc);
    }
    opts->prog_argv = &argv[optind];
    return 0;
}

/* ---- srun / mpirun ---------------------------------------------------- */

/* "2(x3),1" -> tasks on node `node` (SLURM_*TASKS_PER_NODE). Returns -1 if unparsable. */
static int slurm_tasks_on_node(const char *s, int node)
{
    while (*s != '\0') {
        char *end;
        long count = strtol(s, &end, 10);
        long reps = 1;

        if (end == s || count < 1) {
            return -1;
        }
        s = end;
        if (strncmp(s, "(x", 2) == 0) {
            reps = strtol(s + 2, &end, 10);
            if (end == s + 2 || *end != ')' || reps < 1) {
                return -1;
            }
            s = end + 1;
        }
        if (node < reps) {
            return count > INT_MAX ? -1 : (int)count;
        }
        node -= (int)reps;
        if (*s == ',') {
            s++;
        } else if (*s != '\0') {
            return -1;
        }
    }
    return -1;
}

/*
 * First host of a Slurm node list: "a01,a02" -> "a01", "gpu[007-010,12]" -> "gpu007".
 * Returns -1 for forms it does not understand (suffixes after ']', several ranges).
 */
static int slurm_first_host(const char *list, char *host, size_t cap)
{
    size_t n = strcspn(list, ",[");
    size_t digits;

    if (n == 0 || n >= cap) {
        return -1;
    }
    memcpy(host, list, n);
    host[n] = '\0';
    if (list[n] != '[') {
        return 0;
    }
    list += n + 1;
    digits = strspn(list, "0123456789");
    if (digits == 0 || n + digits >= cap || strchr("-,]", list[digits]) == NULL) {
        return -1;
    }
    /* Only "prefix[...]" followed by ',' or the end is simple. */
    {
        const char *close = strchr(list, ']');
        if (close == NULL || (close[1] != '\0' && close[1] != ',')) {
            return -1;
        }
    }
    memcpy(host + n, list, digits);
    host[n + digits] = '\0';
    return 0;
}

static int detect_mpirun(launcher_t *li)
{
    int r;

    li->kind = LAUNCHER_MPIRUN;
    if (env_int("OMPI_COMM_WORLD_SIZE", 1, INT_MAX / 2, &li->world) != 1 ||
        env_int("OMPI_COMM_WORLD_RANK", 0, li->world - 1, &li->rank) != 1) {
        errorf("mpirun: OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE are inconsistent");
        return -1;
    }
    r = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", 1, li->world, &li->local_world);
    if (r < 0) {
        return -1;
    }
    if (r == 0) {
        li->local_world = 1;
    }
    r = env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0, li->local_world - 1, &li->local_rank);
    if (r < 0) {
        return -1;
    }
    if (r == 0) {
        li->local_rank = 0;
    }
    /* Open MPI has no node index; with the same count per node it is this. */
    li->node_rank = li->rank / li->local_world;
    return 0;
}

static int detect_srun(launcher_t *li)
{
    static const char *const ntasks_vars[] = {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", NULL};
    static const char *const nnodes_vars[] = {"SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES",
                                              "SLURM_NNODES", NULL};
    static const char *const list_vars[] = {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
                                            "SLURM_NODELIST", NULL};
    const char *s;
    const char *which = NULL;
    int nnodes = 0;

    li->kind = LAUNCHER_SRUN;
    s = env_first(ntasks_vars, &which);
    if (s == NULL || parse_int(s, 1, INT_MAX / 2, &li->world) != 0) {
        errorf("srun: SLURM_NTASKS is missing or not a positive integer");
        return -1;
    }
    if (env_int("SLURM_PROCID", 0, li->world - 1, &li->rank) != 1) {
        errorf("srun: SLURM_PROCID is missing or not below %s=%d", which, li->world);
        return -1;
    }
    if (env_int("SLURM_LOCALID", 0, li->world - 1, &li->local_rank) < 0 ||
        env_int("SLURM_NODEID", 0, li->world - 1, &li->node_rank) < 0) {
        return -1;
    }

    li->local_world = -1;
    s = getenv("SLURM_STEP_TASKS_PER_NODE");
    if (s != NULL) {
        li->local_world = slurm_tasks_on_node(s, li->node_rank);
    }
    if (li->local_world < 1 &&
        env_int("SLURM_NTASKS_PER_NODE", 1, li->world, &li->local_world) != 1) {
        li->local_world = -1;
        s = getenv("SLURM_TASKS_PER_NODE");
        if (s != NULL) {
            li->local_world = slurm_tasks_on_node(s, li->node_rank);
        }
    }
    if (li->local_world < 1) {
        s = env_first(nnodes_vars, NULL);
        if (s != NULL && parse_int(s, 1, li->world, &nnodes) == 0 && li->world % nnodes == 0) {
            li->local_world = li->world / nnodes;
        }
    }
    if (li->local_world < 1 || li->local_rank >= li->local_world) {
        errorf("srun: cannot tell how many tasks run on this node; set SLURM_NTASKS_PER_NODE "
               "(srun --ntasks-per-node)");
        return -1;
    }

    /* Rank 0 runs on the first node of the step; SLURM_LAUNCH_NODE_IPADDR is
     * where srun was typed, which is not in the allocation under salloc. */
    s = env_first(list_vars, NULL);
    if (s == NULL || slurm_first_host(s, li->master_addr, sizeof(li->master_addr)) != 0) {
        s = getenv("SLURM_LAUNCH_NODE_IPADDR");
        if (s != NULL && *s != '\0' && strlen(s) <= ADDR_MAX) {
            strcpy(li->master_addr, s);
        }
    }
    return 0;
}

/* Fills li (kind NONE when weftrun was not started by a launcher). -1 (logged) on bad vars. */
static int detect_launcher(launcher_t *li)
{
    memset(li, 0, sizeof(*li));
    if (getenv("OMPI_COMM_WORLD_RANK") != NULL && getenv("OMPI_COMM_WORLD_SIZE") != NULL) {
        return detect_mpirun(li);
    }
    /* SLURM_STEP_ID tells an srun task from a batch script, which has SLURM_PROCID too. */
    if (getenv("SLURM_PROCID") != NULL &&
        (getenv("SLURM_STEP_ID") != NULL || getenv("SLURM_STEPID") != NULL)) {
        return detect_srun(li);
    }
    li->kind = LAUNCHER_NONE;
    return 0;
}

static const char *launcher_name(launcher_kind_t kind)
{
    return kind == LAUNCHER_SRUN ? "srun" : "mpirun";
}

/* ---- job configuration ------------------------------------------------ */

static int pick_free_port(int *port_p)
{
    struct sockaddr_in sa;
    socklen_t len = sizeof(sa);
    int status = -1;
    int fd;

    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        errorf("cannot pick a master port: socket: %s", strerror(errno));
        return -1;
    }
    memset(&sa, 0, sizeof(sa));
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    sa.sin_port = 0;
    if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0 ||
        getsockname(fd, (struct sockaddr *)&sa, &len) != 0) {
        errorf("cannot pick a master port on 127.0.0.1: %s", strerror(errno));
        goto err_close;
    }
    *port_p = ntohs(sa.sin_port);
    status = 0;
err_close:
    close(fd);
    return status;
}

static int make_token(char *out, size_t cap)
{
    static const char hex[] = "0123456789abcdef";
    unsigned char raw[TOKEN_BYTES];
    size_t got = 0;
    int status = -1;
    int fd;

    if (cap < 2 * TOKEN_BYTES + 1) {
        return -1;
    }
    fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        errorf("cannot open /dev/urandom for WEFT_AUTH_TOKEN: %s", strerror(errno));
        return -1;
    }
    while (got < sizeof(raw)) {
        ssize_t n = read(fd, raw + got, sizeof(raw) - got);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            errorf("cannot read /dev/urandom for WEFT_AUTH_TOKEN: %s",
                   n < 0 ? strerror(errno) : "end of file");
            goto err_close;
        }
        got += (size_t)n;
    }
    for (size_t i = 0; i < sizeof(raw); i++) {
        out[2 * i] = hex[raw[i] >> 4];
        out[2 * i + 1] = hex[raw[i] & 0xf];
    }
    out[2 * sizeof(raw)] = '\0';
    status = 0;
err_close:
    close(fd);
    return status;
}

/*
 * Master address, port and token. `shared` is true when ranks outside this
 * weftrun take part (other nodes, or sibling srun/mpirun tasks), so nothing
 * may be made up locally.
 */
static int resolve_rendezvous(const opts_t *opts, const launcher_t *li, bool shared, job_t *job)
{
    static const char *const addr_vars[] = {"WEFT_MASTER_ADDR", "MASTER_ADDR", NULL};
    static const char *const port_vars[] = {"WEFT_MASTER_PORT", "MASTER_PORT", NULL};
    const char *addr = opts->master_addr;
    const char *token;
    const char *which = NULL;
    int port = opts->master_port;

    if (li->kind != LAUNCHER_NONE) {
        if (addr == NULL) {
            addr = env_first(addr_vars, NULL);
        }
        if (addr == NULL && li->master_addr[0] != '\0') {
            addr = li->master_addr;
        }
        if (addr == NULL) {
            errorf("started by %s but the master address is unknown: pass --master-addr or set "
                   "MASTER_ADDR",
                   launcher_name(li->kind));
            return -1;
        }
        if (port == 0) {
            const char *s = env_first(port_vars, &which);
            if (s == NULL) {
                errorf("started by %s but the master port is unknown: pass --master-port or set "
                       "MASTER_PORT",
                       launcher_name(li->kind));
                return -1;
            }
            if (parse_int(s, 1, 65535, &port) != 0) {
                errorf("%s='%s' is not a port in [1, 65535]", which, s);
                return -1;
            }
        }
    } else {
        if (addr == NULL) {
            addr = "127.0.0.1";
        }
        if (port == 0 && shared) {
            errorf("--master-port is required when --nnodes > 1 (every node must use the same "
                   "one)");
            return -1;
        }
        if (port == 0 && pick_free_port(&port) != 0) {
            return -1;
        }
    }
    if (copy_str(job->master_addr, sizeof(job->master_addr), addr, "master address") != 0) {
        return -1;
    }
    snprintf(job->master_port, sizeof(job->master_port), "%d", port);

    token = getenv("WEFT_AUTH_TOKEN");
    if (token != NULL && *token != '\0') {
        return copy_str(job->token, sizeof(job->token), token, "WEFT_AUTH_TOKEN");
    }
    if (shared) {
        errorf("WEFT_AUTH_TOKEN must be set when ranks start on more than one node or under "
               "srun/mpirun, so that all ranks share it; e.g.\n"
               "  export WEFT_AUTH_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \\n')");
        return -1;
    }
    return make_token(job->token, sizeof(job->token));
}

/* The variables for local rank `local_rank` (global rank job->first_rank + local_rank). */
static void rank_env_fill(const job_t *job, int local_rank, rank_env_t *re)
{
    int rank = job->first_rank + local_rank;
    const char *rank_s = re->num[0];
    const char *world_s = re->num[1];
    const char *lrank_s = re->num[2];
    const char *lworld_s = re->num[3];
    const char *node_s = re->num[4];
    int i = 0;

    snprintf(re->num[0], sizeof(re->num[0]), "%d", rank);
    snprintf(re->num[1], sizeof(re->num[1]), "%d", job->world);
    snprintf(re->num[2], sizeof(re->num[2]), "%d", local_rank);
    snprintf(re->num[3], sizeof(re->num[3]), "%d", job->nproc);
    snprintf(re->num[4], sizeof(re->num[4]), "%d", job->node_rank);

    re->vars[i++] = (env_var_t){"WEFT_RANK", rank_s};
    re->vars[i++] = (env_var_t){"WEFT_WORLD_SIZE", world_s};
    re->vars[i++] = (env_var_t){"WEFT_LOCAL_RANK", lrank_s};
    re->vars[i++] = (env_var_t){"WEFT_LOCAL_WORLD_SIZE", lworld_s};
    re->vars[i++] = (env_var_t){"WEFT_NODE_RANK", node_s};
    re->vars[i++] = (env_var_t){"WEFT_MASTER_ADDR", job->master_addr};
    re->vars[i++] = (env_var_t){"WEFT_MASTER_PORT", job->master_port};
    re->vars[i++] = (env_var_t){"WEFT_AUTH_TOKEN", job->token};
    re->vars[i++] = (env_var_t){"RANK", rank_s};
    re->vars[i++] = (env_var_t){"WORLD_SIZE", world_s};
    re->vars[i++] = (env_var_t){"LOCAL_RANK", lrank_s};
    re->vars[i++] = (env_var_t){"LOCAL_WORLD_SIZE", lworld_s};
    re->vars[i++] = (env_var_t){"MASTER_ADDR", job->master_addr};
    re->vars[i++] = (env_var_t){"MASTER_PORT", job->master_port};
    if (job->tls_dir[0] != '\0') {
        snprintf(re->tls[0], sizeof(re->tls[0]), "%s/ca.pem", job->tls_dir);
        snprintf(re->tls[1], sizeof(re->tls[1]), "%s/rank%d.pem", job->tls_dir, rank);
        snprintf(re->tls[2], sizeof(re->tls[2]), "%s/rank%d.key", job->tls_dir, rank);
        re->vars[i++] = (env_var_t){"WEFT_TLS_CA", re->tls[0]};
        re->vars[i++] = (env_var_t){"WEFT_TLS_CERT", re->tls[1]};
        re->vars[i++] = (env_var_t){"WEFT_TLS_KEY", re->tls[2]};
    }
    re->n = i;
}

static int rank_env_apply(const rank_env_t *re)
{
    for (int i = 0; i < re->n; i++) {
        if (setenv(re->vars[i].name, re->vars[i].value, 1) != 0) {
            return -1;
        }
    }
    return 0;
}

static void rank_env_print(const rank_env_t *re)
{
    printf("rank %s:", re->vars[0].value);
    for (int i = 0; i < re->n; i++) {
        printf(" %s=%s", re->vars[i].name, re->vars[i].value);
    }
    putchar('\n');
}

/* ---- exec mode (srun/mpirun, one task per rank) ----------------------- */

static int exec_one_rank(const opts_t *opts, const launcher_t *li)
{
    job_t job;
    rank_env_t re;
    int err;

    memset(&job, 0, sizeof(job));
    if (opts->tls) {
        errorf("--tls cannot be used under %s (prog is exec'd in place, so nobody would remove "
               "its keys): give every rank its files in WEFT_TLS_CA, WEFT_TLS_CERT and "
               "WEFT_TLS_KEY (docs/security.md)",
               launcher_name(li->kind));
        return EXIT_USAGE;
    }
    if (opts->nnodes_set || opts->node_rank_set) {
        errorf("--nnodes/--node-rank conflict with the ranks %s assigns; pass --standalone to "
               "ignore %s",
               launcher_name(li->kind), launcher_name(li->kind));
        return EXIT_USAGE;
    }
    if (opts->timeout_s > 0) {
        errorf("warning: --timeout is ignored under %s (prog is exec'd in place); use the "
               "launcher's time limit",
               launcher_name(li->kind));
    }
    job.nproc = li->local_world;
    job.node_rank = li->node_rank;
    job.world = li->world;
    job.first_rank = li->rank - li->local_rank;
    job.local_rank = li->local_rank;
    if (resolve_rendezvous(opts, li, li->world > 1, &job) != 0) {
        return EXIT_USAGE;
    }
    rank_env_fill(&job, job.local_rank, &re);
    if (opts->print_env) {
        rank_env_print(&re);
        return fflush(stdout) == 0 ? 0 : 1;
    }
    if (rank_env_apply(&re) != 0) {
        errorf("setenv: %s", strerror(errno));
        return 1;
    }
    execvp(opts->prog_argv[0], opts->prog_argv);
    err = errno;
    errorf("cannot execute '%s': %s", opts->prog_argv[0], strerror(err));
    return err == ENOENT ? EXIT_NOT_FOUND : EXIT_NOT_EXEC;
}

/* ---- output ----------------------------------------------------------- */

static void write_all(run_t *run, int fd, struct iovec *iov, int cnt)
{
    while (cnt > 0 && !run->out_broken[fd]) {
        ssize_t n = writev(fd, iov, cnt);

        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                /* Our stdout was left non-blocking by someone: wait for room. */
                struct pollfd pfd = {.fd = fd, .events = POLLOUT};
                poll(&pfd, 1, 100);
                continue;
            }
            /* EPIPE and friends: nobody reads us any more. Keep draining the
             * ranks so they do not block, but drop what they print. */
            run->out_broken[fd] = true;
            return;
        }
        while (cnt > 0 && (size_t)n >= iov->iov_len) {
            n -= (ssize_t)iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (char *)iov->iov_base + n;
            iov->iov_len -= (size_t)n;
        }
    }
}

typedef struct {
    struct iovec iov[IOV_BATCH];
    int cnt;
} batch_t;

static void batch_add(run_t *run, int fd, batch_t *b, const void *p, size_t len)
{
    if (b->cnt == IOV_BATCH) {
        write_all(run, fd, b->iov, b->cnt);
        b->cnt = 0;
    }
    b->iov[b->cnt].iov_base = (void *)p;
    b->iov[b->cnt].iov_len = len;
    b->cnt++;
}

/*
 * Print the complete lines in s->buf, each as "<prefix><line>\n". At EOF the
 * partial last line is printed too, with a newline added; a line that fills
 * the whole buffer is printed as a piece of its own.
 */
static void stream_emit(run_t *run, child_t *c, stream_t *s, bool eof)
{
    static const char nl = '\n';
    batch_t b;
    size_t start = 0;

    b.cnt = 0;
    for (;;) {
        char *p = memchr(s->buf + start, '\n', s->len - start);
        if (p == NULL) {
            break;
        }
        batch_add(run, s->out_fd, &b, c->prefix, c->prefix_len);
        batch_add(run, s->out_fd, &b, s->buf + start, (size_t)(p - (s->buf + start)) + 1);
        start = (size_t)(p - s->buf) + 1;
    }
    if (start < s->len && (eof || (start == 0 && s->len == LINE_CAP))) {
        batch_add(run, s->out_fd, &b, c->prefix, c->prefix_len);
        batch_add(run, s->out_fd, &b, s->buf + start, s->len - start);
        batch_add(run, s->out_fd, &b, &nl, 1);
        start = s->len;
    }
    if (b.cnt > 0) {
        write_all(run, s->out_fd, b.iov, b.cnt);
    }
    if (start > 0) {
        memmove(s->buf, s->buf + start, s->len - start);
        s->len -= start;
    }
}

static void stream_close(run_t *run, child_t *c, stream_t *s)
{
    stream_emit(run, c, s, true);
    close(s->fd);
    s->fd = -1;
}

/* Read what is there (the fd is non-blocking). Returns true if data came. */
static bool stream_read(run_t *run, child_t *c, stream_t *s)
{
    ssize_t n;

    if (s->fd < 0) {
        return false;
    }
    n = read(s->fd, s->buf + s->len, LINE_CAP - s->len);
    if (n < 0) {
        if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) {
            return false;
        }
        stream_close(run, c, s);
        return false;
    }
    if (n == 0) {
        stream_close(run, c, s);
        return false;
    }
    s->len += (size_t)n;
    stream_emit(run, c, s, false);
    return true;
}

/* ---- children --------------------------------------------------------- */

static void on_signal(int sig)
{
    g_signal = sig;
    g_signal_count++;
}

static void on_sigchld(int sig)
{
    (void)sig;
    g_sigchld = 1;
}

static void child_exec(const job_t *job, int local_rank, char **argv, const int out_pipe[2],
                       const int err_pipe[2], int status_fd, pid_t parent,
                       const sigset_t *orig_mask)
{
    rank_env_t re;
    int err;
    int fd;

    setpgid(0, 0);
    /* What weftrun was started with: a rank under nohup still ignores SIGHUP. */
    for (int i = 0; i < NSIGS_SAVED; i++) {
        sigaction(g_saved_sigs[i], &g_orig_actions[i], NULL);
    }
#ifdef __linux__
    /* If weftrun is SIGKILLed the ranks must not live on unsupervised. */
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) {
        _exit(EXIT_NOT_EXEC);
    }
#else
    (void)parent;
#endif
    /* Ranks run in their own process groups, so a terminal read would stop them. */
    fd = open("/dev/null", O_RDONLY);
    if (fd >= 0 && fd != STDIN_FILENO) {
        dup2(fd, STDIN_FILENO);
        close(fd);
    }
    if (out_pipe[1] >= 0) {
        dup2(out_pipe[1], STDOUT_FILENO);
        dup2(err_pipe[1], STDERR_FILENO);
    }
    rank_env_fill(job, local_rank, &re);
    if (rank_env_apply(&re) != 0) {
        err = errno;
        goto fail;
    }
    sigprocmask(SIG_SETMASK, orig_mask, NULL);
    execvp(argv[0], argv);
    err = errno;
fail:
    if (write(status_fd, &err, sizeof(err)) < 0) {
        _exit(EXIT_NOT_EXEC);
    }
    _exit(err == ENOENT ? EXIT_NOT_FOUND : EXIT_NOT_EXEC);
}

/* Fork and exec local rank `local_rank`. Returns 0, or the exit code to use (logged). */
static int spawn_rank(run_t *run, const job_t *job, int local_rank, char **argv,
                      const sigset_t *orig_mask)
{
    child_t *c = &run->children[local_rank];
    int out_pipe[2] = {-1, -1};
    int err_pipe[2] = {-1, -1};
    int status_pipe[2];
    int status = 1;
    int err = 0;
    ssize_t n;
    pid_t parent = getpid();
    pid_t pid;

    c->rank = job->first_rank + local_rank;
    c->prefix_len = (size_t)snprintf(c->prefix, sizeof(c->prefix), "[rank %d] ", c->rank);
    c->streams[0].fd = -1;
    c->streams[1].fd = -1;
    if (pipe2(status_pipe, O_CLOEXEC) != 0) {
        errorf("pipe: %s", strerror(errno));
        return 1;
    }
    if (run->prefix && (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0)) {
        errorf("pipe: %s", strerror(errno));
        goto err_close_pipes;
    }
    pid = fork();
    if (pid < 0) {
        errorf("fork: %s", strerror(errno));
        goto err_close_pipes;
    }
    if (pid == 0) {
        close(status_pipe[0]);
        child_exec(job, local_rank, argv, out_pipe, err_pipe, status_pipe[1], parent, orig_mask);
    }
    /* Both sides set the group, so kill(-pid) works whoever runs first. */
    setpgid(pid, pid);
    close(status_pipe[1]);
    status_pipe[1] = -1;
    do {
        n = read(status_pipe[0], &err, sizeof(err));
    } while (n < 0 && errno == EINTR);
    if (n == (ssize_t)sizeof(err)) {
        /* exec failed; the child has _exit'ed (or is about to). */
        while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {
        }
        errorf("rank %d: cannot execute '%s': %s", c->rank, argv[0], strerror(err));
        status = err == ENOENT ? EXIT_NOT_FOUND : EXIT_NOT_EXEC;
        goto err_close_pipes;
    }
    c->pid = pid;
    if (run->prefix) {
        close(out_pipe[1]);
        close(err_pipe[1]);
        c->streams[0].fd = out_pipe[0];
        c->streams[0].out_fd = STDOUT_FILENO;
        c->streams[1].fd = err_pipe[0];
        c->streams[1].out_fd = STDERR_FILENO;
        fcntl(out_pipe[0], F_SETFL, O_NONBLOCK);
        fcntl(err_pipe[0], F_SETFL, O_NONBLOCK);
    }
    close(status_pipe[0]);
    return 0;

err_close_pipes:
    for (int i = 0; i < 2; i++) {
        if (out_pipe[i] >= 0) {
            close(out_pipe[i]);
        }
        if (err_pipe[i] >= 0) {
            close(err_pipe[i]);
        }
        if (status_pipe[i] >= 0) {
            close(status_pipe[i]);
        }
    }
    return status;
}

/* Signal every rank's process group; a zombie leader keeps its pgid from being reused. */
static void signal_all(run_t *run, int sig)
{
    for (int i = 0; i < run->nchildren; i++) {
        child_t *c = &run->children[i];
        if (c->pid <= 0) {
            continue;
        }
        if (kill(-c->pid, sig) != 0 && !c->exited) {
            kill(c->pid, sig);
        }
    }
}

static int alive_count(const run_t *run)
{
    int alive = 0;

    for (int i = 0; i < run->nchildren; i++) {
        if (!run->children[i].exited) {
            alive++;
        }
    }
    return alive;
}

static void set_exit_code(run_t *run, int code)
{
    if (run->exit_code < 0) {
        run->exit_code = code;
    }
}

static void teardown(run_t *run)
{
    int alive;

    if (run->tearing_down) {
        return;
    }
    run->tearing_down = true;
    alive = alive_count(run);
    if (alive > 0) {
        errorf("sending SIGTERM to %d remaining rank%s", alive, alive == 1 ? "" : "s");
    }
    signal_all(run, SIGTERM);
    run->kill_deadline = now_s() + KILL_GRACE_S;
}

static void on_child_exit(run_t *run, child_t *c)
{
    if (c->how == CLD_EXITED && c->code == 0) {
        return;
    }
    if (run->tearing_down) {
        return; /* expected: we are stopping it */
    }
    if (c->how == CLD_EXITED) {
        errorf("rank %d (pid %d) exited with status %d", c->rank, (int)c->pid, c->code);
        set_exit_code(run, c->code);
    } else {
        errorf("rank %d (pid %d) killed by signal %s (%d)%s", c->rank, (int)c->pid,
               signal_name(c->code), c->code, c->how == CLD_DUMPED ? " (core dumped)" : "");
        set_exit_code(run, 128 + c->code);
    }
    teardown(run);
}

/* Notice exited ranks without reaping them (WNOWAIT), in rank order. */
static void check_children(run_t *run)
{
    for (int i = 0; i < run->nchildren; i++) {
        child_t *c = &run->children[i];
        siginfo_t si;

        if (c->exited) {
            continue;
        }
        memset(&si, 0, sizeof(si));
        if (waitid(P_PID, (id_t)c->pid, &si, WEXITED | WNOHANG | WNOWAIT) != 0) {
            if (errno == EINTR) {
                i--;
                continue;
            }
            /* ECHILD: cannot happen for our own unreaped child; treat as gone. */
            c->exited = true;
            c->how = CLD_KILLED;
            c->code = SIGKILL;
            on_child_exit(run, c);
            continue;
        }
        if (si.si_pid == 0) {
            continue;
        }
        c->exited = true;
        c->how = si.si_code;
        c->code = si.si_status;
        on_child_exit(run, c);
    }
}

static void check_signals(run_t *run, int *handled_p)
{
    int count = g_signal_count;
    int sig = g_signal;

    if (count == *handled_p) {
        return;
    }
    *handled_p = count;
    if (!run->tearing_down) {
        errorf("received %s; stopping all ranks", signal_name(sig));
        set_exit_code(run, 128 + sig);
        teardown(run);
        return;
    }
    if (!run->killed) {
        errorf("received %s while stopping the ranks; killing them", signal_name(sig));
        signal_all(run, SIGKILL);
        run->killed = true;
    }
}

static void check_deadlines(run_t *run, double now)
{
    if (run->timeout_deadline > 0 && now >= run->timeout_deadline && !run->tearing_down) {
        errorf("timeout: ranks still running after %g s; stopping them", run->timeout_s);
        set_exit_code(run, EXIT_TIMEOUT);
        teardown(run);
    }
    if (run->tearing_down && !run->killed && now >= run->kill_deadline) {
        int alive = alive_count(run);
        if (alive > 0) {
            errorf("%d rank%s still running %g s after SIGTERM; sending SIGKILL", alive,
                   alive == 1 ? "" : "s", KILL_GRACE_S);
        }
        signal_all(run, SIGKILL);
        run->killed = true;
    }
}

/* Poll timeout until the next deadline; NULL for none. */
static struct timespec *next_wait(const run_t *run, double now, struct timespec *ts)
{
    double deadline = 0;
    double wait;

    if (run->timeout_deadline > 0 && !run->tearing_down) {
        deadline = run->timeout_deadline;
    }
    if (run->tearing_down && !run->killed) {
        deadline = run->kill_deadline;
    }
    if (deadline <= 0) {
        return NULL;
    }
    wait = deadline - now;
    if (wait < 0) {
        wait = 0;
    }
    ts->tv_sec = (time_t)wait;
    ts->tv_nsec = (long)((wait - (double)ts->tv_sec) * 1e9);
    return ts;
}

/*
 * SIGINT/SIGTERM/SIGHUP (unless weftrun was started with them ignored, as
 * under nohup) and SIGCHLD get handlers and stay blocked except inside
 * ppoll(), so no wake-up is lost between checks. SIGPIPE is ignored: a closed
 * stdout must not kill weftrun and orphan the ranks. *wait_mask_p is the mask
 * for ppoll().
 */
static int install_signals(sigset_t *orig_mask_p, sigset_t *wait_mask_p)
{
    struct sigaction sa;
    sigset_t block;

    sigemptyset(&block);
    for (int i = 0; i < NSIGS_SAVED; i++) {
        if (g_saved_sigs[i] != SIGPIPE) {
            sigaddset(&block, g_saved_sigs[i]);
        }
    }
    if (sigprocmask(SIG_BLOCK, &block, orig_mask_p) != 0) {
        return -1;
    }
    *wait_mask_p = *orig_mask_p;
    memset(&sa, 0, sizeof(sa));
    sigfillset(&sa.sa_mask);
    for (int i = 0; i < NSIGS_SAVED; i++) {
        int sig = g_saved_sigs[i];

        if (sigaction(sig, NULL, &g_orig_actions[i]) != 0) {
            return -1;
        }
        if (sig == SIGPIPE) {
            sa.sa_handler = SIG_IGN;
            sa.sa_flags = 0;
        } else if (sig == SIGCHLD) {
            sa.sa_handler = on_sigchld;
            sa.sa_flags = SA_NOCLDSTOP;
        } else if (g_orig_actions[i].sa_handler == SIG_IGN) {
            continue;
        } else {
            sa.sa_handler = on_signal;
            sa.sa_flags = 0;
        }
        if (sigaction(sig, &sa, NULL) != 0) {
            return -1;
        }
        if (sig != SIGPIPE) {
            sigdelset(wait_mask_p, sig);
        }
    }
    return 0;
}

static int run_local(const opts_t *opts, const job_t *job)
{
    run_t run;
    sigset_t orig_mask;
    sigset_t wait_mask;
    struct pollfd *pfds = NULL;
    child_t **pchild = NULL;
    stream_t **pstream = NULL;
    int handled_signals = 0;
    int nfds_max = 2 * job->nproc;
    int status;

    memset(&run, 0, sizeof(run));
    run.prefix = !opts->no_prefix;
    run.exit_code = -1;
    run.timeout_s = opts->timeout_s;
    if (install_signals(&orig_mask, &wait_mask) != 0) {
        errorf("cannot install signal handlers: %s", strerror(errno));
        return 1;
    }

    run.children = calloc((size_t)job->nproc, sizeof(child_t));
    pfds = calloc((size_t)nfds_max, sizeof(*pfds));
    pchild = calloc((size_t)nfds_max, sizeof(*pchild));
    pstream = calloc((size_t)nfds_max, sizeof(*pstream));
    if (run.children == NULL || pfds == NULL || pchild == NULL || pstream == NULL) {
        errorf("out of memory");
        status = 1;
        goto err_free;
    }
    if (run.prefix) {
        for (int i = 0; i < job->nproc; i++) {
            for (int j = 0; j < 2; j++) {
                run.children[i].streams[j].buf = malloc(LINE_CAP);
                if (run.children[i].streams[j].buf == NULL) {
                    errorf("out of memory");
                    status = 1;
                    goto err_free;
                }
            }
        }
    }

    for (int i = 0; i < job->nproc; i++) {
        int rc = spawn_rank(&run, job, i, opts->prog_argv, &orig_mask);
        if (rc != 0) {
            set_exit_code(&run, rc);
            teardown(&run);
            break;
        }
        run.nchildren++;
    }
    if (run.timeout_s > 0) {
        run.timeout_deadline = now_s() + run.timeout_s;
    }
    g_sigchld = 1;

    for (;;) {
        struct timespec ts;
        struct timespec *tsp;
        int nfds = 0;
        int ready;

        if (g_sigchld) {
            g_sigchld = 0;
            check_children(&run);
        }
        check_signals(&run, &handled_signals);
        check_deadlines(&run, now_s());
        if (alive_count(&run) == 0) {
            break;
        }
        for (int i = 0; i < run.nchildren; i++) {
            for (int j = 0; j < 2; j++) {
                stream_t *s = &run.children[i].streams[j];
                if (s->fd >= 0) {
                    pfds[nfds].fd = s->fd;
                    pfds[nfds].events = POLLIN;
                    pfds[nfds].revents = 0;
                    pchild[nfds] = &run.children[i];
                    pstream[nfds] = s;
                    nfds++;
                }
            }
        }
        tsp = next_wait(&run, now_s(), &ts);
        ready = ppoll(pfds, (nfds_t)nfds, tsp, &wait_mask);
        if (ready < 0) {
            if (errno != EINTR) {
                errorf("ppoll: %s", strerror(errno));
                set_exit_code(&run, 1);
                teardown(&run);
                /* Avoid spinning: wait for the children the slow way. */
                signal_all(&run, SIGKILL);
                run.killed = true;
                break;
            }
            continue;
        }
        for (int k = 0; k < nfds; k++) {
            if (pfds[k].revents != 0) {
                stream_read(&run, pchild[k], pstream[k]);
            }
        }
    }

    /* Every rank has exited: take what is left in the pipes, but do not wait
     * for EOF, which a process a rank left behind could hold off forever. */
    for (int i = 0; i < run.nchildren; i++) {
        for (int j = 0; j < 2; j++) {
            stream_t *s = &run.children[i].streams[j];
            /* Bounded: a writer left behind could keep the pipe busy. */
            for (int k = 0; k < 64 && stream_read(&run, &run.children[i], s); k++) {
            }
            if (s->fd >= 0) {
                stream_close(&run, &run.children[i], s);
            }
        }
    }
    if (run.tearing_down) {
        /* Whatever the failed job left in the ranks' process groups. */
        signal_all(&run, SIGKILL);
    }
    for (int i = 0; i < run.nchildren; i++) {
        while (waitpid(run.children[i].pid, NULL, 0) < 0 && errno == EINTR) {
        }
    }
    status = run.exit_code < 0 ? 0 : run.exit_code;

err_free:
    if (run.children != NULL) {
        for (int i = 0; i < job->nproc; i++) {
            free(run.children[i].streams[0].buf);
            free(run.children[i].streams[1].buf);
        }
    }
    free(pstream);
    free(pchild);
    free(pfds);
    free(run.children);
    return status;
}

/* ---- main ------------------------------------------------------------- */

/* Ranks inherit fds 0-2; make sure they are open so pipes never land there. */
static void ensure_std_fds(void)
{
    for (int fd = 0; fd <= 2; fd++) {
        if (fcntl(fd, F_GETFD) < 0) {
            int nfd = open("/dev/null", O_RDWR);
            if (nfd > 2) {
                close(nfd);
            }
        }
    }
}

/* ---- --tls ------------------------------------------------------------ */

/* Removes the job's TLS directory and what weftrun wrote in it. */
static void tls_cleanup(job_t *job)
{
    if (job->tls_dir[0] == '\0') {
        return;
    }
    char p[PATH_MAX + 32];
    snprintf(p, sizeof(p), "%s/ca.pem", job->tls_dir);
    unlink(p);
    for (int i = 0; i < job->nproc; i++) {
        snprintf(p, sizeof(p), "%s/rank%d.pem", job->tls_dir, job->first_rank + i);
        unlink(p);
        snprintf(p, sizeof(p), "%s/rank%d.key", job->tls_dir, job->first_rank + i);
        unlink(p);
    }
    if (rmdir(job->tls_dir) != 0) {
        errorf("warning: cannot remove %s: %s", job->tls_dir, strerror(errno));
    }
    job->tls_dir[0] = '\0';
}

/* A private directory with the job's CA and this node's ranks' certificates and keys. */
static int tls_prepare(const opts_t *opts, job_t *job)
{
    weft_certs_pem_t ca = {NULL, NULL};
    char why[512];
    if ((opts->tls_ca != NULL) != (opts->tls_ca_key != NULL)) {
        errorf("--tls-ca and --tls-ca-key go together");
        return -1;
    }
    if (opts->tls_ca != NULL) {
        if (weft_certs_read(opts->tls_ca, opts->tls_ca_key, &ca, why, sizeof(why)) != 0) {
            errorf("--tls-ca: %s", why);
            return -1;
        }
    } else if (job->nnodes > 1) {
        errorf("--tls with --nnodes %d needs one CA for the whole job: give every node the same "
               "--tls-ca and --tls-ca-key (docs/security.md)",
               job->nnodes);
        return -1;
    } else {
        weft_certs_spec_t spec = {"weft job CA", -1, -300, TLS_DAYS * 24L * 3600};
        if (weft_certs_make_ca(&spec, &ca, why, sizeof(why)) != 0) {
            errorf("--tls: %s", why);
            return -1;
        }
    }
    const char *tmp = getenv("TMPDIR");
    snprintf(job->tls_dir, sizeof(job->tls_dir), "%s/weftrun-tls-XXXXXX",
             tmp != NULL && tmp[0] != '\0' ? tmp : "/tmp");
    if (mkdtemp(job->tls_dir) == NULL) { /* mode 0700 */
        errorf("--tls: cannot make a directory %s: %s", job->tls_dir, strerror(errno));
        job->tls_dir[0] = '\0';
        weft_certs_pem_free(&ca);
        return -1;
    }
    int rc = weft_certs_write(job->tls_dir, "ca", &ca, false, why, sizeof(why));
    for (int i = 0; rc == 0 && i < job->nproc; i++) {
        int rank = job->first_rank + i;
        char cn[32], stem[32];
        snprintf(cn, sizeof(cn), "weft-rank-%d", rank);
        snprintf(stem, sizeof(stem), "rank%d", rank);
        weft_certs_spec_t spec = {cn, rank, -300, TLS_DAYS * 24L * 3600};
        weft_certs_pem_t leaf;
        rc = weft_certs_make_leaf(&ca, &spec, &leaf, why, sizeof(why));
        if (rc == 0) {
            rc = weft_certs_write(job->tls_dir, stem, &leaf, true, why, sizeof(why));
            weft_certs_pem_free(&leaf);
        }
    }
    weft_certs_pem_free(&ca);
    if (rc != 0) {
        errorf("--tls: %s", why);
        tls_cleanup(job);
        return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    opts_t opts;
    launcher_t li;
    job_t job;
    int rc;

    ensure_std_fds();
    rc = parse_opts(argc, argv, &opts);
    if (rc != 0) {
        return rc > 0 ? 0 : EXIT_USAGE;
    }
    if (opts.servers != NULL && setenv("WEFT_PS_SERVERS", opts.servers, 1) != 0) {
        errorf("setenv: %s", strerror(errno));
        return EXIT_USAGE;
    }
    memset(&li, 0, sizeof(li));
    if (!opts.standalone && detect_launcher(&li) != 0) {
        return EXIT_USAGE;
    }
    if (li.kind != LAUNCHER_NONE && !opts.nproc_set) {
        return exec_one_rank(&opts, &li);
    }

    memset(&job, 0, sizeof(job));
    job.nproc = opts.nproc;
    job.nnodes = opts.nnodes;
    job.node_rank = opts.node_rank;
    if (li.kind != LAUNCHER_NONE) {
        /* -n under a launcher: each launcher task is one node of the job. */
        if (opts.nnodes_set || opts.node_rank_set) {
            errorf("--nnodes/--node-rank come from %s here; pass --standalone to set them",
                   launcher_name(li.kind));
            return EXIT_USAGE;
        }
        if (li.local_world != 1) {
            errorf("with -n under %s, start one weftrun per node (e.g. srun "
                   "--ntasks-per-node=1); this node has %d tasks",
                   launcher_name(li.kind), li.local_world);
            return EXIT_USAGE;
        }
        job.nnodes = li.world;
        job.node_rank = li.rank;
        if ((long)job.nnodes * job.nproc > INT_MAX / 2) {
            errorf("world size %d x %d is too large", job.nnodes, job.nproc);
            return EXIT_USAGE;
        }
    }
    job.world = job.nnodes * job.nproc;
    job.first_rank = job.node_rank * job.nproc;
    if (resolve_rendezvous(&opts, &li, job.nnodes > 1, &job) != 0) {
        return EXIT_USAGE;
    }
    if (!opts.tls && (opts.tls_ca != NULL || opts.tls_ca_key != NULL)) {
        errorf("--tls-ca and --tls-ca-key need --tls");
        return EXIT_USAGE;
    }
    if (opts.tls && tls_prepare(&opts, &job) != 0) {
        return EXIT_USAGE;
    }
    if (opts.print_env) {
        for (int i = 0; i < job.nproc; i++) {
            rank_env_t re;
            rank_env_fill(&job, i, &re);
            rank_env_print(&re);
        }
        tls_cleanup(&job);
        return fflush(stdout) == 0 ? 0 : 1;
    }
    rc = run_local(&opts, &job);
    tls_cleanup(&job);
    return rc;
}
