"""``python -m gpu_check``: :func:`gpu_check.check.main` (``make gpu-check`` runs it)."""
import sys

from gpu_check.check import main

if __name__ == "__main__":
    sys.exit(main())
