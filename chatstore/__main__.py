import sys

from chatstore.cli import main

sys.exit(main())
