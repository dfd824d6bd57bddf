"""python -m jax_ep.launch -n N [options] (script.py | -m module) [args ...]; see jax_ep/launch/__init__.py."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
