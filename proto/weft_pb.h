/* protobuf-c for weft's modules: the one allocator (through weft_alloc). Not installed. */
#ifndef WEFT_PROTO_WEFT_PB_H
#define WEFT_PROTO_WEFT_PB_H

#include <protobuf-c/protobuf-c.h>

/* Pass &weft__pb_allocator to every *__unpack and *__free_unpacked. */
extern ProtobufCAllocator weft__pb_allocator;

#endif
