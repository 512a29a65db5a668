/* Export control: the library is built with hidden visibility, and every public declaration
 * carries WEFT_API, so that only weft's API is exported from libweft.so. */
#ifndef WEFT_API_H
#define WEFT_API_H

#if defined(__GNUC__) || defined(__clang__)
#define WEFT_API __attribute__((visibility("default")))
#else
#define WEFT_API
#endif

#endif
