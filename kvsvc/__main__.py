from kvsvc.cli.main import main

raise SystemExit(main())
