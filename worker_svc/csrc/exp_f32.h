/* e^x in float, branch-free so that loops calling it vectorize (build with
 * -fno-trapping-math for the clamps to become vector min/max): Cephes' expf, range
 * reduction by ln 2 in two parts and a degree-6 polynomial, within a few ulp of
 * libm's and torch's. Above 88.7 it overflows to inf like theirs; below -86.6 it
 * returns e^-86.6 (2.4e-38), which softmax and SiLU lose next to 1 anyway. */
#ifndef GAPSERVE_EXP_F32_H
#define GAPSERVE_EXP_F32_H

#include <math.h>
#include <stdint.h>

static inline float exp_f32(float x)
{
    x = x > 88.8f ? 88.8f : x;
    x = x < -86.6f ? -86.6f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);  /* -125 .. 128 */
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 126) << 23;  /* 2^(n-1): a normal float for every n */
    float half_scale;
    __builtin_memcpy(&half_scale, &bits, sizeof half_scale);
    return p * half_scale * 2.0f;  /* exact, or inf when e^x is beyond the float range */
}

#endif
