"""Hopper's instructions on the emulator: kernels/cuda/sm90.cuh's wrappers (mbarrier, TMA, wgmma, setmaxnreg) run by
kernels/emu (README.md there, "Hopper"), through the kernels of tests/emu_kernels/sm90.cu.

- The numbers, in both thread orders, against NumPy models written from the PTX ISA: wgmma m64n64k16 and
  m64n128k16 of fresh random bfloat16 operands stored 128-byte swizzled, several k steps chained, against float64
  rounded to float32 once a wgmma, fragment by fragment (sm90.cuh's accumulator layout); TMA loads of 2-D and 4-D
  boxes partly outside their tensors (zeros there), with and without the 128-byte swizzle, against the bytes
  shared memory should hold; a pipeline of plain loads and a warp-specialised GEMM (a producer's TMA loads, two
  consumer warpgroups' wgmmas, full and empty barriers over 4 stages and 2 phases), in the two ways a consumer may
  release its stage.
- Each misuse a GPU punishes (a hang or a wrong result, never an error), planted beside its correct twin, refused by
  name, naming the check and the line: a wait for a phase that never completes, a TMA stage read before its
  barrier's phase, accumulators used or written before wgmma_wait, a wgmma without wgmma_fence, a warpgroup whose
  threads reach different wgmmas, operands stored without fence_proxy_async, a stage released before the wgmma_wait
  that retires the wgmmas reading it, the mbarrier's own misuses, a TMA destination misaligned or too small, and
  tensor maps cuTensorMapEncodeTiled refuses.
- A tensor map through a simulated GPU's launch (cupy.tensor_map of kernels/simulated).
- NVRTC compiles the kernels for sm_90a; marked gpu, on a GPU of compute capability 9.0, the numbers above (wgmma's
  fragments and descriptor layouts, K-major and MN-major, TMA's boxes, the warp-specialised GEMM) from the real
  instructions, held to the same NumPy models.
"""
import functools
import re
from pathlib import Path

import numpy as np
import pytest

from helpers import rng
from kernels import bfloat16, emu

ROOT = Path(__file__).resolve().parents[1]
SOURCE = Path(__file__).parent / "emu_kernels" / "sm90.cu"
OPTIONS = (f"-I{ROOT / 'kernels' / 'cuda'}",)


@functools.cache
def module(level="full"):
    with emu.sanitizer(level):
        return emu.RawModule(code=SOURCE.read_text(), options=OPTIONS)


def kernel(name, level="full"):
    function = module(level).get_function(name)
    function.max_dynamic_shared_size_bytes = 160 * 1024
    return function


def launch(name, grid, block, *args, shared_mem=0, level="full"):
    with emu.sanitizer(level):
        kernel(name, level)(grid, block, args, shared_mem=shared_mem)


def refused(name, grid, block, *args, shared_mem=0):
    """The message of a launch the emulator refuses."""
    with pytest.raises(emu.KernelError) as error:
        launch(name, grid, block, *args, shared_mem=shared_mem)
    return str(error.value)


def line_of(text):
    """`:N`, N the line of sm90.cu that holds `text` (the module's copy of the file has other paths)."""
    return f":{next(i for i, line in enumerate(SOURCE.read_text().splitlines(), 1) if text in line)}\\b"


def bf16(shape):
    return rng().standard_normal(shape).astype(bfloat16)


# ---- NumPy models ------------------------------------------------------------------------------------------

def swizzled(data):
    """The bytes of `data` as the 128-byte swizzle places them from a 1024-byte aligned address: 16-byte chunk j of
    each 128-byte row r at j ^ (r % 8) (address bits 4-6 XOR bits 7-9)."""
    flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    assert flat.size % 16 == 0
    offsets = np.arange(0, flat.size, 16)
    out = np.empty_like(flat)
    out.reshape(-1, 16)[(offsets ^ ((offsets >> 7 & 7) << 4)) // 16] = flat.reshape(-1, 16)
    return out


def operand_tiles(m):
    """A K-major operand (rows, k) as tiles of 128-byte rows (64 k of bf16, 32 of float32), each swizzled: as
    wgmma_stored stores them."""
    rows, k = m.shape
    per = 128 // m.dtype.itemsize
    return np.concatenate([swizzled(m[:, per * t:per * t + per]) for t in range(k // per)]).view(np.uint32)


def tf32(m):
    """What the tensor cores read of float32 m as TF32: its low 13 bits ignored."""
    return (m.view(np.uint32) & np.uint32(0xffffe000)).view(np.float32)


def chained_product(a, b):
    """d (64|128, N) of wgmma steps (k16 of bf16; k8 of float32, read as TF32) over the k of a (M, K) and b (N, K):
    each step's products summed exactly with d and rounded to float32 once, as a wgmma does."""
    step = 8 if a.dtype == np.float32 else 16
    if step == 8:
        a, b = tf32(a), tf32(b)
    d = np.zeros((a.shape[0], b.shape[0]))
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    for s in range(a.shape[1] // step):
        k = slice(step * s, step * s + step)
        d = (d + a64[:, k] @ b64[:, k].T).astype(np.float32).astype(np.float64)
    return d.astype(np.float32)


def fragments(d):
    """(128, N / 2): what each thread of a warpgroup holds of d (64, N): thread t (warp w, lane l) d[4j + i] =
    element (16 w + l / 4 + 8 (i / 2), 8 j + 2 (l % 4) + i % 2)."""
    n = d.shape[1]
    t, j, i = np.meshgrid(np.arange(128), np.arange(n // 8), np.arange(4), indexing="ij")
    w, lane = t // 32, t % 32
    return d[16 * w + lane // 4 + 8 * (i // 2), 8 * j + 2 * (lane % 4) + i % 2].reshape(128, n // 2)


def tma_box(array, box, start):
    """The box of `array` at `start` (NumPy's axis order), zeros outside the array."""
    out = np.zeros(box, array.dtype)
    inside = tuple(slice(max(s, 0), min(s + b, n)) for s, b, n in zip(start, box, array.shape))
    if all(s.start < s.stop for s in inside):
        out[tuple(slice(s.start - st, s.stop - st) for s, st in zip(inside, start))] = array[inside]
    return out


def shared_bytes(array, box, start, swizzle):
    box_bytes = np.ascontiguousarray(tma_box(array, box, start)).reshape(-1).view(np.uint8)
    return swizzled(box_bytes) if swizzle else box_bytes


# ---- wgmma ---------------------------------------------------------------------------------------------------

def wgmma(n, a, b, mode=0):
    """wgmma_stored's accumulators: of wgmma_bf16 for bfloat16 a and b, of wgmma_tf32 for float32 ones."""
    out = np.full(128 * n // 2, np.nan, np.float32)
    tiles = a.shape[1] * a.dtype.itemsize // 128
    launch(f"wgmma_{'tf32_' * (a.dtype == np.float32)}n{n}", (1,), (128,), operand_tiles(a), operand_tiles(b), out,
           np.int32(tiles), np.int32(mode), shared_mem=tiles * (64 + n) * 128)
    return out.reshape(128, n // 2)


@pytest.mark.parametrize("n", [64, 128])
@pytest.mark.parametrize("tiles", [1, 2])
def test_wgmma_matches_a_float64_model_of_its_fragments(order, n, tiles):
    """4 or 8 wgmma k16 steps chained on one accumulator, from operands the threads stored swizzled (and fenced)."""
    a, b = bf16((64, 64 * tiles)), bf16((n, 64 * tiles))
    np.testing.assert_array_equal(wgmma(n, a, b), fragments(chained_product(a, b)))


@pytest.mark.parametrize("n", [64, 128])
@pytest.mark.parametrize("tiles", [1, 2])
def test_wgmma_tf32_matches_a_float64_model_of_its_fragments(order, n, tiles):
    """wgmma_tf32: 4 or 8 k8 steps of float32 operands read as TF32 (their low 13 bits ignored): the model's
    truncation matters (the values' low bits are random), and rounding them instead would be another result."""
    g = rng()
    a, b = (g.standard_normal(shape).astype(np.float32) for shape in ((64, 32 * tiles), (n, 32 * tiles)))
    got = wgmma(n, a, b)
    np.testing.assert_array_equal(got, fragments(chained_product(a, b)))
    assert not np.array_equal(got, fragments(chained_product(tf32(a + np.float32(2.0**-11) * np.abs(a)), b)))


def test_wgmma_model_would_see_a_wrong_layout():
    """The model is not blind: a transposed operand or a dropped swizzle gives other numbers."""
    a, b = bf16((64, 64)), bf16((64, 64))
    expected = fragments(chained_product(a, b))
    assert not np.array_equal(wgmma(64, a, b), fragments(chained_product(a, b[::-1].copy())))
    unswizzled = np.concatenate([np.ascontiguousarray(a).view(np.uint8).reshape(-1)]).view(np.uint32)
    out = np.full(128 * 32, np.nan, np.float32)
    launch("wgmma_n64", (1,), (128,), unswizzled, operand_tiles(b), out, np.int32(1), np.int32(0), shared_mem=16384)
    assert not np.array_equal(out.reshape(128, 32), expected)


def layout(m, mode, lbo, sbo):
    """The bytes of a K-major operand m (rows, 16) in descriptor layout `mode` (CUTLASS's canonical GMMA K-major
    layouts, in 16-byte chunks: none, ((8, n), 2):((1, SBO), LBO); the swizzles of 128, 64, 32 bytes,
    ((8, n), 2):((W, SBO), 1) with W 8, 4, 2 and address bits 4.. XOR bits 7.. (3, 2, 1 of them))."""
    pitch, bits = {0: (16, 0), 1: (128, 3), 2: (64, 2), 3: (32, 1)}[mode]
    rows = m.shape[0]
    r, chunk = np.meshgrid(np.arange(rows), np.arange(2), indexing="ij")
    address = r // 8 * sbo + r % 8 * pitch + chunk * (lbo if mode == 0 else 16)
    address ^= (address >> 7 & (1 << bits) - 1) << 4
    out = np.zeros(-(-(address.max() + 16) // 1024) * 1024, np.uint8)
    source = np.ascontiguousarray(m).view(np.uint8).reshape(rows, 2, 16)
    for rr in range(rows):
        for c in range(2):
            out[address[rr, c]:address[rr, c] + 16] = source[rr, c]
    return out


@pytest.mark.parametrize("mode, lbo, sbo", [(0, 128, 256), (0, 1024, 128), (1, 16, 1024), (2, 16, 512), (3, 16, 256),
                                            (1, 16, 2048)])
def test_wgmma_reads_each_layout_a_descriptor_can_name(order, mode, lbo, sbo):
    """No swizzle (8 x 16-byte core matrices, LBO apart along k, SBO along the rows) and the three swizzles."""
    a, b = bf16((64, 16)), bf16((64, 16))
    sa, sb = layout(a, mode, lbo, sbo), layout(b, mode, lbo, sbo)
    out = np.full(128 * 32, np.nan, np.float32)
    launch("wgmma_layout", (1,), (128,), sa.view(np.uint32), sb.view(np.uint32), out, np.int32(sa.size),
           np.int32(sb.size), np.int32(mode), np.int32(lbo), np.int32(sbo), shared_mem=sa.size + sb.size)
    np.testing.assert_array_equal(out.reshape(128, 32), fragments(chained_product(a, b)))


def mn_layout(m, lbo, sbo):
    """The bytes of an MN-major operand m (rows, 16 k), 128-byte swizzled (CUTLASS's Layout_MN_SW128_Atom): element
    (row, k) at (row / 64) LBO + (k / 8) SBO + (k % 8) 128 + (row % 64) 2, address bits 4-6 XOR bits 7-9."""
    rows = m.shape[0]
    row, k = np.meshgrid(np.arange(rows), np.arange(16), indexing="ij")
    address = row // 64 * lbo + k // 8 * sbo + k % 8 * 128 + row % 64 * 2
    address ^= (address >> 7 & 7) << 4
    out = np.zeros(-(-(address.max() + 2) // 1024) * 1024, np.uint8)
    source = np.ascontiguousarray(m).view(np.uint8).reshape(rows, 16, 2)
    out[address[..., None] + np.arange(2)] = source
    return out


def wgmma_mn(a, b, lbo, sbo):
    sa, sb = mn_layout(a, lbo, sbo), mn_layout(b, lbo, sbo)
    out = np.full(128 * 64, np.nan, np.float32)
    launch("wgmma_mn_major", (1,), (128,), sa.view(np.uint32), sb.view(np.uint32), out, np.int32(sa.size),
           np.int32(sb.size), np.int32(lbo), np.int32(sbo), shared_mem=sa.size + sb.size)
    return out.reshape(128, 64)


@pytest.mark.parametrize("lbo, sbo", [(8192, 1024), (2048, 4096)])
def test_wgmma_reads_mn_major_operands(order, lbo, sbo):
    """Both operands transposed (lines of 64 rows at one k, the next 64 rows of B LBO further): conv_sm90's
    backward-weight, whose stages hold a pixel's channels along the rows."""
    a, b = bf16((64, 16)), bf16((128, 16))
    np.testing.assert_array_equal(wgmma_mn(a, b, lbo, sbo), fragments(chained_product(a, b)))


def test_the_mn_major_model_would_see_a_wrong_layout():
    """Not blind: B's two halves of 64 rows exchanged, or its k read as rows, give other numbers."""
    a, b = bf16((64, 16)), bf16((128, 16))
    ours = wgmma_mn(a, b, 8192, 1024)
    assert not np.array_equal(ours, fragments(chained_product(a, np.concatenate([b[64:], b[:64]]))))
    sa, sb = mn_layout(a, 8192, 1024), layout(b, 1, 16, 1024)   # B laid out K-major, read as MN-major
    out = np.full(128 * 64, np.nan, np.float32)
    launch("wgmma_mn_major", (1,), (128,), sa.view(np.uint32), np.resize(sb, 16384).view(np.uint32), out,
           np.int32(sa.size), np.int32(16384), np.int32(8192), np.int32(1024), shared_mem=sa.size + 16384)
    assert not np.array_equal(out.reshape(128, 64), ours)


@pytest.mark.parametrize("mode, message", [
    (1, r"initcheck: writes an undefined value to global memory at 0x[0-9a-f]+ at \S+{use}: the accumulators of the "
        r"wgmma_bf16<64> at \S+{wgmma}, undefined until the wgmma_wait that retires it"),
    (4, r"initcheck: uses an undefined value in a comparison at \S+{compare}: the accumulators of the "
        r"wgmma_bf16<64> at \S+{wgmma}"),
    (2, r"racecheck: d\[1\], an accumulator of the wgmma at \S+{wgmma}, written before its wgmma.wait_group \(the "
        r"wgmma_wait<0> at \S+{wait}\)"),
])
def test_accumulators_used_or_written_before_wgmma_wait_are_refused(order, mode, message):
    a, b = bf16((64, 64)), bf16((64, 64))
    expected = message.format(wgmma=line_of("the wgmma of wgmma_stored"), use=line_of("used before the wait"),
                              compare=line_of("compared before the wait"), wait=line_of("wgmma_wait<0>();"))
    with pytest.raises(emu.KernelError, match=expected):
        wgmma(64, a, b, mode)
    np.testing.assert_array_equal(wgmma(64, a, b), fragments(chained_product(a, b)))   # the twin


def test_a_wgmma_without_wgmma_fence_is_refused(order):
    a, b = bf16((64, 64)), bf16((64, 64))
    with pytest.raises(emu.KernelError, match=r"thread \(\d+,0,0\) of block \(0,0,0\): synccheck: wgmma_bf16<64> at "
                                              rf"\S+{line_of('the wgmma of wgmma_stored')} writes accumulators with no "
                                              r"wgmma_fence\(\) by the thread before it"):
        wgmma(64, a, b, mode=3)


def test_operands_stored_without_fence_proxy_async_are_refused(order):
    a, b = bf16((64, 64)), bf16((128, 64))
    with pytest.raises(emu.KernelError, match=rf"racecheck: the wgmma_bf16<128> at \S+{line_of('the wgmma of wgmma_stored')} "
                                              r"reads byte \d+ of `the dynamic shared memory .*`, which thread "
                                              r"\(\d+,0,0\) wrote with a plain store \(the generic proxy\) and did not "
                                              r"follow with fence_proxy_async\(\)"):
        wgmma(128, a, b, mode=5)


def test_an_operand_overwritten_before_the_wgmma_wait_is_refused(order):
    a, b = bf16((64, 64)), bf16((64, 64))
    with pytest.raises(emu.KernelError, match=r"thread \(3,0,0\) of block \(0,0,0\): racecheck: a plain store at "
                                              rf"\S+{line_of('an operand stored to before the wait')} writes byte 8240 "
                                              r"of `the dynamic shared memory .*` while the wgmma at "
                                              rf"\S+{line_of('the wgmma of wgmma_stored')} of warpgroup 0 \(threads "
                                              r"0-127\) reads it: that wgmma is not retired yet"):
        wgmma(64, a, b, mode=6)


def test_a_warpgroup_whose_threads_reach_different_wgmmas_is_refused(order):
    a, b = bf16((64, 64)), bf16((64, 64))
    args = (operand_tiles(a), operand_tiles(b), np.zeros(128 * 32, np.float32))
    message = refused("wgmma_diverged", (1,), (128,), *args, np.int32(1), shared_mem=16384)
    lines = line_of("warp 1's wgmma"), line_of("the others' wgmma")
    assert re.search(r"synccheck: reached wgmma_bf16<64> at \S+(?P<one>:\d+) while thread \(\d+,0,0\) of its warpgroup "
                     r"waits in wgmma_bf16<64> at \S+(?P<two>:\d+): a warpgroup-wide .aligned instruction needs all "
                     r"128 threads of warpgroup 0 \(threads 0-127\) at the same call", message), message
    assert all(re.search(rf"wgmma_bf16<64> at \S+{line}", message) for line in lines), message
    message = refused("wgmma_diverged", (1,), (128,), *args, np.int32(2), shared_mem=16384)
    assert re.search(r"synccheck: wgmma_fence at \S+ with thread 5 of its warpgroup returned: all 128 threads of "
                     r"warpgroup 0 \(threads 0-127\) must execute it", message), message
    out = np.zeros(128 * 32, np.float32)
    launch("wgmma_diverged", (1,), (128,), *args[:2], out, np.int32(0), shared_mem=16384)
    np.testing.assert_array_equal(out.reshape(128, 32), fragments(chained_product(a[:, :16], b[:, :16])))


def test_a_warpgroup_whose_threads_reach_different_setmaxnregs_is_refused(order):
    message = refused("setmaxnreg_split", (1,), (256,), np.zeros(256, np.int32), np.int32(1))
    assert re.search(r"synccheck: reached setmaxnreg_dec<40> at \S+:\d+ while thread \(\d+,0,0\) of its warpgroup "
                     r"waits in setmaxnreg_dec<40> at \S+:\d+: a warpgroup-wide .aligned instruction needs all 128 "
                     r"threads of warpgroup 0", message), message
    assert all(re.search(rf"setmaxnreg_dec<40> at \S+{line}", message)
               for line in (line_of("warp 1's setmaxnreg"), line_of("the producers' setmaxnreg"))), message
    out = np.zeros(256, np.int32)
    launch("setmaxnreg_split", (1,), (256,), out, np.int32(0))
    assert (out == 1).all()


@pytest.mark.parametrize("mode, what", [(1, "never committed \\(wgmma_commit\\) nor retired"),
                                        (2, "committed but never retired \\(wgmma_wait\\)")])
def test_a_thread_that_returns_with_its_wgmma_not_retired_is_refused(order, mode, what):
    a, b = bf16((64, 64)), bf16((64, 64))
    message = refused("wgmma_unretired", (1,), (128,), operand_tiles(a), operand_tiles(b), np.zeros(128, np.float32),
                      np.int32(mode), shared_mem=16384)
    assert re.search(rf"synccheck: returned with the wgmma at \S+:\d+ {what}", message), message
    launch("wgmma_unretired", (1,), (128,), operand_tiles(a), operand_tiles(b), np.zeros(128, np.float32),
           np.int32(0), shared_mem=16384)


# ---- TMA ---------------------------------------------------------------------------------------------------------

def tma(name, array, box, start, swizzle, *extra, wait=1, offset=0, level="full", shared_mem=None):
    """The bytes a TMA load of the box of `array` at `start` (NumPy's axis order) leaves in shared memory."""
    box_bytes = int(np.prod(box)) * array.dtype.itemsize
    out = np.zeros(box_bytes, np.uint8)
    coordinates = [np.int32(c) for c in reversed(start)]   # innermost first
    tail = (np.int32(wait), np.int32(offset)) if name == "tma_2d" else ()
    launch(name, (1,), (64,), emu.TensorMap(array, box, swizzle), out, np.int32(box_bytes), np.int32(box_bytes),
           *coordinates, *tail, shared_mem=shared_mem or box_bytes + offset, level=level)
    return out


@pytest.mark.parametrize("dtype, shape, box, start, swizzle", [
    (bfloat16, (40, 96), (16, 64), (-4, 64), 128),    # rows above the tensor, columns past its end
    (bfloat16, (40, 96), (16, 64), (30, -16), 128),   # rows past the end, columns before the start
    (bfloat16, (40, 96), (32, 32), (3, 72), 128),     # rows of 64 bytes: two to a swizzled 128-byte row
    (bfloat16, (40, 96), (16, 48), (-2, 60), 0),
    (np.float32, (33, 20), (8, 12), (29, 12), 0),
    (np.float32, (9, 32), (8, 32), (0, 0), 128),      # whole rows, inside
    (bfloat16, (40, 96), (8, 64), (100, 0), 128),     # all outside: zeros
])
def test_a_2d_tma_load_brings_its_box_zeros_outside_swizzled_or_not(order, dtype, shape, box, start, swizzle):
    array = rng().standard_normal(shape).astype(dtype)
    got = tma("tma_2d", array, box, start, swizzle)
    np.testing.assert_array_equal(got, shared_bytes(array, box, start, swizzle))


@pytest.mark.parametrize("dtype, shape, box, start, swizzle", [
    (bfloat16, (2, 5, 6, 64), (1, 4, 4, 64), (1, 3, -1, 0), 128),   # conv_sm90's box of x (N, H, W, C)
    (bfloat16, (2, 5, 6, 64), (2, 2, 8, 64), (-1, -1, 2, 0), 128),
    (np.float32, (3, 4, 5, 8), (2, 3, 4, 8), (2, 2, -2, 0), 0),
    (np.int8, (3, 4, 5, 16), (2, 2, 2, 16), (1, -1, 4, 0), 0),
])
def test_a_4d_tma_load_brings_its_box_zeros_outside_swizzled_or_not(order, dtype, shape, box, start, swizzle):
    array = (rng().standard_normal(shape) * 20).astype(dtype)
    got = tma("tma_4d", array, box, start, swizzle)
    np.testing.assert_array_equal(got, shared_bytes(array, box, start, swizzle))


@pytest.mark.parametrize("rows, columns", [(slice(None, None, 2), slice(1, None, 2)), (slice(1, None, 2), slice(None))])
def test_a_tma_load_of_a_strided_view_brings_its_box(order, rows, columns):
    """A map of every other row (and column) of an (N, H, W, C) image, conv_sm90's stride-2 operand of x: the view's
    strides are the map's, its box the view's elements, zeros past the view (not the image)."""
    image = rng().standard_normal((2, 7, 9, 64)).astype(bfloat16)
    view = image[:, rows, columns]
    assert not view.flags.c_contiguous
    for start in ((1, 2, -1, 0), (0, -1, 3, 0)):
        got = tma("tma_4d", view, (1, 4, 4, 64), start, 128)
        np.testing.assert_array_equal(got, shared_bytes(view, (1, 4, 4, 64), start, 128))


@pytest.mark.parametrize("dtype", [np.float32, bfloat16])
def test_a_map_of_nan_fill_brings_nan_past_the_tensor(order, dtype):
    """nan_fill (CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA): the box's elements past the tensor are NaN, those
    inside it as they are; the same box without it has zeros there."""
    array = rng().standard_normal((2, 5, 6, 64 if dtype == bfloat16 else 32)).astype(dtype)
    box, start = (1, 4, 4, array.shape[3]), (1, 3, -1, 0)
    out = np.zeros(int(np.prod(box)) * array.dtype.itemsize, np.uint8)
    coordinates = [np.int32(c) for c in reversed(start)]
    launch("tma_4d", (1,), (64,), emu.TensorMap(array, box, 128, nan_fill=True), out, np.int32(out.size),
           np.int32(out.size), *coordinates, shared_mem=out.size)
    got = np.frombuffer(swizzled(out).tobytes(), array.dtype).reshape(box)   # the swizzle is its own inverse
    inside = tma_box(np.ones(array.shape, bool), box, start)
    assert np.isnan(got.astype(np.float32)[~inside]).all() and (~inside).any()
    np.testing.assert_array_equal(got[inside], tma_box(array, box, start)[inside])
    with pytest.raises(emu.LaunchError, match="NaN fills elements of float32, float16 or bfloat16 tensors only"):
        emu.TensorMap(np.zeros((4, 16), np.int32), (4, 16), 0, nan_fill=True)


def test_a_dimension_of_one_element_takes_any_stride_numpy_gives_it():
    """NumPy leaves a contiguous array's stride along a dimension of one element arbitrary (here 2 bytes): the map
    takes the stride a dense layout would have, as launch.tensor_map gives the driver."""
    array = np.ascontiguousarray(rng().standard_normal((2, 64, 1, 1)).astype(bfloat16).transpose(0, 2, 3, 1))
    array = np.lib.stride_tricks.as_strided(array, strides=(128, 2, 2, 2))
    assert emu.tensor_map.byte_strides(array) == (128, 128, 128, 2)
    got = tma("tma_4d", array, (2, 1, 1, 64), (0, 0, 0, 0), 128)
    np.testing.assert_array_equal(got, shared_bytes(array, (2, 1, 1, 64), (0, 0, 0, 0), 128))


def test_the_tma_model_would_see_a_wrong_box():
    array = rng().standard_normal((40, 96)).astype(bfloat16)
    got = tma("tma_2d", array, (16, 64), (-4, 64), 128)
    assert not np.array_equal(got, shared_bytes(array, (16, 64), (-4, 64), 0))
    assert not np.array_equal(got, shared_bytes(array, (16, 64), (-3, 64), 128))


def test_reading_a_tma_stage_before_waiting_for_its_barrier_is_refused(order):
    array = rng().standard_normal((40, 96)).astype(bfloat16)
    with pytest.raises(emu.KernelError, match=r"initcheck: reads byte \d+ of `the dynamic shared memory \(extern "
                                              r"__shared__, 2048 bytes asked for\)`, which the TMA load at "
                                              rf"\S+{line_of('the 2-D load')} writes, before this thread observed "
                                              r"the completion of phase 0 of the mbarrier at byte 0 of `bar` that its "
                                              rf"bytes complete \(mbarrier_wait\(bar, 0\)\) at \S+{line_of('the box read')}"):
        tma("tma_2d", array, (16, 64), (0, 0), 128, wait=0)


@pytest.mark.parametrize("offset, message", [
    (512, r"memcheck: tma_load_2d at \S+{line}: the destination byte 512 of `the dynamic shared memory .*` \(shared "
          r"address 0x[0-9a-f]+\) is not a multiple of 1024 bytes, which the 128-byte swizzle needs"),
    (4096, r"memcheck: tma_load_2d's destination \(a box of 2048 bytes\) at \S+{line}: 2048 bytes at byte 4096 of "
           r"`the dynamic shared memory \(extern __shared__, 5120 bytes asked for\)` \(5120 bytes\) run past its end"),
])
def test_a_tma_destination_misaligned_or_too_small_is_refused(order, offset, message):
    array = rng().standard_normal((40, 96)).astype(bfloat16)
    with pytest.raises(emu.KernelError, match=message.format(line=line_of("the 2-D load"))):
        tma("tma_2d", array, (16, 64), (0, 0), 128, offset=offset, shared_mem=5120)


def test_a_tma_destination_needs_128_bytes_without_swizzle():
    array = rng().standard_normal((40, 96)).astype(bfloat16)
    with pytest.raises(emu.KernelError, match=r"is not a multiple of 128 bytes"):
        tma("tma_2d", array, (16, 64), (0, 0), 0, offset=64, shared_mem=4096)
    got = tma("tma_2d", array, (16, 64), (0, 0), 0, offset=128, shared_mem=4096)
    np.testing.assert_array_equal(got, shared_bytes(array, (16, 64), (0, 0), 0))


# ---- tensor maps -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make, message", [
    (lambda: emu.TensorMap(np.zeros((2,) * 6, np.float32), (1,) * 6), "a tensor of rank 6; a tensor map's rank is 1 to 5"),
    (lambda: emu.TensorMap(np.zeros((64, 64), np.float32)[:, ::2], (8, 8)), "innermost dimension is dense"),
    (lambda: emu.TensorMap(np.zeros((64, 64), np.float32)[::-1], (8, 8)), "other strides positive"),
    (lambda: emu.TensorMap([1.0, 2.0], (2,)), "the tensor must be a NumPy array, not list"),
    (lambda: emu.TensorMap(np.zeros((64, 64), np.float32), (8,)), r"box \(8,\) has 1 dimensions, the tensor 2"),
    (lambda: emu.TensorMap(np.zeros((300, 64), bfloat16), (257, 64)), r"each box dimension is 1 to 256"),
    (lambda: emu.TensorMap(np.zeros((300, 64), bfloat16), (0, 64)), r"each box dimension is 1 to 256"),
    (lambda: emu.TensorMap(np.zeros((64, 64), bfloat16), (8, 12)), r"is 24 bytes: a multiple of 16 is needed"),
    (lambda: emu.TensorMap(np.zeros((64, 128), bfloat16), (8, 128)), "the 128-byte swizzle takes at most 128"),
    (lambda: emu.TensorMap(np.zeros((64, 12), bfloat16), (8, 8), swizzle=0), r"the stride of axis 0 .* is 24 bytes"),
    (lambda: emu.TensorMap(np.zeros((64, 64), bfloat16), (8, 64), swizzle=64), "swizzles are not emulated"),
    (lambda: emu.TensorMap(np.zeros((64, 64), bfloat16), (8, 64), swizzle=100), r"swizzle 100: 0 \(none\) or 128"),
    (lambda: emu.TensorMap(np.zeros(1030, np.float32)[1:1025].reshape(16, 64), (8, 32), swizzle=128),
     "the array's address is not a multiple of 16 bytes"),
    (lambda: emu.TensorMap(np.zeros((0, 64), np.float32), (1, 16)), "is empty"),
    (lambda: emu.TensorMap(np.zeros(64, np.complex64), (16,), swizzle=0), "no tensor map data type holds complex64"),
])
def test_a_tensor_map_that_cu_tensor_map_encode_tiled_refuses_is_refused(make, message):
    with pytest.raises(emu.LaunchError, match=r"emu.TensorMap: .*" + message):
        make()


def test_a_tensor_map_is_the_argument_of_a_tensor_map_parameter_only():
    array = rng().standard_normal((40, 96)).astype(bfloat16)
    tensor_map, out = emu.TensorMap(array, (16, 64)), np.zeros(2048, np.uint8)
    tail = [np.int32(v) for v in (2048, 2048, 0, 0, 1, 0)]
    with pytest.raises(emu.LaunchError, match=r"kernel 'tma_2d' argument 1 \(unsigned char\* out\): got an "
                                              r"emu.TensorMap; the parameter is not a tensor map"):
        launch("tma_2d", (1,), (64,), tensor_map, tensor_map, *tail, shared_mem=2048)
    with pytest.raises(emu.LaunchError, match=r"kernel 'tma_2d' argument 0 \(const __grid_constant__ TensorMap map\): "
                                              r"got an array .* the parameter is not a pointer"):
        launch("tma_2d", (1,), (64,), array, out, *tail, shared_mem=2048)
    with pytest.raises(emu.LaunchError, match=r"argument 0 .*: got int 3; a tensor map parameter takes an "
                                              r"emu.TensorMap"):
        launch("tma_2d", (1,), (64,), 3, out, *tail, shared_mem=2048)


def test_a_tensor_maps_tensor_is_copied_in_as_a_read_only_argument():
    """The kernel's loads read the launch's guarded copy; the array comes back untouched, whatever the kernel did."""
    array = rng().standard_normal((40, 96)).astype(bfloat16)
    before = array.copy()
    array.flags.writeable = False   # a read-only array is fine: the kernel only reads it
    got = tma("tma_2d", array, (16, 64), (8, 32), 128)
    np.testing.assert_array_equal(got, shared_bytes(array, (16, 64), (8, 32), 128))
    assert np.array_equal(array.view(np.uint16), before.view(np.uint16))


# ---- pipelines -----------------------------------------------------------------------------------------------------

def test_a_pipeline_of_tma_loads_and_plain_reads_over_several_phases(order):
    x = rng().standard_normal((7, 64)).astype(np.float32)
    out = np.zeros(64, np.float32)
    launch("pipeline_sum", (1,), (96,), emu.TensorMap(x, (1, 64), swizzle=0), out, np.int32(7), np.int32(0),
           shared_mem=3 * 256)
    expected = np.zeros(64, np.float32)
    for row in x:
        expected += row
    np.testing.assert_array_equal(out, expected)


def test_a_consumer_that_releases_its_stage_before_reading_it_is_refused(order):
    x = rng().standard_normal((7, 64)).astype(np.float32)
    with pytest.raises(emu.KernelError) as error:
        launch("pipeline_sum", (1,), (96,), emu.TensorMap(x, (1, 64), swizzle=0), np.zeros(64, np.float32), np.int32(7),
               np.int32(1), shared_mem=3 * 256)
    message = str(error.value)
    read, load = line_of("the consumer's read"), line_of("the producer's load")
    assert (re.search(rf"racecheck: the TMA load at \S+{load} overwrites byte \d+ of `the dynamic shared memory .*`, "
                      r"which thread \(\d+,0,0\) read, with no __syncthreads\(\) or mbarrier hand-off between them",
                      message) or
            re.search(rf"initcheck: reads byte \d+ of `the dynamic shared memory .*`, which the TMA load at \S+{load} "
                      rf"writes, before this thread observed the completion of phase \d+ .* at \S+{read}", message)), message


def gemm(n, a, b, mode, level="full"):
    c = np.full((128, n), np.nan, np.float32)
    steps = a.shape[1] // 64
    launch(f"gemm_n{n}", (1,), (384,), emu.TensorMap(a, (128, 64)), emu.TensorMap(b, (n, 64)), c, np.int32(steps),
           np.int32(mode), shared_mem=4 * (128 + n) * 128, level=level)
    return c


@pytest.mark.parametrize("n", [64, 128])
@pytest.mark.parametrize("mode", [0, 1, 3])
def test_a_warp_specialised_gemm_of_tma_loads_and_wgmmas(order, n, mode):
    """6 k steps through 4 stages (the barriers' phases flip), the stage released after wgmma_wait<0>() (mode 0)
    or, one group kept in flight, the stage before after wgmma_wait<1>() (mode 1, conv_sm90's); mode 3, then the
    ring the consumers' scratch after a __syncthreads() (the wgmmas every warpgroup's wait retired before it are
    ordered before what any thread does after it)."""
    a, b = bf16((128, 384)), bf16((n, 384))
    np.testing.assert_array_equal(gemm(n, a, b, mode), chained_product(a, b))


def test_a_stage_released_before_the_wgmma_wait_that_retires_its_wgmmas_is_refused(order):
    a, b = bf16((128, 384)), bf16((128, 384))
    wgmma_line = line_of("the consumers' wgmma")
    with pytest.raises(emu.KernelError, match=rf"racecheck: the TMA load at \S+:\d+ writes byte \d+ of `the dynamic "
                                              r"shared memory .*`(,)? (which|while) the wgmma at "
                                              rf"\S+{wgmma_line} of warpgroup \d \(threads "
                                              r"\d+-\d+\) reads.*a stage released before the wgmma_wait that retires "
                                              r"the wgmmas reading it"):
        gemm(128, a, b, mode=2)


def test_a_ring_reused_with_no_barrier_after_the_last_wgmma_wait_is_refused(order):
    """mode 4: the consumers store to the ring as soon as their own warpgroup's wgmmas retired, where the other
    warpgroup's wgmmas read it (the B operand both read), with no __syncthreads() between."""
    a, b, store = bf16((128, 384)), bf16((64, 384)), line_of("the scratch's store")
    with pytest.raises(emu.KernelError, match=rf"racecheck: a plain store at \S+{store} writes "
                                              r"byte \d+ of `the dynamic shared memory .*`(,)? (which|while) the wgmma "
                                              r"at \S+ of warpgroup \d \(threads \d+-\d+\) reads"):
        gemm(64, a, b, mode=4)


@pytest.mark.parametrize("level", ["memcheck", "off"])
def test_the_emulation_is_the_same_without_the_full_sanitizer(level):
    a, b = bf16((128, 384)), bf16((64, 384))
    np.testing.assert_array_equal(gemm(64, a, b, 1, level=level), chained_product(a, b))
    array = rng().standard_normal((2, 5, 6, 64)).astype(bfloat16)
    got = tma("tma_4d", array, (1, 4, 4, 64), (1, 3, -1, 0), 128, level=level)
    np.testing.assert_array_equal(got, shared_bytes(array, (1, 4, 4, 64), (1, 3, -1, 0), 128))


# ---- named barriers ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [0, 5])
def test_a_named_barrier_orders_the_warps_that_meet_at_it(order, mode):
    """Warps 1-3 meet at named barrier 1 for 96 threads while warp 0 waits elsewhere (a producer that takes no part in
    the consumers' epilogue): each reads what another warp wrote before it, which racecheck finds ordered (the
    barrier's threads' clocks); named_barrier_any tells them all that one passed a true predicate."""
    out = np.zeros(128, np.int32)
    launch("named_barrier", (1,), (128,), out, np.int32(mode))
    t = np.arange(32, 128)
    np.testing.assert_array_equal(out[32:], 1 if mode == 5 else 7 * (32 + (t - 32 + 32) % 96))


@pytest.mark.parametrize("mode, message", [
    (1, r"synccheck: named barrier 1 at \S+ for (96|128) threads, while \d+ threads wait at it for (96|128)"),
    (2, r"synccheck: named barrier [12] \(\S+\) has its (64|32) threads, lanes (0-15|16-31) of warp [23] among them, "
        r"while lanes (16-31|0-15) of that warp are elsewhere"),
    (3, r"deadlock in block \(0,0,0\): .*named barrier 1 \(\S+\): threads 32-127 wait for 128 threads, 96 of them "
        r"arrived"),
    (4, r"(racecheck|initcheck): .*exchange"),
])
def test_the_misuses_of_a_named_barrier_are_refused(order, mode, message):
    """Counts that disagree; a warp split across it (bar.sync is .aligned); a count that never comes (not a hang); and
    without it, the race it prevents."""
    assert re.search(message, refused("named_barrier", (1,), (128,), np.zeros(128, np.int32), np.int32(mode)))


# ---- mbarrier ---------------------------------------------------------------------------------------------------

def test_a_wait_for_a_phase_that_never_completes_is_a_deadlock(order):
    message = refused("mbarrier_phase", (1,), (64,), np.zeros(64, np.int32), np.int32(2))
    assert re.search(r"deadlock in block \(0,0,0\): 0 of 64 threads wait at __syncthreads\(\); the mbarrier at byte 0 "
                     r"of `bar` \(phase 0: 1 of 2 arrivals and 0 transaction bytes pending\): threads 0-63 wait at "
                     rf"\S+{line_of('the wait for phase 0')} for its phase of parity 0 to complete", message), message
    out = np.zeros(64, np.int32)
    launch("mbarrier_phase", (1,), (64,), out, np.int32(1))
    assert (out == 1).all()


@pytest.mark.parametrize("mode, message", [
    (1, r"synccheck: mbarrier_arrive at \S+{arrival on} uses the mbarrier at byte 8 of `bars`, which no mbarrier_init "
        r"initialised"),
    (2, r"synccheck: mbarrier_arrive at \S+{beyond} on the mbarrier at byte 8 of `bars`, whose phase 0 has had all its "
        r"1 arrivals \(it awaits 64 transaction bytes\): an arrival beyond the count"),
    (3, r"synccheck: mbarrier_init at \S+{second init} of the mbarrier at byte 8 of `bars` while its phase 0 is in "
        r"progress \(phase 0: 1 of 2 arrivals and 0 transaction bytes pending\)"),
    (4, r"synccheck: block \(0,0,0\) ended with 64 transaction bytes pending on the mbarrier at byte 8 of `bars` "
        r"\(phase 0: 0 of 1 arrivals and 64 transaction bytes pending\): mbarrier_arrive_expect_tx expected more bytes"),
    (5, r"synccheck: writes byte 0 of `bars`, part of the mbarrier initialised at \S+:\d+: a plain store of an "
        r"mbarrier's bytes \(only the mbarrier_\* wrappers may touch them\) at \S+{store}"),
    (6, r"synccheck: mbarrier_wait at \S+{fresh} uses the mbarrier at byte 0 of `bars`, (which no mbarrier_init "
        r"initialised|which thread \(0,0,0\) initialised at \S+:\d+ with no __syncthreads\(\) since)"),
    (7, r"synccheck: reads byte 0 of `bars`, part of the mbarrier initialised at \S+:\d+: a plain load .* at "
        r"\S+{load}"),
])
def test_the_misuses_of_an_mbarrier_are_refused(order, mode, message):
    lines = {key: line_of(text) for key, text in [("arrival on", "the arrival on bars[1]"),
                                                  ("beyond", "the arrival beyond the count"),
                                                  ("second init", "the second init"),
                                                  ("store", "the store to the barrier"),
                                                  ("load", "the load of the barrier"),
                                                  ("fresh", "a fresh barrier's phase")]}
    got = refused("mbarrier_misuse", (1,), (32,), np.zeros(2, np.int32), np.int32(mode))
    assert re.search(message.format(**lines), got), got


def test_an_mbarrier_used_as_it_should_runs_clean(order):
    out = np.zeros(2, np.int32)
    launch("mbarrier_misuse", (1,), (32,), out, np.int32(0))
    assert out[0] == 1


# ---- on a simulated GPU ------------------------------------------------------------------------------------------

def test_a_tensor_map_passes_through_a_simulated_gpus_launch(monkeypatch):
    import kernels
    monkeypatch.setenv(kernels.SIMULATED_GPUS, "1")
    cupy = kernels.cupy_module()
    source = SOURCE.read_text()
    function = cupy.RawModule(code=source, options=OPTIONS).get_function("tma_2d")
    host = rng().standard_normal((40, 96)).astype(bfloat16)
    array, out = cupy.asarray(host), cupy.zeros(2048, np.uint8)
    tail = [np.int32(v) for v in (2048, 2048, 16, 8, 1, 0)]
    function((1,), (64,), (cupy.tensor_map(array, (16, 64)), out, *tail), shared_mem=2048)
    np.testing.assert_array_equal(cupy.asnumpy(out), shared_bytes(host, (16, 64), (8, 16), 128))
    with pytest.raises(TypeError, match=r"an emu.TensorMap of a host array; on the simulated GPUs a tensor map "
                                        r"describes a device array: cupy.tensor_map"):
        function((1,), (64,), (emu.TensorMap(host, (16, 64)), out, *tail), shared_mem=2048)
    with pytest.raises(TypeError, match="tensor_map takes device arrays"):
        cupy.tensor_map(host, (16, 64))


# ---- the same models on a GPU of compute capability 9.0 (pytest -m gpu) ------------------------------------------
# What the emulator runs, held to the hardware: the PTX of sm90.cuh's wrappers (wgmma's fragments and descriptors,
# K-major and MN-major; TMA's boxes, zeros and swizzle; the warp-specialised pipeline) must give the numbers the
# NumPy models above give, as the emulator does.

@pytest.mark.nvrtc("conv_sm90")
def test_the_kernels_compile_for_sm_90a_as_the_gpu_tests_compile_them():
    """NVRTC compiles this file's kernels for sm_90a, kernels/cuda on the include path (what `hopper` loads), every
    one of them there and no warning."""
    from kernels import nvrtc
    from kernels.cuda import OPTIONS as CUDA_OPTIONS
    reason = nvrtc.unavailable_reason() or nvrtc.unsupported_reason("sm_90a")
    if reason:
        pytest.skip(reason)
    compiled = nvrtc.compile(SOURCE.read_text(), arch="sm_90a", options=CUDA_OPTIONS + OPTIONS, verbose=True)
    defined = set(re.findall(r'extern "C" __global__ void (\w+)\(', SOURCE.read_text()))
    assert set(compiled.named_resources()) == defined and "warning" not in compiled.log.lower(), compiled.log


@pytest.fixture(scope="module")
def hopper():
    """(the cuda backend, this file's kernels compiled for sm_90a: kernels.cuda.ArchModule), on a GPU of 9.0."""
    from test_kernels_cuda import gpu_unavailable_reason
    reason = gpu_unavailable_reason()
    if reason:
        pytest.skip(reason)
    import kernels
    from kernels.cuda import OPTIONS as CUDA_OPTIONS, ArchModule
    be = kernels._device_backend("cuda")
    if be.xp.cuda.Device().compute_capability != "90":
        pytest.skip("sm90.cuh's instructions are sm_90a's: a GPU of compute capability 9.0")
    return be, ArchModule(SOURCE.read_text(), CUDA_OPTIONS + OPTIONS, ())


def on_gpu(hopper, name, grid, block, *args, shared_mem=0):
    """`launch`, on the GPU: each host array copied there and, after the kernel, back into itself; an emu.TensorMap
    made again as the driver encodes it (launch.tensor_map) over the array's device copy."""
    from kernels.cuda.launch import tensor_map
    be, module = hopper
    given, copies = [], []
    for a in args:
        if isinstance(a, emu.TensorMap):
            given.append(tensor_map(be, be.xp.asarray(a.array), a.box, a.swizzle))
        elif isinstance(a, np.ndarray) and a.ndim:
            copies.append((a, be.xp.asarray(a)))
            given.append(copies[-1][1])
        else:
            given.append(a)
    function = module.get_function(name)
    function.max_dynamic_shared_size_bytes = 160 * 1024
    function(grid, block, tuple(given), shared_mem=shared_mem)
    for host, device in copies:
        host[...] = be.xp.asnumpy(device)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [64, 128])
def test_wgmma_on_the_gpu_matches_the_model(hopper, n):
    a, b = bf16((64, 128)), bf16((n, 128))
    out = np.full(128 * n // 2, np.nan, np.float32)
    on_gpu(hopper, f"wgmma_n{n}", (1,), (128,), operand_tiles(a), operand_tiles(b), out, np.int32(2), np.int32(0),
           shared_mem=2 * (64 + n) * 128)
    np.testing.assert_array_equal(out.reshape(128, n // 2), fragments(chained_product(a, b)))


@pytest.mark.gpu
@pytest.mark.parametrize("mode, lbo, sbo", [(0, 128, 256), (1, 16, 1024), (2, 16, 512), (3, 16, 256)])
def test_wgmma_on_the_gpu_reads_each_layout_as_the_model(hopper, mode, lbo, sbo):
    a, b = bf16((64, 16)), bf16((64, 16))
    sa, sb = layout(a, mode, lbo, sbo), layout(b, mode, lbo, sbo)
    out = np.full(128 * 32, np.nan, np.float32)
    on_gpu(hopper, "wgmma_layout", (1,), (128,), sa.view(np.uint32), sb.view(np.uint32), out, np.int32(sa.size),
           np.int32(sb.size), np.int32(mode), np.int32(lbo), np.int32(sbo), shared_mem=sa.size + sb.size)
    np.testing.assert_array_equal(out.reshape(128, 32), fragments(chained_product(a, b)))


@pytest.mark.gpu
def test_wgmma_on_the_gpu_reads_mn_major_operands_as_the_model(hopper):
    a, b = bf16((64, 16)), bf16((128, 16))
    sa, sb = mn_layout(a, 8192, 1024), mn_layout(b, 8192, 1024)
    out = np.full(128 * 64, np.nan, np.float32)
    on_gpu(hopper, "wgmma_mn_major", (1,), (128,), sa.view(np.uint32), sb.view(np.uint32), out, np.int32(sa.size),
           np.int32(sb.size), np.int32(8192), np.int32(1024), shared_mem=sa.size + sb.size)
    np.testing.assert_array_equal(out.reshape(128, 64), fragments(chained_product(a, b)))


@pytest.mark.gpu
@pytest.mark.parametrize("name, shape, box, start, swizzle", [
    ("tma_2d", (40, 96), (16, 64), (-4, 64), 128), ("tma_2d", (40, 96), (32, 32), (3, 72), 128),
    ("tma_2d", (40, 96), (16, 48), (-2, 60), 0), ("tma_4d", (2, 5, 6, 64), (1, 4, 4, 64), (1, 3, -1, 0), 128),
    ("tma_4d", (2, 5, 6, 64), (2, 2, 8, 64), (-1, -1, 2, 0), 128)])
def test_tma_loads_on_the_gpu_land_as_the_model(hopper, name, shape, box, start, swizzle):
    array = rng().standard_normal(shape).astype(bfloat16)
    box_bytes = int(np.prod(box)) * 2
    out = np.zeros(box_bytes, np.uint8)
    tail = (np.int32(1), np.int32(0)) if name == "tma_2d" else ()
    on_gpu(hopper, name, (1,), (64,), emu.TensorMap(array, box, swizzle), out, np.int32(box_bytes),
           np.int32(box_bytes), *(np.int32(c) for c in reversed(start)), *tail, shared_mem=box_bytes)
    np.testing.assert_array_equal(out, shared_bytes(array, box, start, swizzle))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [64, 128])
def test_the_warp_specialised_gemm_on_the_gpu_matches_the_model(hopper, n):
    a, b = bf16((128, 384)), bf16((n, 384))
    c = np.full((128, n), np.nan, np.float32)
    on_gpu(hopper, f"gemm_n{n}", (1,), (384,), emu.TensorMap(a, (128, 64)), emu.TensorMap(b, (n, 64)), c,
           np.int32(6), np.int32(1), shared_mem=4 * (128 + n) * 128)
    np.testing.assert_array_equal(c, chained_product(a, b))
