"""The `granary` command line, as `pip install` puts it on the PATH: the same Rust code as the
`granary` binary, run in this process."""

import signal
import sys

from . import _native


def main() -> None:
    # Ctrl-C ends the command at once, as it ends the binary; Python's handler would only set a
    # flag that the Rust code never looks at.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.exit(_native.cli(["granary", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
