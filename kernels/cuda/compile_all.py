"""Compile kernel families for the current GPU at once, one process each, into CuPy's disk cache, so that
the processes that launch them later load them instead of compiling them one after another:

    python -m kernels.cuda.compile_all [family ...]

What bench/gpu_check runs before its tests (a family takes NVRTC up to a minute and a half, one core
each). Each family is compiled as its first launch would compile it (Backend.module(family).compile()),
the backend being the one CuPy's device gives, or the simulated GPUs' (KERNELS_SIMULATED_GPUS, whose
emulator caches its builds too). Prints each family as it is done; exits non-zero, naming them, when
some fail.
"""
import argparse
import concurrent.futures
import os
import sys
import time

from kernels.cuda import FAMILIES, families_for


def compile_family(family):
    """Seconds the family's compile took in this process; None for a family that this GPU does not run
    (families_for: conv_sm90 on anything but a Hopper)."""
    import kernels
    began = time.monotonic()
    be = kernels._device_backend("cuda")
    if family not in families_for(f"sm_{be.xp.cuda.Device().compute_capability}"):
        return None
    be.module(family).compile()
    return time.monotonic() - began


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("families", nargs="*", metavar="family", help=f"among {', '.join(FAMILIES)} (default: all)")
    families = p.parse_args(argv).families or list(FAMILIES)
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        p.error(f"no kernel family {', '.join(unknown)}: the families are {', '.join(FAMILIES)}")
    failed = []
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(len(families), os.cpu_count() or 1)) as pool:
        futures = {pool.submit(compile_family, family): family for family in families}
        for future in concurrent.futures.as_completed(futures):
            family = futures[future]
            try:
                seconds = future.result()
                print(f"{family}: " + ("not for this GPU" if seconds is None else f"compiled in {seconds:.1f} s"),
                      flush=True)
            except Exception as e:   # the next families still compile; the error is the family's own
                failed.append(family)
                print(f"{family}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    if failed:
        print(f"compile_all: {', '.join(sorted(failed))} did not compile", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
