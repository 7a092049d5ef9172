from rltrain.cli import main

raise SystemExit(main())
