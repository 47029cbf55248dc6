"""``python -m mmtune`` is the ``mmtune`` command, so launchers that run modules can start
it: ``accelerate launch --config_file ... -m mmtune train ...``."""

import sys

from mmtune.cli import main

sys.exit(main())
