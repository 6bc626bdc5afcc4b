"""Naive float64 references for every op of the kernel contract (see kernels/cpu/__init__.py).

Each function has the name and signature of the kernel it checks and follows the
definition as literally as it can: loops over output positions and kernel offsets, and
backward passes written as the chain rule, step by step. They are slow and meant for the
small shapes of the tests. They were written without reading any backend, so that a test
compares two independent codes; they cast their inputs to float64 and return float64, so a
float32 kernel is compared against the exact answer for its own inputs.
"""
import numpy as np


def _f64(*arrays):
    return [None if a is None else np.asarray(a, dtype=np.float64) for a in arrays]


def _pair(v):
    return (v, v) if np.isscalar(v) else tuple(v)


def _out_size(size, kernel, stride, padding):
    return (size + 2 * padding - kernel) // stride + 1


def _pad_hw(x, ph, pw, value):
    return np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=value)


# ---- convolution -------------------------------------------------------------------------

def conv2d_forward(x, w, b, stride, padding):
    x, w, b = _f64(x, w, b)
    (sh, sw), (ph, pw) = _pair(stride), _pair(padding)
    n, c, h, wd = x.shape
    o, wc, kh, kw = w.shape
    if wc != c:
        raise ValueError(f"input has {c} channels, weight expects {wc}")
    oh, ow = _out_size(h, kh, sh, ph), _out_size(wd, kw, sw, pw)
    xp = _pad_hw(x, ph, pw, 0.0)
    y = np.zeros((n, o, oh, ow))
    for i in range(oh):
        for j in range(ow):
            patch = xp[:, :, i * sh:i * sh + kh, j * sw:j * sw + kw]
            y[:, :, i, j] = np.einsum("nckl,ockl->no", patch, w)
    if b is not None:
        y += b[None, :, None, None]
    return y


def conv2d_backward(dy, x, w, stride, padding):
    dy, x, w = _f64(dy, x, w)
    (sh, sw), (ph, pw) = _pair(stride), _pair(padding)
    kh, kw = w.shape[2:]
    xp = _pad_hw(x, ph, pw, 0.0)
    dxp = np.zeros_like(xp)
    dw = np.zeros_like(w)
    # Each output position read one input window through w: send its gradient back there.
    for i in range(dy.shape[2]):
        for j in range(dy.shape[3]):
            window = (slice(None), slice(None), slice(i * sh, i * sh + kh), slice(j * sw, j * sw + kw))
            g = dy[:, :, i, j]
            dxp[window] += np.einsum("no,ockl->nckl", g, w)
            dw += np.einsum("no,nckl->ockl", g, xp[window])
    dx = dxp[:, :, ph:ph + x.shape[2], pw:pw + x.shape[3]]
    db = dy.sum(axis=(0, 2, 3))
    return dx, dw, db


# ---- batch normalisation -----------------------------------------------------------------

def _per_channel(v):
    return v[None, :, None, None]


def batch_norm_forward(x, gamma, beta, eps):
    x, gamma, beta = _f64(x, gamma, beta)
    mean = x.mean(axis=(0, 2, 3))
    var = ((x - _per_channel(mean)) ** 2).mean(axis=(0, 2, 3))
    invstd = 1.0 / np.sqrt(var + eps)
    xhat = (x - _per_channel(mean)) * _per_channel(invstd)
    return _per_channel(gamma) * xhat + _per_channel(beta), mean, invstd


def batch_norm_backward(dy, x, gamma, mean, invstd):
    dy, x, gamma, mean, invstd = _f64(dy, x, gamma, mean, invstd)
    m = x.shape[0] * x.shape[2] * x.shape[3]
    axes = (0, 2, 3)
    centered = x - _per_channel(mean)
    xhat = centered * _per_channel(invstd)
    dgamma = (dy * xhat).sum(axis=axes)
    dbeta = dy.sum(axis=axes)
    # Chain rule through y = gamma * (x - mean) * (var + eps)^-1/2 + beta, with mean and var
    # both functions of x: d invstd / d var = -invstd^3 / 2, d var / d x = 2 (x - mean) / m.
    dxhat = dy * _per_channel(gamma)
    dvar = (dxhat * centered).sum(axis=axes) * -0.5 * invstd ** 3
    dmean = -(dxhat * _per_channel(invstd)).sum(axis=axes) \
        + dvar * (-2.0 * centered).sum(axis=axes) / m
    dx = dxhat * _per_channel(invstd) + _per_channel(dvar) * 2.0 * centered / m \
        + _per_channel(dmean) / m
    return dx, dgamma, dbeta


def batch_norm_sums(x, shift):
    x, shift = _f64(x, shift)
    d = x - _per_channel(shift)
    return np.stack([d.sum(axis=(0, 2, 3)), (d * d).sum(axis=(0, 2, 3))])


def batch_norm_backward_sums(dy, x, mean, invstd):
    dy, x, mean, invstd = _f64(dy, x, mean, invstd)
    xhat = (x - _per_channel(mean)) * _per_channel(invstd)
    return np.stack([(dy * xhat).sum(axis=(0, 2, 3)), dy.sum(axis=(0, 2, 3))])


def batch_norm_inference(x, gamma, beta, running_mean, running_var, eps):
    x, gamma, beta, running_mean, running_var = _f64(x, gamma, beta, running_mean, running_var)
    xhat = (x - _per_channel(running_mean)) / np.sqrt(_per_channel(running_var) + eps)
    return _per_channel(gamma) * xhat + _per_channel(beta)


def batch_norm_inference_backward(dy, x, gamma, running_mean, running_var, eps):
    dy, x, gamma, running_mean, running_var = _f64(dy, x, gamma, running_mean, running_var)
    scale = 1.0 / np.sqrt(running_var + eps)
    xhat = (x - _per_channel(running_mean)) * _per_channel(scale)
    dx = dy * _per_channel(gamma * scale)
    return dx, (dy * xhat).sum(axis=(0, 2, 3)), dy.sum(axis=(0, 2, 3))


# ---- element-wise ------------------------------------------------------------------------

def add(a, b, out=None):
    result = np.empty(np.shape(a))
    for i in np.ndindex(result.shape):
        result[i] = float(a[i]) + float(b[i])
    if out is not None:
        out[...] = result
    return result


def relu_forward(x):
    (x,) = _f64(x)
    return np.where(x > 0, x, 0.0)


def relu_backward(dy, y):
    dy, y = _f64(dy, y)
    return np.where(y > 0, dy, 0.0)


def add_relu_forward(a, b):
    a, b = _f64(a, b)
    return relu_forward(a + b)


# ---- pooling -----------------------------------------------------------------------------

def max_pool2d_forward(x, kernel_size, stride, padding):
    (x,) = _f64(x)
    (kh, kw), (sh, sw), (ph, pw) = _pair(kernel_size), _pair(stride), _pair(padding)
    n, c, h, wd = x.shape
    oh, ow = _out_size(h, kh, sh, ph), _out_size(wd, kw, sw, pw)
    xp = _pad_hw(x, ph, pw, -np.inf)
    y = np.full((n, c, oh, ow), -np.inf)
    argmax = np.full((n, c, oh, ow), -1, dtype=np.int64)
    for i in range(oh):
        for j in range(ow):
            # Window in row-major order; a strictly greater value replaces, so ties keep the first.
            for di in range(kh):
                for dj in range(kw):
                    hp, wp = i * sh + di, j * sw + dj
                    v = xp[:, :, hp, wp]
                    better = v > y[:, :, i, j]
                    y[:, :, i, j] = np.where(better, v, y[:, :, i, j])
                    argmax[:, :, i, j] = np.where(better, (hp - ph) * wd + (wp - pw), argmax[:, :, i, j])
    return y, argmax


def max_pool2d_backward(dy, argmax, x_shape):
    (dy,) = _f64(dy)
    n, c, h, wd = x_shape
    dx = np.zeros((n, c, h * wd))
    for ni in range(n):
        for ci in range(c):
            for i in range(dy.shape[2]):
                for j in range(dy.shape[3]):
                    dx[ni, ci, argmax[ni, ci, i, j]] += dy[ni, ci, i, j]
    return dx.reshape(x_shape)


def global_avg_pool_forward(x):
    (x,) = _f64(x)
    return x.sum(axis=(2, 3)) / (x.shape[2] * x.shape[3])


def global_avg_pool_backward(dy, x_shape):
    (dy,) = _f64(dy)
    n, c, h, w = x_shape
    return np.broadcast_to(dy[:, :, None, None] / (h * w), (n, c, h, w)).copy()


# ---- linear ------------------------------------------------------------------------------

def linear_forward(x, w, b):
    x, w, b = _f64(x, w, b)
    y = np.einsum("ni,oi->no", x, w)
    return y if b is None else y + b


def linear_backward(dy, x, w):
    dy, x, w = _f64(dy, x, w)
    return np.einsum("no,oi->ni", dy, w), np.einsum("no,ni->oi", dy, x), dy.sum(axis=0)


# ---- loss --------------------------------------------------------------------------------

def softmax_cross_entropy_forward(logits, labels):
    (logits,) = _f64(logits)
    n = logits.shape[0]
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    log_probs = shifted - log_norm
    loss = -np.mean([log_probs[i, labels[i]] for i in range(n)])
    return np.asarray(loss), np.exp(log_probs)


def softmax_cross_entropy_backward(dloss, probs, labels):
    dloss, probs = _f64(dloss, probs)
    n = probs.shape[0]
    dlogits = probs.copy()
    for i in range(n):
        dlogits[i, labels[i]] -= 1.0
    return dlogits * dloss / n


# ---- optimiser ---------------------------------------------------------------------------

def sgd_update(param, grad, velocity, lr, momentum, weight_decay):
    """In place, like the kernel; computed in float64 and written back in the arrays' dtype.
    With momentum 0 the velocity plays no part, as in PyTorch, which keeps no buffer then."""
    p, g, v = _f64(param, grad, velocity)
    g = g + weight_decay * p
    if momentum == 0:
        step = g
    else:
        step = momentum * v + g
        velocity[...] = step
    param[...] = p - lr * step


# ---- batch-norm running statistics, accuracy and input conversion --------------------------

def count_correct(logits, labels):
    hits = 0
    for row, label in zip(logits, labels):
        best = 0
        for k in range(1, len(row)):
            if row[k] > row[best]:
                best = k
        hits += best == label
    return np.int64(hits)


def batch_norm_update_running(running_mean, running_var, mean, invstd, count, momentum, eps):
    """In place: PyTorch's running update, the variance made unbiased (Bessel's correction)."""
    biased = 1.0 / np.asarray(invstd, np.float64) ** 2 - eps
    running_mean[...] = (1 - momentum) * running_mean + momentum * np.asarray(mean, np.float64)
    running_var[...] = (1 - momentum) * running_var + momentum * biased * count / (count - 1)


def images_to_float(images):
    out = np.empty((images.shape[0], 1) + images.shape[1:])
    for i in range(images.shape[0]):
        out[i, 0] = images[i] / 255.0
    return out
