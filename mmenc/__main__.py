"""`python -m mmenc ...` is `mmenc ...`."""
import sys

from mmenc.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
