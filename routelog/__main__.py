"""``python -m routelog``: the same command line as ``routelog``."""

from routelog.cli import main

main()
