"""Print each CUDA kernel's registers, shared memory, stack and spills, as ptxas reports them.

    python -m kernels.cuda.ptxas_report [--arch sm_90 ...] [family ...]

Compiles every family's source (the text the backends compile, with the same options and name
expressions) with NVRTC and ``-Xptxas -v``; needs NVRTC (the cuda12 or cuda13 extra), no GPU. For sm_80 to
sm_90, NVRTC writes the PTX once and the ptxas of its release (the nvidia-cuda-nvcc wheel, where installed)
makes each architecture's SASS from it: the same SASS, at half the time.
Exits non-zero when a kernel spills, so that a regression shows in a script too.
"""
import argparse
import concurrent.futures
import sys
import threading

from kernels import nvrtc
from kernels.cuda import FAMILIES, HOPPER_FAMILIES, OPTIONS, arch_of, families_for, launcher, source

ARCHS = ("sm_80", "sm_90")
# NVRTC (13) writes one PTX for compute_80 to compute_90 from these sources, but for its .target line
# (tests/test_nvrtc.py checks it on a family): its front end, half of a family's compile (conv_tc: 26 of 52 s),
# runs once for the four, and ptxas, of NVRTC's own release, makes each one's SASS, the same as NVRTC's.
SHARED_PTX = "compute_80"
PTX_SHARED = ("sm_80", "sm_86", "sm_89", "sm_90")


_compiles = {}   # (family, arch) -> Future of kernels.nvrtc.Compiled
_ptx = {}   # family -> Future of its kernels.nvrtc.Compiled for SHARED_PTX
_lock = threading.Lock()


def compile_family(family, arch):
    """kernels.nvrtc.Compiled for one family and architecture, with ptxas' report (verbose); raises
    NvrtcError. Once per process: a family takes NVRTC up to half a minute, and the tests and
    benchmarks that read its SASS and its resources share the result. The first request for a
    family of ARCHS starts it for the other architectures of ARCHS that it compiles for
    (kernels.cuda.families_for) on a thread (NVRTC releases the GIL): callers that go through
    ARCHS wait for one compile where they waited for two."""
    if arch in ARCHS:   # the other architectures of ARCHS that the tests compile the family for too
        prefetch([family], [other for other in ARCHS if other != arch and family in families_for(other)])
    return _compile(family, arch).result()


def prefetch(families, archs=ARCHS):
    """Starts compiling each family for each architecture, one after another on a thread of its own
    (a daemon: a process that ends first does not wait for it), those no one has asked for yet;
    compile_family waits for them. What a test session that reads the SASS of several families
    calls at its start, so that NVRTC runs on a second core while the first runs the other tests."""
    with _lock:
        pairs = [(family, arch) for family in families for arch in archs
                 if family in families_for(arch) and (family, arch) not in _compiles]
    if pairs:
        threading.Thread(target=lambda: [_compile(*pair) for pair in pairs], daemon=True, name="nvrtc").start()


def _compile(family, arch):
    """The Future of the family's compile for arch: compiled here by the first caller, whose result or
    error it holds; later callers get it at once, to wait for."""
    with _lock:
        future, mine = _compiles.get((family, arch)), (family, arch) not in _compiles
        if mine:
            future = _compiles[family, arch] = concurrent.futures.Future()
    if mine:
        try:
            future.set_result(_assembled(family, arch) or _nvrtc(family, arch, verbose=True))
        except BaseException as e:  # noqa: BLE001  (handed to whoever waits for it)
            future.set_exception(e)
    return future


def _nvrtc(family, arch, verbose=False):
    return nvrtc.compile(source(family), arch=arch_of(family, arch), options=OPTIONS,
                         name_expressions=launcher(family).KERNELS,
                         filename=f"{family}.cu", verbose=verbose)


def _assembled(family, arch):
    """The family for an architecture of PTX_SHARED from the PTX of SHARED_PTX, by the ptxas of NVRTC's
    release (kernels.nvrtc.assemble), or None (another architecture, a Hopper family, whose sm_90a PTX no other
    architecture shares, or no such ptxas here)."""
    if arch not in PTX_SHARED or family in HOPPER_FAMILIES or \
            nvrtc.nvrtc_for(arch) is not nvrtc.nvrtc_for(SHARED_PTX.replace("compute", "sm")):
        return None
    with _lock:
        future, mine = _ptx.get(family), family not in _ptx
        if mine:
            future = _ptx[family] = concurrent.futures.Future()
    if mine:
        try:
            future.set_result(_nvrtc(family, SHARED_PTX))
        except BaseException as e:  # noqa: BLE001
            future.set_exception(e)
    return nvrtc.assemble(future.result(), arch, verbose=True)


def report(families, archs):
    """Rows (arch, family, kernel, Resources), kernels named by their name expressions; of the families that
    each architecture runs (families_for)."""
    rows = []
    for arch in archs:
        for family in (f for f in families if f in families_for(arch)):
            compiled = compile_family(family, arch)
            for kernel, resources in compiled.named_resources().items():
                rows.append((arch, family, kernel, resources))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", default=FAMILIES, help=f"default: all ({', '.join(FAMILIES)})")
    parser.add_argument("--arch", action="append", help=f"repeatable; default: {' '.join(ARCHS)}")
    args = parser.parse_args(argv)
    rows = report(args.families, args.arch or ARCHS)
    width = max(len(r[2]) for r in rows)
    print(f"{'arch':6} {'family':12} {'kernel':{width}} {'regs':>5} {'smem B':>7} {'stack B':>7} {'spill st/ld B':>14}")
    for arch, family, kernel, r in rows:
        print(f"{arch:6} {family:12} {kernel:{width}} {r.registers:5d} {r.shared_bytes:7d} {r.stack_bytes:7d} "
              f"{f'{r.spill_stores}/{r.spill_loads}':>14}")
    spilling = [f"{arch} {kernel}" for arch, _, kernel, r in rows if r.spill_stores or r.spill_loads]
    if spilling:
        print(f"spills in: {', '.join(spilling)}", file=sys.stderr)
    return 1 if spilling else 0


if __name__ == "__main__":
    sys.exit(main())
