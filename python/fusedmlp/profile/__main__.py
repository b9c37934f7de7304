from fusedmlp.profile.cli import main

raise SystemExit(main())
