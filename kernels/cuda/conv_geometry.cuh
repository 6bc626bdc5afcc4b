// conv_geometry.cuh: the sizes of one convolution and the stride phases of its backward-data,
// which the FP32 kernels (conv.cu) and the tensor-core ones (conv_tc.cu, conv_sm90.cu) share; and the weights
// of the forward convolution that a stride-1 backward-data is.
#pragma once

// Sizes of one convolution; the kernel size is a template constant when KH, KW are not 0.
template <int KH, int KW>
struct Geometry {
    int n, c, h, w, o, kh_run, kw_run, sh, sw, ph, pw, oh, ow;
    __device__ int kh() const { return KH ? KH : kh_run; }
    __device__ int kw() const { return KW ? KW : kw_run; }
    __device__ int taps() const { return kh() * kw(); }
    __device__ int out_plane() const { return oh * ow; }
};

// n / d and n % d for 0 <= n < 2^31 by a divisor d >= 1 known only at run time, in a multiply-high,
// an add and a shift instead of the dozen instructions of an integer division (Granlund and
// Montgomery, "Division by invariant integers using multiplication", 1994, figure 4.1, whose
// (t + (n - t) / 2) >> (l - 1) is (t + n) >> l while t + n < 2^32): with l = ceil(log2 d) and
// multiplier = floor(2^32 (2^l - d) / d) + 1, which the launcher works out (fast_divmod in
// kernels/cuda/conv_tc.py) and passes as kernel parameters.
struct FastDivmod {
    int d;
    unsigned multiplier, shift;
    __device__ int div(int n) const { return int((__umulhi(unsigned(n), multiplier) + unsigned(n)) >> shift); }
    __device__ int mod(int n, int quotient) const { return n - quotient * d; }
};

// The kernels' size parameters, named apart from the Geometry fields they initialise.
#define CONV_PARAMS \
    int n_, int c_, int h_, int w_, int o_, int kh_, int kw_, int sh_, int sw_, int ph_, int pw_, int oh_, int ow_
#define CONV_GEOMETRY {n_, c_, h_, w_, o_, kh_, kw_, sh_, sw_, ph_, pw_, oh_, ow_}

// Backward-data works on one stride phase at a time: the input cells (h, w) with
// (h + ph) % sh = a and (w + pw) % sw = b, which only the kernel taps r = a + sh*i,
// s = b + sw*j reach, from the outputs p = t_h + u - i, q = t_w + v - j for the phase's cell
// (u, v) = ((h - h_first) / sh, (w - w_first) / sw). Each phase is a dense GEMM, with no
// multiply by a tap that misses; at stride 1 there is one phase, and all taps.
struct Phase {
    int a, b;              // the phase
    int h_first, w_first;  // its first input cell
    int rows, cols;        // its number of cells along each axis
    int t_h, t_w;          // output offsets: p = t_h + u - i, q = t_w + v - j
    int taps_h, taps_w;    // kernel rows and columns that reach it

    __device__ int cells() const { return rows * cols; }
    __device__ int taps() const { return taps_h * taps_w; }
};

// The phase of grid.z = a * sw + b.
template <int KH, int KW>
__device__ Phase stride_phase(const Geometry<KH, KW>& g, int z) {
    Phase f;
    f.a = z / g.sw;
    f.b = z - f.a * g.sw;
    f.h_first = ((f.a - g.ph) % g.sh + g.sh) % g.sh;
    f.w_first = ((f.b - g.pw) % g.sw + g.sw) % g.sw;
    f.rows = g.h > f.h_first ? (g.h - f.h_first + g.sh - 1) / g.sh : 0;
    f.cols = g.w > f.w_first ? (g.w - f.w_first + g.sw - 1) / g.sw : 0;
    f.t_h = (f.h_first + g.ph - f.a) / g.sh;  // exact, and >= 0
    f.t_w = (f.w_first + g.pw - f.b) / g.sw;
    f.taps_h = g.kh() > f.a ? (g.kh() - f.a + g.sh - 1) / g.sh : 0;
    f.taps_w = g.kw() > f.b ? (g.kw() - f.b + g.sw - 1) / g.sw : 0;
    return f;
}

// The single phase of a stride-1 convolution, its kernel size a template constant if given.
template <int KH, int KW>
__device__ Phase unit_stride_phase(const Geometry<KH, KW>& g) {
    return Phase{0, 0, 0, 0, g.h, g.w, g.ph, g.pw, g.kh(), g.kw()};
}

// w_mirrored (C, KH, KW, O) [ci][tap][co] = w_krsc (O, KH, KW, C) [co][taps - 1 - tap][ci]: the weights of the
// forward convolution that backward-data of a stride-1 one is (dy convolved with them, padding KH - 1 - PH), so that
// a backward-data kernel reads them as a forward reads its own, along k (TF32's halo kernel for 3x3 filters,
// Hopper's forward GEMM). One thread an element.
template <class T>
__global__ void __launch_bounds__(256)
mirrored_weights(const T* __restrict__ w_krsc, T* __restrict__ w_mirrored, int o, int taps, int c) {
    const int i = blockIdx.x * 256 + int(threadIdx.x);   // the output element, (ci * taps + tap) * O + co
    if (i >= taps * o * c) return;
    const int co = i % o, tap = i / o % taps, ci = i / (taps * o);
    w_mirrored[i] = w_krsc[(co * taps + taps - 1 - tap) * c + ci];
}
