"""The emulator as a compute-sanitizer (kernels/emu/runtime.cpp; kernels/emu/README.md): each kernel of
tests/emu_kernels/sanitizer.cu that holds a bug a GPU punishes is refused at the access, naming the
check, the thread and block, the array (an argument, or a __shared__ variable and the byte in it)
and the .cu line; each correct kernel beside them runs clean, in both thread orders. The undefined
value a shuffle gives a lane that reads outside its mask is refused where it is used, naming the use's
line and the shuffle's, and runs clean where it is discarded. The project's own kernels run under the
same checks in every kernel test (tests/test_kernels_cuda.py, tests/test_conv_tc.py,
tests/test_tensor_core.py, the simulated GPUs).
"""
import functools
import re

import numpy as np
import pytest

from helpers import rng, validate
from kernels import emu
from test_emu import KERNELS, OPTIONS as FILE_OPTIONS

SOURCE = KERNELS / "sanitizer.cu"
OPTIONS = FILE_OPTIONS["sanitizer.cu"]
LINE = r"at \S+\.cu:\d+"   # where the access is, in the module's copy of sanitizer.cu


@functools.cache
def module():
    with emu.sanitizer(True):
        return emu.RawModule(code=SOURCE.read_text(), options=OPTIONS)


def line_of(text):
    """The line of sanitizer.cu that holds `text`."""
    return next(i for i, line in enumerate(SOURCE.read_text().splitlines(), 1) if text in line)


def floats(n):
    return rng().standard_normal(n).astype(np.float32)


def refused(name, grid, block, args, shared_mem=0):
    """The error of a launch the sanitizer refuses."""
    with pytest.raises(emu.KernelError) as error:
        module().get_function(name)(grid, block, args, shared_mem=shared_mem)
    return str(error.value)


# ---- memcheck --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, block, args, message", [
    ("read_past_end", (16,), lambda: (floats(16), floats(16), np.int32(16)),
     r"thread \(15,0,0\) of block \(0,0,0\): memcheck: out-of-bounds global read of 4 bytes at 0x[0-9a-f]+ {line} "
     r"\(argument 0 \(const float\* x\) of 16 elements: element 16, 0 bytes past its end\)"),
    ("read_before_start", (16,), lambda: (floats(16), floats(16), np.int32(16)),
     r"thread \(0,0,0\) of block \(0,0,0\): memcheck: out-of-bounds global read of 4 bytes .* \(argument 0 "
     r"\(const float\* x\) of 16 elements: element -1, 4 bytes before its start\)"),
    ("read_a_row_too_far", (8, 4), lambda: (floats(32), floats(32), np.int32(4), np.int32(8)),
     r"thread \(\d,3,0\) of block \(0,0,0\): memcheck: out-of-bounds global read .* element 3\d, \d+ bytes past"),
    ("static_shared_written_past_its_end", (33,), lambda: (floats(33),),
     r"thread \(32,0,0\) of block \(0,0,0\): memcheck: out-of-bounds shared write of 4 bytes at offset 128 of "
     r"`tile` \(128 bytes\) {line}"),
    ("static_shared_read_past_its_end", (32,), lambda: (floats(32),),
     r"thread \(31,0,0\) of block \(0,0,0\): memcheck: out-of-bounds shared read of 4 bytes at offset 128 of "
     r"`tile` \(128 bytes\)"),
    ("misaligned_float4_load", (4,), lambda: (floats(20), floats(4)),
     r"memcheck: misaligned 16-byte read at 0x[0-9a-f]+ \(a multiple of 16 is needed\) {line} \(argument 0 "
     r"\(const float\* x\) of 20 elements: element \d+, its first byte\)"),
    ("misaligned_shared_float2", (64,), lambda: (floats(64),),
     r"thread \(\d+,0,0\) of block \(0,0,0\): memcheck: misaligned 8-byte read"),
    ("memcpy_past_end", (1,), lambda: (floats(8), floats(8), np.int32(8)),
     r"memcheck: out-of-bounds global read of 36 bytes .* \(argument 0 \(const float\* x\) of 8 elements"),
])
def test_memcheck_refuses_each_access_outside_its_array(order, name, block, args, message):
    assert re.search(message.format(line=LINE), refused(name, (1,), block, args())), name


def test_an_atomic_out_of_bounds_names_the_kernel_line(order):
    error = refused("atomic_past_end", (1,), (4,), (np.zeros(4, np.uint32), np.int32(4)))
    assert re.search(rf"thread \(\d,0,0\) of block \(0,0,0\): memcheck: out-of-bounds global atomic of 4 bytes at "
                     rf"0x[0-9a-f]+ at \S+\.cu:{line_of('atomicAdd(count + n, 1u)')} \(argument 0 \(unsigned\* count\) "
                     rf"of 4 elements: element 4, 0 bytes past its end\)", error), error


def test_memcheck_holds_dynamic_shared_memory_to_what_the_launch_asked_for():
    error = refused("dynamic_shared_past_what_was_asked", (1,), (32,), (floats(32),), shared_mem=32 * 4)
    assert re.search(r"thread \(31,0,0\) of block \(0,0,0\): memcheck: out-of-bounds shared read of 4 bytes at "
                     r"offset 128 of `the dynamic shared memory \(extern __shared__, 128 bytes asked for\)`", error)


def test_a_device_variable_is_memory_the_kernel_may_read(order):
    x, y = floats(32), np.zeros(32, np.float32)
    module().get_function("scaled_by_a_device_variable")((1,), (32,), (x, y))
    np.testing.assert_array_equal(y, 2 * x)


def test_the_line_named_is_the_access():
    error = refused("read_past_end", (1,), (16,), (floats(16), floats(16), np.int32(16)))
    assert re.search(rf"\.cu:{line_of('y[i] = x[i + 1]')}\b", error), error


# ---- synccheck --------------------------------------------------------------------------------------

def test_synccheck_refuses_a_barrier_that_part_of_the_block_skips(order):
    error = refused("barrier_in_divergent_code", (1,), (64,), (floats(64), floats(64)))
    assert re.search(r"synccheck: thread \(\d+,0,0\) of block \(0,0,0\) waits at a __syncthreads\(\) at \S+:(\d+) "
                     r"and thread \(\d+,0,0\) at another at \S+:(\d+): a barrier that part of the block skips", error)
    first = line_of("half the block waits here")
    second = next(i for i, line in enumerate(SOURCE.read_text().splitlines(), 1)
                  if i > first and line.strip() == "__syncthreads();")
    assert {int(n) for n in re.findall(r"\.cu:(\d+)", error)} == {first, second}, error


def test_synccheck_knows_one_barrier_of_the_source_whose_calls_the_compiler_copied(order):
    """g++ copies the one call of a helper that holds a barrier into both sides of the kernel's
    `if (i < n)`: the threads wait at two code addresses, but at one barrier of the source, as on a
    GPU. The helper called from two calls of the source, one a side, is two barriers."""
    x, y = floats(64), np.zeros(64, np.float32)
    module().get_function("barrier_in_a_helper_called_once")((1,), (64,), (x, y, np.int32(40)))
    np.testing.assert_array_equal(y[:40], x[:40] + np.concatenate([x[1:40], np.zeros(1, np.float32)]))
    assert not y[40:].any()
    error = refused("barrier_in_a_helper_called_from_both_sides", (1,), (64,), (x, y, np.int32(40)))
    assert re.search(r"synccheck: thread \(\d+,0,0\) of block \(0,0,0\) waits at a __syncthreads\(\) at (\S+:\d+) and "
                     r"thread \(\d+,0,0\) at another at \1 \(the same line, reached through other calls\)", error), error


def test_synccheck_matches_warp_wide_instructions_by_call_instance_not_by_source_line(order):
    error = refused("mma_by_two_halves_through_one_helper", (1,), (32,), (np.zeros(32, np.float32),))
    assert re.search(r"synccheck: reached mma\.sync\.aligned\.m16n8k8\.row\.col\.f32\.tf32\.tf32\.f32 at \S+ while "
                     r"lane \d+ waits in mma\.sync\S+ at \S+: a warp-wide \.aligned instruction needs all 32 lanes at "
                     r"the same call", error), error
    out = np.zeros(32, np.float32)   # one call of the helper: fine (D = 0 0 + C, C[0] the lane)
    module().get_function("mma_through_one_helper")((1,), (32,), (out,))
    np.testing.assert_array_equal(out, np.arange(32, dtype=np.float32))


# ---- shuffles ---------------------------------------------------------------------------------------

def test_a_shuffle_of_lanes_that_are_not_there_is_refused(order):
    """A shuffle whose mask names lanes that do not exist (a block of 48 threads) or that returned: refused
    with the lanes and the line. One whose lanes read lanes that returned, with a mask of themselves, gets
    undefined values, refused where they are stored. The twin, which exchanges among the lanes there, runs
    clean."""
    x = floats(48)
    error = refused("warp_sum_in_a_partial_warp", (1,), (48,), (x, np.zeros(2, np.float32)))
    assert re.search(rf"thread \(32,0,0\) of block \(0,0,0\): __shfl_down_sync\(mask 0xffffffff\) names lanes 16-31, "
                     rf"which have returned or are not in the block \(of 48 threads\): a shuffle's mask may name only lanes that "
                     rf"execute it \(the values are undefined on a GPU\) {LINE}", error), error
    assert f".cu:{line_of('v += __shfl_down_sync(0xffffffffu')}" in error, error
    error = refused("shuffle_reads_lanes_that_returned", (1,), (32,), (x[:32], np.zeros(32, np.float32)))
    line = line_of("y[threadIdx.x] = __shfl_sync(0x0000ffffu")
    assert re.search(rf"thread \((\d+),0,0\) of block \(0,0,0\): initcheck: writes an undefined value to global memory "
                     rf"at 0x[0-9a-f]+ at \S+\.cu:{line}: what __shfl_sync at \S+\.cu:{line} gives a lane that reads one "
                     rf"outside the mask \(the first: lane 0 of thread \(0,0,0\) of block \(0,0,0\), which read lane 16, not "
                     rf"in mask 0x0000ffff\) \(argument 1 \(float\* y\) of 32 elements: element \1, its first byte\)", error), error
    y = np.zeros(2, np.float32)
    module().get_function("warp_sum_of_the_lanes_there")((1,), (48,), (x, y))
    np.testing.assert_allclose(y, [x[:32].astype(np.float64).sum(), x[32:].astype(np.float64).sum()], rtol=1e-5,
                               atol=1e-5)


# ---- undefined shuffle values --------------------------------------------------------------------------
# A lane that reads one outside its shuffle's mask (past the 16 lanes of a block's second warp) gets an
# undefined value: no error while it is discarded, refused where it is used, naming the use's line and the
# shuffle's.

def partial_warp_sums(x):
    """Each lane's sum in partial_warp_sums: lane l adds lane l + k's value for k = 16, 8, 4, 2, 1 where that
    lane is in its warp, of a block of x.size threads."""
    sums = []
    for start in range(0, x.size, 32):
        v = x[start:start + 32].astype(np.int64 if np.issubdtype(x.dtype, np.integer) else np.float64)
        for k in (16, 8, 4, 2, 1):
            v = v + np.pad(v[k:], (0, v.size - v[k:].size))
        sums.append(v)
    return np.concatenate(sums)


def values(dtype, n=48):
    if np.issubdtype(dtype, np.integer):
        return rng().integers(-1000, 1000, n).astype(dtype)
    return rng().standard_normal(n).astype(dtype)


def shuffle_read_outside_the_mask(shuffle, use_line):
    """The message's account of the use at use_line of what the shuffle marked `shuffle` gave a lane."""
    return (rf"at \S+\.cu:{use_line}: what __shfl_down_sync at \S+\.cu:{line_of(shuffle)} gives a lane that reads "
            rf"one outside the mask \(the first: lane (\d+) of thread \((\d+),0,0\) of block \(0,0,0\), which read lane "
            rf"(\d+), not in mask 0x0000ffff\)")


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.float64])
def test_an_undefined_shuffle_value_that_is_discarded_runs_clean(order, dtype):
    """A partial warp's sum that adds what a lane read from lane + k only where that lane is there (as a GPU
    runs it: compute-sanitizer says nothing), in each type's size of undefined value; and the sum without
    that guard, whose undefined values reach lanes that no one reads, stored by lane 0 alone."""
    x, y = values(dtype), np.zeros(48, dtype)
    name = {np.float32: "float", np.int32: "int", np.float64: "double"}[dtype]
    module().get_function(f"partial_warp_sums_{name}")((1,), (48,), (x, y))
    validate(y, partial_warp_sums(x), f"partial_warp_sums_{name}")
    if dtype is np.float32:
        y = np.zeros(2, np.float32)
        module().get_function("partial_warp_sum_stored_by_lane_0")((1,), (48,), (x, y))
        validate(y, partial_warp_sums(x)[[0, 32]], "partial_warp_sum_stored_by_lane_0")


@pytest.mark.parametrize("name, dtype, place, shuffle, store", [
    ("partial_warp_sums_unguarded_float", np.float32, r"global memory at 0x[0-9a-f]+", "// unguarded sum",
     "y[threadIdx.x] = v;   // every lane, unguarded"),
    ("partial_warp_sums_unguarded_double", np.float64, r"global memory at 0x[0-9a-f]+", "// unguarded sum",
     "y[threadIdx.x] = v;   // every lane, unguarded"),
    ("next_lane_into_shared_memory", np.int32, r"byte 1\d\d of `s`", "// shared store", "// shared store"),
])
def test_an_undefined_shuffle_value_written_to_memory_is_refused(order, name, dtype, place, shuffle, store):
    """A float computed from an undefined value (its NaN carries the mark), a double and an int undefined
    value themselves, written to global or shared memory by a lane of the partial warp."""
    error = refused(name, (1,), (48,), (values(dtype), np.zeros(48, dtype)))
    match = re.search(rf"thread \((\d+),0,0\) of block \(0,0,0\): initcheck: writes an undefined value to {place} "
                      + shuffle_read_outside_the_mask(shuffle, line_of(store)), error)
    assert match, error
    thread, first_lane, first_thread, source = map(int, match.groups())
    assert 32 <= thread < 48 and first_thread == 32 + first_lane and source >= 16, error


def test_an_undefined_shuffle_value_as_an_atomic_operand_is_refused(order):
    total = np.zeros(1, np.int32)
    error = refused("next_lane_added_atomically", (1,), (48,), (values(np.int32), total))
    assert re.search(r"thread \(47,0,0\) of block \(0,0,0\): initcheck: uses an undefined value as an atomic's "
                     r"operand " + shuffle_read_outside_the_mask("// atomic operand", line_of("// atomic operand")),
                     error), error


def test_an_undefined_shuffle_value_compared_or_branched_on_is_refused(order):
    """A maximum that compares what a lane read outside the mask (float), a switch on it (int); their twins,
    whose guard keeps the comparison to lanes there, run clean."""
    x = floats(48)
    error = refused("partial_warp_max", (1,), (48,), (x, np.zeros(2, np.float32), np.int32(0)))
    assert re.search(r"thread \((3[2-9]|4[0-7]),0,0\) of block \(0,0,0\): initcheck: uses an undefined value in a "
                     r"comparison "
                     + shuffle_read_outside_the_mask("// max", line_of("&& other > v) v = other")), error), error
    y = np.zeros(2, np.float32)
    module().get_function("partial_warp_max")((1,), (48,), (x, y, np.int32(1)))
    np.testing.assert_array_equal(y, [x[:32].max(), x[32:].max()])

    codes = rng().integers(0, 5, 48).astype(np.int32)
    error = refused("by_the_next_lane", (1,), (48,), (codes, np.zeros(48, np.int32), np.int32(0)))
    assert re.search(r"thread \(47,0,0\) of block \(0,0,0\): initcheck: uses an undefined value in a comparison "
                     + shuffle_read_outside_the_mask("// branched on", line_of("switch (next)")), error), error
    y = np.zeros(48, np.int32)
    module().get_function("by_the_next_lane")((1,), (48,), (codes, y, np.int32(1)))
    next_lane = np.concatenate([codes[1:], [0]])
    expected = np.select([next_lane == 0, next_lane == 1, next_lane == 2], [codes, -codes, 2 * codes], 7)
    expected[[31, 47]] = -1   # the last lane of each warp: lane + 1 is not there
    np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("place, base", [
    (0, r"0x[0-9a-f]+ \(argument 0 \(const float\* table\) of 48 elements: element 0, its first byte\)"),
    (1, r"byte 0 of `s`"), (2, r"a variable of the module"), (3, r"the thread's own stack \(a local array\)")])
def test_an_undefined_shuffle_value_as_an_index_is_refused(order, place, base):
    """A table looked up (an argument, in shared memory, a __device__ array, the thread's own array) at what
    a lane read outside the mask: refused at the access, which lies the undefined value times 4 bytes past
    the table; the twin looks up only what lanes there gave."""
    table, index = floats(48), rng().integers(0, 48, 48).astype(np.int32)
    error = refused("look_up_the_next_lane", (1,), (48,), (table, index, np.zeros(48, np.float32), np.int32(0),
                                                             np.int32(place)))
    assert re.search(r"thread \(47,0,0\) of block \(0,0,0\): initcheck: uses an undefined value in the address of a "
                     r"4-byte read " + shuffle_read_outside_the_mask("// index", line_of("// looked up"))
                     + rf"; the address is 4 times the value past {base}$", error), error
    y = np.zeros(48, np.float32)
    module().get_function("look_up_the_next_lane")((1,), (48,), (table, index, y, np.int32(1), np.int32(place)))
    expected = table[np.concatenate([index[1:], [0]])]
    expected[[31, 47]] = -1   # the last lane of each warp: lane + 1 is not there
    np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("use, what, marker", [(0, "as the lane or offset of a shuffle", "// source lane"),
                                               (1, "as the predicate of a barrier", "// predicate"),
                                               (2, "as the mask of a warp operation", "// mask")])
def test_an_undefined_shuffle_value_as_an_operand_of_the_runtime_is_refused(order, use, what, marker):
    """What a lane read outside the mask as the source lane of a shuffle, the predicate of
    __syncthreads_count or the mask of a __syncwarp(); the twins give those of lanes there alone."""
    lanes = np.arange(48) % 32
    if use == 0:
        x = rng().integers(0, 16, 48).astype(np.int32)   # source lanes that both warps have
    elif use == 1:
        x = rng().integers(-2, 3, 48).astype(np.int32)   # predicates, some of them 0
    else:
        x = np.where(np.arange(48) < 32, -1, 0xffff).astype(np.int32)   # the mask of each warp's lanes
    error = refused("next_lane_as_an_operand", (1,), (48,), (x, np.zeros(48, np.int32), np.int32(use), np.int32(0)))
    assert re.search(rf"thread \(47,0,0\) of block \(0,0,0\): initcheck: uses an undefined value {what} "
                     + shuffle_read_outside_the_mask("// operand", line_of(marker)), error), error
    y = np.zeros(48, np.int32)
    module().get_function("next_lane_as_an_operand")((1,), (48,), (x, y, np.int32(use), np.int32(1)))
    there = np.ones(48, bool)
    there[[31, 47]] = False   # the last lane of each warp: lane + 1 is not there
    following = np.concatenate([x[1:], [0]])
    if use == 0:
        source = np.where(there, following, lanes)
        expected = x[np.where(np.arange(48) < 32, 0, 32) + source]
    elif use == 1:
        expected = np.full(48, np.count_nonzero(np.where(there, following, 0)))
    else:
        expected = lanes
    np.testing.assert_array_equal(y, expected)


def test_undefined_shuffle_values_are_checked_under_memcheck_too():
    """The level whole networks run under: no shadow memory is needed to see an undefined value."""
    x = floats(48)
    with emu.sanitizer("memcheck"):
        error = refused("partial_warp_sums_unguarded_float", (1,), (48,), (x, np.zeros(48, np.float32)))
        y = np.zeros(48, np.float32)
        module().get_function("partial_warp_sums_float")((1,), (48,), (x, y))
    assert "initcheck: writes an undefined value to global memory" in error, error
    validate(y, partial_warp_sums(x), "partial_warp_sums_float under memcheck")


# ---- racecheck --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, block, args, message", [
    ("every_thread_writes_one_shared_word", (32,), lambda: (floats(32),),
     r"racecheck: writes byte 0 of `s`, which thread \(\d+,0,0\) wrote, with no __syncthreads\(\) between them "
     r"\(nor a __syncwarp\(\) of both lanes\) {line}"),
    ("one_thread_writes_a_slot_the_others_read_without_a_barrier", (64,), lambda: (floats(64),),
     r"racecheck: (reads byte 128 of `s`, which thread \(0,0,0\) wrote|writes byte 128 of `s`, which thread "
     r"\(\d+,0,0\) read), with no __syncthreads\(\)"),
    ("overwrites_a_slot_before_its_reader_is_done", (64,), lambda: (floats(64),),
     r"racecheck: (writes byte \d+ of `s`, which thread \(\d+,0,0\) read|reads byte \d+ of `s`, which thread "
     r"\(\d+,0,0\) wrote), with no __syncthreads\(\) between them"),
    ("warp_sum_without_syncwarp", (32,), lambda: (floats(32), floats(1)),
     r"racecheck: .* of `s`, which thread \(\d+,0,0\) (wrote|read), with no __syncthreads\(\) between them \(nor a "
     r"__syncwarp\(\) of both lanes\)"),
])
def test_racecheck_refuses_shared_memory_touched_by_two_threads_without_a_barrier(order, name, block, args, message):
    assert re.search(message.format(line=LINE), refused(name, (1,), block, args())), name


def test_a_warp_sum_with_its_syncwarps_runs_clean(order):
    x, y = floats(32), np.zeros(1, np.float32)
    module().get_function("warp_sum_with_syncwarp")((1,), (32,), (x, y))
    # within float32's rounding of a 32-term sum of these magnitudes (a sum that cancels has no relative bound)
    np.testing.assert_allclose(y[0], x.astype(np.float64).sum(), rtol=0,
                               atol=32 * 2.0**-24 * np.abs(x.astype(np.float64)).sum())


@pytest.mark.parametrize("name, grid, block", [("every_thread_writes_one_global_word", 1, 32),
                                               ("every_block_adds_to_one_global_word", 4, 32)])
def test_racecheck_refuses_two_plain_stores_to_one_global_word(name, grid, block):
    error = refused(name, (grid,), (block,), (np.zeros(1, np.float32),))
    assert re.search(r"racecheck: writes global memory at 0x[0-9a-f]+ that thread \(0,0,0\) of block \(0,0,0\) wrote "
                     r"in this launch: two plain stores to one word race \(one is lost: they differ\); use an atomic", error), error
    assert "argument 0 (float* y) of 1 elements: element 0" in error


def test_atomics_and_the_last_block_reduction_are_not_races(order):
    count = np.zeros(1, np.uint32)
    module().get_function("every_block_adds_atomically")((8,), (32,), (count,))
    assert count[0] == 8
    x = floats(8 * 128)
    partial, counter, total = np.zeros(8, np.float32), np.zeros(1, np.uint32), np.zeros(1, np.float32)
    module().get_function("split_sum_finished_by_the_last_block")((8,), (128,), (x, partial, counter, total))
    np.testing.assert_allclose(total[0], x.astype(np.float64).sum(), rtol=1e-4, atol=1e-4)
    assert counter[0] == 0


def test_racecheck_lets_threads_store_one_value_to_one_word(order):
    """Many threads setting one flag to the same value lose nothing (every_thread_writes_one_global_word,
    whose values differ, is refused above)."""
    x, found = np.abs(floats(4 * 64)), np.zeros(1, np.int32)
    module().get_function("threads_set_one_flag")((4,), (64,), (x, found))
    assert found[0] == 0
    x[rng().choice(x.size, 20, replace=False)] *= -1
    module().get_function("threads_set_one_flag")((4,), (64,), (x, found))
    assert found[0] == 1


def test_racecheck_sees_a_slot_handed_on_by_the_last_block_counter(order):
    """last_block's fence and counter hand every block's slot to the block that comes last, which may
    then overwrite it; a block that writes its slot after it has counted itself races with that block."""
    x = floats(8 * 64)
    partial, counter = np.zeros(8, np.float32), np.zeros(1, np.uint32)
    module().get_function("last_block_reuses_the_partials")((8,), (64,), (x, partial, counter))
    np.testing.assert_allclose(partial, np.cumsum(x.reshape(8, 64).astype(np.float64).sum(1)), rtol=1e-4, atol=1e-4)
    counter[0] = 0
    error = refused("partial_written_after_counting", (8,), (64,), (x, np.zeros(8, np.float32), counter))
    assert re.search(r"racecheck: writes global memory at 0x[0-9a-f]+ that thread \(0,0,0\) of block \(\d,0,0\) "
                     r"wrote in this launch: two plain stores to one word race \(one is lost: they differ\)", error), error
    assert "argument 1 (float* partial)" in error


# ---- initcheck ----------------------------------------------------------------------------------------

def test_initcheck_refuses_a_shared_read_nobody_wrote_whatever_hides_it(order):
    error = refused("reads_unwritten_shared_behind_fmaxf", (1,), (64,), (floats(64), floats(64)))
    assert re.search(r"initcheck: reads byte \d+ of `s`, which no thread of the block has written", error), error
    error = refused("reads_dynamic_shared_nobody_wrote", (1,), (32,), (floats(32),), shared_mem=128)
    assert re.search(r"initcheck: reads byte \d+ of `the dynamic shared memory", error), error


def test_initcheck_refuses_a_cp_async_destination_read_before_its_wait(order):
    x = floats(128)
    error = refused("compares_a_cp_async_destination_before_its_wait", (1,), (32,), (x, floats(32)))
    assert re.search(r"initcheck: reads byte \d+ of `s` while a cp\.async to it is in flight: read it after the "
                     r"cp\.async\.wait_group that covers it", error), error
    y = np.zeros(32, np.float32)
    module().get_function("reads_a_cp_async_destination_after_its_wait")((1,), (32,), (x, y))
    np.testing.assert_array_equal(y, np.maximum(x[::4], 0))


# ---- ldmatrix -------------------------------------------------------------------------------------------

def test_ldmatrix_reads_the_rows_at_the_instruction(order):
    """Lane 0 overwrites row 7 right after the ldmatrix: on a GPU the warp's rows were read at the
    instruction, so every lane holds the rows as they were (lane by lane, the lanes that resume after
    lane 0 would get the new row)."""
    m = rng().integers(0, 2**16, 64).astype(np.uint16)
    out = np.zeros(32, np.uint32)
    module().get_function("overwrites_a_row_right_after_ldmatrix")((1,), (32,), (m, out))
    rows = m.reshape(8, 8)
    lane = np.arange(32)
    expected = rows[lane // 4, 2 * (lane % 4)].astype(np.uint32) | rows[lane // 4, 2 * (lane % 4) + 1].astype(
        np.uint32) << np.uint32(16)
    np.testing.assert_array_equal(out, expected)
