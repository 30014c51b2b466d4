from synccheck.cli import main

raise SystemExit(main())
