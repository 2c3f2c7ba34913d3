import sys

from meshserve.service.webhooks.cli import main

sys.exit(main())
