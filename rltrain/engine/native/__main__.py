from rltrain.engine.native.server import main

raise SystemExit(main())
