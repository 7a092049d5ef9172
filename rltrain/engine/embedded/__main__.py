import sys

from rltrain.engine.embedded.saver import exec_preloaded

exec_preloaded(sys.argv[1:])  # (before the engine's imports: with --enable-memory-saver, preloaded)

from rltrain.engine.embedded.main import main  # noqa: E402

raise SystemExit(main())
