/*
 * rref_observers: the agent/observer pattern of torch's "distributed reinforcement learning with
 * RPC" tutorial, with remote references.
 *
 *   weftrun -n 4 build/examples/rref_observers [--episodes N] [--steps N] [--seed N]
 *
 * Rank 0 runs the agent; every other rank hosts one observer. The agent constructs its own object
 * ("agent", owned by rank 0) and one "observer" object on each other rank with
 * weft_rref_remote_object, keeping a reference to each. For every episode it calls run_episode on
 * all observers at once (weft_rref_rpc_async), passing a reference to itself inside the arguments
 * (a fork). Each observer then plays its episode: at every step it asks the agent for an action
 * (select_action) and reports the reward it got (report_reward), both through the agent's
 * reference, and finally returns its episode's reward. The agent gathers the rewards and checks
 * them against what the observers returned.
 *
 * The environment is a toy: every step shows a number in [0, 100); the right action is 1 when the
 * number is 50 or more, 0 otherwise, and is rewarded with 1. The agent's policy is a threshold at
 * 50 with noise that shrinks from episode to episode (its "learning"). Every random draw comes
 * from generators seeded with --seed, one per observer, so the output does not depend on timing.
 *
 * When the agent releases its references, each owner frees its observer (which says so), and
 * weft_agent_shutdown returns once every reference anywhere is deleted.
 *
 * Exit status: 0 on success, 2 on bad arguments or fewer than 2 ranks, 1 on any unexpected
 * failure (with a message on stderr).
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <weft/weft.h>

#define SHUTDOWN_TIMEOUT_MS 30000
#define CALL_TIMEOUT_MS     30000
#define MAX_EPISODES        1000
#define MAX_STEPS           100000

/* ------------------------------------------------------------- helpers */

/* A 64-bit LCG (Knuth's MMIX constants); the high bits are the draw. */
static uint32_t rng_next(uint64_t *state)
{
    *state = *state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(*state >> 33);
}

static uint64_t rng_seed(uint32_t seed, int stream)
{
    uint64_t s = ((uint64_t)seed << 32) ^ (uint64_t)(stream + 1) * 0x9E3779B97F4A7C15ULL;

    (void)rng_next(&s);
    return s;
}

/* A value whose payload is the text @p fmt makes; NULL when out of memory. */
static weft_value_t *value_printf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static weft_value_t *value_printf(const char *fmt, ...)
{
    char buf[128];
    weft_value_t *v;
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    if (weft_value_create(&v) != WEFT_OK) {
        return NULL;
    }
    if (weft_value_set_string(v, buf) != WEFT_OK) {
        weft_value_free(v);
        return NULL;
    }
    return v;
}

/* The payload of @p v as a NUL-terminated string in @p buf; "" when there is none. */
static const char *value_text(const weft_value_t *v, char *buf, size_t cap)
{
    size_t len = 0;
    const char *p = v != NULL ? weft_value_payload(v, &len) : NULL;

    if (p == NULL || len >= cap) {
        len = 0;
    }
    if (len > 0) {
        memcpy(buf, p, len);
    }
    buf[len] = '\0';
    return buf;
}

/* ------------------------------------------------------------- the agent */

/* Owned by rank 0. Observers call its methods concurrently: the mutex guards it. */
typedef struct {
    pthread_mutex_t mu;
    int n_observers; /* observers are 1..n_observers */
    int episode;     /* the episode being played, from 0 */
    int n_episodes;
    uint64_t *policy_rng; /* one generator per observer: the draws do not depend on timing */
    int *reported;        /* [observer][episode]: the rewards report_reward received */
} agent_t;

/* args: "n_observers n_episodes seed" */
static weft_status_t agent_ctor(const weft_value_t *args, void *type_arg, void **obj_p)
{
    char text[128];
    int n_obs = 0;
    int n_eps = 0;
    unsigned seed = 0;
    agent_t *ag;

    (void)type_arg;
    if (sscanf(value_text(args, text, sizeof(text)), "%d %d %u", &n_obs, &n_eps, &seed) != 3 ||
        n_obs < 1 || n_eps < 1) {
        return WEFT_ERR_INVALID_ARG;
    }
    ag = calloc(1, sizeof(*ag));
    if (ag == NULL) {
        return WEFT_ERR_NO_MEMORY;
    }
    ag->policy_rng = calloc((size_t)n_obs + 1, sizeof(*ag->policy_rng));
    ag->reported = calloc(((size_t)n_obs + 1) * (size_t)n_eps, sizeof(*ag->reported));
    if (ag->policy_rng == NULL || ag->reported == NULL) {
        free(ag->policy_rng);
        free(ag->reported);
        free(ag);
        return WEFT_ERR_NO_MEMORY;
    }
    pthread_mutex_init(&ag->mu, NULL);
    ag->n_observers = n_obs;
    ag->n_episodes = n_eps;
    for (int i = 1; i <= n_obs; i++) {
        ag->policy_rng[i] = rng_seed(seed, 1000 + i);
    }
    *obj_p = ag;
    return WEFT_OK;
}

static void agent_dtor(void *obj, void *type_arg)
{
    agent_t *ag = obj;

    (void)type_arg;
    pthread_mutex_destroy(&ag->mu);
    free(ag->policy_rng);
    free(ag->reported);
    free(ag);
}

/* select_action("observer state") -> "action": a threshold at 50 with noise that shrinks with the
 * episodes (30, 15, 10, 7, ...). */
static void agent_select_action(void *obj, weft_call_t *call, void *type_arg)
{
    agent_t *ag = obj;
    char text[64];
    int ob = 0;
    int state = 0;
    int action;

    (void)type_arg;
    if (sscanf(value_text(weft_call_args(call), text, sizeof(text)), "%d %d", &ob, &state) != 2 ||
        ob < 1 || ob > ag->n_observers) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "select_action wants \"observer state\"");
        return;
    }
    pthread_mutex_lock(&ag->mu);
    int amplitude = 30 / (ag->episode + 1);
    int noise = (int)(rng_next(&ag->policy_rng[ob]) % (uint32_t)(2 * amplitude + 1)) - amplitude;
    pthread_mutex_unlock(&ag->mu);
    action = state + noise >= 50 ? 1 : 0;

    weft_value_t *res = value_printf("%d", action);
    if (res == NULL) {
        weft_call_fail(call, WEFT_ERR_NO_MEMORY, "no memory for the action");
        return;
    }
    weft_call_reply(call, res);
}

/* report_reward("observer reward"): adds to the observer's reward of the current episode. */
static void agent_report_reward(void *obj, weft_call_t *call, void *type_arg)
{
    agent_t *ag = obj;
    char text[64];
    int ob = 0;
    int reward = 0;

    (void)type_arg;
    if (sscanf(value_text(weft_call_args(call), text, sizeof(text)), "%d %d", &ob, &reward) != 2 ||
        ob < 1 || ob > ag->n_observers) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "report_reward wants \"observer reward\"");
        return;
    }
    pthread_mutex_lock(&ag->mu);
    ag->reported[ob * ag->n_episodes + ag->episode] += reward;
    pthread_mutex_unlock(&ag->mu);
    weft_call_reply(call, NULL);
}

static const weft_rref_method_t agent_methods[] = {
    {"select_action", agent_select_action},
    {"report_reward", agent_report_reward},
};

/* ---------------------------------------------------------- an observer */

/* Owned by the rank it runs on; the agent plays one episode at a time on it. */
typedef struct {
    int id;
    uint64_t env_rng;
    int episodes;
    int total;
} observer_t;

/* args: "id seed" */
static weft_status_t observer_ctor(const weft_value_t *args, void *type_arg, void **obj_p)
{
    char text[64];
    int id = 0;
    unsigned seed = 0;
    observer_t *ob;

    (void)type_arg;
    if (sscanf(value_text(args, text, sizeof(text)), "%d %u", &id, &seed) != 2 || id < 1) {
        return WEFT_ERR_INVALID_ARG;
    }
    ob = calloc(1, sizeof(*ob));
    if (ob == NULL) {
        return WEFT_ERR_NO_MEMORY;
    }
    ob->id = id;
    ob->env_rng = rng_seed(seed, id);
    *obj_p = ob;
    return WEFT_OK;
}

static void observer_dtor(void *obj, void *type_arg)
{
    observer_t *ob = obj;

    (void)type_arg;
    printf("observer%d freed by its owner after %d episodes (total reward %d)\n", ob->id,
           ob->episodes, ob->total);
    free(ob);
}

/* The timeout of a call made for @p call: what is left of its deadline, at least 1 ms (a timeout
 * of 0 would mean the agent's default call timeout, a negative one is refused). */
static int64_t time_left_ms(const weft_call_t *call)
{
    int64_t left = weft_call_time_left_ms(call);
    return left > 0 ? left : 1;
}

/*
 * run_episode(payload "n_steps", the agent's reference) -> "observer reward".
 *
 * Like the tutorial's Observer.run_episode it calls the agent synchronously at every step. The
 * method runs on one of weft's handler threads; blocking there is allowed (the agent starts another
 * thread when one blocks in a weft wait). The agent does not play two episodes of one observer at
 * once, so the observer needs no lock.
 */
static void observer_run_episode(void *obj, weft_call_t *call, void *type_arg)
{
    observer_t *ob = obj;
    const weft_value_t *args = weft_call_args(call);
    weft_rref_t *agent = weft_value_rref(args, 0); /* borrowed from the arguments */
    char text[64];
    int n_steps = 0;
    int reward = 0;
    weft_status_t st = WEFT_OK;

    (void)type_arg;
    if (agent == NULL || sscanf(value_text(args, text, sizeof(text)), "%d", &n_steps) != 1 ||
        n_steps < 1) {
        weft_call_fail(call, WEFT_ERR_INVALID_ARG, "run_episode wants n_steps and the agent");
        return;
    }
    for (int step = 0; step < n_steps && st == WEFT_OK; step++) {
        int state = (int)(rng_next(&ob->env_rng) % 100);
        int action = -1;
        int r;
        weft_value_t *q = value_printf("%d %d", ob->id, state);
        weft_value_t *res = NULL;

        st = q != NULL ? weft_rref_rpc_sync(agent, "select_action", q, time_left_ms(call), &res)
                       : WEFT_ERR_NO_MEMORY;
        weft_value_free(q);
        if (st != WEFT_OK) {
            break;
        }
        if (sscanf(value_text(res, text, sizeof(text)), "%d", &action) != 1) {
            st = WEFT_ERR_PROTOCOL;
        }
        weft_value_free(res);
        r = action == (state >= 50 ? 1 : 0) ? 1 : 0;
        reward += r;
        q = value_printf("%d %d", ob->id, r);
        st = q != NULL ? weft_rref_rpc_sync(agent, "report_reward", q, time_left_ms(call), NULL)
                       : WEFT_ERR_NO_MEMORY;
        weft_value_free(q);
    }
    if (st != WEFT_OK) {
        weft_call_fail(call, st, "observer%d: calling the agent on %s: %s", ob->id,
                       weft_rref_owner_name(agent), weft_last_error());
        return;
    }
    ob->episodes++;
    ob->total += reward;

    weft_value_t *res = value_printf("%d %d", ob->id, reward);
    if (res == NULL) {
        weft_call_fail(call, WEFT_ERR_NO_MEMORY, "no memory for the result");
        return;
    }
    weft_call_reply(call, res);
}

static const weft_rref_method_t observer_methods[] = {
    {"run_episode", observer_run_episode},
};

/* ------------------------------------------------------------ the driver */

typedef struct {
    int episodes;
    int steps;
    unsigned seed;
} opts_t;

/* Plays every episode on every observer; prints the per-episode rewards and the summary. */
static int run_agent(weft_agent_t *a, const opts_t *o)
{
    int n_obs = weft_agent_world_size(a) - 1;
    weft_rref_t *self = NULL;
    weft_rref_t **obs = calloc((size_t)n_obs, sizeof(*obs));
    weft_future_t **fs = calloc((size_t)n_obs, sizeof(*fs));
    int *returned = calloc((size_t)n_obs * (size_t)o->episodes, sizeof(*returned));
    agent_t *ag = NULL;
    weft_value_t *args = NULL;
    weft_status_t st;
    double running = 0.0;
    int rc = 1;

    if (obs == NULL || fs == NULL || returned == NULL) {
        fprintf(stderr, "rref_observers: out of memory\n");
        goto out;
    }
    /* The agent's own object, owned by this rank: observers reach it through forks of self. */
    args = value_printf("%d %d %u", n_obs, o->episodes, o->seed);
    st = args != NULL ? weft_rref_remote_object(a, 0, "agent", args, CALL_TIMEOUT_MS, &self)
                      : WEFT_ERR_NO_MEMORY;
    weft_value_free(args);
    args = NULL;
    if (st == WEFT_OK) {
        void *obj = NULL;

        st = weft_rref_local_object(self, CALL_TIMEOUT_MS, &obj);
        ag = obj;
    }
    if (st != WEFT_OK) {
        fprintf(stderr, "rref_observers: creating the agent: %s: %s\n", weft_status_name(st),
                weft_last_error());
        goto out;
    }
    /* One observer on each other rank; remote_object returns at once, the construction goes on. */
    for (int i = 0; i < n_obs; i++) {
        args = value_printf("%d %u", i + 1, o->seed);
        st = args != NULL
                 ? weft_rref_remote_object(a, i + 1, "observer", args, CALL_TIMEOUT_MS, &obs[i])
                 : WEFT_ERR_NO_MEMORY;
        weft_value_free(args);
        args = NULL;
        if (st != WEFT_OK) {
            fprintf(stderr, "rref_observers: creating observer%d: %s: %s\n", i + 1,
                    weft_status_name(st), weft_last_error());
            goto out;
        }
    }
    printf("agent on %s holds %d observer references:", weft_agent_name(a), n_obs);
    for (int i = 0; i < n_obs; i++) {
        printf(" observer%d@%s", i + 1, weft_rref_owner_name(obs[i]));
    }
    printf("\n");

    for (int ep = 0; ep < o->episodes; ep++) {
        int sum = 0;
        char line[1024];
        size_t used = 0;

        pthread_mutex_lock(&ag->mu);
        ag->episode = ep;
        pthread_mutex_unlock(&ag->mu);

        /* run_episode on every observer at once; each gets a fork of the agent's reference. */
        st = weft_value_create(&args);
        if (st == WEFT_OK) {
            char n[32];

            snprintf(n, sizeof(n), "%d", o->steps);
            st = weft_value_set_string(args, n);
        }
        if (st == WEFT_OK) {
            st = weft_value_add_rref(args, self);
        }
        for (int i = 0; i < n_obs && st == WEFT_OK; i++) {
            st = weft_rref_rpc_async(obs[i], "run_episode", args, CALL_TIMEOUT_MS, &fs[i]);
        }
        weft_value_free(args); /* each call holds what it needs */
        args = NULL;
        if (st != WEFT_OK) {
            fprintf(stderr, "rref_observers: starting episode %d: %s: %s\n", ep + 1,
                    weft_status_name(st), weft_last_error());
            goto out;
        }
        (void)weft_future_wait_all(fs, (size_t)n_obs, CALL_TIMEOUT_MS);
        for (int i = 0; i < n_obs; i++) {
            char text[64];
            int id = 0;
            int reward = 0;

            st = weft_future_status(fs[i]);
            if (st != WEFT_OK) {
                fprintf(stderr, "rref_observers: run_episode on observer%d: %s: %s\n", i + 1,
                        weft_status_name(st), weft_future_error(fs[i]));
                goto out;
            }
            if (sscanf(value_text(weft_future_value(fs[i]), text, sizeof(text)), "%d %d", &id,
                       &reward) != 2 ||
                id != i + 1) {
                fprintf(stderr, "rref_observers: observer%d returned \"%s\"\n", i + 1, text);
                goto out;
            }
            weft_future_release(fs[i]);
            fs[i] = NULL;
            returned[i * o->episodes + ep] = reward;
            sum += reward;
            used +=
                (size_t)snprintf(line + used, sizeof(line) - used, " observer%d=%d", id, reward);
            if (used >= sizeof(line)) {
                used = sizeof(line) - 1;
            }
        }
        /* As the tutorial: the episode's reward is the observers' mean; a running average. */
        double last = (double)sum / n_obs;
        running = 0.05 * last + 0.95 * running;
        printf("episode %d: rewards%s, last reward %.2f, running reward %.2f\n", ep + 1, line, last,
               running);
    }

    /* The summary: per observer, then in all; and what the agent was told against what the
     * observers returned. */
    int total = 0;
    int match = 1;
    for (int i = 0; i < n_obs; i++) {
        int ob_total = 0;

        for (int ep = 0; ep < o->episodes; ep++) {
            ob_total += returned[i * o->episodes + ep];
            pthread_mutex_lock(&ag->mu);
            match &= ag->reported[(i + 1) * o->episodes + ep] == returned[i * o->episodes + ep];
            pthread_mutex_unlock(&ag->mu);
        }
        total += ob_total;
        printf("observer%d on %s: total reward %d over %d episodes\n", i + 1,
               weft_rref_owner_name(obs[i]), ob_total, o->episodes);
    }
    printf("total reward %d (%d observers x %d episodes x %d steps)\n", total, n_obs, o->episodes,
           o->steps);
    printf("rewards reported to the agent match the observers' returns: %s\n",
           match ? "yes" : "no");
    rc = match ? 0 : 1;

out:
    for (int i = 0; obs != NULL && i < n_obs; i++) {
        if (fs != NULL) {
            weft_future_release(fs[i]);
        }
        weft_rref_release(obs[i]); /* the owner frees observer i once every fork is gone */
    }
    weft_rref_release(self);
    free(returned);
    free(fs);
    free(obs);
    return rc;
}

static int parse_int(const char *s, int lo, int hi, int *v_p)
{
    char *end = NULL;
    long v = strtol(s, &end, 10);

    if (end == s || *end != '\0' || v < lo || v > hi) {
        return -1;
    }
    *v_p = (int)v;
    return 0;
}

static int parse_args(int argc, char **argv, opts_t *o)
{
    o->episodes = 3;
    o->steps = 20;
    o->seed = 2024;
    for (int i = 1; i < argc; i++) {
        int seed = 0;

        if (i + 1 >= argc) {
            fprintf(stderr, "rref_observers: %s wants a value\n", argv[i]);
            return -1;
        }
        if (strcmp(argv[i], "--episodes") == 0) {
            if (parse_int(argv[++i], 1, MAX_EPISODES, &o->episodes) != 0) {
                fprintf(stderr, "rref_observers: bad value '%s' for --episodes\n", argv[i]);
                return -1;
            }
        } else if (strcmp(argv[i], "--steps") == 0) {
            if (parse_int(argv[++i], 1, MAX_STEPS, &o->steps) != 0) {
                fprintf(stderr, "rref_observers: bad value '%s' for --steps\n", argv[i]);
                return -1;
            }
        } else if (strcmp(argv[i], "--seed") == 0) {
            if (parse_int(argv[++i], 0, 1 << 30, &seed) != 0) {
                fprintf(stderr, "rref_observers: bad value '%s' for --seed\n", argv[i]);
                return -1;
            }
            o->seed = (unsigned)seed;
        } else {
            fprintf(stderr,
                    "usage: weftrun -n N rref_observers [--episodes N] [--steps N] [--seed N]\n");
            return -1;
        }
    }
    return 0;
}

int main(int argc, char **argv)
{
    weft_agent_opts_t opts;
    weft_agent_t *a;
    weft_status_t st;
    opts_t o;
    int rc = 0;

    setvbuf(stdout, NULL, _IOLBF, 0);
    if (parse_args(argc, argv, &o) != 0) {
        return 2;
    }
    weft_agent_opts_init(&opts);
    st = weft_agent_create(&opts, &a);
    if (st != WEFT_OK) {
        fprintf(stderr, "rref_observers: cannot start the agent: %s: %s\n", weft_status_name(st),
                weft_last_error());
        return 1;
    }
    if (weft_agent_world_size(a) < 2) {
        fprintf(stderr, "rref_observers: needs 2 ranks or more (weftrun -n 4 rref_observers)\n");
        weft_agent_free(a);
        return 2;
    }
    /* The rref module and the types are set up before join, on every rank that may own, receive
     * or use references (weft_rref_register_type would set the module up too). */
    st = weft_rref_init(a);
    if (st == WEFT_OK) {
        st = weft_rref_register_type(a, "agent", agent_ctor, agent_dtor, agent_methods,
                                     (int)(sizeof(agent_methods) / sizeof(agent_methods[0])), NULL);
    }
    if (st == WEFT_OK) {
        st = weft_rref_register_type(a, "observer", observer_ctor, observer_dtor, observer_methods,
                                     (int)(sizeof(observer_methods) / sizeof(observer_methods[0])),
                                     NULL);
    }
    if (st != WEFT_OK) {
        fprintf(stderr, "rref_observers: setting up remote references: %s: %s\n",
                weft_status_name(st), weft_last_error());
        weft_agent_free(a);
        return 1;
    }
    st = weft_agent_join(a);
    if (st != WEFT_OK) {
        fprintf(stderr, "rref_observers: join: %s: %s\n", weft_status_name(st), weft_last_error());
        weft_agent_free(a);
        return 1;
    }

    if (weft_agent_rank(a) == 0) {
        rc = run_agent(a, &o);
    }

    /* Returns once no reference is left anywhere: the observers are freed by then. */
    st = weft_agent_shutdown(a, SHUTDOWN_TIMEOUT_MS);
    if (st != WEFT_OK) {
        fprintf(stderr, "rref_observers: shutdown: %s: %s\n", weft_status_name(st),
                weft_last_error());
        rc = 1;
    }
    weft_agent_free(a);
    if (rc == 0) {
        printf("done\n");
    }
    return rc;
}
