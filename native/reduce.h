/* Element-wise kernels of the engine: internal, not part of the ABI. */
#ifndef SPARKTRAIN_REDUCE_H
#define SPARKTRAIN_REDUCE_H

#include <stddef.h>

/* Bytes per element of dtype: a reducible enum stc_dtype, or STC_OPAQUE + itemsize; 0 if neither. */
size_t stc_dtype_size(int dtype);
/* Whether dtype is one the kernels reduce (not an opaque type that is only moved). */
int stc_dtype_reducible(int dtype);
/* out = srcs[0] (op) srcs[1] (op) ... in that order; STC_AVERAGE sums (divide afterwards). Half
 * types compute in float, rounded once; integers wrap; bool's sum and max are or, min and product
 * and. out may alias srcs[0] only. */
void stc_reduce(void *out, const void *const *srcs, int nsrc, size_t n, int dtype, int op);
/* acc = acc (op) src, element-wise. */
void stc_accumulate(void *acc, const void *src, size_t n, int dtype, int op);
/* buf /= divisor (> 0); integers truncate toward zero. */
void stc_divide(void *buf, size_t n, int dtype, int divisor);

#endif
