from fusestate.cli import main

raise SystemExit(main())
