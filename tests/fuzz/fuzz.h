/* Shared parts of the libFuzzer harnesses (docs/fuzzing.md).
 *
 * The harnesses of decoders that only a live agent reaches (the direct connection, the stream,
 * the Join, the modules' handlers) start a world once per process: two agents in this process,
 * rank 0 (the target: every fuzzed byte goes to it) and rank 1 (the sender: it proves rank 1 and
 * makes the calls). Each input goes to rank 0 through a real call, message or connection, and the
 * harness waits until rank 0 has dealt with it before it returns. */
#ifndef WEFT_FUZZ_H
#define WEFT_FUZZ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <weft/weft.h>

/* Every wait of a harness ends by this (ms): a live input that takes longer is a finding. */
#define FUZZ_WAIT_MS 5000
/* The deadline of the calls a module harness makes: handlers that hold a call (a pull waiting for
 * a clock) answer -60 then. */
#define FUZZ_CALL_MS 100

/* ---- the world (fuzz_world.c) */

typedef struct {
    weft_agent_t *target; /* rank 0 */
    weft_agent_t *sender; /* rank 1 */
    weft_agent_t *raw;    /* rank 2: its key signs the raw peers' proofs */
    weft_pg_t *pg;        /* the target's world group */
} fuzz_world_t;

/* Starts the world of 3 (every module on ranks 0 and 1, the direct listeners on) once; later
 * calls return the same one. Aborts when it cannot start: a harness without its world finds
 * nothing. */
const fuzz_world_t *fuzz_world(void);
/* Returns once the target has handled every frame the sender sent it before: a call of the
 * target's "fuzz.flush" function on the same stream, answered after the frames before it were
 * delivered. */
void fuzz_flush(void);

/* ---- values from bytes */

/*
 * A value from fuzzed bytes, for the module harnesses:
 *   u8 selector | u8 n (tensors: n & 3) | per tensor: u8 dtype (mod 9), u8 ndim (mod 3), ndim x
 *   u8 dim (mod 9) | u16 LE payload length | payload | tensor bytes (the rest, cycled; zeros if
 *   none)
 * *sel_p gets the selector. NULL when the bytes are too few for the header.
 */
weft_value_t *fuzz_value(const uint8_t *data, size_t size, uint8_t *sel_p);
/* The opposite, for the seed generator: writes @p v as such bytes (selector @p sel) at @p out;
 * returns the length (0: does not fit in @p cap). */
size_t fuzz_value_bytes(uint8_t sel, const weft_value_t *v, uint8_t *out, size_t cap);

#endif
