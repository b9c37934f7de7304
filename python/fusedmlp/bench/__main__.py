from fusedmlp.bench.cli import main

raise SystemExit(main())
