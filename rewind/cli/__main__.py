"""``python -m rewind.cli``: the ``rewind`` script."""

from rewind.cli import main

main()
