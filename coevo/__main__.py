import sys

from coevo.cli import main

sys.exit(main())
