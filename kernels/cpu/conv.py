"""2-D convolution (cross-correlation, like PyTorch) as im2col + one large matrix product.

The kernels work in NHWC and return channels-last arrays (NCHW views of NHWC memory), so a
network of them never transposes: the NHWC view of a channels-last input is free, and any
other input is moved to NHWC by the padding copy. Each window row (KH, KW, C) is gathered
from contiguous channel runs. Its windows form a (N*OH*OW, KH*KW*C) matrix whose
product with the weight, reordered to (KH, KW, C) columns, is the output in NHWC.
Backward rebuilds the same matrix for dw. For dx at stride 1, the input gradient is itself
a convolution: of dy, padded by K-1-P, with the kernel flipped and its two channel axes
swapped, so it is one more im2col and one product of the same efficiency as the forward's.
At larger strides, the column gradient dy @ W, one product, is added back window by window
into the padded input gradient (col2im).

The column matrices would be the largest arrays of a training step (230 MB for ResNet-18's first
stage at batch 128), so none is made whole: each product runs a part of whole images at a time (_parts),
whose columns (about two megabytes) are built in a reused workspace and multiplied while they are in
cache, the parts on every core (kernels/cpu/_parallel.py). The weight gradient, a sum over the
images, is each part's product added in the parts' order; where the images make two parts or fewer (a
small output), it is the whole window matrix's product instead, half of the filters a thread. A 3x3,
stride-1, padding-1 convolution of 64 channels or more multiplies Winograd's tiles instead of the window
matrix (kernels/cpu/winograd.py).
"""
import numpy as np

from . import winograd
from ._parallel import each
from ._util import channel_sum, output_size, pair, padded, windows, workspace, written
from .batchnorm import (backward_sums_of_part, batch_norm_apply, relu_output, statistics_of_part,
                        statistics_of_parts, written_sums)


def conv2d_forward(x, w, b, stride, padding, *, statistics=None, normalize=None, w_tf32=False):
    if normalize is not None:   # computed first: a device backend's loads apply it, the CPU has no loads to hide it in
        x = batch_norm_apply(x, *normalize, relu=True)
    stride, padding = pair(stride), pair(padding)
    _output_shape(x, w, stride, padding)
    if b is not None and b.shape != (w.shape[0],):
        raise ValueError(f"conv2d bias shape {b.shape} does not match {w.shape[0]} "
                         f"output channels")
    parts = {}   # the statistics' sums of each part of y, made while it is in cache
    y = _nchw(_products(_nhwc(x), w, stride, padding, b,
                        after=None if statistics is None else
                        lambda i, images, part: parts.__setitem__(i, statistics_of_part(part))))
    return y if statistics is None else (y, *statistics_of_parts([parts[i] for i in sorted(parts)], *statistics))


def conv2d_folds(x, w, stride, padding):
    return False


def conv2d_tf32(w):
    return False


def conv2d_backward(dy, x, w, stride, padding, *, need_dx=True, out=None, add_dx_to=None, norm=None,
                    norm_out=None, normalize=None, w_tf32=False, dy_tf32=False):
    if normalize is not None:
        x = batch_norm_apply(x, *normalize, relu=True)
    after, parts = None, {}
    if norm is not None:   # the norm's backward sums of each part of dx, made while it is in cache
        if not need_dx:
            raise ValueError("conv2d_backward: a batch norm's sums (norm) need dx (need_dx)")
        y, x_norm, mean, invstd, gamma, beta = norm
        y_nhwc, x_norm_nhwc = _nhwc(relu_output(y, x_norm, gamma, beta, mean, invstd)), _nhwc(x_norm)

        def after(i, s, part):
            parts[i] = backward_sums_of_part(part, y_nhwc[s], x_norm_nhwc[s], mean)
    stride, padding = pair(stride), pair(padding)
    n, oh, ow = _output_shape(x, w, stride, padding)
    if dy.shape != (n, w.shape[0], oh, ow):
        raise ValueError(f"conv2d dy shape {dy.shape} does not match the forward output "
                         f"{(n, w.shape[0], oh, ow)}")
    dy_nhwc = np.ascontiguousarray(_nhwc(dy))
    dw_out, db_out = (None, None) if out is None else out
    dw = _backward_weight(dy_nhwc, x, w, stride, padding, dw_out)
    if not need_dx:
        dx = None
    elif stride == (1, 1) and all(p < k for p, k in zip(padding, w.shape[2:])):
        dx = _backward_data_stride1(dy_nhwc, w, padding, add_dx_to, after)
    else:
        dx = _col2im(dy_nhwc, x.shape, w, stride, padding, add_dx_to, after)
    if dx is not None and add_dx_to is not None:
        dx = add_dx_to   # the very array (the callers' accumulation tells it by identity)
    grads = dx, dw, written(db_out, channel_sum(dy))
    if norm is None:
        return grads
    return grads + written_sums([parts[i] for i in sorted(parts)], invstd, norm_out)


def _output_shape(x, w, stride, padding):
    """(N, OH, OW) of the output, after checking that x and w fit together."""
    if x.ndim != 4 or w.ndim != 4:
        raise ValueError(f"conv2d expects x (N, C, H, W) and w (O, C, KH, KW), "
                         f"got {x.shape} and {w.shape}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"conv2d input has {x.shape[1]} channels, weight expects {w.shape[1]}")
    oh, ow = (output_size(x.shape[d], w.shape[d], s, p)
              for d, s, p in zip((2, 3), stride, padding))
    return x.shape[0], oh, ow


_PART_BYTES = 2 << 20   # 1 MB parts measured 6 % slower at batch 32, 30 % at width 16 (fewer, longer passes)


def _parts(n, rows, k, itemsize):
    """Slices of the n images, a part of the products each: its window matrix of about _PART_BYTES (k columns,
    ``rows`` rows an image), at least 256 and k / 2 rows (fewer multiply at a fraction of the BLAS's pace,
    each packing the weights anew), and at least two parts where there are two images. From the shape alone:
    so are the results, whatever the threads (kernels/cpu/_parallel.py)."""
    least = max(256, k // 2, _PART_BYTES // (k * itemsize))
    per = max(1, min(-(-least // rows), -(-n // 2)))
    return [slice(i, min(i + per, n)) for i in range(0, n, per)]


def _products(x_nhwc, w, stride, padding, bias=None, add_to=None, after=None, flipped=False):
    """(N, OH, OW, O): x convolved with w (O, C, KH, KW) (flipped: with w[:, :, ::-1, ::-1] and its channel axes
    swapped, dx's kernel), plus bias when given, a part of the images at a time:
    by Winograd's F(2x2, 3x3) where it applies, else x's window matrix (N*OH*OW, KH*KW*C) times w's. With
    add_to (an (N, OH, OW, O) view), added to it as each part is made, and add_to returned. after(i, images,
    part): called with each part of the result (of add_to) as it is made, on the part's thread, where it is
    in cache."""
    n, kernel, (o, c) = x_nhwc.shape[0], w.shape[2:], w.shape[1::-1] if flipped else w.shape[:2]
    oh, ow = (output_size(x_nhwc.shape[d], kernel[i], stride[i], padding[i]) for i, d in enumerate((1, 2)))
    dtype = np.result_type(x_nhwc.dtype, w.dtype)
    y = np.empty((n, oh, ow, o), dtype) if add_to is None else add_to
    if winograd.applies(kernel, stride, padding, c, o):
        u, tiles = winograd.filters(w, flipped), winograd.tile_count(oh, ow)
        parts = _parts(n, 16 * tiles, c, dtype.itemsize)
        if winograd.whole(tiles):   # every image's tiles, then their products a position a thread
            v = winograd.every_tile(x_nhwc, parts, tiles)
            m = workspace("all tile products", (16, n * tiles, o), dtype)
            each(lambda p: np.matmul(v[p], u[p], out=m[p]), 16)

            def product(s, out):
                winograd.outputs(m[:, s.start * tiles:s.stop * tiles], oh, ow, out)
        else:
            def product(s, out):
                v = winograd.tiles(x_nhwc[s])
                m = workspace("tile products", (16, v.shape[1], o), dtype)
                winograd.outputs(np.matmul(v, u, out=m), oh, ow, out)
    else:
        # rows (i, j, o) in the order _im2col lays out a window of dy, flipped: from channels-last w in runs of C
        weights = (w[:, :, ::-1, ::-1].transpose(2, 3, 0, 1).reshape(-1, o) if flipped else _weight_matrix(w).T)
        parts = _parts(n, oh * ow, weights.shape[0], dtype.itemsize)

        def product(s, out):
            np.matmul(_im2col(x_nhwc[s], kernel, stride, padding), weights, out=out.reshape(-1, o))

    def part(i):
        s = parts[i]   # added: made in this thread's workspace first
        out = y[s] if add_to is None else workspace("products", (s.stop - s.start, oh, ow, o), dtype)
        product(s, out)
        if bias is not None:
            out += bias
        if add_to is not None:
            add_to[s] += out
        if after is not None:
            after(i, s, y[s])
    each(part, len(parts))
    return y


def _im2col(x_nhwc, kernel, stride, padding, out=None):
    """(N*OH*OW, KH*KW*C) matrix of the padded NHWC input's windows, in this thread's workspace (or into out,
    a contiguous array of that shape, which is returned)."""
    if padding != (0, 0):
        x_nhwc = padded(x_nhwc, padding, axes=(1, 2), scratch="padded")
    win = windows(x_nhwc, kernel, stride, axes=(1, 2))      # (N, OH, OW, C, KH, KW)
    win = win.transpose(0, 1, 2, 4, 5, 3)
    cols = workspace("im2col", win.shape, x_nhwc.dtype) if out is None else out.reshape(win.shape)
    np.copyto(cols, win)
    return cols.reshape(-1, win.shape[3] * win.shape[4] * win.shape[5])


def _backward_weight(dy_nhwc, x, w, stride, padding, out=None):
    """dw = dy^T @ im2col(x), each part's product added in the parts' order (or, where Winograd applies, the
    sums of its tiles' products, winograd.weight_gradient: at 49 tiles an image or more a part of the images a
    thread, below it each position's product over every image's tiles a thread), into out (O, C, KH, KW) when
    given (returned), else into a new array of w's memory layout."""
    o, c, kh, kw = w.shape
    x_nhwc, (n, oh, ow, _) = _nhwc(x), dy_nhwc.shape
    dtype = np.result_type(dy_nhwc.dtype, x.dtype)
    dw = np.empty_like(w, dtype=dtype) if out is None else out
    tiles = winograd.tile_count(oh, ow)
    if winograd.applies((kh, kw), stride, padding, c, o):
        if winograd.whole(tiles):   # every image's tiles of x and of dy, then their products a position a thread
            parts = _parts(n, 16 * tiles, c, dtype.itemsize)
            v, g = winograd.every_tile(x_nhwc, parts, tiles), winograd.every_gradient(dy_nhwc, parts, tiles)
            du = np.empty((16, o, c), dtype)
            each(lambda p: np.matmul(g[p].T, v[p], out=du[p]), 16)
            return winograd.weight_gradient(du, dw)
        parts = _parts(n, tiles, 16 * c, dtype.itemsize)
        partial = np.empty((len(parts), 16, o, c), dtype)

        def part(i):
            s = parts[i]
            np.matmul(winograd.gradients(dy_nhwc[s]).transpose(0, 2, 1), winograd.tiles(x_nhwc[s]), out=partial[i])
        each(part, len(parts))
        return winograd.weight_gradient(np.sum(partial, axis=0), dw)   # the parts added in order
    parts = _parts(n, oh * ow, kh * kw * c, dtype.itemsize)
    if len(parts) <= 2:   # few rows (a small output): the whole window matrix, its product half the filters a thread
        return _backward_weight_by_filters(dy_nhwc, x_nhwc, parts, (kh, kw), stride, padding, dw)
    partial = np.empty((len(parts), o, kh * kw * c), dtype)

    def part(i):
        dy = dy_nhwc[parts[i]].reshape(-1, o)
        np.matmul(dy.T, _im2col(x_nhwc[parts[i]], (kh, kw), stride, padding), out=partial[i])
    each(part, len(parts))
    # the outer axis: added part by part, in order (into a channels-last dw in one contiguous pass)
    np.sum(partial.reshape(-1, o, kh, kw, c), axis=0, out=dw.transpose(0, 2, 3, 1))
    return dw


def _backward_weight_by_filters(dy_nhwc, x_nhwc, parts, kernel, stride, padding, dw):
    """dw = dy^T @ im2col(x) for a layer of few rows: the window matrix of every image (made a part of the
    images a thread), then the product for half of the filters a thread, over every row at once. Split by
    the images, the product would be two shallow ones whose (O, KH*KW*C) sums take a pass of their own, as
    large as the window matrix or larger (ResNet-18's 4 x 4 stage at batch 32: 18.9 MB for 9.4 MB of
    windows); by the filters, the step's weight gradients took 16 % less time at batch 32, 9 % at 128."""
    (n, oh, ow, o), (kh, kw), c = dy_nhwc.shape, kernel, x_nhwc.shape[3]
    dtype, per_image = np.result_type(dy_nhwc.dtype, x_nhwc.dtype), oh * ow
    cols = workspace("window matrix", (n * per_image, kh * kw * c), dtype)
    each(lambda i: _im2col(x_nhwc[parts[i]], kernel, stride, padding,
                           out=cols[parts[i].start * per_image:parts[i].stop * per_image]), len(parts))
    dy, half = dy_nhwc.reshape(-1, o), -(-o // 2)
    taps = dw.transpose(0, 2, 3, 1)   # (O, KH, KW, C): the window matrix's column order
    direct = taps.flags.c_contiguous and taps.dtype == dtype   # a channels-last dw: the product written there
    product = taps.reshape(o, -1) if direct else workspace("weight gradient", (o, kh * kw * c), dtype)
    each(lambda i: np.matmul(dy[:, i * half:(i + 1) * half].T, cols, out=product[i * half:(i + 1) * half]), 2)
    if not direct:
        np.copyto(taps, product.reshape(o, kh, kw, c))
    return dw


def _backward_data_stride1(dy_nhwc, w, padding, add_to=None, after=None):
    """dx of a stride-1 convolution: dy, padded by K-1-P, convolved with the flipped kernel (added to
    add_to, which is returned, when given)."""
    o, c, kh, kw = w.shape
    pad = (kh - 1 - padding[0], kw - 1 - padding[1])
    return _nchw(_products(dy_nhwc, w, (1, 1), pad, add_to=None if add_to is None else _nhwc(add_to),
                           after=after, flipped=True))


def _col2im(dy_nhwc, x_shape, w, stride, padding, add_to=None, after=None):
    """dx from the output gradient: the column gradient dy @ W, scattered back by the
    adjoint of _im2col (each window's cells added to the input cells they came from), a part of the
    images at a time (added to add_to, which is returned, when given)."""
    n, c, h, width = x_shape
    _, oh, ow, o = dy_nhwc.shape
    (kh, kw), (sh, sw), (ph, pw) = w.shape[2:], stride, padding
    weights = _weight_matrix(w)
    dtype = np.result_type(dy_nhwc.dtype, w.dtype)
    dx = np.empty((n, h, width, c), dtype) if add_to is None else None
    parts = _parts(n, oh * ow, kh * kw * c, dtype.itemsize)

    def part(p):
        s = parts[p]
        m = s.stop - s.start
        dcols = workspace("im2col", (m, oh, ow, kh, kw, c), dtype)
        np.matmul(dy_nhwc[s].reshape(-1, o), weights, out=dcols.reshape(m * oh * ow, -1))
        dxp = workspace("padded", (m, h + 2 * ph, width + 2 * pw, c), dtype)
        dxp.fill(0)
        # Windows overlap when the kernel is larger than the stride, but at one kernel
        # position they all touch distinct cells, so a strided += per position is exact.
        for i in range(kh):
            for j in range(kw):
                dxp[:, i:i + sh * oh:sh, j:j + sw * ow:sw, :] += dcols[:, :, :, i, j, :]
        if add_to is None:
            dx[s] = dxp[:, ph:ph + h, pw:pw + width, :]
        else:
            _nhwc(add_to)[s] += dxp[:, ph:ph + h, pw:pw + width, :]
        if after is not None:
            after(p, s, (dx if add_to is None else _nhwc(add_to))[s])
    each(part, len(parts))
    return _nchw(dx) if add_to is None else add_to


def _weight_matrix(w):
    """(O, KH*KW*C): the weight with columns in the order _im2col lays out a window."""
    return w.transpose(0, 2, 3, 1).reshape(w.shape[0], -1)


def _nhwc(a):
    """The (N, H, W, C) view of an (N, C, H, W) array: contiguous when a is channels-last."""
    return a.transpose(0, 2, 3, 1)


def _nchw(a):
    """The (N, C, H, W) view of an (N, H, W, C) array: a channels-last result."""
    return a.transpose(0, 3, 1, 2)
