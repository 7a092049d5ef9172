import sys

from rltrain.engine.native.saver import exec_preloaded

exec_preloaded(sys.argv[1:])  # (before the server's imports: with --enable-memory-saver, preloaded)

from rltrain.engine.native.server import main  # noqa: E402

raise SystemExit(main())
