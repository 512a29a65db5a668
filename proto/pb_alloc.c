/* The one protobuf-c allocator of weft: every unpack and free_unpacked goes through weft_alloc and
 * weft_free, so a replaced allocator (weft_set_allocator) sees protobuf memory too. */
#include <weft/alloc.h>

#include "weft_pb.h"

static void *pb_alloc(void *data, size_t size)
{
    (void)data;
    return weft_alloc(size);
}

static void pb_free(void *data, void *ptr)
{
    (void)data;
    weft_free(ptr);
}

ProtobufCAllocator weft__pb_allocator = {pb_alloc, pb_free, NULL};
