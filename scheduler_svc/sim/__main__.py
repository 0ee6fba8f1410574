import sys

from scheduler_svc.sim.cli import main

sys.exit(main())
