/* weft: umbrella header. */
#ifndef WEFT_WEFT_H
#define WEFT_WEFT_H

/* For programs: weft's own modules include the headers of the layers they use. */
#if defined(WEFT_BUILDING)
#error "weft/weft.h is for programs: a module includes only the headers of the layers below it"
#endif

#include <weft/status.h>
#include <weft/alloc.h>
#include <weft/log.h>
#include <weft/tensor.h>
#include <weft/reduce.h>
#include <weft/value.h>
#include <weft/future.h>
#include <weft/pool.h>
#include <weft/rpc.h>
#include <weft/module.h>
#include <weft/config.h>
#include <weft/collectives.h>
#include <weft/rref.h>
#include <weft/ps.h>
#include <weft/random.h>
#include <weft/optim.h>
#include <weft/autograd.h>
#include <weft/ops.h>
#include <weft/nn.h>
#include <weft/ddp.h>
#include <weft/dist_autograd.h>

#endif
