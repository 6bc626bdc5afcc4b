"""The tensor-core wrappers of kernels/cuda/tensor_core.cuh (tests/emu_kernels/tensor_core.cu).

- On the emulator, in both thread orders: each wrapper against a NumPy model of its fragment
  layout, written from the PTX ISA's tables, on random data: cvt.rna.tf32.f32 (ties too),
  cvt.rn.bf16.f32 and cvt.rn.bf16x2.f32 (bf16.cuh) against NumPy's bfloat16 (ml_dtypes), mma.sync
  m16n8k8 TF32 and m16n8k16 BF16 (two warps of a block apart), ldmatrix x1/x2/x4 with and without .trans
  from rows scattered in shared memory, cp.async of 4, 8 and 16 bytes with zero-fill, in two
  groups, reading NaN until the wait that covers it.
- What the emulation refuses, each naming the call: a divergent mma, an mma after lanes
  returned, a misaligned ldmatrix, an ldmatrix of global memory, a cp.async source outside the
  kernel's arguments, copies never waited for.
- Marked gpu: the same kernels on a GPU against the emulator, fragment by fragment: bit for bit
  for cvt, ldmatrix and cp.async, within accumulation rounding for mma. This proves that the
  PTX strings mean what their emulation does; bench/gpu_check runs it first. Its emulation side
  runs in CI too (the emulator's outputs standing in for the GPU's), cp.async's kernel, which
  reads its destinations before their wait, without the sanitizer as the CPU tests run it
  (planted: under it, refused by name).
"""
import functools
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from helpers import rng
from kernels import emu

ROOT = Path(__file__).resolve().parents[1]
SOURCE = Path(__file__).parent / "emu_kernels" / "tensor_core.cu"
OPTIONS = (f"-I{ROOT / 'kernels' / 'cuda'}",)


@functools.cache
def module(sanitize=True):
    with emu.sanitizer(sanitize):
        return emu.RawModule(code=SOURCE.read_text(), options=OPTIONS)


def launch(name, grid, block, *args, sanitize=True):
    module(sanitize).get_function(name)(grid, block, args)


# ---- NumPy models, from the PTX ISA's fragment tables --------------------------------------------

def tf32_model(x):
    """x rounded to 11 significant bits, to nearest, ties away from zero; inf and NaN kept."""
    x = np.asarray(x, np.float32)
    out = x.astype(np.float64)
    finite = np.isfinite(x) & (x != 0)
    _, e = np.frexp(out[finite])
    scale = np.ldexp(1.0, e - 11)
    q = out[finite] / scale
    out[finite] = np.sign(q) * np.floor(np.abs(q) + 0.5) * scale
    with np.errstate(over="ignore"):
        return out.astype(np.float32)


def fragment_places(lane):
    """{(matrix, index in the lane's fragment): (row, column)} of mma.m16n8k8 .tf32/.f32."""
    g, t = lane // 4, lane % 4
    return {**{("a", i): (g + 8 * (i % 2), t + 4 * (i // 2)) for i in range(4)},
            **{("b", i): (t + 4 * i, g) for i in range(2)},
            **{("c", i): (g + 8 * (i // 2), 2 * t + i % 2) for i in range(4)}}


def mma_model(a, b, c):
    """(32, 4) D fragments of one warp from its (32, 4) A, (32, 2) B (uint32 bits) and (32, 4) C
    fragments: the matrices assembled, TF32 inputs read as their top 19 bits, D = A B + C."""
    A, B, C = np.zeros((16, 8)), np.zeros((8, 8)), np.zeros((16, 8))
    top19 = lambda bits: (bits & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)  # noqa: E731
    for lane in range(32):
        for (name, i), (r, col) in fragment_places(lane).items():
            matrix, fragment = {"a": (A, top19(a)), "b": (B, top19(b)), "c": (C, c.astype(np.float64))}[name]
            matrix[r, col] = fragment[lane, i]
    D = A @ B + C
    return np.array([[D[fragment_places(lane)["c", i]] for i in range(4)] for lane in range(32)], np.float32)


def bf16_fragment_places(lane):
    """{(matrix, index of the b16 element in the lane's fragment): (row, column)} of mma.m16n8k16
    .bf16: element 2r + h is the half h (0 low) of register r."""
    g, t = lane // 4, lane % 4
    return {**{("a", i): (g + 8 * (i // 2 % 2), 2 * t + i % 2 + 8 * (i // 4)) for i in range(8)},
            **{("b", i): (2 * t + i % 2 + 8 * (i // 2), g) for i in range(4)},
            **{("c", i): (g + 8 * (i // 2), 2 * t + i % 2) for i in range(4)}}


def mma_bf16_model(a, b, c):
    """(32, 4) D fragments of one warp from its (32, 4) A and (32, 2) B registers (uint32, each two
    bfloat16) and (32, 4) float32 C: D = A B + C."""
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    halves = lambda regs: regs.view(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)  # noqa: E731  (little-endian: low half first)
    for lane in range(32):
        for (name, i), (r, col) in bf16_fragment_places(lane).items():
            matrix, fragment = {"a": (A, halves(a)), "b": (B, halves(b)), "c": (C, c.astype(np.float64))}[name]
            matrix[r, col] = fragment[lane, i]
    D = A @ B + C
    return np.array([[D[bf16_fragment_places(lane)["c", i]] for i in range(4)] for lane in range(32)], np.float32)


def ldmatrix_model(m, count, trans):
    """(32, 4) registers of ldmatrix .x{count}[.trans] of the (4, 8, 8) uint16 matrices m."""
    out = np.zeros((32, 4), np.uint32)
    for lane in range(32):
        for j in range(count):
            if trans:
                halves = m[j, 2 * (lane % 4), lane // 4], m[j, 2 * (lane % 4) + 1, lane // 4]
            else:
                halves = m[j, lane // 4, 2 * (lane % 4)], m[j, lane // 4, 2 * (lane % 4) + 1]
            out[lane, j] = np.uint32(halves[0]) | np.uint32(halves[1]) << np.uint32(16)
    return out


def ulps(a, b):
    """The distance between float32 arrays in units in the last place."""
    ia, ib = (np.asarray(v, np.float32).view(np.int32).astype(np.int64) for v in (a, b))
    ia, ib = (np.where(i < 0, -(i & 0x7FFFFFFF), i) for i in (ia, ib))
    return np.abs(ia - ib)


# ---- each wrapper against its model ----------------------------------------------------------------

def test_tf32_rounding(order):
    g = rng()
    x = np.concatenate([g.standard_normal(200) * 10.0 ** g.integers(-30, 30, 200),
                        [0.0, -0.0, np.inf, -np.inf, 3.4028235e38, 1.0 + 2.0 ** -11, -(1.0 + 2.0 ** -11),
                         1.0 + 2.0 ** -11 - 2.0 ** -23, 1.0 + 3 * 2.0 ** -11]]).astype(np.float32)
    y = np.full(x.size, 0xDEADBEEF, np.uint32)
    launch("round_tf32", (2,), (128,), x, y, np.int32(x.size))
    np.testing.assert_array_equal(y & 0xFFFFE000, tf32_model(x).view(np.uint32))   # what the mma reads
    nan = np.full(1, 0xDEADBEEF, np.uint32)
    launch("round_tf32", (1,), (32,), np.array([np.nan], np.float32), nan, np.int32(1))
    assert np.isnan(nan.view(np.float32)).all()


def test_bf16_rounding(order):
    """Nearest, ties to even (ties both ways, the largest finite float to infinity, subnormals
    rounded as any other), one at a time and in pairs, as NumPy's bfloat16 rounds; NaN stays NaN."""
    g = rng()
    tie_down, tie_up = np.float32(1.0 + 2.0 ** -8), np.float32(1.0 + 3 * 2.0 ** -8)   # halfway, even below / above
    x = np.concatenate([g.standard_normal(400) * 10.0 ** g.integers(-38, 38, 400),
                        [0.0, -0.0, np.inf, -np.inf, 3.4028235e38, -3.3e38, tie_down, -tie_down, tie_up, 1e-40,
                         -3e-39, 1.1754942e-38, np.nextafter(tie_down, 2, dtype=np.float32)]]).astype(np.float32)
    n = x.size + x.size % 2
    x = np.append(x, np.float32(0.5))[:n]
    single = np.zeros(n, ml_dtypes.bfloat16)
    pairs = np.zeros(n // 2, np.uint32)
    wide = np.zeros(n, np.float32)
    launch("round_bf16", (4,), (128,), x, single, pairs, wide, np.int32(n))
    expected = x.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(single.view(np.uint16), expected.view(np.uint16))
    np.testing.assert_array_equal(pairs.view(np.uint16), expected.view(np.uint16))
    np.testing.assert_array_equal(wide, expected.astype(np.float32))
    bits = dict(zip(x.tolist(), single.view(np.uint16).tolist()))
    assert (bits[float(tie_down)], bits[float(tie_up)], bits[float(-tie_down)]) == (0x3F80, 0x3F82, 0xBF80), "ties go to the even neighbour"
    assert bits[float(np.float32(3.4028235e38))] == 0x7F80, "the largest float rounds to infinity"
    nan = np.zeros(2, ml_dtypes.bfloat16)
    launch("round_bf16", (1,), (32,), np.array([np.nan, -np.nan], np.float32), nan, np.zeros(1, np.uint32),
           np.zeros(2, np.float32), np.int32(2))
    assert np.isnan(nan.astype(np.float32)).all()


def test_mma_bf16_of_two_warps(order):
    g = rng()
    bf16_bits = lambda shape: g.standard_normal(shape).astype(ml_dtypes.bfloat16).view(np.uint16)  # noqa: E731
    a = bf16_bits((64, 8)).view(np.uint32)
    b = bf16_bits((64, 4)).view(np.uint32)
    c = g.standard_normal((64, 4)).astype(np.float32)
    d = np.full((64, 4), np.nan, np.float32)
    launch("mma_bf16_fragments", (1,), (64,), a, b, c, d)
    for warp in (slice(0, 32), slice(32, 64)):
        expected = mma_bf16_model(a[warp], b[warp], c[warp])
        assert ulps(d[warp], expected).max() <= 1, (d[warp], expected)


def test_mma_of_two_warps(order):
    g = rng()
    a = g.standard_normal((64, 4)).astype(np.float32).view(np.uint32)     # raw floats: the top 19 bits count
    b = g.standard_normal((64, 2)).astype(np.float32).view(np.uint32)
    c = g.standard_normal((64, 4)).astype(np.float32)
    d = np.full((64, 4), np.nan, np.float32)
    launch("mma_fragments", (1,), (64,), a, b, c, d)
    for warp in (slice(0, 32), slice(32, 64)):
        expected = mma_model(a[warp], b[warp], c[warp])
        assert ulps(d[warp], expected).max() <= 1, (d[warp], expected)


@pytest.mark.parametrize("count", [1, 2, 4])
@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix(order, count, trans):
    g = rng()
    m = g.integers(0, 2**16, (4, 8, 8)).astype(np.uint16)
    slot = g.permutation(32).astype(np.int32)
    out = np.full((32, 4), 0xDEADBEEF, np.uint32)
    launch("ldmatrix_fragments", (1,), (32,), m, slot, out, np.int32(count), np.int32(trans))
    np.testing.assert_array_equal(out, ldmatrix_model(m, count, trans))


@pytest.mark.parametrize("bytes_, src_bytes, cg", [(4, 4, 0), (8, 8, 0), (8, 4, 0), (16, 16, 0), (16, 12, 0),
                                                   (16, 0, 0), (16, 16, 1), (16, 8, 1)])
def test_cp_async_lands_at_the_wait_that_covers_it(order, bytes_, src_bytes, cg):
    per = bytes_ // 4
    src = rng().standard_normal(64 * per).astype(np.float32)
    early, middle, late = (np.full(64 * per, 7.0, np.float32) for _ in range(3))
    # it reads the destinations before their waits, to see what is there: without the sanitizer, which
    # refuses that read (tests/test_sanitizer.py)
    launch("cp_async_groups", (1,), (64,), src, early, middle, late, np.int32(bytes_), np.int32(src_bytes),
           np.int32(cg), sanitize=False)
    landed = src.reshape(64, per).copy()
    landed[:, src_bytes // 4:] = 0.0     # zero-filled past the source size
    landed = landed.ravel()
    assert np.isnan(early).all(), "before any wait every destination reads NaN"
    first = 32 * per   # the chunks of threads 0-31: the first group
    np.testing.assert_array_equal(middle[:first], landed[:first])
    assert np.isnan(middle[first:]).all(), "the second group has not landed after wait_group 1"
    np.testing.assert_array_equal(late, landed)


# ---- what the emulation refuses -------------------------------------------------------------------

@pytest.mark.parametrize("kernel, args, message", [
    ("divergent_mma", lambda: (np.zeros(32, np.float32),),
     r"reached mma\.sync\.aligned\.m16n8k8\.row\.col\.f32\.tf32\.tf32\.f32 at \S+:\d+ while lane \d+ waits in "
     r"mma\.sync\S+ at \S+:\d+: a warp-wide \.aligned instruction needs all 32 lanes at the same call"),
    ("divergent_mma_bf16", lambda: (np.zeros(32, np.float32),),
     r"reached mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32 at \S+:\d+ while lane \d+ waits in "
     r"mma\.sync\S+ at \S+:\d+: a warp-wide \.aligned instruction needs all 32 lanes at the same call"),
    ("mma_after_half_the_warp_returned", lambda: (np.zeros(32, np.float32),),
     # the same words in both orders: lanes 0-15 wait as 16-31 return, or find them returned
     r"thread \(0,0,0\) of block \(0,0,0\): synccheck: mma\.sync\S+ at \S+:\d+ with lanes 16-31 of its warp returned "
     r"or not there: all 32 lanes must execute it$"),
    ("misaligned_ldmatrix", lambda: (np.zeros(32, np.uint32),),
     r"ldmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16 at \S+:\d+: address 0x[0-9a-f]+ is not a multiple of 16"),
    ("ldmatrix_from_global", lambda: (np.zeros(64, np.uint16), np.zeros(32, np.uint32)),
     r"ldmatrix\.sync\.aligned\.m8n8\.x1\.shared\.b16 at \S+:\d+: 16 bytes at 0x[0-9a-f]+ are not in the "
     r"block's shared memory"),
    ("cp_async_past_the_end", lambda: (np.ones(9, np.float32), np.zeros(1, np.float32), np.int32(9)),
     r"cp\.async\.ca at \S+:\d+ reads 8 bytes at 0x[0-9a-f]+, outside the kernel's argument buffers"),
    ("cp_async_never_waited", lambda: (np.ones(4, np.float32), np.zeros(1, np.float32)),
     r"thread \(\d+,0,0\) of block \(0,0,0\): returned with 1 cp\.async copy not waited for"),
])
def test_what_the_hardware_punishes_is_an_error_naming_the_call(order, kernel, args, message):
    with pytest.raises(emu.KernelError, match=rf"kernel '{kernel}' failed: .*{message}"):
        launch(kernel, (1,), (32,), *args())


# ---- what NVRTC makes of the PTX strings ----------------------------------------------------------

@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_wrappers_compile_to_tensor_core_instructions(arch):
    """The SASS of the test kernels holds the instructions the wrappers stand for."""
    from kernels import nvrtc
    reason = nvrtc.unavailable_reason() or (None if nvrtc.cuobjdump() else
                                            "cuobjdump is not installed (the test extra brings it)")
    if reason:
        pytest.skip(reason)
    sass = nvrtc.compile(SOURCE.read_text(), arch, OPTIONS).sass()
    joined = {name: " ; ".join(instructions) for name, instructions in sass.items()}
    assert "HMMA.1688.F32.TF32" in joined["mma_fragments"]
    assert "HMMA.16816.F32.BF16" in joined["mma_bf16_fragments"]
    assert "F2FP.BF16" in joined["round_bf16"] and "PACK_AB" in joined["round_bf16"]
    for form in ("LDSM.16.M88 ", "LDSM.16.M88.2", "LDSM.16.M88.4", "LDSM.16.MT88 ", "LDSM.16.MT88.2",
                 "LDSM.16.MT88.4"):
        assert form in joined["ldmatrix_fragments"], form
    for form in ("LDGSTS.E.ZFILL", "LDGSTS.E.64.ZFILL", "LDGSTS.E.128.ZFILL", "LDGSTS.E.BYPASS.128.ZFILL",
                 "LDGDEPBAR", "DEPBAR"):
        assert form in joined["cp_async_groups"], form


# ---- the GPU against the emulator -----------------------------------------------------------------

def gpu_module():
    """The kernels compiled by CuPy for the GPU, or a skip with the reason."""
    import kernels
    if kernels.gpu_count() == 0 or kernels.cupy_module().__name__ != "cupy":
        pytest.skip("needs a CUDA GPU (a real one: this compares the GPU with the emulator)")
    cupy = kernels.cupy_module()
    return cupy, cupy.RawModule(code=SOURCE.read_text(), options=("--std=c++17", *OPTIONS))


def on_both(name, grid, block, *args, sanitize=True, gpu=True):
    """The outputs of one launch on the emulator (under its sanitizer unless sanitize=False) and on the GPU:
    (emulator's, GPU's) per array. gpu=False: the emulation side alone, its own outputs standing in for the GPU's."""
    cupy, module = gpu_module() if gpu else (None, None)
    host = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    launch(name, grid, block, *host, sanitize=sanitize)
    if not gpu:
        return [(h, h.copy()) for h in host if isinstance(h, np.ndarray)]
    device = [cupy.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
    module.get_function(name)(grid, block, tuple(device))
    return [(h, d.get()) for h, d in zip(host, device) if isinstance(h, np.ndarray)]


def compare_with_the_emulation(run):
    """Each wrapper's kernel on random data, through run (on_both, or a stand-in for it): bit for bit for cvt,
    ldmatrix and cp.async, within accumulation rounding for mma."""
    g = rng()
    x = (g.standard_normal(1000) * 10.0 ** g.integers(-20, 20, 1000)).astype(np.float32)
    _, (emulated, real) = run("round_tf32", (8,), (128,), x, np.zeros(1000, np.uint32), np.int32(1000))
    np.testing.assert_array_equal(real, emulated, err_msg="cvt.rna.tf32.f32")

    a = g.standard_normal((32, 4)).astype(np.float32).view(np.uint32)
    b = g.standard_normal((32, 2)).astype(np.float32).view(np.uint32)
    c = g.standard_normal((32, 4)).astype(np.float32)
    *_, (emulated, real) = run("mma_fragments", (1,), (32,), a, b, c, np.zeros((32, 4), np.float32))
    # the tensor core's accumulation is not one IEEE rounding of the exact sum, and near cancellation
    # its difference is many units of the small result: bound it, as the convolutions' tests do, by
    # float32's rounding of a sum of 8 products and C, relative to the sum of their magnitudes
    magnitude = mma_model(a & np.uint32(0x7FFFFFFF), b & np.uint32(0x7FFFFFFF), np.abs(c)).astype(np.float64)
    excess = np.abs(real.astype(np.float64) - emulated) - (8 + 16) * 2.0**-24 * magnitude
    assert excess.max() <= 0, (real.ravel()[excess.argmax()], emulated.ravel()[excess.argmax()])

    x = np.concatenate([(g.standard_normal(998) * 10.0 ** g.integers(-38, 38, 998)), [1.0 + 2.0 ** -8, 3e38]])
    x = x.astype(np.float32)
    single, pairs, wide = run("round_bf16", (8,), (128,), x, np.zeros(1000, ml_dtypes.bfloat16),
                              np.zeros(500, np.uint32), np.zeros(1000, np.float32), np.int32(1000))[1:]
    for name, (emulated, real) in (("cvt.rn.bf16.f32", single), ("cvt.rn.bf16x2.f32", pairs), ("widened", wide)):
        np.testing.assert_array_equal(real.view(np.uint16), emulated.view(np.uint16), err_msg=name)

    a = g.standard_normal((32, 8)).astype(ml_dtypes.bfloat16).view(np.uint32)
    b = g.standard_normal((32, 4)).astype(ml_dtypes.bfloat16).view(np.uint32)
    c = g.standard_normal((32, 4)).astype(np.float32)
    *_, (emulated, real) = run("mma_bf16_fragments", (1,), (32,), a, b, c, np.zeros((32, 4), np.float32))
    magnitude = mma_bf16_model(a & np.uint32(0x7FFF7FFF), b & np.uint32(0x7FFF7FFF), np.abs(c)).astype(np.float64)
    excess = np.abs(real.astype(np.float64) - emulated) - (16 + 16) * 2.0**-24 * magnitude
    assert excess.max() <= 0, (real.ravel()[excess.argmax()], emulated.ravel()[excess.argmax()])

    for count in (1, 2, 4):
        for trans in (0, 1):
            m = g.integers(0, 2**16, (4, 8, 8)).astype(np.uint16)
            slot = g.permutation(32).astype(np.int32)
            *_, (emulated, real) = run("ldmatrix_fragments", (1,), (32,), m, slot, np.zeros((32, 4), np.uint32),
                                       np.int32(count), np.int32(trans))
            np.testing.assert_array_equal(real, emulated, err_msg=f"ldmatrix x{count} trans={trans}")

    for bytes_, src_bytes, cg in ((4, 4, 0), (8, 4, 0), (16, 12, 0), (16, 16, 1)):
        src = g.standard_normal(64 * 4).astype(np.float32)
        # it reads its destinations before their waits: without the sanitizer, which refuses that read
        _, _, middle, late = run("cp_async_groups", (1,), (64,), src, *(np.zeros(64 * 4, np.float32) for _ in range(3)),
                                 np.int32(bytes_), np.int32(src_bytes), np.int32(cg), sanitize=False)
        # before a wait the GPU's shared memory holds anything: only what has landed is compared
        first = 32 * bytes_ // 4
        np.testing.assert_array_equal(middle[1][:first], middle[0][:first], err_msg=f"cp.async {bytes_}, group 0")
        np.testing.assert_array_equal(late[1], late[0], err_msg=f"cp.async {bytes_} bytes, {src_bytes} read")


@pytest.mark.gpu
def test_the_gpu_computes_what_the_emulation_does():
    compare_with_the_emulation(on_both)


@pytest.mark.parametrize("planted", [False, True], ids=["as the CPU tests", "planted: every launch sanitized"])
def test_the_emulation_side_of_the_gpu_comparison_runs(planted):
    """The GPU test above with the emulator's outputs standing in for the GPU's, in CI: each launch runs on the
    emulator as the GPU test runs it there, cp_async_groups without the sanitizer. Planted, every launch under the
    sanitizer (as the GPU test ran on one H200): it refuses that kernel's reads before their wait, by name."""
    def emulated(*launch_args, sanitize=True):
        return on_both(*launch_args, sanitize=sanitize or planted, gpu=False)
    if planted:
        with pytest.raises(emu.KernelError, match=r"kernel 'cp_async_groups' failed: .*initcheck: reads byte 0 of "
                                                  r"`tile` while a cp\.async to it is in flight"):
            compare_with_the_emulation(emulated)
    else:
        compare_with_the_emulation(emulated)
