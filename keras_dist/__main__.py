"""`python -m keras_dist ...` is `keras-dist ...`."""

import sys

from keras_dist.launching.cli import main

if __name__ == "__main__":
    sys.exit(main())
