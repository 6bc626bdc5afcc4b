"""Launchers of batchnorm.cu: batch normalisation per channel of float32 or bfloat16 activations,
NCHW or channels-last, in training and inference, with per-block partial sums added in a fixed order.

The kernels see an array as (N, C, plane): a channels-last array (N, C, H, W) is, in memory, the
NCHW array (N*H*W, C, 1, 1), so the same kernels serve both layouts; dy and the results take x's, and
dy, y and residual must have x's dtype too (the results have it); the statistics, the parameters and
their gradients are float32.
The two reductions over (N, plane), the statistics and the backward's sums, have kernels of their own
for rows of channels (plane 1) when C is a multiple of 32, which read whole sectors (reduction())."""
import numpy as np

from .launch import STORAGE_TYPES, THREADS, blocks, cdiv, dense, float32, gradient_outputs, in_place, \
    is_channels_last, launch, like, split, storage, storage_argument, vector_width

OPS = ("batch_norm_forward", "batch_norm_backward", "batch_norm_update_running", "batch_norm_inference",
       "batch_norm_inference_backward", "batch_norm_sums", "batch_norm_stats", "batch_norm_apply",
       "batch_norm_backward_sums", "batch_norm_backward_dx")
KERNELS = ("bn_stats_finish", "bn_invstd", "bn_update_running") + \
    tuple(f"{kernel}<{t}>" for kernel in ("bn_stats", "bn_stats_rows", "bn_backward_sums", "bn_backward_sums_rows",
                                          "bn_pooled_backward", "bn_inference_dx") for t in STORAGE_TYPES.values()) + \
    tuple(f"bn_backward_dx<{vec}{storage_argument(t)}>" for vec in (1, 4) for t in STORAGE_TYPES.values()) + \
    tuple(f"bn_apply<{mode}, {vec}{storage_argument(t)}>" for mode in (0, 1, 2) for vec in (1, 4)
          for t in STORAGE_TYPES.values())
APPLY_MODES = {(False, False): 0, (True, False): 1, (True, True): 2}   # (relu, residual) -> bn_apply's MODE
GROUP = 32   # channels per block of the _rows reductions: one per lane of a warp
# A convolution's BN_STATS_PARAMS and BN_SUMS_PARAMS (bn_stats.cuh: the norm's statistics in a forward's epilogue,
# its backward sums in a backward-data's) when none are wanted: the partials null.
NO_STATISTICS = (None, None, 0, None, None, None, None, 0.0, 0.0, 0.0)
NO_SUMS = (None, None, None, None, None, None, None, None, 0, None, None)


def batch_norm_forward(be, x, gamma, beta, eps, *, running=None, momentum=0.1, relu=False, residual=None):
    """See kernels/cpu/batchnorm.py. Two launches: the statistics (which also move `running`, the
    pair (running_mean, running_var), when given) and the normalisation with its relu or residual join."""
    op = "batch_norm_forward"
    x, (gamma, beta) = dense(be, op, x), float32(be, op, gamma, beta)
    _sizes(x, gamma)
    mean, invstd = batch_statistics(be, x, eps, running_pair(be, op, running, x.shape[1]), momentum)
    return apply(be, x, gamma, beta, mean, invstd, relu, residual), mean, invstd


def batch_statistics(be, x, eps, running, momentum):
    """(mean, invstd), float32 (C,), of a training batch norm of the dense activations x (N, C, H, W), in one
    launch, which also moves `running` (the checked pair of running_pair) with `momentum`: no shifts, a sample of
    each channel (its first value of x) centres its sums."""
    mean, invstd = be.xp.empty((2, x.shape[1]), np.float32)
    _stats(be, x, None, mean=mean, invstd=invstd, eps=eps, running=running, momentum=momentum)
    return mean, invstd


def running_pair(be, op, running, c):
    """The pair (running_mean, running_var) that a training forward moves in place, checked (float32
    (C,), dense), or (None, None) for None."""
    if running is None:
        return None, None
    running = in_place(be, op, *running)
    if any(r.shape != (c,) for r in running):
        raise ValueError(f"{op}: running statistics of shapes {[r.shape for r in running]} for {c} channels")
    return running


def batch_norm_sums(be, x, shift):
    x, (shift,) = dense(be, "batch_norm_sums", x), float32(be, "batch_norm_sums", shift)
    _sizes(x, shift)
    sums = be.xp.empty((2, shift.size), np.float32)
    _stats(be, x, shift, sums=sums)
    return sums


def batch_norm_stats(be, sums, shift, count, eps):
    sums, shift = float32(be, "batch_norm_stats", sums, shift)
    if sums.shape != (2,) + shift.shape:
        raise ValueError(f"batch norm sums {sums.shape} do not fit shift {shift.shape}")
    c = shift.size
    mean, invstd = be.xp.empty((2, c), np.float32)
    launch(be, "batchnorm", "bn_stats_finish", (cdiv(c, THREADS),), (shift, sums, c, count, float(eps), mean, invstd))
    return mean, invstd


def batch_norm_apply(be, x, gamma, beta, mean, invstd, *, relu=False, residual=None):
    x = dense(be, "batch_norm_apply", x)
    gamma, beta, mean, invstd = float32(be, "batch_norm_apply", gamma, beta, mean, invstd)
    return apply(be, x, gamma, beta, mean, invstd, relu, residual)


def apply(be, x, gamma, beta, mean, invstd, relu=False, residual=None):
    """gamma * (x - mean) * invstd + beta, then its relu, or relu(. + residual), in one kernel."""
    n, c, plane = _sizes(x, gamma)
    if residual is not None:
        (residual,) = like(be, "batch_norm_forward", x, residual)
        _sizes(x, gamma, residual)
    t = storage("batch_norm_forward", x, residual)
    y = be.xp.empty_like(x)
    mode = APPLY_MODES[relu or residual is not None, residual is not None]
    vec = vector_width(x.size, x, residual, y)
    launch(be, "batchnorm", f"bn_apply<{mode}, {vec}{storage_argument(t)}>", blocks(x.size // vec),
           (x, mean, invstd, gamma, beta, residual, x.size, c, plane, y))
    return y


def batch_norm_backward(be, dy, x, gamma, mean, invstd, *, y=None, beta=None, out=None, shortcut=False, sums=None,
                        round_dx=False, round_g=False):
    """See kernels/cpu/batchnorm.py: (dx, dgamma, dbeta), and the masked dy when `shortcut`; `sums`: the
    (dgamma, dbeta) that the convolution after the norm computed (conv2d_backward's norm_out), which
    then are the gradients returned. With `beta` (a relu alone), the dx pass recomputes the relu's mask
    from x (bn_affine) and does not read y; it rounds dx (round_dx) and g (round_g) to TF32 there."""
    op = "batch_norm_backward"
    x = dense(be, op, x)
    dy, y = like(be, op, x, dy, y)
    storage(op, x, dy, y)
    if (round_dx or round_g) and x.dtype != np.float32:
        raise TypeError(f"{op}: round_dx and round_g round float32 gradients, not {x.dtype}")
    if round_g and not shortcut:
        raise ValueError(f"{op}: round_g rounds the shortcut's gradient, which only `shortcut` returns")
    gamma, mean, invstd, beta = float32(be, op, gamma, mean, invstd, beta)
    if beta is not None and (shortcut or beta.shape != gamma.shape):
        raise ValueError(f"{op}: beta is given for a relu alone (no shortcut), of gamma's shape")
    if sums is None:   # the sums' pass reads the mask
        y = relu_output(be, y, x, gamma, beta, mean, invstd)
    _sizes(x, gamma, dy)
    if y is not None:
        _sizes(x, gamma, y)
    c = gamma.size
    if sums is not None:
        dgamma, dbeta = float32(be, op, *sums)
        if out is not None and any(o is not None and o is not s for o, s in zip(out, sums)):
            raise ValueError(f"{op}: the sums given are not the gradients' outputs (out)")
    else:
        dgamma, dbeta = sums_outputs(be, op, out, c)
        _affine_grads(be, dy, y, x, mean, invstd, dgamma, dbeta)
    masked = be.xp.empty_like(x) if shortcut else None
    dx = _dx(be, dy, None if beta is not None else y, x, gamma, beta, mean, invstd, dgamma, dbeta,
             x.size // x.shape[1], masked, round_dx | round_g << 1)
    return (dx, dgamma, dbeta) + ((masked,) if shortcut else ())


def relu_output(be, y, x, gamma, beta, mean, invstd):
    """y, the output of a batch norm of x with its relu; where it was not stored (None, with beta: a relu
    alone that its reader applied as it loaded x, conv2d's normalize), made (apply) for a pass that reads
    the mask."""
    return apply(be, x, gamma, beta, mean, invstd, relu=True) if y is None and beta is not None else y


def sums_outputs(be, op, out, c):
    """(dgamma, dbeta) where a norm's backward sums over `c` channels go: the arrays of `out` (checked by
    gradient_outputs; either may be None), new float32 ones for the others."""
    return tuple(be.xp.empty((c,), np.float32) if a is None else a for a in gradient_outputs(be, op, out, ((c,), (c,))))


def batch_norm_backward_sums(be, dy, x, mean, invstd):
    return backward_sums(be, dy, None, x, mean, invstd, "batch_norm_backward_sums")


def backward_sums(be, dy, y, x, mean, invstd, op, into=None):
    """(2, C) float32 [sum(g * xhat), sum(g)] of the training batch norm of x, g = dy where its output y > 0
    (dy itself when y is None), or into `into` = (dgamma, dbeta): one launch (_affine_grads)."""
    x = dense(be, op, x)
    (dy, y), (mean, invstd) = like(be, op, x, dy, y), float32(be, op, mean, invstd)
    storage(op, x, dy, y)
    _sizes(x, mean, dy)
    sums = be.xp.empty((2, mean.size), np.float32) if into is None else into
    _affine_grads(be, dy, y, x, mean, invstd, sums[0], sums[1])
    return sums


def pooled_backward(be, pooled, dx, norm, sums, op):
    """dx (a channels-last (N, C, H, W) array) = pooled ((N, C) float32) / (H * W) at each pixel, and into
    `sums` = (dgamma, dbeta) the backward sums of the training batch norm whose output is the pooled
    activations, norm = (y, x, mean, invstd, ...) (backward_sums' g of that dx): one launch of bn_pooled_backward,
    where its rows take them (channels-last y and x of dx's dtype, C a multiple of GROUP); else False, and
    nothing launched."""
    y, x, mean, invstd = norm[:4]
    n, c, h, w = dx.shape
    if not (by_rows(c, 1) and all(is_channels_last(a) and a.dtype == dx.dtype and a.shape == dx.shape
                                  for a in (dx, y, x))):
        return False
    mean, invstd = float32(be, op, mean, invstd)
    _sizes(x, mean)
    suffix, grid, chunk = reduction(n * h * w, c, 1)
    launch(be, "batchnorm", f"bn_pooled_backward<{STORAGE_TYPES[dx.dtype]}>", grid,
           (pooled, h * w, dx, y, x, mean, invstd, n * h * w, c, chunk, _partial(be, grid, c), be.counters(grid[0]),
            *sums))
    return True


def batch_norm_backward_dx(be, dy, x, gamma, mean, invstd, sums, count):
    op = "batch_norm_backward_dx"
    x = dense(be, op, x)
    (dy,) = like(be, op, x, dy)
    storage(op, x, dy)
    gamma, mean, invstd, sums = float32(be, op, gamma, mean, invstd, sums)
    _sizes(x, gamma, dy)
    return _dx(be, dy, None, x, gamma, None, mean, invstd, sums[0], sums[1], count, None)


def batch_norm_update_running(be, running_mean, running_var, mean, invstd, count, momentum, eps):
    in_place(be, "batch_norm_update_running", running_mean, running_var)
    mean, invstd = float32(be, "batch_norm_update_running", mean, invstd)
    c = running_mean.size
    launch(be, "batchnorm", "bn_update_running", (cdiv(c, THREADS),),
           (running_mean, running_var, mean, invstd, c, float(momentum), float(eps), _correction(count)))


def batch_norm_inference(be, x, gamma, beta, running_mean, running_var, eps):
    x = dense(be, "batch_norm_inference", x)
    gamma, beta, running_mean, running_var = float32(be, "batch_norm_inference", gamma, beta, running_mean,
                                                     running_var)
    _sizes(x, gamma)
    return apply(be, x, gamma, beta, running_mean, _invstd(be, running_var, eps))


def batch_norm_inference_backward(be, dy, x, gamma, running_mean, running_var, eps):
    op = "batch_norm_inference_backward"
    x = dense(be, op, x)
    (dy,) = like(be, op, x, dy)
    t = storage(op, x, dy)
    gamma, running_mean, running_var = float32(be, op, gamma, running_mean, running_var)
    n, c, plane = _sizes(x, gamma, dy)
    invstd = _invstd(be, running_var, eps)
    dgamma, dbeta = be.xp.empty((2, c), np.float32)
    _affine_grads(be, dy, None, x, running_mean, invstd, dgamma, dbeta)
    dx = be.xp.empty_like(x)
    launch(be, "batchnorm", f"bn_inference_dx<{t}>", blocks(x.size), (dy, invstd, gamma, x.size, c, plane, dx))
    return dx, dgamma, dbeta


def by_rows(c, plane):
    """Whether the reductions over (N, plane) of (N, C, plane) run as their _rows kernels: on rows of
    channels (channels-last memory, or 1x1 images) whose C is a multiple of GROUP, where a warp reading
    GROUP consecutive channels reads whole 32-byte sectors, and the block-per-channel kernels 4 bytes of
    each."""
    return plane == 1 and c % GROUP == 0


def reduction(n, c, plane):
    """(suffix, grid, chunk) of bn_stats and bn_backward_sums over (N, C, plane): with by_rows, their
    _rows kernels, a block per GROUP channels and split of the N rows, `chunk` rows each; else a block
    per channel and split of its N*plane values, `chunk` values each."""
    if by_rows(c, plane):
        # split() sizes by elements, of which a row of a group holds GROUP
        splits, chunk = split(n * GROUP, c // GROUP, GROUP)
        return "_rows", (c // GROUP, splits), chunk // GROUP
    splits, chunk = split(n * plane, c)
    return "", (c, splits), chunk


def _stats(be, x, shifts, sums=None, mean=None, invstd=None, eps=0.0, running=(None, None), momentum=0.0):
    """One launch of bn_stats or bn_stats_rows over x (see batchnorm.cu, reduction()): the shift of
    channel c is shifts[c], or its first value of x when shifts is None; the totals go to sums, else to
    mean and invstd (and the running pair)."""
    n, c, plane = _sizes(x, mean if sums is None else sums[0])
    suffix, grid, chunk = reduction(n, c, plane)
    geometry = (n, c, chunk) if suffix else (n, c, plane, chunk)   # rows: plane 1
    launch(be, "batchnorm", f"bn_stats{suffix}<{STORAGE_TYPES[x.dtype]}>", grid,
           (x, shifts, *geometry, _partial(be, grid, c), be.counters(grid[0]), sums, float(eps), mean, invstd,
            *running, float(momentum), _correction(n * plane)))


def _affine_grads(be, dy, y, x, mean, invstd, dgamma, dbeta):
    """dgamma = sum(g * xhat) and dbeta = sum(g) per channel, g the dy masked by y (if given): one launch
    of bn_backward_sums or bn_backward_sums_rows (reduction())."""
    n, c, plane = _sizes(x, mean, dy)
    suffix, grid, chunk = reduction(n, c, plane)
    geometry = (n, c, chunk) if suffix else (n, c, plane, chunk)
    launch(be, "batchnorm", f"bn_backward_sums{suffix}<{STORAGE_TYPES[x.dtype]}>", grid,
           (dy, y, x, mean, invstd, *geometry, _partial(be, grid, c), be.counters(grid[0]), dgamma, dbeta))


def _partial(be, grid, c):
    """The per-split sums (splits, 2, C) of a reduction's grid (blocks, splits), or None for one split."""
    return be.xp.empty((grid[1], 2, c), np.float32) if grid[1] > 1 else None


def _dx(be, dy, y, x, gamma, beta, mean, invstd, dgamma, dbeta, count, masked, rounded=0):
    """One launch of bn_backward_dx: dy masked by y where y is given, else by the relu's mask recomputed
    from x where beta is, else not at all; dx rounded to TF32 where rounded & 1, masked where rounded & 2."""
    n, c, plane = _sizes(x, gamma, dy)
    dx = be.xp.empty_like(x)
    vec = vector_width(x.size, dy, y, x, dx, masked)
    launch(be, "batchnorm", f"bn_backward_dx<{vec}{storage_argument(STORAGE_TYPES[x.dtype])}>", blocks(x.size // vec),
           (dy, y, x, mean, invstd, gamma, beta, dgamma, dbeta, count, x.size, c, plane, dx, masked,
            int(rounded)))
    return dx


def _correction(count):
    """count / (count - 1): the biased variance of `count` values made unbiased."""
    return float(count / max(count - 1, 1))


def _invstd(be, var, eps):
    invstd = be.xp.empty_like(var)
    launch(be, "batchnorm", "bn_invstd", (cdiv(var.size, THREADS),), (var, var.size, float(eps), invstd))
    return invstd


def _sizes(x, gamma, dy=None):
    """(N, C, H*W) as the kernels see x, after checking the shapes: (N*H*W, C, 1) when it is
    channels-last (see the module's docstring)."""
    if x.ndim != 4 or gamma.shape != (x.shape[1],):
        raise ValueError(f"batch norm expects x (N, C, H, W) and per-channel parameters (C,), "
                         f"got x {x.shape} and gamma {gamma.shape}")
    if dy is not None and dy.shape != x.shape:
        raise ValueError(f"batch norm dy shape {dy.shape} differs from x {x.shape}")
    n, c, h, w = x.shape
    return (n * h * w, c, 1) if is_channels_last(x) else (n, c, h * w)
