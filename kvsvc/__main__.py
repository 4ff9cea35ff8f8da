from kvsvc.cli import main

raise SystemExit(main())
