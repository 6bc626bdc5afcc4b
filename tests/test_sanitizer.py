"""The emulator as a compute-sanitizer (kernels/emu/runtime.cpp; kernels/emu/README.md): each kernel of
tests/emu_kernels/sanitizer.cu that holds a bug a GPU punishes is refused at the access, naming the
check, the thread and block, the array (an argument, or a __shared__ variable and the byte in it)
and the .cu line; each correct kernel beside them runs clean, in both thread orders. The project's
own kernels run under the same checks in every kernel test (tests/test_kernels_cuda.py,
tests/test_conv_tc.py, tests/test_tensor_core.py, the simulated GPUs).
"""
import functools
import re

import numpy as np
import pytest

from helpers import rng
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
    """A shuffle whose mask names lanes that do not exist (a block of 48 threads) or that returned, or
    whose lane reads one of them: undefined values on a GPU, refused with the lanes and the line. Its
    twin, which exchanges among the lanes there, runs clean."""
    x = floats(48)
    error = refused("warp_sum_in_a_partial_warp", (1,), (48,), (x, np.zeros(2, np.float32)))
    assert re.search(rf"thread \(32,0,0\) of block \(0,0,0\): __shfl_down_sync\(mask 0xffffffff\) names lanes 16-31, "
                     rf"which have returned or are not in the block \(of 48 threads\): a shuffle's mask may name only lanes that "
                     rf"execute it \(the values are undefined on a GPU\) {LINE}", error), error
    assert f".cu:{line_of('v += __shfl_down_sync(0xffffffffu')}" in error, error
    error = refused("shuffle_reads_lanes_that_returned", (1,), (32,), (x[:32], np.zeros(32, np.float32)))
    assert re.search(r"thread \(\d+,0,0\) of block \(0,0,0\): __shfl_sync\(mask 0x0000ffff\) of lane \d+ reads lane "
                     r"(1[6-9]|2\d|3[01]), which is not in the mask: the value is undefined on a GPU", error), error
    y = np.zeros(2, np.float32)
    module().get_function("warp_sum_of_the_lanes_there")((1,), (48,), (x, y))
    np.testing.assert_allclose(y, [x[:32].astype(np.float64).sum(), x[32:].astype(np.float64).sum()], rtol=1e-5,
                               atol=1e-5)


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
