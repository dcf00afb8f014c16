from gpuopt.report.cli import main

raise SystemExit(main())
