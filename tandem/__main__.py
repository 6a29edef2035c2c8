"""``python -m tandem run ...``: the ``tandem`` command without the console script."""

import sys

from tandem.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
