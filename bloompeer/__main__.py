import sys

from .peer.cli import main

sys.exit(main())
