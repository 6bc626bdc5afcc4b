"""The emulator's exceptions; each message names the kernel it is about."""


class EmuError(Exception):
    """Base of every error the emulator raises."""


class CompileError(EmuError):
    """g++ refused the source (the message holds its log), as NVRTC would refuse it."""


class LaunchError(EmuError):
    """A launch that a GPU would refuse or that passes wrong arguments: nothing ran."""


class KernelError(EmuError):
    """The kernel ran and went wrong: an out-of-bounds write, a fault, a deadlock, an assert."""


class CacheError(EmuError):
    """The folder of compiled kernels cannot be written (a read-only home, a folder without write
    permission, a path under a file): nothing was compiled. One line that names the folder."""
