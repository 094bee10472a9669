/* The C kernels' vector helpers: W floats per vector as GCC/clang vector extensions (the compiler picks the
 * instructions, -march=native), unaligned loads and stores through memcpy. Included by paged_decode.c and
 * cpu_ops.c; kernels/cpu_build.py keys every build by this header too. */
#ifndef AFSERVE_VEC_H
#define AFSERVE_VEC_H

#include <stdint.h>
#include <string.h>

#define W 8
typedef float vec __attribute__((vector_size(W * sizeof(float))));

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }

static inline vec splat(float x) { return (vec){x, x, x, x, x, x, x, x}; }

#endif
