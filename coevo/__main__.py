import os
import sys

if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a rank: gone with its launcher, asked before anything is imported
    from coevo.runtime.proc import die_with_launcher

    die_with_launcher()

from coevo.cli import main

sys.exit(main())
