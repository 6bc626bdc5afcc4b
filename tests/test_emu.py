"""The CPU emulator of CUDA kernels (kernels/emu), on the kernels in tests/emu_kernels.

Each kernel runs against NumPy, most of them once in each thread order (ascending, then
descending), so that a result which depends on the order of the threads shows. Then the
emulator's diagnostics: a missing __syncthreads(), unwritten shared memory, an out-of-bounds
write, a float atomicMax, each kind of wrong argument or launch, a cache folder that cannot be
written. The traffic counter (emu.traffic()), against the requests, sectors and bytes of loads
counted by hand. Last, every test kernel through NVRTC for sm_80 and sm_90, as on a GPU.
"""
import functools
from pathlib import Path

import numpy as np
import pytest

from helpers import again_where_permissions_bind, permissions_bind, rng, validate
from kernels import emu, nvrtc

KERNELS = Path(__file__).parent / "emu_kernels"
OPTIONS = {"elementwise.cu": (f"-I{KERNELS}", "-DSCALE=2.0f"),
           "tensor_core.cu": (f"-I{KERNELS.parents[1] / 'kernels' / 'cuda'}",),
           "sanitizer.cu": (f"-I{KERNELS.parents[1] / 'kernels' / 'cuda'}",)}
NAME_EXPRESSIONS = {"templates.cu": ("scaled_block_sum<float, 128>", "scaled_block_sum<double, 256>",
                                     "scaled_block_sum_dynamic<float, 128>")}


@functools.cache
def module(filename, sanitize=True):
    with emu.sanitizer(sanitize):
        return emu.RawModule(code=(KERNELS / filename).read_text(), options=OPTIONS.get(filename, ()),
                             name_expressions=NAME_EXPRESSIONS.get(filename))


def kernel(filename, name, sanitize=True):
    """A kernel of one of the test files, compiled for the sanitizer, or (sanitize=False) without:
    the emulation underneath it, for the tests of its plain mechanisms."""
    return module(filename, sanitize).get_function(name)


def in_both_orders(launch):
    """{order: launch()} for each thread order; launch makes fresh arrays each time."""
    results = {}
    for order in emu.ORDERS:
        with emu.thread_order(order):
            results[order] = launch()
    return results


# ---- kernels against NumPy ----------------------------------------------------------------------

def test_grid_stride_elementwise():
    gen = rng()
    n, a = 1000, np.float32(1.5)
    x = gen.standard_normal(n).astype(np.float32)
    y0 = gen.standard_normal(n).astype(np.float32)

    def launch():
        y = y0.copy()
        kernel("elementwise.cu", "axpy")((3,), (128,), (a, x, y, n))  # 384 threads stride over 1000
        return y

    for order, y in in_both_orders(launch).items():
        validate(y, y0 + 2.0 * float(a) * x.astype(np.float64), f"axpy ({order})")
    y = y0.copy()
    kernel("elementwise.cu", "negate")((2,), (64,), (y, n))
    validate(y, -y0.astype(np.float64), "negate, a kernel in a namespace")
    y = y0.copy()
    kernel("elementwise.cu", "scale")((2,), (64,), (y, y, a, n))  # the same array in and out
    validate(y, float(a) * y0.astype(np.float64), "scale in place")


def block_sums(x, block):
    padded = np.zeros(-(-x.size // block) * block)
    padded[:x.size] = x
    return padded.reshape(-1, block).sum(axis=1)


def test_block_reduction_through_shared_memory():
    x = rng().standard_normal(5000).astype(np.float32)

    def launch():
        partial = np.empty(20, np.float32)
        kernel("reduce.cu", "block_sum")((20,), (256,), (x, partial, np.int32(x.size)))
        return partial

    for order, partial in in_both_orders(launch).items():
        validate(partial, block_sums(x, 256), f"block_sum partials ({order})")


def test_missing_syncthreads_shows_in_some_thread_order():
    """Without the sanitizer (which refuses the race at the access: tests/test_sanitizer.py), the
    two thread orders are what shows it."""
    x = rng().random(2048).astype(np.float32)

    def launch(name):
        partial = np.empty(8, np.float32)
        kernel("reduce.cu", name, sanitize=False)((8,), (256,), (x, partial, np.int32(x.size)))
        return partial

    reference = block_sums(x, 256)
    wrong = {order: not np.allclose(partial, reference, rtol=1e-4)
             for order, partial in in_both_orders(lambda: launch("block_sum_missing_sync")).items()}
    assert any(wrong.values()), "the kernel without its barrier gave the right sums in both thread orders"
    for order, partial in in_both_orders(lambda: launch("block_sum")).items():
        validate(partial, reference, f"block_sum ({order})")
    with pytest.raises(emu.KernelError, match=r"racecheck: writes byte \d+ of `s`, which thread \(\d+,0,0\) read"):
        kernel("reduce.cu", "block_sum_missing_sync")((8,), (256,), (x, np.empty(8, np.float32), np.int32(x.size)))


def test_unwritten_shared_memory_reads_as_nan():
    """Without the sanitizer (which refuses the read itself: tests/test_sanitizer.py)."""
    x = rng().standard_normal(3 * 64).astype(np.float32)

    def launch():
        out, dynamic_out = np.zeros_like(x), np.zeros_like(x)
        kernel("reduce.cu", "unwritten_shared", sanitize=False)((3,), (64,), (x, out, dynamic_out),
                                                                 shared_mem=64 * 4)
        return out, dynamic_out

    written = np.ones(3 * 64, bool)
    written[64:] = np.arange(3 * 64)[64:] % 2 == 0
    for order, outputs in in_both_orders(launch).items():
        for name, out in zip(("static", "dynamic"), outputs):
            assert np.isnan(out[~written]).all(), f"{name} shared memory: unwritten slots not NaN ({order})"
            validate(out[written], x[written], f"{name} shared memory, written slots ({order})")


def test_warp_shuffle_reduction():
    x = rng().standard_normal(4 * 128).astype(np.float32)

    def launch():
        out = np.empty_like(x)
        kernel("warp.cu", "warp_sum")((4,), (128,), (x, out))
        return out

    expected = np.repeat(x.astype(np.float64).reshape(-1, 32).sum(axis=1), 32)
    for order, out in in_both_orders(launch).items():
        validate(out, expected, f"warp_sum ({order})")


def shuffle_model(v, taking_part, op, lane_arg, width):
    """CUDA's documented result of each shuffle for one warp's lanes."""
    out = np.full(32, -7)
    for lane in np.flatnonzero(taking_part):
        segment = lane // width * width
        if op == "idx":
            src = segment + lane_arg % width
        elif op == "up":
            src = lane - lane_arg if lane - segment >= lane_arg else lane
        elif op == "down":
            src = lane + lane_arg if lane - segment + lane_arg < width else lane
        else:  # xor: earlier segments may be read, later ones give the lane's own value
            src = lane ^ lane_arg
            src = lane if src // width > lane // width else src
        assert taking_part[src], "the kernel reads only lanes that take part (others are refused)"
        out[lane] = v[src]
    return out


@pytest.mark.parametrize("lane_arg, width", [(1, 32), (5, 32), (17, 32), (3, 16), (6, 8), (2, 4), (9, 16)])
def test_warp_primitives_match_cuda_semantics(lane_arg, width):
    gen = rng()
    warps = 4
    v = gen.integers(0, 1000, 32 * warps).astype(np.int32)
    predicate = (gen.random(32 * warps) < 0.5).astype(np.int32)
    predicate[32:64] = 1  # one warp votes unanimously
    out = np.empty(8 * 32 * warps, np.int32)
    kernel("warp.cu", "warp_primitives")((2,), (64,), (v, predicate, out, np.int32(lane_arg), np.int32(width)))
    out = out.reshape(8, warps, 32)
    for w in range(warps):
        lanes = np.arange(32)
        taking_part = lanes < 16 if w % 2 else np.ones(32, bool)
        vw, pw = v[32 * w:32 * w + 32], predicate[32 * w:32 * w + 32]
        for k, op in enumerate(("idx", "up", "down", "xor")):
            validate(out[k, w], shuffle_model(vw, taking_part, op, lane_arg, min(width, 16) if w % 2 else width),
                     f"__shfl_{op}_sync({lane_arg}, width {width}), warp {w}")
        ballot = int(np.sum(pw.astype(np.int64) << lanes))
        validate(out[4, w], np.full(32, np.int64(ballot).astype(np.int32)), f"__ballot_sync, warp {w}")
        validate(out[5, w], np.full(32, int(pw.any())), f"__any_sync, warp {w}")
        validate(out[6, w], np.full(32, int(pw.all())), f"__all_sync, warp {w}")
        validate(out[7, w], 4 * vw[lanes ^ 1] + 1, f"__shfl_xor_sync on double, warp {w}")


def test_integer_atomics_from_many_blocks():
    gen = rng()
    values = gen.integers(0, 50, 20000).astype(np.int32)
    counts = np.zeros(50, np.int32)
    kernel("atomics.cu", "histogram")((40,), (128,), (values, np.int32(values.size), counts))
    validate(counts, np.bincount(values, minlength=50).astype(np.int32), "histogram")

    counters = np.array([np.iinfo(np.int32).min, np.iinfo(np.int32).max, 0, 0, 0, -1], np.int32)
    ucounters = np.zeros(2, np.uint32)
    kernel("atomics.cu", "integer_atomics")((16,), (64,), (values, np.int32(values.size), counters, ucounters))
    bits = np.bitwise_or.reduce(np.left_shift(1, values & 31).astype(np.int64))
    expected = [values.max(), values.min(), 1, values.size, np.int64(bits).astype(np.int32),
                np.int64(~bits).astype(np.int32)]
    validate(counters, np.array(expected, np.int32), "atomicMax, Min, Exch, CAS, Or, And on int")
    hashed = (values.astype(np.uint64) * 2654435761) % 2**32
    validate(ucounters, np.array([hashed.max(), values.size % 1001], np.uint32), "atomicMax, Inc on unsigned")


def test_float_atomic_add_from_many_blocks():
    gen = rng()
    x, y = gen.random(4096).astype(np.float32), gen.random(4096)
    fsum, dsum = np.zeros(1, np.float32), np.zeros(1, np.float64)
    kernel("atomics.cu", "float_sums")((16,), (64,), (x, y, np.int32(x.size), fsum, dsum))
    validate(fsum, np.array([x.astype(np.float64).sum()]), "float atomicAdd", rtol=1e-5)
    validate(dsum, np.array([y.sum()]), "double atomicAdd")


def test_tiled_matmul_with_2d_blocks_and_dynamic_shared_memory():
    gen = rng()
    M, N, K, tile = 37, 45, 29, 16
    A = gen.standard_normal((M, K)).astype(np.float32)
    B = gen.standard_normal((K, N)).astype(np.float32)

    def launch():
        C = np.empty((M, N), np.float32)
        kernel("matmul.cu", "matmul_tiled")((-(-N // tile), -(-M // tile)), (tile, tile),
                                            (A, B, C, np.int32(M), np.int32(N), np.int32(K)),
                                            shared_mem=2 * tile * tile * 4)
        return C

    for order, C in in_both_orders(launch).items():
        validate(C, A.astype(np.float64) @ B, f"matmul_tiled ({order})")


@pytest.mark.parametrize("dtype, block", [(np.float32, 128), (np.float64, 256)])
def test_templated_kernel_through_name_expressions(dtype, block):
    x = rng().standard_normal(1000).astype(dtype)
    blocks = -(-x.size // block)
    partial = np.empty(blocks, dtype)
    name = f"scaled_block_sum<{'float' if dtype == np.float32 else 'double'}, {block}>"
    scaled = kernel("templates.cu", name)
    assert scaled.max_threads_per_block == 1024  # its __launch_bounds__ depends on a template argument
    scaled((blocks,), (block,), (dtype(3), x, partial, np.int32(x.size)))
    validate(partial, block_sums(3 * x.astype(np.float64), block), name)


def test_dynamic_shared_memory_declared_in_a_templates_body():
    """extern __shared__ at block scope in a template kernel (legal CUDA): the emulator's thread-local stand-in
    for it takes no initialiser call (g++'s -fno-extern-tls-init), where it crashed at address 0."""
    x = rng().standard_normal(1000).astype(np.float32)
    partial = np.empty(8, np.float32)
    kernel("templates.cu", "scaled_block_sum_dynamic<float, 128>")((8,), (128,), (np.float32(3), x, partial,
                                                                                  np.int32(x.size)), shared_mem=512)
    validate(partial, block_sums(3 * x.astype(np.float64), 128), "scaled_block_sum_dynamic")


SHARED_IN_A_TEMPLATE = """
template <int N> __global__ void NAME(float* out) {
    __shared__ float tile[N];
    tile[threadIdx.x] = float(threadIdx.x) + 0.5f;
    __syncthreads();
    out[threadIdx.x] = tile[N - 1 - threadIdx.x];
}
"""


@pytest.mark.parametrize("flags, planted", [("", False), ("-fgnu-unique", True)], ids=["as built", "gnu-unique"])
def test_one_source_built_without_and_with_the_sanitizer_runs_both_ways_in_one_process(flags, planted,
                                                                                       monkeypatch):
    """A template kernel's __shared__ array is a thread_local static of an inline function, which g++ gives
    STB_GNU_UNIQUE binding: one definition per process, even across libraries loaded RTLD_LOCAL. The
    second build of a source (the other sanitizer level: a process whose tests ask for both) would then
    use the first one's storage, outside its own block's shared memory. Modules are built with
    -fno-gnu-unique; the planted twin puts the binding back (CUDA_EMU_CXXFLAGS comes after it)."""
    monkeypatch.setenv("CUDA_EMU_CXXFLAGS", flags)
    name = f"reversed_{'unique' if planted else 'local'}"
    source = SHARED_IN_A_TEMPLATE.replace("NAME", name)
    results = []
    for level in ("off", "full"):
        with emu.sanitizer(level):
            reverse = emu.RawModule(code=source, name_expressions=[f"{name}<32>"]).get_function(f"{name}<32>")
            out = np.full(32, np.nan, np.float32)
            if planted and level == "full":
                with pytest.raises(emu.KernelError, match="out-of-bounds global write"):
                    reverse((1,), (32,), (out,))
                return
            reverse((1,), (32,), (out,))
            results.append(out)
    for out in results:
        np.testing.assert_array_equal(out, np.arange(31, -1, -1, dtype=np.float32) + 0.5)
    assert not planted


def test_cuda_vocabulary():
    types = (np.int32, np.uint32, np.int64, np.uint64, np.uint16, np.float32, np.float64)
    counters = [np.zeros(1, t) for t in types]
    v = np.array([[0.5, 0, 0, 0.75]], np.float32)
    out = np.empty(9, np.float32)
    kernel("vocabulary.cu", "vocabulary")((1,), (1,), (*counters, v, out))
    expected = [0.5 + 7, 2, 2.75, 45, 1.25 + 2**30, 1 + 0x4400, 9.5, 44.75, 2]
    validate(out, np.array(expected), "vocabulary")
    validate(np.array([c[0] for c in counters[5:]]), np.array([2.5, 0.25]), "float atomics")


# ---- what the emulator catches ------------------------------------------------------------------

def test_out_of_bounds_write_is_caught():
    """At the access under the sanitizer; without it, by the canaries after the launch, or as a fault."""
    x = rng().standard_normal(100).astype(np.float32)
    y = np.zeros(100, np.float32)
    with pytest.raises(emu.KernelError, match=r"'write_one_past_end' failed: thread \(100,0,0\) of block \(0,0,0\): "
                                              r"memcheck: out-of-bounds global write of 4 bytes at 0x[0-9a-f]+ at "
                                              r"\S+:\d+ \(argument 1 \(float\* y\) of 100 elements: element 100, 0 "
                                              r"bytes past its end\)$"):
        kernel("faults.cu", "write_one_past_end")((1,), (128,), (x, y, np.int32(100)))
    y = np.zeros(100, np.float32)
    with pytest.raises(emu.KernelError, match=r"'write_one_past_end' wrote outside its arrays: argument 1 \(float"
                                              r"\* y\) of 100 elements: element 100, 0 bytes past its end$"):
        kernel("faults.cu", "write_one_past_end", sanitize=False)((1,), (128,), (x, y, np.int32(100)))
    validate(y, 2 * x.astype(np.float64), "the writes inside the array")
    with pytest.raises(emu.KernelError, match=r"'write_far_past_end' failed: thread \(1,0,0\) of block "
                                              r"\(0,0,0\): segmentation fault at address 0x[0-9a-f]+ \(argument "
                                              r"0 \(float\* y\) of 100 elements: element 100000, 399600 bytes "
                                              r"past its end\)"):
        kernel("faults.cu", "write_far_past_end", sanitize=False)((1,), (4,), (y,))
    with pytest.raises(emu.KernelError, match=r"'write_far_past_end' failed: thread \(1,0,0\) of block "
                                              r"\(0,0,0\): memcheck: out-of-bounds global write .* \(argument "
                                              r"0 \(float\* y\) of 100 elements: element 100000, 399600 bytes "
                                              r"past its end\)"):
        kernel("faults.cu", "write_far_past_end")((1,), (4,), (y,))


def test_float_atomic_max_is_refused():
    with pytest.raises(emu.CompileError, match=r"atomicMax\(float\*"):
        emu.RawModule(code=(KERNELS / "atomic_max_float.cu").read_text())


def test_deadlock_device_assert_and_shared_overflow_are_reported():
    with pytest.raises(emu.KernelError, match=r"deadlock in block \(0,0,0\).*warp 0: lanes 0-15 wait in "
                                              r"__shfl_xor_sync\(mask 0xffffffff\) for lanes 16-31"):
        kernel("faults.cu", "divergent_shuffle")((1,), (64,), (np.zeros(64, np.float32),))
    x = np.arange(40, dtype=np.int32) - 30
    with pytest.raises(emu.KernelError, match=r"thread \(0,0,0\) of block \(0,0,0\): .*assertion "
                                              r"`x\[i\] >= 0'"):
        kernel("faults.cu", "checks_its_input")((2,), (32,), (x, np.int32(x.size)))
    with pytest.raises(emu.KernelError, match=r"block \(0,0,0\) wrote past the 128 bytes of dynamic shared"):
        kernel("faults.cu", "write_past_dynamic_shared", sanitize=False)((1,), (32,), (np.zeros(32, np.float32),),
                                                                         shared_mem=128)
    with pytest.raises(emu.KernelError, match=r"memcheck: out-of-bounds shared write of 4 bytes at offset 128 of "
                                              r"`the dynamic shared memory \(extern __shared__, 128 bytes asked for\)`"):
        kernel("faults.cu", "write_past_dynamic_shared")((1,), (32,), (np.zeros(32, np.float32),), shared_mem=128)


def parameters_args(**changes):
    """Good arguments for faults.cu's `parameters`, with some replaced."""
    args = dict(out=np.zeros(8, np.float32), index=np.arange(8, dtype=np.int32), n=8, a=np.float32(2),
                b=1.5, big=2**63 + 1, vectors=np.ones((8, 4), np.float32))
    args.update(changes)
    return tuple(args.values())


def test_arguments_converted_as_cupy_converts_them():
    out = np.zeros(8, np.float32)
    # Python int -> int64 (fits the int parameter), float -> double, int >= 2**63 -> uint64.
    kernel("faults.cu", "parameters")((1,), (8,), parameters_args(out=out))
    validate(out, 2.0 * np.arange(8) + 1.5 + 1 + 1, "parameters")


def test_wrong_argument_count_is_refused():
    with pytest.raises(emu.LaunchError, match=r"kernel 'parameters' takes 7 arguments \(float\* out, "
                                              r"const int\* index, int n, .*\), got 6"):
        kernel("faults.cu", "parameters")((1,), (8,), parameters_args()[:-1])


@pytest.mark.parametrize("changes, message", [
    (dict(out=np.zeros(8)), r"argument 0 \(float\* out\): got an array of float64"),
    (dict(a=2.0), r"argument 3 \(float a\): got float 2.0, which CuPy passes as float64; "
                  r"the kernel would read the first bytes of a double as a float"),
    (dict(n=2**31), r"argument 2 \(int n\): got int 2147483648.*does not fit"),
    (dict(n=np.int16(8)), r"argument 2 \(int n\): got int16 8; the kernel would read 4 bytes"),
    (dict(n=np.zeros(1, np.int32)), r"argument 2 \(int n\): got an array .* not a pointer"),
    (dict(index=3), r"argument 1 \(const int\* index\): got int 3; the parameter is a pointer"),
    (dict(out=np.zeros((8, 2), np.float32)[:, 0]), r"argument 0 .* is not C-contiguous"),
    (dict(vectors=np.ones(33, np.float32)[1:]), r"argument 6 .* not a multiple of 16 bytes"),
    (dict(b="1.5"), r"argument 4 \(double b\): unsupported argument type str"),
], ids=["dtype", "python-float", "too-big", "narrow", "array-for-scalar", "scalar-for-pointer",
        "non-contiguous", "misaligned", "unsupported"])
def test_wrong_arguments_are_refused_naming_the_kernel(changes, message):
    with pytest.raises(emu.LaunchError, match=r"kernel 'parameters' " + message):
        kernel("faults.cu", "parameters")((1,), (8,), parameters_args(**changes))


@pytest.mark.parametrize("grid, block, shared_mem, message", [
    ((1,), (1025,), 0, r"block \(1025, 1, 1\) has 1025 threads; a GPU allows 1024"),
    ((1,), (32, 32, 2), 0, r"has 2048 threads"),
    ((1,), (512,), 0, r"more than its __launch_bounds__\(256\)"),
    ((1,), (256,), 48 * 1024, r"shared_mem=49152 bytes of dynamic shared memory \(plus 1024 static\): a GPU "
                              r"allows 49152 bytes of shared memory per block without opt-in"),
    (1, (256,), 0, r"grid must be a tuple, not int"),
    ((1, 70000), (256,), 0, r"grid \(1, 70000, 1\) exceeds"),
])
def test_impossible_launches_are_refused(grid, block, shared_mem, message):
    x = np.zeros(1024, np.float32)
    with pytest.raises(emu.LaunchError, match=r"kernel 'block_sum'.*" + message):
        kernel("reduce.cu", "block_sum")(grid, block, (x, x[:4].copy(), np.int32(0)), shared_mem=shared_mem)


def test_more_shared_memory_after_opt_in():
    A, B, C = np.ones((16, 16), np.float32), np.ones((16, 16), np.float32), np.empty((16, 16), np.float32)
    args = (A, B, C, np.int32(16), np.int32(16), np.int32(16))
    matmul = kernel("matmul.cu", "matmul_tiled")
    with pytest.raises(emu.LaunchError, match="without opt-in"):
        matmul((1, 1), (16, 16), args, shared_mem=100 * 1024)
    matmul.max_dynamic_shared_size_bytes = 227 * 1024
    kernel("matmul.cu", "matmul_tiled")((1, 1), (16, 16), args, shared_mem=227 * 1024)  # the function's attribute
    validate(C, np.full((16, 16), 16.0), "matmul_tiled with 227 KiB of dynamic shared memory")
    with pytest.raises(emu.LaunchError, match="exceed the 232448 a GPU allows"):
        matmul.max_dynamic_shared_size_bytes = 228 * 1024
    matmul.max_dynamic_shared_size_bytes = 48 * 1024


def test_kernels_are_found_as_cupy_finds_them():
    with pytest.raises(emu.LaunchError, match=r"no kernel named 'scaled_block_sum'.* C\+\+ linkage"):
        module("templates.cu").get_function("scaled_block_sum")
    with pytest.raises(emu.LaunchError, match=r"no kernel named 'axpi'.*kernels: axpy"):
        module("elementwise.cu").get_function("axpi")


def test_compiled_modules_come_from_the_cache(monkeypatch):
    module("warp.cu")  # compiled (or found) once

    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled again instead of using the cache")

    monkeypatch.setattr(emu.build, "_run_compiler", no_compiler)
    again = emu.RawKernel((KERNELS / "warp.cu").read_text(), "warp_sum")
    x = np.arange(64, dtype=np.float32)
    out = np.empty_like(x)
    again((1,), (64,), (x, out))
    validate(out, np.repeat(x.reshape(2, 32).sum(axis=1), 32).astype(np.float64), "warp_sum through RawKernel")


def test_an_edited_header_rebuilds_the_module(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_EMU_CACHE_DIR", str(tmp_path / "cache"))  # its -I path is new every run
    header = tmp_path / "value.cuh"
    source = '#include "value.cuh"\nextern "C" __global__ void value(float* out) { out[0] = VALUE; }\n'
    out = np.zeros(1, np.float32)
    for value in (1.0, 2.0):
        header.write_text(f"#define VALUE {value}f\n")
        emu.RawModule(code=source, options=(f"-I{tmp_path}",)).get_function("value")((1,), (1,), (out,))
        validate(out, np.array([value]), "a value from an included header")


def unwritable_folder(tmp_path, how):
    """A cache folder that cannot be written: under a regular file, or a folder without write permission."""
    if how == "under a file":
        (tmp_path / "file").write_text("not a folder")
        return tmp_path / "file" / "cache"
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o555)
    return folder


@pytest.mark.parametrize("how", ["under a file", "without write permission"])
@pytest.mark.parametrize("variable", ["CUDA_EMU_CACHE_DIR", "HOME"])
def test_a_cache_folder_that_cannot_be_written_is_one_line_naming_it(tmp_path, monkeypatch, request, how, variable):
    """Through CUDA_EMU_CACHE_DIR, or as the default under a home that cannot be written: emu.CacheError, one
    line that names the folder, and nothing compiled; the same source in a folder that can be written runs."""
    if how == "without write permission" and not permissions_bind(tmp_path):
        return again_where_permissions_bind(request)
    folder = unwritable_folder(tmp_path, how)
    if variable == "HOME":
        monkeypatch.delenv("CUDA_EMU_CACHE_DIR", raising=False)
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        monkeypatch.setenv("HOME", str(folder))
        named = folder / ".cache" / "resnet-cuda-from-scratch" / "emu"
    else:
        monkeypatch.setenv("CUDA_EMU_CACHE_DIR", str(folder))
        named = folder
    source = f'extern "C" __global__ void seven(float* y) {{ y[0] = 7.0f; }}  // {tmp_path}\n'   # new every run
    with pytest.raises(emu.CacheError) as error:
        emu.RawModule(code=source)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"the CUDA emulator's cache folder {named} cannot be written ("), \
        message
    monkeypatch.setenv("CUDA_EMU_CACHE_DIR", str(tmp_path / "writable"))
    y = np.zeros(1, np.float32)
    emu.RawModule(code=source).get_function("seven")((1,), (1,), (y,))
    assert y[0] == 7


def test_a_read_only_cache_that_holds_the_module_serves_it(tmp_path, monkeypatch, request):
    """Only a module missing from the cache is written: one compiled before the folder lost its write
    permission is loaded from it (the runtime of the process is another folder's: a test of modules)."""
    if not permissions_bind(tmp_path):
        return again_where_permissions_bind(request)
    folder = tmp_path / "cache"
    monkeypatch.setenv("CUDA_EMU_CACHE_DIR", str(folder))
    source = f'extern "C" __global__ void eight(float* y) {{ y[0] = 8.0f; }}  // {tmp_path}\n'
    emu.RawModule(code=source)
    for path in folder.rglob("*"):
        path.chmod(0o555 if path.is_dir() else 0o444)
    folder.chmod(0o555)
    y = np.zeros(1, np.float32)
    emu.RawModule(code=source).get_function("eight")((1,), (1,), (y,))
    assert y[0] == 8


# ---- float modes -------------------------------------------------------------------------------

TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32: below it, subnormals


def flushed(a):
    """float32 ``a`` with its subnormals replaced by a zero of their sign, as -ftz=true does."""
    a = np.asarray(a, np.float32)
    return np.where(np.abs(a) < TINY, np.copysign(np.float32(0), a), a).astype(np.float32)


def test_subnormals_are_flushed_as_cupys_ftz_does():
    g = rng()
    subnormal = (g.uniform(0.1, 0.9, 8) * TINY * np.where(g.random(8) < 0.5, -1, 1)).astype(np.float32)
    x = np.concatenate([subnormal, (g.uniform(1, 2, 8) * 2 * TINY).astype(np.float32),
                        g.standard_normal(16).astype(np.float32)])
    assert np.count_nonzero(np.abs(x) < TINY) == 8 and np.all(x != 0)
    for s, what in ((np.float32(1.0), "subnormal inputs"), (np.float32(0.3), "subnormal results")):
        y = np.full_like(x, np.nan)
        kernel("subnormal.cu", "scale")((1,), (32,), (x, s, y, np.int32(x.size)))
        expected = flushed(flushed(x) * s)
        assert not np.array_equal(expected.view(np.int32), (x * s).view(np.int32)), f"no {what} to flush"
        np.testing.assert_array_equal(y.view(np.int32), expected.view(np.int32), err_msg=what)
    # the host's own arithmetic is untouched, after a launch that faults too
    with pytest.raises(emu.KernelError, match="segmentation fault|fault"):
        kernel("subnormal.cu", "scale_then_fault")((1,), (32,), (x, np.float32(1.0), y, np.int32(x.size)))
    assert np.array_equal(x * np.float32(1.0), x) and np.count_nonzero(x[:8] * np.float32(1.0)) == 8


def test_nvrtc_compiles_with_cupys_flush_to_zero():
    reason = nvrtc.unavailable_reason()
    if reason:
        pytest.skip(reason)
    ptx = nvrtc.compile((KERNELS / "subnormal.cu").read_text(), "sm_90").ptx
    assert "mul.ftz.f32" in ptx and "mul.f32" not in ptx


# ---- the traffic counter -------------------------------------------------------------------------

def counted(name, grid, block, x, *extra, out_size=None):
    """{kernel name: Traffic} of one launch of a kernel of traffic.cu on x, writing out_size floats (a float a
    thread by default)."""
    out = np.empty(out_size or grid * block, np.float32)
    with emu.traffic() as counts:
        kernel("traffic.cu", name)((grid,), (block,), (x, out, *extra))
    return counts


def test_the_traffic_counter_counts_the_sectors_of_each_warps_load():
    """A request per warp and execution of a load; its distinct sectors and bytes: whole sectors for 32 consecutive
    floats, a sector per lane for a stride of 32 bytes, one for a value every lane reads, a fifth one when the
    floats start off a sector's edge."""
    x = emu.aligned_empty(4096)
    x[...] = rng().standard_normal(x.size)
    warps = 2 * 128 // 32
    for order in emu.ORDERS:
        with emu.thread_order(order):
            assert counted("coalesced", 2, 128, x) == {"coalesced": emu.Traffic(warps, 4 * warps, 128 * warps)}
    assert counted("coalesced", 2, 128, x[1:]) == {"coalesced": emu.Traffic(warps, 5 * warps, 128 * warps)}
    assert counted("strided", 2, 128, x, np.int32(8)) == {"strided": emu.Traffic(warps, 32 * warps, 128 * warps)}
    assert counted("strided", 2, 128, x, np.int32(2)) == {"strided": emu.Traffic(warps, 8 * warps, 128 * warps)}
    assert counted("broadcast", 2, 128, x) == {"broadcast": emu.Traffic(warps, warps, 4 * warps)}
    assert counted("vectors", 2, 128, x, out_size=4 * 256) == {"vectors": emu.Traffic(warps, 16 * warps, 512 * warps)}
    assert counted("rows", 2, 128, x, np.int32(3)) == {"rows": emu.Traffic(3 * warps, 12 * warps, 384 * warps)}


def test_the_traffic_counter_needs_the_sanitizers_hooks_and_counts_only_inside_its_block():
    x = emu.aligned_empty(256)
    x[...] = rng().standard_normal(x.size)
    with emu.traffic() as outer:
        assert counted("coalesced", 2, 128, x)["coalesced"] == outer["coalesced"]
    kernel("traffic.cu", "coalesced")((2,), (128,), (x, np.empty_like(x)))
    assert outer == {"coalesced": emu.Traffic(8, 32, 1024)}
    with emu.traffic(), pytest.raises(emu.LaunchError, match="compiled without"):
        kernel("traffic.cu", "coalesced", sanitize=False)((2,), (128,), (x, np.empty_like(x)))


# ---- the same sources through NVRTC --------------------------------------------------------------

@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("filename", sorted(p.name for p in KERNELS.glob("*.cu")))
def test_kernel_compiles_with_nvrtc(filename, arch):
    reason = nvrtc.unavailable_reason()
    if reason:
        pytest.skip(reason)
    source = (KERNELS / filename).read_text()
    options, expressions = OPTIONS.get(filename, ()), NAME_EXPRESSIONS.get(filename, ())
    if filename == "atomic_max_float.cu":
        with pytest.raises(nvrtc.NvrtcError, match="atomicMax"):
            nvrtc.compile(source, arch, options, expressions, filename)
        return
    compiled = nvrtc.compile(source, arch, options, expressions, filename)
    assert compiled.ptx and compiled.cubin
    assert set(compiled.lowered_names) == set(expressions)


def test_two_processes_that_need_one_new_module_compile_it_once(tmp_path):
    """The two workers of --gpus 2 (or two test workers) on a machine whose cache is empty ask for the
    same modules at the same moment: one compiles, the other waits and loads what it made."""
    import os
    import subprocess
    import sys
    import textwrap
    script = textwrap.dedent(f"""
        import sys, time
        from kernels.emu import build
        compile_ = build._run_compiler
        def logged(args, what):
            if what.startswith("compiling"):
                with open({str(tmp_path / "log")!r}, "a") as log:
                    log.write(what + "\\n")
                time.sleep(1)   # long enough for the other process to arrive meanwhile
            return compile_(args, what)
        build._run_compiler = logged
        build.runtime_library()
        print(build.build_module('__global__ void twice(float* x) {{ x[threadIdx.x] = 2; }}\\n')["library"])
    """)
    environment = {**os.environ, "CUDA_EMU_CACHE_DIR": str(tmp_path / "cache")}
    first = subprocess.run([sys.executable, "-c", "from kernels.emu import build; build.runtime_library()"],
                           env=environment, capture_output=True, text=True, timeout=300)   # the runtime, once
    assert first.returncode == 0, first.stderr
    runs = [subprocess.Popen([sys.executable, "-c", script], env=environment, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=300) for run in runs]
    assert all(run.returncode == 0 for run in runs), outputs
    assert outputs[0][0] == outputs[1][0] and outputs[0][0].strip().endswith(".so"), outputs
    assert (tmp_path / "log").read_text().count("compiling") == 1
