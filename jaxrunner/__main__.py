import sys

from jaxrunner.cli import main

sys.exit(main())
