/* Configuration: the one table of WEFT_* variables (core/config_vars.h), each read from the
 * environment once per process, at its first use, validated, and printable with its default and
 * the value in effect (weft_config_print, `weftrun --print-config`). */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <weft/config.h>

#include "internal.h"

typedef enum { T_INT, T_BOOL, T_STR, T_CHOICE, T_SECRET } type_t;

typedef struct {
    const char *name;
    type_t type;
    const char *dflt;
    int64_t min, max;
    const char *choices;
    const char *aliases;
    const char *module;
    const char *doc;
} var_t;

static const var_t vars[WEFT__CFG_COUNT] = {
#define VAR_(id, name, type, dflt, min, max, choices, aliases, module, doc)                        \
    [WEFT__CFG_##id] = {name, T_##type, dflt, min, max, choices, aliases, module, doc},
    WEFT__CONFIG_VARS(VAR_)
#undef VAR_
};

typedef struct {
    _Atomic int state; /* 0 unread, 1 being read, 2 read */
    int64_t i;
    char *s;
    const char *from; /* the name it was read from; NULL: the default */
} value_t;

static value_t values[WEFT__CFG_COUNT];
static pthread_mutex_t read_mu = PTHREAD_MUTEX_INITIALIZER;

static bool parse_int(const char *s, int64_t *v_p)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0') {
        return false;
    }
    *v_p = v;
    return true;
}

static bool parse_bool(const char *s, int64_t *v_p)
{
    static const char *const yes[] = {"1", "true", "yes", "on"};
    static const char *const no[] = {"0", "false", "no", "off"};
    for (size_t i = 0; i < 4; i++) {
        if (strcasecmp(s, yes[i]) == 0) {
            *v_p = 1;
            return true;
        }
        if (strcasecmp(s, no[i]) == 0) {
            *v_p = 0;
            return true;
        }
    }
    return false;
}

static bool in_choices(const char *choices, const char *s)
{
    size_t n = strlen(s);
    for (const char *p = choices; *p != '\0';) {
        const char *bar = strchr(p, '|');
        size_t len = bar != NULL ? (size_t)(bar - p) : strlen(p);
        if (len == n && strncasecmp(p, s, n) == 0) {
            return true;
        }
        p += len + (bar != NULL ? 1 : 0);
    }
    return false;
}

/* The raw text from the environment (the variable, else its aliases in order); NULL if unset. */
static const char *lookup(const var_t *v, const char **from_p)
{
    const char *s = getenv(v->name);
    if (s != NULL && s[0] != '\0') {
        *from_p = v->name;
        return s;
    }
    char name[128];
    for (const char *p = v->aliases; *p != '\0';) {
        const char *bar = strchr(p, '|');
        size_t len = bar != NULL ? (size_t)(bar - p) : strlen(p);
        if (len < sizeof(name)) {
            memcpy(name, p, len);
            name[len] = '\0';
            s = getenv(name);
            if (s != NULL && s[0] != '\0') {
                /* from_p points into the table's alias text: print only up to the bar. */
                *from_p = p;
                return s;
            }
        }
        p += len + (bar != NULL ? 1 : 0);
    }
    *from_p = NULL;
    return NULL;
}

/* Parses @p text for @p v; false (nothing set) when it is not a valid value. */
static bool parse(const var_t *v, const char *text, int64_t *i_p, const char **s_p)
{
    switch (v->type) {
    case T_INT:
        return parse_int(text, i_p) && *i_p >= v->min && *i_p <= v->max;
    case T_BOOL:
        return parse_bool(text, i_p);
    case T_CHOICE:
        *s_p = text;
        return in_choices(v->choices, text);
    case T_STR:
    case T_SECRET:
        *s_p = text;
        return true;
    }
    return false;
}

static void describe_valid(const var_t *v, char *buf, size_t n)
{
    switch (v->type) {
    case T_INT:
        snprintf(buf, n, "an integer in %lld..%lld", (long long)v->min, (long long)v->max);
        break;
    case T_BOOL:
        snprintf(buf, n, "0 or 1");
        break;
    case T_CHOICE:
        snprintf(buf, n, "one of %s", v->choices);
        break;
    default:
        snprintf(buf, n, "a string");
        break;
    }
}

static void read_var(weft__cfg_id_t id)
{
    const var_t *v = &vars[id];
    value_t *val = &values[id];
    const char *from = NULL;
    const char *text = lookup(v, &from);
    int64_t i = 0;
    const char *s = NULL;

    if (text != NULL && !parse(v, text, &i, &s)) {
        char valid[128];
        describe_valid(v, valid, sizeof(valid));
        /* Not WEFT_WARN: the log's own threshold is one of these variables. */
        fprintf(stderr, "[weft] warning: ignoring %s=%s: not %s; using the default %s\n", v->name,
                v->type == T_SECRET ? "(hidden)" : text, valid,
                v->dflt[0] != '\0' ? v->dflt : "(none)");
        text = NULL;
        from = NULL;
    }
    if (text == NULL) {
        s = NULL;
        if (!parse(v, v->dflt, &i, &s) && (v->type == T_INT || v->type == T_BOOL)) {
            i = 0;
        }
        if (v->type == T_STR || v->type == T_SECRET || v->type == T_CHOICE) {
            s = v->dflt;
        }
    }
    val->i = i;
    val->s = s != NULL ? weft_strdup(s) : NULL;
    val->from = from;
}

static const value_t *get(weft__cfg_id_t id)
{
    value_t *val = &values[id];
    if (atomic_load_explicit(&val->state, memory_order_acquire) == 2) {
        return val;
    }
    pthread_mutex_lock(&read_mu);
    if (atomic_load(&val->state) != 2) {
        atomic_store(&val->state, 1);
        read_var(id);
        atomic_store_explicit(&val->state, 2, memory_order_release);
    }
    pthread_mutex_unlock(&read_mu);
    return val;
}

int64_t weft__cfg_int(weft__cfg_id_t id)
{
    return get(id)->i;
}

bool weft__cfg_bool(weft__cfg_id_t id)
{
    return get(id)->i != 0;
}

const char *weft__cfg_str(weft__cfg_id_t id)
{
    const char *s = get(id)->s;
    return s != NULL ? s : "";
}

bool weft__cfg_is_set(weft__cfg_id_t id)
{
    return get(id)->from != NULL;
}

const char *weft__cfg_name(weft__cfg_id_t id)
{
    return vars[id].name;
}

/* ------------------------------------------------------------------ public */

static int find(const char *name)
{
    for (int i = 0; i < WEFT__CFG_COUNT; i++) {
        if (strcmp(vars[i].name, name) == 0) {
            return i;
        }
    }
    return -1;
}

const char *weft_config_str(const char *name)
{
    int i = name != NULL ? find(name) : -1;
    if (i < 0 || vars[i].type == T_SECRET) {
        return NULL;
    }
    if (vars[i].type == T_INT || vars[i].type == T_BOOL) {
        return NULL;
    }
    return weft__cfg_str((weft__cfg_id_t)i);
}

weft_status_t weft_config_int(const char *name, int64_t *value_p)
{
    int i = name != NULL ? find(name) : -1;
    if (i < 0) {
        return weft__set_error(WEFT_ERR_NOT_FOUND, "config: no variable named %s",
                               name != NULL ? name : "(null)");
    }
    if (vars[i].type != T_INT && vars[i].type != T_BOOL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "config: %s is not a number", name);
    }
    if (value_p == NULL) {
        return weft__set_error(WEFT_ERR_INVALID_ARG, "config: NULL value pointer");
    }
    *value_p = weft__cfg_int((weft__cfg_id_t)i);
    return WEFT_OK;
}

static const char *type_name(type_t t)
{
    switch (t) {
    case T_INT:
        return "int";
    case T_BOOL:
        return "bool";
    case T_CHOICE:
        return "choice";
    case T_SECRET:
        return "secret";
    default:
        return "string";
    }
}

void weft_config_print(FILE *out)
{
    const char *module = "";

    if (out == NULL) {
        out = stdout;
    }
    fprintf(out, "# weft configuration: every WEFT_* variable, its type, default and the value "
                 "in effect\n");
    for (int i = 0; i < WEFT__CFG_COUNT; i++) {
        const var_t *v = &vars[i];
        const value_t *val = get((weft__cfg_id_t)i);
        char shown[512];
        if (strcmp(module, v->module) != 0) {
            module = v->module;
            fprintf(out, "\n[%s]\n", module);
        }
        if (v->type == T_SECRET) {
            snprintf(shown, sizeof(shown), "%s", val->from != NULL ? "(set, hidden)" : "(unset)");
        } else if (v->type == T_INT || v->type == T_BOOL) {
            snprintf(shown, sizeof(shown), "%lld", (long long)val->i);
        } else {
            snprintf(shown, sizeof(shown), "%s", val->s != NULL ? val->s : "");
        }
        char from[160] = "default";
        if (val->from != NULL) {
            size_t len = strcspn(val->from, "|");
            snprintf(from, sizeof(from), "from %.*s", (int)len, val->from);
        }
        fprintf(out, "%-28s = %-24s (%s)\n", v->name, shown, from);
        fprintf(out, "    %s; %s", v->doc, type_name(v->type));
        if (v->type == T_INT) {
            fprintf(out, " %lld..%lld", (long long)v->min, (long long)v->max);
        } else if (v->type == T_CHOICE) {
            fprintf(out, " %s", v->choices);
        }
        fprintf(out, ", default %s", v->dflt[0] != '\0' ? v->dflt : "(none)");
        if (v->aliases[0] != '\0') {
            fprintf(out, "; also read from %s", v->aliases);
        }
        fprintf(out, "\n");
    }
}
