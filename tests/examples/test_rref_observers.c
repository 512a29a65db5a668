/*
 * examples/rref_observers run under weftrun, as a user would: WEFTRUN is the launcher,
 * RREF_OBSERVERS the example. Every run has a 60 s deadline, after which it is killed and the
 * test fails. The expected values follow from the example's seeded generators alone (the
 * observers' draws do not depend on timing); a second run with another seed and world checks the
 * summary's arithmetic instead.
 */

#include <criterion/criterion.h>

#include "example.h"

#include <stdio.h>
#include <string.h>

/* Runs `weftrun -n NPROC rref_observers [ARGS...]` (@p args NULL-terminated, or NULL). */
static void run_observers(result_t *r, const char *nproc, const char *const *args)
{
    const example_t ex = {.ranks = nproc, .prog_env = "RREF_OBSERVERS"};

    example_run(r, &ex, args);
}

Test(rref_observers, seeded_rewards_on_four_ranks, .timeout = 90)
{
    static const char *const want[] = {
        "[rank 0] agent on worker0 holds 3 observer references: observer1@worker1 "
        "observer2@worker2 observer3@worker3",
        "[rank 0] episode 1: rewards observer1=16 observer2=16 observer3=15, last reward 15.67, "
        "running reward 0.78",
        "[rank 0] episode 2: rewards observer1=18 observer2=19 observer3=19, last reward 18.67, "
        "running reward 1.68",
        "[rank 0] episode 3: rewards observer1=18 observer2=19 observer3=20, last reward 19.00, "
        "running reward 2.54",
        "[rank 0] observer1 on worker1: total reward 52 over 3 episodes",
        "[rank 0] observer2 on worker2: total reward 54 over 3 episodes",
        "[rank 0] observer3 on worker3: total reward 54 over 3 episodes",
        "[rank 0] total reward 160 (3 observers x 3 episodes x 20 steps)",
        "[rank 0] rewards reported to the agent match the observers' returns: yes",
        /* Releasing the agent's references frees each observer on its owner, once. */
        "[rank 1] observer1 freed by its owner after 3 episodes (total reward 52)",
        "[rank 2] observer2 freed by its owner after 3 episodes (total reward 54)",
        "[rank 3] observer3 freed by its owner after 3 episodes (total reward 54)",
        "[rank 0] done",
        "[rank 1] done",
        "[rank 2] done",
        "[rank 3] done",
        NULL,
    };
    result_t r;

    run_observers(&r, "4", NULL);
    assert_exit(&r, 0);
    example_assert_lines(&r, want);
    for (int i = 1; i <= 3; i++) {
        char freed[64];
        const char *p = r.out;
        int n = 0;

        snprintf(freed, sizeof(freed), "] observer%d freed by its owner", i);
        while ((p = strstr(p, freed)) != NULL) {
            n++;
            p++;
        }
        cr_assert_eq(n, 1, "observer%d freed %d times\nstdout:\n%s", i, n, r.out);
    }
    run_result_free(&r);
}

/* Another seed and world: the per-episode rewards add up to the per-observer totals and the
 * total, and the agent was told the same rewards the observers returned. */
Test(rref_observers, summary_adds_up_on_three_ranks, .timeout = 90)
{
    static const char *const args[] = {"--seed", "7", "--episodes", "2", "--steps", "9", NULL};
    result_t r;
    int per_ob[3] = {0, 0, 0};
    int total = 0;

    run_observers(&r, "3", args);
    assert_exit(&r, 0);
    for (int ep = 1; ep <= 2; ep++) {
        char prefix[64];
        const char *line;
        int id1, r1, id2, r2;

        snprintf(prefix, sizeof(prefix), "[rank 0] episode %d: rewards ", ep);
        line = find_line(r.out, prefix, true);
        cr_assert(line != NULL, "no line %s\nstdout:\n%s", prefix, r.out);
        cr_assert(
            sscanf(line + strlen(prefix), "observer%d=%d observer%d=%d", &id1, &r1, &id2, &r2) == 4,
            "%.200s", line);
        cr_assert(id1 == 1 && id2 == 2 && r1 >= 0 && r1 <= 9 && r2 >= 0 && r2 <= 9, "%.200s", line);
        per_ob[1] += r1;
        per_ob[2] += r2;
    }
    for (int i = 1; i <= 2; i++) {
        char want[128];

        snprintf(want, sizeof(want),
                 "[rank 0] observer%d on worker%d: total reward %d over 2 "
                 "episodes",
                 i, i, per_ob[i]);
        example_assert_lines(&r, (const char *const[]){want, NULL});
        total += per_ob[i];
    }
    char want[128];
    snprintf(want, sizeof(want), "[rank 0] total reward %d (2 observers x 2 episodes x 9 steps)",
             total);
    example_assert_lines(
        &r, (const char *const[]){
                want, "[rank 0] rewards reported to the agent match the observers' returns: yes",
                "[rank 0] done", "[rank 1] done", "[rank 2] done", NULL});
    run_result_free(&r);
}

Test(rref_observers, wants_two_ranks, .timeout = 60)
{
    result_t r;

    run_observers(&r, "1", NULL);
    assert_exit(&r, 2);
    assert_stderr_has(&r, "needs 2 ranks");
    run_result_free(&r);
}
