"""Old module path of `keras_dist.launching.worker`: `python -m keras_dist._worker` still runs."""

import sys

from keras_dist.launching.worker import main

if __name__ == "__main__":
    sys.exit(main())
