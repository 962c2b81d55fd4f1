"""`python -m tokenmill.kernels`: build the native CPU kernels now (make setup runs it)."""

import logging
import sys

from tokenmill.kernels import build_cpu_kernels

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print("building tokenmill's native CPU kernels (once per machine, ~1 min) ...", file=sys.stderr, flush=True)
    build_cpu_kernels(verbose="-v" in sys.argv)
