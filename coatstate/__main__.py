from coatstate.cli import main

raise SystemExit(main())
