"""python -m profiler: see profiler/cli.py."""
import sys

from .cli import main

sys.exit(main())
