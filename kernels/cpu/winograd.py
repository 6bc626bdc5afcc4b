"""3x3, stride-1, padding-1 convolutions by Winograd's minimal filtering F(2x2, 3x3) (Lavin and Gray, 2016).

A 2x2 tile of the output is four windows of a 4x4 tile of the input, 36 multiplies a channel pair the
direct way; F(2x2, 3x3) makes it 16. The input tile is transformed (V = B^T d B, additions only), the
filter once a call (U = G g G^T), and the 16 positions of the tiles multiply apart: 16 matrix products
(tiles x C) @ (C x O), 2.25x fewer FLOPs than the window matrix's product (less the tiles that overhang
an odd output). The output tile is A^T M A, additions only again. The backward runs on the same tiles:
dx is the forward of dy with the kernel flipped and its channel axes swapped, and the weight gradient is
the forward's transposed, dU = sum over tiles of (A dY A^T) * V at each position, dW = G^T dU G.

The tiles start every two pixels of the input padded by one (by two at the far side of an odd size, where
the last tile overhangs: its zeros add nothing, its outputs are dropped). Every transform is a few NumPy
passes over strided views of a part of the images (kernels/cpu/conv.py runs the parts), in this thread's
workspace: the tiles of a part are four times its input, a few megabytes, and stay near the core.
"""
import numpy as np

from ._parallel import each
from ._util import workspace

# F(2x2, 3x3): y = A^T [(G g G^T) * (B^T d B)] A
_G = np.array([[1, 0, 0], [.5, .5, .5], [.5, -.5, .5], [0, 0, 1]])
_GG = np.kron(_G, _G)                       # (16, 9): position (a, b) from tap (i, j)
_GG_FLIPPED = np.ascontiguousarray(_GG[:, ::-1])
# G^T, its last column negated: the output gradient's transform below leaves that sign out
_GT_SIGNED = np.array([[1, .5, .5, 0], [0, .5, -.5, 0], [0, .5, .5, -1]])
_GG_SIGNED_T = np.kron(_GT_SIGNED, _GT_SIGNED)   # (9, 16): tap (i, j) from position (a, b)
# a part of the filters a thread, of about this many bytes of their 16 positions: a smaller transform on one
# thread (the threads' hand-over cost more than it: 35 -> 21 ms a batch-32 step with four parts always)
_FILTER_PART_BYTES = 2 << 20

# measured on the step (2 cores, OpenBLAS): below this many channels on either side the 16 products are too
# thin for the BLAS to pay for the transforms (width 16: 12 % slower at 16 channels, 6 % at 32); below this
# many tiles an image, a part's products too short (and its weight gradient's too shallow): every image's tiles
# first, then a position's product over all of them a thread (see whole)
_LEAST_CHANNELS = 64
_PART_TILES = 49


def applies(kernel, stride, padding, channels, outputs):
    """Whether a convolution of this geometry runs here: a 3x3 kernel at stride 1, padding 1, and channel counts
    where the tiles' products measured faster than the window matrix's."""
    return (tuple(kernel) == (3, 3) and tuple(stride) == (1, 1) and tuple(padding) == (1, 1)
            and min(channels, outputs) >= _LEAST_CHANNELS)


def tile_count(h, w):
    """The 2x2 output tiles of an h x w output (and input)."""
    return -(-h // 2) * -(-w // 2)


def filters(w, flipped=False):
    """U = G g G^T of each filter g of an (O, C, 3, 3) kernel (g[::-1, ::-1] if flipped), as the products'
    right-hand sides: (16, C, O), or flipped (16, O, C) (the kernel of dx's convolution of dy), strided views
    of (O, 16, C) memory that the BLAS reads as they are. Each filter's 16 from its 9 taps in one small
    product (channels-last weights are read where they lie), a part of the filters a thread."""
    o, c = w.shape[:2]
    taps = w.transpose(0, 2, 3, 1).reshape(o, 9, c)
    gg = (_GG_FLIPPED if flipped else _GG).astype(w.dtype)
    u = _per_filter(gg, taps, np.empty((o, 16, c), w.dtype))
    return u.transpose(1, 0, 2) if flipped else u.transpose(1, 2, 0)


def weight_gradient(du, out):
    """dW = G^T dU G from (16, O, C) sums of the tiles' products (with gradients' signs as `gradients` leaves
    them), written into out (O, C, 3, 3), which is returned: each filter's 9 taps from its 16 in one small
    product, as filters."""
    o, c = du.shape[1:]
    gg = _GG_SIGNED_T.astype(du.dtype)
    taps = _per_filter(gg, du.transpose(1, 0, 2), np.empty((o, 9, c), du.dtype))
    np.copyto(out.transpose(0, 2, 3, 1), taps.reshape(o, 3, 3, c))
    return out


def _per_filter(gg, a, out):
    """out[f] = gg @ a[f] for each filter f of a's (O, k, C), parts of _FILTER_PART_BYTES a thread; out returned."""
    per = max(1, _FILTER_PART_BYTES // (16 * a.shape[2] * a.itemsize))
    each(lambda i: np.matmul(gg, a[i * per:(i + 1) * per], out=out[i * per:(i + 1) * per]), -(-a.shape[0] // per))
    return out


def tiles(x, out=None):
    """V = B^T d B of every 4x4 input tile of an (m, H, W, C) part, as (16, m*TH*TW, C): into out when given
    (rows of a contiguous whole's: see every), else in this thread's workspace "tiles"."""
    m, h, w, c = x.shape
    th, tw = -(-h // 2), -(-w // 2)
    # padded by one (two past an odd side), its even and odd columns apart: p[:, r, q, j] is column 2j + q, so
    # each of a tile's four columns below is a contiguous run of tiles (of TW*C values)
    p = workspace("padded", (m, 2 * th + 2, 2, tw + 1, c), x.dtype)
    p[:, 0] = 0
    p[:, h + 1:] = 0
    p[:, 1:h + 1, 0, 0] = 0
    p[:, 1:h + 1, 0, 1 + w // 2:] = 0
    p[:, 1:h + 1, 1, -(-w // 2):] = 0
    p[:, 1:h + 1, 1, :-(-w // 2)] = x[:, :, 0::2]
    p[:, 1:h + 1, 0, 1:1 + w // 2] = x[:, :, 1::2]
    # rows: B^T = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]] on the tile rows at 2t .. 2t+3
    r = workspace("tile rows", (4, m, th, 2, tw + 1, c), x.dtype)
    _transformed([p[:, k:k + 2 * th:2] for k in range(4)], r)
    # then the columns, alike: column 2t + k is (k % 2, t + k // 2)
    shape = (4, 4, m, th, tw, c)
    v = workspace("tiles", shape, x.dtype) if out is None else out.reshape(shape)
    _transformed([r[:, :, :, k % 2, k // 2:k // 2 + tw] for k in range(4)], v.transpose(1, 0, 2, 3, 4, 5))
    return v.reshape(16, m * th * tw, c)


def _transformed(d, out):
    """B^T's four rows of d[0..3] into out[0..3]."""
    np.subtract(d[0], d[2], out=out[0])
    np.add(d[1], d[2], out=out[1])
    np.subtract(d[2], d[1], out=out[2])
    np.subtract(d[1], d[3], out=out[3])


def gradients(dy, out=None):
    """A dY A^T of every 2x2 tile of an (m, H, W, O) output gradient part, as (16, m*TH*TW, O): into out when
    given (rows of a whole's: see every_gradient), else in this thread's workspace "tile gradients"; A's last
    row is -[0, 1], and its sign is left to weight_gradient (_GT_SIGNED, in _GG_SIGNED_T), so this is additions
    only."""
    m, h, w, o = dy.shape
    th, tw = -(-h // 2), -(-w // 2)
    if (h, w) != (2 * th, 2 * tw):   # an odd side: the overhanging tiles' missing cells are zeros
        full = workspace("padded", (m, 2 * th, 2 * tw, o), dy.dtype)
        full[:, h:] = 0
        full[:, :h, w:] = 0
        full[:, :h, :w] = dy
        dy = full
    r = workspace("tile rows", (4, m, th, 2 * tw, o), dy.dtype)
    _spread([dy[:, 0::2], dy[:, 1::2]], r)
    shape = (4, 4, m, th, tw, o)
    g = workspace("tile gradients", shape, dy.dtype) if out is None else out.reshape(shape)
    _spread([r[:, :, :, 0::2], r[:, :, :, 1::2]], g.transpose(1, 0, 2, 3, 4, 5))
    return g.reshape(16, m * th * tw, o)


def every_tile(x, parts, per_image):
    """The tiles of all of x's (n, H, W, C) images, as (16, n*TH*TW, C) in this thread's workspace "all tiles", a
    part of the images (slices; ``per_image`` tiles an image) a thread: for a layer of few tiles an image, whose
    products run a position a thread over every image's tiles (see whole)."""
    return _every(tiles, x, parts, per_image, "all tiles")


def every_gradient(dy, parts, per_image):
    """The gradients' tiles (see gradients) of all of dy's (n, H, W, O) images, as every_tile makes x's, in this
    thread's workspace "all tile gradients": for the weight gradient of a layer of few tiles an image."""
    return _every(gradients, dy, parts, per_image, "all tile gradients")


def _every(transform, a, parts, per_image, name):
    """transform of each part of a's images into the rows of one (16, n*per_image, a's channels) workspace."""
    out = workspace(name, (16, a.shape[0] * per_image, a.shape[3]), a.dtype)
    each(lambda i: transform(a[parts[i]], out[:, parts[i].start * per_image:parts[i].stop * per_image]), len(parts))
    return out


def whole(tiles):
    """Whether a layer of this many tiles an image runs its products a position a thread over every image's
    tiles (else a part of the images a thread): where a part's products would be too short for the BLAS."""
    return tiles < _PART_TILES


def _spread(y, out):
    """A's four rows [1, 0], [1, 1], [1, -1], [0, (-)1] of y[0..1] into out[0..3]."""
    np.copyto(out[0], y[0])
    np.add(y[0], y[1], out=out[1])
    np.subtract(y[0], y[1], out=out[2])
    np.copyto(out[3], y[1])


def outputs(m, h, w, out):
    """Y = A^T M A of the products m (16, n*TH*TW, O) into out, an (n, h, w, O) array."""
    n, o = out.shape[0], m.shape[2]
    th, tw = -(-h // 2), -(-w // 2)
    m = m.reshape(4, 4, n, th, tw, o)
    # rows: A^T = [[1, 1, 1, 0], [0, 1, -1, -1]], then the columns, into contiguous runs of tiles
    t = workspace("tile rows", (2, 4, n, th, tw, o), m.dtype)
    _gathered(m, t)
    y = workspace("tile outputs", (2, 2, n, th, tw, o), m.dtype)
    for a in range(2):
        _gathered(t[a], y[a])
    y = y.transpose(2, 3, 0, 4, 1, 5)   # (n, th, 2, tw, 2, o): the output's order
    if (h, w) == (2 * th, 2 * tw):
        np.copyto(out.reshape(y.shape), y)
    else:   # the overhanging tiles' cells dropped
        full = workspace("padded", y.shape, m.dtype)
        np.copyto(full, y)
        np.copyto(out, full.reshape(n, 2 * th, 2 * tw, o)[:, :h, :w])
    return out


def _gathered(m, out):
    """A^T's two rows of m[0..3] into out[0..1]."""
    np.add(m[0], m[1], out=out[0])
    out[0] += m[2]
    np.subtract(m[1], m[2], out=out[1])
    out[1] -= m[3]
