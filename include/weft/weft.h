/* weft: umbrella header. */
#ifndef WEFT_WEFT_H
#define WEFT_WEFT_H

#include <weft/status.h>
#include <weft/alloc.h>
#include <weft/log.h>
#include <weft/tensor.h>
#include <weft/value.h>
#include <weft/future.h>
#include <weft/pool.h>
#include <weft/rpc.h>

#endif
