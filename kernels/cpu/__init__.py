"""The CPU backend: NumPy implementations of every op that training needs.

Every backend (``cpu``, ``cuda``, ``emu``) offers these functions with the same
signatures. Arrays are NCHW; the CPU backend accepts float32 and float64 and
computes in the dtype it is given. ``stride``, ``padding`` and ``kernel_size``
are ints or (h, w) pairs. What a backward needs from its forward is returned by
the forward and passed back explicitly.

The device backends take float32 and, for activations and their gradients,
bfloat16 (``kernels.bfloat16``, the bf16 precision's storage): an op's activations
share one dtype, which its activation outputs take, and it computes in float32,
rounding what it stores to bfloat16 once; statistics, parameters, their gradients,
the loss and the linear layer stay float32. The CPU backend meets bfloat16 only
where a signature names it (cast, sgd_update's copy, global_avg_pool_backward's
dtype).

The CPU backend's 4-D results are channels-last in memory (NCHW shape over NHWC
strides, like PyTorch's channels_last format), the layout its convolutions compute
in, so that a network of them never transposes. Every kernel accepts any memory
layout; np.ascontiguousarray gives C order where something needs it.

conv2d_forward(x, w, b, stride, padding, *, statistics=None, normalize=None, w_tf32=False)
        -> y, or (y, mean, invstd)
    x (N, C, H, W), w (O, C, KH, KW), b (O,) or None -> y (N, O, OH, OW),
    OH = (H + 2*ph - KH) // sh + 1. statistics = (eps, running, momentum): also the statistics
    of the training batch norm that follows, of y, as batch_norm_forward computes them (running:
    the pair moved in place, or None); a device backend's tensor-core forward sums them in its
    epilogue, where y is, and batch_norm_apply then normalises. normalize = (gamma, beta, mean,
    invstd): the convolution of relu(batch_norm_apply(x, gamma, beta, mean, invstd)), x a training
    batch norm's input, so that its normalised output need not be stored (a device backend's TF32
    GEMMs apply it as they load x; the others compute it first). w_tf32: w holds TF32 values already
    (round_tf32's: a flat buffer's TF32 copy), which a device backend's TF32 GEMMs then read as they
    are, where they read any other w rounded by a launch of round_tf32 first; the CPU backend, which
    computes in float32, ignores it.
conv2d_folds(x, w, stride, padding) -> bool
    Whether conv2d_forward and conv2d_backward of x (a batch norm's input) by w apply a normalize as
    they load x, rather than compute relu(bn(x)) first: a caller that would compute it once and keep
    it (nn.functional.Normalized) does that where not. False on the CPU backend.
conv2d_tf32(w) -> bool
    Whether the convolutions by weights w (O, C, KH, KW) multiply TF32 on this backend under the
    current precision (a device backend's under tf32, where the channel counts take its tensor
    cores): those that read a weight rounded to TF32 (w_tf32) as it is; the others multiply the
    float32 weight in float32, and get it. False on the CPU backend.
conv2d_backward(dy, x, w, stride, padding, *, need_dx=True, out=None, add_dx_to=None, norm=None,
                norm_out=None, normalize=None, w_tf32=False, dy_tf32=False)
        -> (dx, dw, db), or (dx, dw, db, dgamma, dbeta)
    db is dy summed over (N, OH, OW); callers without a bias ignore it. dx is None unless
    need_dx (the first layer's input needs none). out = (dw, db): arrays that the gradients
    are written into (a parameter's gradient, say; either may be None), returned. add_dx_to:
    x's gradient so far, to which dx is added in place and which is returned as dx. norm =
    (y, x_norm, mean, invstd, gamma, beta): x is the output y of a training batch norm of x_norm
    with its relu or residual join, and dx (with add_dx_to, the total) is its final gradient; then
    also that norm's backward sums of dx (its dy), as batch_norm_backward computes them where
    y > 0, written into norm_out = (dgamma, dbeta) when given (a device backend's tensor-core
    backward-data computes them in its epilogue, where dx is), which batch_norm_backward then
    takes as `sums`. gamma and beta: the norm's, for a relu alone (None for a join), whose mask
    y > 0 a device backend recomputes from x_norm (as the forward computed y) rather than read y;
    y may then be None (not stored: the forward's normalize). normalize: as conv2d_forward's, x
    the norm's input (the weight gradient reads relu(bn(x))). w_tf32: as conv2d_forward's. dy_tf32:
    dy holds TF32 values already (its producer rounded it: batch_norm_backward's round_tf32), which a
    device backend's TF32 GEMMs then read as they are, where they read any other dy rounded by a launch
    of round_tf32 first (one for both; the bias gradient sums dy as given); ignored elsewhere.

batch_norm_forward(x, gamma, beta, eps, *, running=None, momentum=0.1, relu=False, residual=None)
    -> (y, mean, invstd)
    Training mode: per-channel batch mean and 1/sqrt(biased var + eps). running: the pair
    (running_mean, running_var), updated in place as batch_norm_update_running does. relu:
    y = relu(batch norm); residual (x's shape): y = relu(batch norm + residual), a residual
    block's join.
batch_norm_backward(dy, x, gamma, mean, invstd, *, y=None, beta=None, out=None, shortcut=False,
                    sums=None, round_dx=False, round_g=False) -> (dx, dgamma, dbeta[, g])
    y: the output of a forward with relu or residual; the gradient then flows where y > 0
    (g = dy there, 0 elsewhere), and `shortcut` also returns g, the residual's gradient. beta
    (for a relu alone, with y or without it: an output not stored): the norm's, from which the mask
    is recomputed (gamma * xhat + beta > 0, as batch_norm_apply computed y) rather than read from y.
    out = (dgamma, dbeta): arrays the parameter gradients are written into, returned. sums:
    (dgamma, dbeta) computed already (conv2d_backward's norm), returned as they are. round_dx,
    round_g (float32): dx, g rounded to TF32 (round_tf32) where they are made, for a reader that
    multiplies them as TF32 and is their only one: the convolution that made x, or the residual
    (conv2d_backward's dy_tf32).
batch_norm_update_running(running_mean, running_var, mean, invstd, count, momentum, eps) -> None
    In place: running <- (1 - momentum) running + momentum batch, with the unbiased
    batch variance (1/invstd^2 - eps) * count / (count - 1), count = N*H*W.
batch_norm_sums(x, shift) -> sums
    (2, C): [sum(x - shift), sum((x - shift)^2)] per channel over (N, H, W); the
    training forward in parts, for batch norm synchronised across replicas, is
    sums -> (added over replicas) -> stats -> apply.
batch_norm_stats(sums, shift, count, eps) -> (mean, invstd)
    From sums over ``count`` values per channel: mean = shift + sums[0] / count,
    invstd = 1/sqrt(sums[1] / count - (sums[0] / count)^2 + eps).
batch_norm_apply(x, gamma, beta, mean, invstd, *, relu=False, residual=None) -> y
    gamma * (x - mean) * invstd + beta, then relu, or relu(. + residual), as batch_norm_forward
batch_norm_backward_sums(dy, x, mean, invstd) -> sums
    (2, C): [sum(dy * xhat), sum(dy)] = [dgamma, dbeta], xhat = (x - mean) * invstd.
batch_norm_backward_dx(dy, x, gamma, mean, invstd, sums, count) -> dx
    gamma * invstd * (dy - sums[1] / count - xhat * sums[0] / count); with the sums of
    every replica and their total count, the dx of the whole batch.
batch_norm_inference(x, gamma, beta, running_mean, running_var, eps) -> y
batch_norm_inference_backward(dy, x, gamma, running_mean, running_var, eps)
    -> (dx, dgamma, dbeta)

add(a, b, out=None) -> y
    a + b of one shape; ``out`` may be a or b (gradients accumulate in place)
relu_forward(x) -> y
relu_backward(dy, y) -> dx            (mask taken from the output)
add_relu_forward(a, b) -> y           relu(a + b), the residual join
    its backward is relu_backward(dy, y), the same gradient for a and b

max_pool2d_forward(x, kernel_size, stride, padding) -> (y, argmax)
    argmax: int64 (N, C, OH, OW), flat index h * W + w into the input plane.
max_pool2d_backward(dy, argmax, x_shape) -> dx
global_avg_pool_forward(x) -> y       (N, C, H, W) -> (N, C); float32 y of float32 or bfloat16 x
global_avg_pool_backward(dy, x_shape, *, dtype=None, norm=None, norm_out=None) -> dx, or
                         (dx, dgamma, dbeta)
    dx of dtype `dtype` (None: dy's), e.g. the bfloat16 of the activations it flows back into;
    norm, norm_out: the sums of the batch norm whose output the pool read, as conv2d_backward's

linear_forward(x, w, b) -> y          x (N, I), w (O, I), b (O,) or None
linear_backward(dy, x, w, *, out=None) -> (dx, dw, db)
    out = (dw, db) as for conv2d_backward

softmax_cross_entropy_forward(logits, labels) -> (loss, probs)
    logits (N, K), labels integer (N,); loss is the 0-d mean over the batch.
softmax_cross_entropy_backward(dloss, probs, labels) -> dlogits
count_correct(logits, labels) -> n
    0-d int64: rows whose first largest logit is at the label (accuracy, on the device).

sgd_update(param, grad, velocity, lr, momentum, weight_decay, copy=None) -> None
    In place on flat buffers, PyTorch's rule: g = grad + wd * param;
    velocity = momentum * velocity + g; param -= lr * velocity
    (velocity may be None when momentum is 0; then param -= lr * g). lr: a number, or a
    1-element array of param's dtype read when the update runs (on a GPU, device memory that
    a CUDA graph's replay reads anew). copy: a bfloat16 array of param's shape and memory
    layout (C-contiguous), set to the updated param rounded to nearest even in the same pass
    (the weights the bf16 precision's forward reads), or a float32 one, set to it rounded to
    TF32 (round_tf32: the weights the tf32 precision's tensor cores read); param, grad and
    velocity are float32 and updated as without it.

images_to_float(images, idx=None) -> x
    uint8 (N, H, W) -> float32 (N, 1, H, W) scaled to [0, 1]; with 1-D integer indices idx,
    those images (images[idx]), gathered in the same pass. On a device backend under the bf16
    precision, bfloat16 (kernels.storage_dtype()): rounded once, as autocast rounds the input of
    the first convolution.
take(a, idx) -> a[idx]
    a 1-D int32 array (the labels) gathered at 1-D integer indices: a batch's labels.
cast(a, dtype, out=None) -> y
    a (float32 or bfloat16; on the CPU backend float64 too) converted to dtype (float32 or
    bfloat16: rounded to nearest even), into out when given (a's shape, dense, that dtype:
    a flat buffer's view at any offset, say), else a new array in a's memory layout.
round_tf32(a, out=None) -> y
    float32 a rounded to TF32 as cvt.rna.tf32.f32 rounds (10 mantissa bits, to nearest, ties
    away from zero), a float32 whose low 13 bits are zero; infinity and NaN as they are. Into
    out when given (float32, a's shape), else a new array.
"""
import ctypes
import os
import sys

from .conv import conv2d_forward, conv2d_backward, conv2d_folds, conv2d_tf32
from .batchnorm import (batch_norm_forward, batch_norm_backward, batch_norm_update_running,
                        batch_norm_inference, batch_norm_inference_backward, batch_norm_sums,
                        batch_norm_stats, batch_norm_apply, batch_norm_backward_sums,
                        batch_norm_backward_dx)
from .elementwise import add, relu_forward, relu_backward, add_relu_forward
from .pool import (max_pool2d_forward, max_pool2d_backward, global_avg_pool_forward,
                   global_avg_pool_backward)
from .linear import linear_forward, linear_backward
from .loss import softmax_cross_entropy_forward, softmax_cross_entropy_backward, count_correct
from .optim import sgd_update
from .convert import images_to_float, take, cast, round_tf32

name = "cpu"


def _keep_freed_memory():
    """glibc's malloc gives arrays of 128 KB and more (adaptively, up to 32 MB) back to the OS when they are
    freed, so that every step's activations fault their pages in afresh (27,000 faults a step at batch 32,
    and a step time that depends on what the process allocated before). Freed memory is kept for the next
    step's arrays instead: mmap only above 32 MB, and no trimming below 2 GB of free memory. Where the user
    set malloc's thresholds (MALLOC_*_THRESHOLD_, GLIBC_TUNABLES), or the C library is not glibc, nothing."""
    if not sys.platform.startswith("linux") or any(v in os.environ for v in (
            "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3   # malloc.h
    libc.mallopt(m_mmap_threshold, 32 << 20)
    libc.mallopt(m_trim_threshold, (1 << 31) - 1)


_keep_freed_memory()
