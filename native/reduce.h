/* Element-wise kernels of the engine: internal, not part of the ABI. */
#ifndef SPARKTRAIN_REDUCE_H
#define SPARKTRAIN_REDUCE_H

#include <stddef.h>

size_t stc_dtype_size(int dtype);
/* out = srcs[0] + srcs[1] + ... in that order (half types accumulate in float, rounded once).
 * out may alias srcs[0] only. */
void stc_reduce(void *out, const void *const *srcs, int nsrc, size_t n, int dtype);
/* acc = acc + src, element-wise. */
void stc_accumulate(void *acc, const void *src, size_t n, int dtype);
/* buf /= divisor; integers truncate toward zero. */
void stc_divide(void *buf, size_t n, int dtype, int divisor);

#endif
